//! The layers of `src/` import one way (SPEC §0.1), no files import each
//! other in a circle, and the sans-IO cores name no runtime and no clock.
//! Reads the sources: every `crate::module` and `super::sibling` path
//! outside comments, in every file but the binaries and the test files.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Each top-level module's layer, lowest first. A module may use its own
/// layer and those below it.
const LAYERS: &[(&str, u8)] = &[
    ("identity", 0),
    ("warn_limit", 0),
    ("fast_hash", 0),
    ("telemetry", 0),
    ("extractor", 0),
    ("wire", 1),
    ("error", 1),
    ("persistence", 1),
    ("config", 2),
    ("envelope", 2),
    ("transport", 2),
    ("membership", 2),
    ("protocol", 3),
    ("entity", 4),
    ("dispatch", 5),
    ("store", 5),
    ("cluster", 5),
    ("runtime", 6),
    ("sharding", 7),
    ("system", 8),
    ("reliable", 8),
    ("private", 8),
    ("guarantees", 8),
    ("management", 9),
    ("lib", 9),
];

/// The state machines that decide without doing: they take `now` and
/// give commands (or call a host), and never name an executor, an actor
/// runtime or the clock.
/// A folder stands for every source file under it but its tests.
const CORES: &[&str] = &[
    "src/membership/core",
    "src/sharding/coordinator",
    "src/runtime/slot",
    "src/sharding/region_core.rs",
];

/// The files of the cores, each folder walked as `sources` walks `src/`.
fn core_files(root: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for core in CORES {
        let path = root.join(core);
        if path.is_dir() {
            sources(&path, &mut files);
        } else {
            files.push(path);
        }
    }
    assert!(files.len() >= CORES.len(), "every core has a file");
    files
}

/// A source file's module path (`transport/pipes`, `membership`, `lib`).
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).expect("under src");
    let mut parts: Vec<String> = rel
        .with_extension("")
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts.join("/")
}

/// The files the rule covers: everything but binaries and test files.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("readable src") {
        let path = entry.expect("entry").path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            if name != "bin" {
                sources(&path, out);
            }
        } else if name.ends_with(".rs")
            && !name.ends_with("tests.rs")
            && !matches!(name.as_str(), "sim.rs" | "props.rs")
        {
            out.push(path);
        }
    }
}

/// The identifiers after each `prefix` in `code`; `prefix::{a, b}` gives both.
fn paths_after<'a>(code: &'a str, prefix: &str) -> Vec<(&'a str, Option<&'a str>)> {
    let ident = |s: &'a str| {
        let end = s
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(s.len());
        &s[..end]
    };
    let mut found = Vec::new();
    for (at, _) in code.match_indices(prefix) {
        let rest = &code[at + prefix.len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let group = &group[..group.find('}').unwrap_or(group.len())];
            for item in group.split(',') {
                let item = item.trim();
                let first = ident(item);
                let second = item[first.len()..].strip_prefix("::").map(ident);
                found.push((first, second));
            }
        } else {
            let first = ident(rest);
            let second = rest[first.len()..].strip_prefix("::").map(ident);
            found.push((first, second));
        }
    }
    found
}

/// Every module each file imports, by the modules' paths.
fn imports() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let exists = |module: &str| {
        src.join(format!("{module}.rs")).exists() || src.join(module).join("mod.rs").exists()
    };
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in files {
        let me = module_of(&src, &file);
        let text = std::fs::read_to_string(&file).expect("readable");
        let code: String = text
            .lines()
            .map(|l| l.split("//").next().unwrap_or(""))
            .collect::<Vec<_>>()
            .join("\n");
        let edges = graph.entry(me.clone()).or_default();
        for (first, second) in paths_after(&code, "crate::") {
            if !exists(first) {
                continue; // an item re-exported at the root, or `crate::Foo`
            }
            let target = match second.map(|s| format!("{first}/{s}")) {
                Some(sub) if exists(&sub) => sub,
                _ => first.to_owned(),
            };
            if target != me {
                edges.insert(target);
            }
        }
        let is_mod_rs = file.file_name().is_some_and(|n| n == "mod.rs");
        if let Some((parent, _)) = me.rsplit_once('/').filter(|_| !is_mod_rs) {
            for (first, _) in paths_after(&code, "super::") {
                let sibling = format!("{parent}/{first}");
                if exists(&sibling) {
                    edges.insert(sibling);
                }
            }
        }
    }
    graph
}

fn layer(module: &str) -> u8 {
    let top = module.split('/').next().unwrap_or(module);
    LAYERS
        .iter()
        .find(|(name, _)| *name == top)
        .map(|(_, l)| *l)
        .unwrap_or_else(|| panic!("module `{top}` has no layer in tests/layering.rs"))
}

/// The imports of `graph` that go up a layer, by top-level module.
fn upward(graph: &BTreeMap<String, BTreeSet<String>>) -> BTreeSet<(String, String)> {
    let top = |m: &str| m.split('/').next().unwrap_or(m).to_owned();
    let mut found = BTreeSet::new();
    for (from, targets) in graph {
        for to in targets {
            if layer(to) > layer(from) {
                found.insert((top(from), top(to)));
            }
        }
    }
    found
}

