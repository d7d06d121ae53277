//! The layers of `src/` import one way (SPEC §0.1), no files import each
//! other in a circle, and the sans-IO cores name no runtime and no clock.
//! Reads the sources: every `crate::module` and `super::sibling` path
//! outside comments, in every file but the binaries and the test files.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Each module's layer, lowest first; a module not listed takes the layer
/// of its nearest listed ancestor. A module may use its own layer and
/// those below it.
const LAYERS: &[(&str, u8)] = &[
    ("model", 0),
    ("model/extractor", 0),
    ("model/identity", 0),
    ("util", 0),
    ("ops/telemetry", 0),
    ("wire", 1),
    ("model/error", 1),
    ("persistence", 1),
    ("model/config", 2),
    ("model/envelope", 2),
    ("transport", 2),
    ("membership", 2),
    ("persistence/remember/writer", 2),
    ("ops/history", 2),
    ("model/protocol", 3),
    ("entity", 4),
    ("runtime/dispatch", 5),
    ("cluster", 5),
    ("runtime", 6),
    ("sharding", 7),
    ("system", 8),
    ("reliable", 8),
    ("private", 8),
    ("guarantees", 8),
    ("guide", 8),
    ("ops", 9),
    ("ops/management", 9),
    ("lib", 9),
];

/// The state machines that decide without doing: they take `now` and
/// give commands (or call a host), and never name an executor, an actor
/// runtime or the clock. A folder stands for every source file under it
/// but its tests.
const CORES: &[&str] = &[
    "src/membership/core",
    "src/sharding/coordinator",
    "src/runtime/slot",
    "src/runtime/region/table.rs",
    "src/runtime/region/preparing.rs",
    "src/sharding/region_core.rs",
    "src/sharding/control_core.rs",
];

/// What the cores may import besides each other and their own folder:
/// the model, and the data the protocol each one runs is spoken in — the
/// membership's view and gossip, the sharding control messages, a shard's
/// mailbox and passivation bookkeeping, a migrated state, a remembered
/// entity's record. Nothing here runs a task or holds a socket.
const CORE_MAY_IMPORT: &[&str] = &[
    "model",
    "membership/config",
    "membership/error",
    "membership/gossip",
    "membership/protocol",
    "membership/ring",
    "membership/state",
    "membership/status",
    "sharding/wire",
    "runtime/mailbox",
    "runtime/passivation",
    "entity/migration",
    "persistence/remember/spi",
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

/// The paths after each `prefix` in `code`, as their segments:
/// `prefix::a::b::C` gives `[a, b, C]`; `prefix::{a::B, c}` gives `[a, B]`
/// and `[c]`; `prefix::a::{b::C, d::{E, F}}` gives `[a, b, C]`,
/// `[a, d, E]` and `[a, d, F]`.
fn paths_after<'a>(code: &'a str, prefix: &str) -> Vec<Vec<&'a str>> {
    /// The paths of `rest` (a path, maybe ending in a group) under `base`.
    fn walk<'a>(mut rest: &'a str, mut base: Vec<&'a str>, out: &mut Vec<Vec<&'a str>>) {
        loop {
            if let Some(group) = rest.strip_prefix('{') {
                for item in split_group(group) {
                    walk(item.trim(), base.clone(), out);
                }
                return;
            }
            let end = rest
                .find(|c: char| !(c.is_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            if end == 0 {
                break;
            }
            base.push(&rest[..end]);
            match rest[end..].strip_prefix("::") {
                Some(next) => rest = next,
                None => break,
            }
        }
        if !base.is_empty() {
            out.push(base);
        }
    }
    /// The items of a group, `{` already taken, up to its matching `}`.
    fn split_group(group: &str) -> Vec<&str> {
        let (mut depth, mut from, mut items) = (0usize, 0, Vec::new());
        for (at, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    items.push(&group[from..at]);
                    return items;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    items.push(&group[from..at]);
                    from = at + 1;
                }
                _ => {}
            }
        }
        items.push(&group[from..]);
        items
    }
    let mut found = Vec::new();
    for (at, _) in code.match_indices(prefix) {
        // `$crate::` is a macro's path, resolved where it expands.
        if code[..at].ends_with('$') {
            continue;
        }
        walk(&code[at + prefix.len()..], Vec::new(), &mut found);
    }
    found
}

