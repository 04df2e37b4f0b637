//! Shared helpers for the integration tests: locating the real snapshots.

#![allow(dead_code)]

use std::path::PathBuf;

/// The directory with the real PyTorch snapshots (`GPUALLOC_TRACES` overrides it), or `None`
/// (with the reason printed) when it is absent.
pub fn traces_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("GPUALLOC_TRACES")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/traces"))
        });
    if dir.is_dir() {
        Some(dir)
    } else {
        eprintln!(
            "skipping: no traces directory at {} (set GPUALLOC_TRACES)",
            dir.display()
        );
        None
    }
}

/// Reads one snapshot file from [`traces_dir`], or `None` with the reason printed.
pub fn trace_bytes(name: &str) -> Option<Vec<u8>> {
    let path = traces_dir()?.join(name);
    match std::fs::read(&path) {
        Ok(b) => Some(b),
        Err(e) => {
            eprintln!("skipping: cannot read {}: {e}", path.display());
            None
        }
    }
}
