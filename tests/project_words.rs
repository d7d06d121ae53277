//! The project's files speak of the project alone: no README, SPEC,
//! BENCHMARKS, guide page or source comment says in which step of the work
//! something was done, or names a tracker number. They say what the project
//! does and what was measured.
//!
//! Reads every Markdown file at the root and under `docs/`, and every Rust
//! file under `src/`, `tests/`, `examples/`, `benches/` and `protocols/`,
//! with its whitespace folded (a phrase may break across lines), and fails
//! naming each file, phrase and its surroundings.

use std::path::{Path, PathBuf};

/// Words that, followed by a number, name a step of the work or a ticket.
const NUMBERED: &[&str] = &["session", "sessions", "issue", "issues", "ticket"];

/// Words before "session" that speak of the work's own sittings.
const SITTING: &[&str] = &["this", "last", "previous", "next", "earlier", "later"];

fn files(dir: &Path, ext: &str, recurse: bool, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries {
        let path = entry.expect("a readable entry").path();
        if path.is_dir() {
            if recurse {
                files(&path, ext, recurse, out);
            }
        } else if path.extension().is_some_and(|e| e == ext) {
            out.push(path);
        }
    }
}

/// Every phrase of `text` the rule forbids, with some words around it.
fn findings(text: &str) -> Vec<String> {
    let words: Vec<&str> = text.split_whitespace().collect();
    let bare = |w: &str| {
        w.trim_matches(|c: char| !c.is_alphanumeric() && c != '#')
            .to_lowercase()
    };
    let number = |w: &str| {
        let w = w.trim_start_matches(['(', '[', '#']);
        w.starts_with(|c: char| c.is_ascii_digit())
    };
    let mut found = Vec::new();
    for (i, word) in words.iter().enumerate() {
        let here = bare(word);
        let next = words.get(i + 1).copied().unwrap_or("");
        let forbidden = (NUMBERED.contains(&here.as_str()) && number(next))
            || (here == "session" && i > 0 && SITTING.contains(&bare(words[i - 1]).as_str()))
            || tracker_number(word);
        if forbidden {
            let from = i.saturating_sub(4);
            let to = (i + 5).min(words.len());
            found.push(words[from..to].join(" "));
        }
    }
    found
}

/// `#52`, `(#52)`, `#52,`: a number of two digits or more after a `#` that
/// opens a word (not `{:#04x}`, not a colour, not an attribute).
fn tracker_number(word: &str) -> bool {
    let w = word.trim_start_matches(['(', '[']);
    let Some(rest) = w.strip_prefix('#') else {
        return false;
    };
    let digits = rest.chars().take_while(|c| c.is_ascii_digit()).count();
    digits >= 2 && !rest[digits..].starts_with(|c: char| c.is_alphanumeric())
}

#[test]
fn the_rule_catches_what_it_is_for() {
    for bad in [
        "measured in session 17, then",
        "as issue 49 asks",
        "see issue #52.",
        "fixed (#54) here",
        "written in this session",
        "the previous\n session kept it",
    ] {
        assert!(!findings(bad).is_empty(), "{bad:?} passed the rule");
    }
    for good in [
        "a TLS session resumes no ticket",
        "the one session over the pipe",
        "format!(\"{:#04x}\", b)",
        "#[derive(Debug)]",
        "an issue with 3 nodes is",
        "node 2 of 3, W1 at 16 in flight",
    ] {
        assert!(findings(good).is_empty(), "{good:?} was refused");
    }
}

#[test]
fn the_project_files_name_no_step_of_the_work() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut paths = Vec::new();
    files(root, "md", false, &mut paths);
    files(&root.join("docs"), "md", true, &mut paths);
    for dir in ["src", "tests", "examples", "benches", "protocols"] {
        files(&root.join(dir), "rs", true, &mut paths);
    }
    assert!(paths.len() > 100, "the sources were found: {}", paths.len());
    let this_file = root.join("tests").join("project_words.rs");
    let mut problems = Vec::new();
    for path in paths.iter().filter(|p| **p != this_file) {
        let text = std::fs::read_to_string(path).expect("readable");
        for phrase in findings(&text) {
            problems.push(format!("{}: …{phrase}…", path.display()));
        }
    }
    assert!(
        problems.is_empty(),
        "files that speak of the work instead of the project:\n{}",
        problems.join("\n")
    );
}
