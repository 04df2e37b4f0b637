//! No two modules of the core import each other, except the pairs listed here (none today:
//! a module that adds to `DeviceCore` through an `impl` block is one the core does not import,
//! and the types the core keeps are in leaf modules). The list must shrink, never grow: a new
//! pair fails this test, and so does a listed pair that is gone (take it off the list).
//!
//! An import is any `crate::module` path in a module's code before its test module (a `use`,
//! a path in an expression or a doc link, and a `super::` path in a folder's file), so the
//! check is conservative. Each file is a module (`expandable/growth.rs` is
//! `expandable::growth`); a folder's `mod.rs` and its own files may name each other (one
//! module's parts). And the core's state (`core.rs`) names no module that adds to
//! `DeviceCore` through an `impl` block: the types it keeps are in leaf modules.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The pairs of modules that still import each other, in name order.
const STILL_MUTUAL: &[(&str, &str)] = &[];

/// A module's source: its path in the crate (`growth` in `expandable/` is
/// `expandable::growth`; a folder's `mod.rs` is the folder) and its code before its test module
/// (a file named `tests.rs` is a test module, left out).
fn modules() -> BTreeMap<String, String> {
    fn walk(dir: &Path, prefix: &str, out: &mut BTreeMap<String, String>) {
        for entry in std::fs::read_dir(dir).expect("a source folder") {
            let path = entry.expect("a directory entry").path();
            let name = file_name(&path);
            let join = |n: &str| {
                if prefix.is_empty() {
                    n.to_string()
                } else {
                    format!("{prefix}::{n}")
                }
            };
            if path.is_dir() {
                walk(&path, &join(&name), out);
                continue;
            }
            let Some(stem) = name.strip_suffix(".rs") else {
                continue;
            };
            let module = match stem {
                "tests" => continue,
                "mod" | "lib" => prefix.to_string(),
                _ => join(stem),
            };
            let text = std::fs::read_to_string(&path).expect("a source file");
            let code = text.split("#[cfg(test)]").next().unwrap_or("").to_string();
            out.insert(module, code);
        }
    }
    let mut out = BTreeMap::new();
    walk(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        "",
        &mut out,
    );
    out.remove("");
    out
}

fn file_name(path: &Path) -> String {
    path.file_name().unwrap().to_string_lossy().into_owned()
}

/// The modules of this crate a path names: its longest prefix that is a module.
fn resolve(known: &BTreeMap<String, String>, path: &[String]) -> Option<String> {
    (1..=path.len())
        .rev()
        .map(|n| path[..n].join("::"))
        .find(|m| known.contains_key(m))
}

/// The module path that starts at `text` (identifiers joined by `::`).
fn path_at(text: &str) -> Vec<String> {
    let mut segments = Vec::new();
    let mut rest = text;
    loop {
        let segment: String = rest
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        if segment.is_empty() {
            return segments;
        }
        rest = &rest[segment.len()..];
        segments.push(segment);
        match rest.strip_prefix("::") {
            Some(r) => rest = r,
            None => return segments,
        }
    }
}

/// Each module and the modules of this crate it names (`crate::` paths, and `super::` paths
/// of a folder's files).
fn imports() -> BTreeMap<String, BTreeSet<String>> {
    let modules = modules();
    let mut out = BTreeMap::new();
    for (name, code) in &modules {
        let mut names = BTreeSet::new();
        for (i, _) in code.match_indices("crate::") {
            let path = path_at(&code[i + "crate::".len()..]);
            names.extend(resolve(&modules, &path));
        }
        // `super::` in `a/b.rs` names `a` (or a sibling `a::c`).
        if let Some((parent, _)) = name.rsplit_once("::") {
            for (i, _) in code.match_indices("super::") {
                let mut path: Vec<String> = parent.split("::").map(str::to_string).collect();
                path.extend(path_at(&code[i + "super::".len()..]));
                names.extend(resolve(&modules, &path));
            }
        }
        names.remove(name);
        out.insert(name.clone(), names);
    }
    out
}

/// True when `a` is `b`'s folder, or the other way round: a folder's `mod.rs` and its files
/// are parts of one module and may name each other.
fn nested(a: &str, b: &str) -> bool {
    b.starts_with(&format!("{a}::")) || a.starts_with(&format!("{b}::"))
}

#[test]
fn no_two_modules_import_each_other_beyond_the_listed_pairs() {
    let imports = imports();
    assert!(imports.len() > 40, "read {} modules", imports.len());
    // The folders' files are read too: the miss chain names the core and the growth planner,
    // the core names the expandable segments component but not their operations.
    assert!(imports["miss"].contains("core"), "{:?}", imports["miss"]);
    assert!(imports["miss"].contains("expandable::growth"));
    assert!(imports["miss::ops"].contains("free::detached"));
    assert!(imports["core"].contains("expandable::segments"));
    assert!(!imports["core"].contains("expandable"));
    let mut mutual = BTreeSet::new();
    for (a, names) in &imports {
        for b in names {
            let back = imports.get(b).is_some_and(|theirs| theirs.contains(a));
            if back && !nested(a, b) {
                let pair = if a < b { (a, b) } else { (b, a) };
                mutual.insert((pair.0.clone(), pair.1.clone()));
            }
        }
    }
    let listed: BTreeSet<(String, String)> = STILL_MUTUAL
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    let new: Vec<_> = mutual.difference(&listed).collect();
    let gone: Vec<_> = listed.difference(&mutual).collect();
    assert!(
        new.is_empty(),
        "modules that import each other, not on the list: {new:?} (make one of them a \
         component the other calls, or move the shared type to a leaf module)"
    );
    assert!(
        gone.is_empty(),
        "pairs on the list that no longer import each other: {gone:?} (take them off)"
    );
}

/// The core's own module names only leaf modules: none of those that add to `DeviceCore`.
#[test]
fn the_core_names_no_module_that_extends_it() {
    let modules = modules();
    let imports = imports();
    let extend: Vec<&String> = imports["core"]
        .iter()
        .filter(|m| modules[*m].contains("\nimpl DeviceCore"))
        .collect();
    assert!(
        extend.is_empty(),
        "core.rs names modules with `impl DeviceCore`: {extend:?}"
    );
    // And the check reads what it should: the malloc path extends the core.
    assert!(modules["malloc"].contains("\nimpl DeviceCore"));
}

/// The statistics (`DeviceStats`, and each private pool's usage) are written by the ledger
/// only (`ledger/books.rs`: one call per event); elsewhere they are read through
/// `DeviceCore::stats`.
#[test]
fn the_statistics_are_written_by_the_ledger_only() {
    let modules = modules();
    let mut writers = Vec::new();
    for (name, code) in &modules {
        if name == "ledger" || name.starts_with("ledger::") {
            continue;
        }
        let usage_calls =
            code.matches("usage_mut(").count() - code.matches("fn usage_mut(").count();
        if code.contains("self.stats.") || code.contains("&mut self.stats") || usage_calls > 0 {
            writers.push(name.clone());
        }
    }
    assert!(
        writers.is_empty(),
        "modules outside ledger/ that write the statistics: {writers:?} (add a call to \
         ledger/books.rs instead)"
    );
    // And the check reads what it should: the ledger's books write them.
    assert!(modules["ledger::books"].contains("&mut self.stats"));
}