/// A source file's text with `//` comments cut off.
fn code_of(file: &Path) -> String {
    std::fs::read_to_string(file)
        .expect("readable source")
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The modules under `src`, by path (`sharding/driver`, `lib`).
fn modules(src: &Path) -> BTreeSet<String> {
    let mut files = Vec::new();
    sources(src, &mut files);
    let mut all = BTreeSet::new();
    for file in files {
        let module = module_of(src, &file);
        // A folder's files make it a module even without code of its own.
        let mut at = module.as_str();
        while let Some((parent, _)) = at.rsplit_once('/') {
            all.insert(parent.to_owned());
            at = parent;
        }
        all.insert(module);
    }
    all
}

/// The module a path from the crate root names: its longest prefix that
/// is a module, then (when the next segment is a name that module
/// re-exports) the module that holds that name, and so on. A path that
/// starts with no module is looked up among the root's re-exports.
fn resolve(
    modules: &BTreeSet<String>,
    reexports: &BTreeMap<(String, String), String>,
    path: &[&str],
) -> Option<String> {
    let (mut module, mut used) = (1..=path.len())
        .rev()
        .map(|n| (path[..n].join("/"), n))
        .find(|(m, _)| modules.contains(m))
        .unwrap_or_else(|| ("lib".to_owned(), 0));
    // (Bounded: a re-export names a module that holds the name.)
    for _ in 0..8 {
        let Some(next) = path.get(used) else { break };
        match reexports.get(&(module.clone(), (*next).to_owned())) {
            Some(holder) if *holder != module => {
                module = holder.clone();
                used += 1;
            }
            _ => break,
        }
    }
    (module != "lib" || used > 0).then_some(module)
}

/// What each module re-exports (`pub use self::a::B`, `pub(crate) use
/// crate::c::{D, self}`): by the module and the name it is known by there,
/// the module that holds it.
fn reexports(src: &Path, modules: &BTreeSet<String>) -> BTreeMap<(String, String), String> {
    let mut files = Vec::new();
    sources(src, &mut files);
    let mut out = BTreeMap::new();
    for file in files {
        let me = module_of(src, &file);
        let code = code_of(&file);
        // The module `self::` names: a file's own module (the root's is
        // empty), under which its children are found.
        let here: Vec<&str> = if me == "lib" {
            Vec::new()
        } else {
            me.split('/').collect()
        };
        for statement in code.split(';') {
            let Some(at) = ["pub use ", "pub(crate) use ", "pub(super) use "]
                .iter()
                .find_map(|p| statement.find(p).map(|at| at + p.len()))
            else {
                continue;
            };
            let used = statement[at..].trim();
            let (base, names): (&str, Vec<&str>) = match used.split_once("::{") {
                Some((base, group)) => (
                    base,
                    group
                        .trim_end_matches('}')
                        .split(',')
                        .map(str::trim)
                        .collect(),
                ),
                None => match used.rsplit_once("::") {
                    Some((base, name)) => (base, vec![name]),
                    None => continue,
                },
            };
            let mut base: Vec<&str> = base.split("::").collect();
            match base.first().copied() {
                Some("crate") => {
                    base.remove(0);
                }
                Some("self") => {
                    base.splice(0..1, here.iter().copied());
                }
                Some(_) => {
                    // A child module (an external crate is no module here).
                    base.splice(0..0, here.iter().copied());
                }
                None => continue,
            }
            for name in names.into_iter().filter(|n| !n.is_empty()) {
                let name = name.split(" as ").next().unwrap_or(name).trim();
                let (alias, path) = if name == "self" {
                    (base.last().copied().unwrap_or_default(), base.clone())
                } else {
                    let mut path = base.clone();
                    path.push(name);
                    (name, path)
                };
                if let Some(module) = resolve(modules, &BTreeMap::new(), &path) {
                    out.insert((me.clone(), alias.to_owned()), module);
                }
            }
        }
    }
    out
}

/// Every module each file imports, by the modules' paths; a name the crate
/// root re-exports (`crate::ShardingError`) is followed to the module that
/// defines it.
fn imports() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let modules = modules(&src);
    let reexports = reexports(&src, &modules);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in files {
        let me = module_of(&src, &file);
        let code = code_of(&file);
        let edges = graph.entry(me.clone()).or_default();
        for path in paths_after(&code, "crate::") {
            if let Some(target) = resolve(&modules, &reexports, &path).filter(|t| *t != me) {
                edges.insert(target);
            }
        }
        // (In a folder's `mod.rs` too: `super::` is the folder's parent,
        // which is what `me`'s parent is.)
        if let Some((parent, _)) = me.rsplit_once('/') {
            for path in paths_after(&code, "super::") {
                let mut full = vec![parent];
                full.extend(path);
                // (A sibling's item the parent re-exports is the parent's
                // here: the parts of one concept's folder may share it.)
                let direct = BTreeMap::new();
                if let Some(target) = resolve(&modules, &direct, &full).filter(|t| t != parent) {
                    edges.insert(target);
                }
            }
        }
    }
    graph
}

