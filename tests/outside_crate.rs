//! README's quickstart, built and run as a new user's crate would: a fresh
//! package that depends on this crate by path and on exactly the other
//! crates README names, nothing else.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The first ```rust block after `heading` in README.md.
fn readme_block(heading: &str) -> String {
    let readme = include_str!("../README.md");
    let from = readme.find(heading).expect("README has the heading");
    let rest = &readme[from..];
    let start = rest.find("```rust\n").expect("a rust block") + "```rust\n".len();
    let end = rest[start..].find("\n```").expect("the block ends") + start;
    rest[start..end].to_owned()
}

/// The dependency lines README tells a new user to add, from its
/// ```toml block after `heading`.
fn readme_dependencies(heading: &str) -> String {
    let readme = include_str!("../README.md");
    let from = readme.find(heading).expect("README has the heading");
    let rest = &readme[from..];
    let start = rest.find("```toml\n").expect("a toml block") + "```toml\n".len();
    let end = rest[start..].find("\n```").expect("the block ends") + start;
    rest[start..end].to_owned()
}

fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

#[test]
fn readme_quickstart_builds_and_runs_in_a_fresh_crate() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let work = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("outside-crate");
    std::fs::create_dir_all(work.join("src")).expect("work dir");
    let deps = readme_dependencies("## Quickstart");
    assert!(
        deps.contains("datum-cluster-sharding"),
        "README names the crate itself: {deps}"
    );
    // The user's `datum-cluster-sharding = "…"` becomes a path dependency here.
    let deps: String = deps
        .lines()
        .map(|line| {
            if line.trim_start().starts_with("datum-cluster-sharding") {
                format!(
                    "datum-cluster-sharding = {{ path = {:?}, default-features = false }}",
                    crate_dir.display().to_string()
                )
            } else {
                line.to_owned()
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    let manifest = format!(
        "[package]\nname = \"quickstart-outside\"\nversion = \"0.0.0\"\nedition = \"2024\"\npublish = false\n\n{deps}\n\n[workspace]\n"
    );
    std::fs::write(work.join("Cargo.toml"), manifest).expect("manifest");
    std::fs::write(work.join("src/main.rs"), readme_block("## Quickstart")).expect("main.rs");
    // The same versions as this crate's own build, so nothing new is fetched.
    std::fs::copy(crate_dir.join("Cargo.lock"), work.join("Cargo.lock")).expect("lock file");
    let target = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("outside-crate-target");
    let out = cargo()
        .args(["run", "--quiet", "--offline"])
        .current_dir(&work)
        .env("CARGO_TARGET_DIR", &target)
        .env_remove("RUSTFLAGS")
        .output()
        .expect("cargo runs");
    assert!(
        out.status.success(),
        "the quickstart did not build or run as an outside crate:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
