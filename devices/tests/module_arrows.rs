//! No two modules of the core import each other, except the pairs listed here (none today:
//! a module that adds to `DeviceCore` through an `impl` block is one the core does not import,
//! and the types the core keeps are in leaf modules). The list must shrink, never grow: a new
//! pair fails this test, and so does a listed pair that is gone (take it off the list).
//!
//! An import is any `crate::module` path in a module's code before its test module (a `use`,
//! a path in an expression or a doc link), so the check is conservative.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The pairs of modules that still import each other, in name order.
const STILL_MUTUAL: &[(&str, &str)] = &[];

/// Each module's name and the modules of this crate it names.
fn imports() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(&src).expect("devices/src") {
        let path = entry.expect("a directory entry").path();
        if path.extension().and_then(|e| e.to_str()) != Some("rs") {
            continue;
        }
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(&path).expect("a source file");
        let code = text.split("#[cfg(test)]").next().unwrap_or("");
        let mut names = BTreeSet::new();
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
        out.insert(name, names);
    }
    out
}

#[test]
fn no_two_modules_import_each_other_beyond_the_listed_pairs() {
    let imports = imports();
    assert!(imports.len() > 30, "read {} modules", imports.len());
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
