//! No two modules of the core import each other, except the pairs listed here (none today:
//! a module that adds to `DeviceCore` through an `impl` block is one the core does not import,
//! and the types the core keeps are in leaf modules). The list must shrink, never grow: a new
//! pair fails this test, and so does a listed pair that is gone (take it off the list).
//!
//! An import is any `crate::module` path in a module's code before its test module (a `use`,
//! a path in an expression or a doc link), so the check is conservative. A folder module
//! (`config/`, `miss/`) counts as one, its files together.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The pairs of modules that still import each other, in name order.
const STILL_MUTUAL: &[(&str, &str)] = &[];

/// Each module's name and the modules of this crate it names. A folder with a `mod.rs` is one
/// module, all its files together (a file named `tests.rs` is its test module, left out).
fn imports() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(&src).expect("devices/src") {
        let path = entry.expect("a directory entry").path();
        let (name, texts) = if path.is_dir() && path.join("mod.rs").exists() {
            (file_name(&path), folder_sources(&path))
        } else if path.extension().and_then(|e| e.to_str()) == Some("rs") {
            let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
            (
                stem,
                vec![std::fs::read_to_string(&path).expect("a source file")],
            )
        } else {
            continue;
        };
        let mut names = BTreeSet::new();
        for text in &texts {
            let code = text.split("#[cfg(test)]").next().unwrap_or("");
            for (i, _) in code.match_indices("crate::") {
                let rest = &code[i + "crate::".len()..];
                let module: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                    .collect();
                if !module.is_empty() && module != name {
                    names.insert(module);
                }
            }
        }
        out.insert(name, names);
    }
    out
}

fn file_name(path: &Path) -> String {
    path.file_name().unwrap().to_string_lossy().into_owned()
}

/// The sources of a folder module, its subfolders included, but not its `tests.rs`.
fn folder_sources(dir: &Path) -> Vec<String> {
    let mut texts = Vec::new();
    for entry in std::fs::read_dir(dir).expect("a module folder") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            texts.extend(folder_sources(&path));
        } else if path.extension().and_then(|e| e.to_str()) == Some("rs")
            && file_name(&path) != "tests.rs"
        {
            texts.push(std::fs::read_to_string(&path).expect("a source file"));
        }
    }
    texts
}

#[test]
fn no_two_modules_import_each_other_beyond_the_listed_pairs() {
    let imports = imports();
    assert!(imports.len() > 30, "read {} modules", imports.len());
    // The folder modules are read too: the miss chain names the core, and nothing names the
    // miss chain back.
    assert!(
        imports["miss"].contains("core"),
        "{:?}",
        imports.get("miss")
    );
    assert!(imports.contains_key("config"));
    let mut mutual = BTreeSet::new();
    for (a, names) in &imports {
        for b in names {
            if imports.get(b).is_some_and(|theirs| theirs.contains(a)) {
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