fn layer(module: &str) -> u8 {
    LAYERS
        .iter()
        .filter(|(name, _)| {
            module == *name
                || module
                    .strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with('/'))
        })
        .max_by_key(|(name, _)| name.len())
        .map(|(_, l)| *l)
        .unwrap_or_else(|| panic!("module `{module}` has no layer in tests/layering.rs"))
}

/// The imports of `graph` that go up a layer.
fn upward(graph: &BTreeMap<String, BTreeSet<String>>) -> BTreeSet<(String, String)> {
    let mut found = BTreeSet::new();
    for (from, targets) in graph {
        for to in targets {
            if layer(to) > layer(from) {
                found.insert((from.clone(), to.clone()));
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
/// import, a root re-export is followed, and an import from the runtime
/// into the sharding layer is upward. (Limits: `self::` and
/// `super::super::` paths, and `/* */` comments, are not read.)
#[test]
fn the_upward_check_finds_an_upward_import() {
    let code =
        "use crate::sharding::{driver::DriverMsg, remote};\nuse crate::{model::envelope::X, Y};";
    assert_eq!(
        paths_after(code, "crate::"),
        [
            vec!["sharding", "driver", "DriverMsg"],
            vec!["sharding", "remote"],
            vec!["model", "envelope", "X"],
            vec!["Y"]
        ]
    );
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let modules = modules(&src);
    let reexports = reexports(&src, &modules);
    let at = |path: &[&str]| resolve(&modules, &reexports, path);
    assert_eq!(
        at(&["model", "envelope", "X"]).as_deref(),
        Some("model/envelope")
    );
    assert_eq!(at(&["ShardingError"]).as_deref(), Some("model/error"));
    assert_eq!(
        at(&["Registration"]).as_deref(),
        Some("system/registration")
    );
    assert_eq!(
        at(&["identity", "NodeId"]).as_deref(),
        Some("model/identity")
    );
    assert_eq!(
        at(&["membership", "MembershipState"]).as_deref(),
        Some("membership/state")
    );
    assert_eq!(at(&["NotAName"]), None);
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
        BTreeSet::from([("runtime/region".to_owned(), "sharding/driver".to_owned())])
    );
}

/// The cores import only the model, the data their protocols speak
/// (`CORE_MAY_IMPORT`), each other, and their own folder's files.
#[test]
fn the_cores_import_only_the_model_and_their_data() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let src = root.join("src");
    let graph = imports();
    let cores: Vec<String> = CORES
        .iter()
        .map(|c| {
            c.trim_start_matches("src/")
                .trim_end_matches(".rs")
                .to_owned()
        })
        .collect();
    let within = |module: &str, of: &str| {
        module == of
            || module
                .strip_prefix(of)
                .is_some_and(|rest| rest.starts_with('/'))
    };
    let modules = modules(&src);
    let reexports = reexports(&src, &modules);
    let mut found = BTreeSet::new();
    for file in core_files(root) {
        let me = module_of(&src, &file);
        // A path the checker cannot follow could hide anything: in a core,
        // every `crate::` path must resolve.
        let code = code_of(&file);
        for path in paths_after(&code, "crate::") {
            if resolve(&modules, &reexports, &path).is_none() {
                found.insert((me.clone(), format!("unresolved crate::{}", path.join("::"))));
            }
        }
        for target in graph.get(&me).into_iter().flatten() {
            let allowed = CORE_MAY_IMPORT.iter().any(|m| within(target, m))
                || cores.iter().any(|c| within(target, c));
            if !allowed {
                found.insert((me.clone(), target.clone()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "a core imports what is neither the model nor its data: {found:?}"
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
    assert_eq!(found, vec![vec!["wire", "Frame"], vec!["identity"]]);
}