#[test]
fn layers_import_only_downward() {
    let found = upward(&imports());
    assert!(
        found.is_empty(),
        "upward imports (a lower layer using a higher one): {found:?}"
    );
}

/// The checker sees what it must: the parser finds the module of each
/// import, and an import from the runtime into the sharding layer is
/// upward. (Limits: an item the crate root re-exports, `crate::Foo`, is
/// not followed to the module that defines it; `self::` and
/// `super::super::` paths, and `/* */` comments, are not read.)
#[test]
fn the_upward_check_finds_an_upward_import() {
    let code = "use crate::sharding::{driver::DriverMsg, remote};\nuse crate::envelope::X;";
    // (A group after a module is not entered: the import is still the
    // sharding layer's, which is what the layer check needs.)
    assert_eq!(
        paths_after(code, "crate::"),
        [("sharding", Some("")), ("envelope", Some("X"))]
    );
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    graph
        .entry("runtime/region".into())
        .or_default()
        .insert("sharding/driver".into());
    graph
        .entry("sharding/driver".into())
        .or_default()
        .insert("runtime/region".into());
    let found = upward(&graph);
    assert_eq!(
        found,
        BTreeSet::from([("runtime".to_owned(), "sharding".to_owned())])
    );
}

#[test]
fn the_cores_name_no_runtime_and_no_clock() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for file in core_files(root) {
        let core = file.display();
        let text = std::fs::read_to_string(&file).expect("readable core");
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            for name in ["tokio", "ractor", "Instant::now", "SystemTime::now"] {
                // As a path of its own: `extractor::` is not `ractor::`.
                let named = code.match_indices(name).any(|(at, _)| {
                    let before = code[..at].chars().next_back();
                    !before.is_some_and(|c| c.is_alphanumeric() || c == '_')
                });
                assert!(!named, "{core}:{}: a core names `{name}`: {line}", n + 1);
            }
        }
    }
}

/// The strongly connected components of more than one file (Tarjan).
fn circles(graph: &BTreeMap<String, BTreeSet<String>>) -> BTreeSet<BTreeSet<String>> {
    struct Walk<'g> {
        graph: &'g BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'g str, (usize, usize)>,
        stack: Vec<&'g str>,
        next: usize,
        found: BTreeSet<BTreeSet<String>>,
    }
    impl<'g> Walk<'g> {
        fn visit(&mut self, v: &'g str) {
            self.index.insert(v, (self.next, self.next));
            self.next += 1;
            self.stack.push(v);
            for w in self.graph.get(v).into_iter().flatten() {
                let w = w.as_str();
                match self.index.get(w).copied() {
                    None => {
                        self.visit(w);
                        let low = self.index[w].1.min(self.index[v].1);
                        self.index.get_mut(v).unwrap().1 = low;
                    }
                    Some((wi, _)) if self.stack.contains(&w) => {
                        let low = wi.min(self.index[v].1);
                        self.index.get_mut(v).unwrap().1 = low;
                    }
                    Some(_) => {}
                }
            }
            let (vi, vl) = self.index[v];
            if vi == vl {
                let mut component = BTreeSet::new();
                while let Some(w) = self.stack.pop() {
                    component.insert(w.to_owned());
                    if w == v {
                        break;
                    }
                }
                if component.len() > 1 {
                    self.found.insert(component);
                }
            }
        }
    }
    let mut walk = Walk {
        graph,
        index: BTreeMap::new(),
        stack: Vec::new(),
        next: 0,
        found: BTreeSet::new(),
    };
    for v in graph.keys() {
        if !walk.index.contains_key(v.as_str()) {
            walk.visit(v);
        }
    }
    walk.found
}

#[test]
fn no_files_import_each_other_in_a_circle() {
    let mut graph = imports();
    // The crate root re-exports everything: it is above every file.
    graph.remove("lib");
    let found = circles(&graph);
    assert!(
        found.is_empty(),
        "files importing each other in a circle: {found:?}"
    );
}

/// The checker sees what it must: a made-up graph with a circle and one
/// without.
#[test]
fn the_circle_finder_finds_circles_and_only_them() {
    let graph = |edges: &[(&str, &str)]| {
        let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (a, b) in edges {
            g.entry(a.to_string()).or_default().insert(b.to_string());
            g.entry(b.to_string()).or_default();
        }
        g
    };
    let found = circles(&graph(&[("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]));
    let abc: BTreeSet<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
    assert_eq!(found, BTreeSet::from([abc]));
    assert!(circles(&graph(&[("a", "b"), ("b", "c"), ("a", "c")])).is_empty());
    let found = paths_after("use crate::{wire::Frame, identity};", "crate::");
    assert_eq!(found, vec![("wire", Some("Frame")), ("identity", None)]);
}
