//! The real PyTorch snapshots of ../shared/traces, for the tests that replay them (skipped
//! with a printed reason where that folder is absent, as in a user's clone).
#![allow(dead_code)]

use std::path::PathBuf;

use gpualloc_replay::{load, Trace};

/// The trace crate's helper for the same folder (`GPUALLOC_TRACES`, else ../shared/traces).
#[path = "../../../trace/tests/common/mod.rs"]
mod snapshots;
pub use snapshots::traces_dir;

/// Every device trace of every snapshot in the folder (none when it is absent).
pub fn all_traces() -> Vec<Trace> {
    let Some(dir) = traces_dir() else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "pickle"))
        .collect();
    files.sort();
    assert!(
        files.len() >= 3,
        "expected the three snapshots in {}",
        dir.display()
    );
    files.iter().flat_map(|f| load(f).unwrap()).collect()
}
