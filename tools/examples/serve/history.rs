//! `--history`: the recorded history written as a snapshot, read back and checked.

use gpualloc::{Allocator, DeviceId, Error};

/// Writes the snapshot with the recorded history to `path`, reads it back and checks its
/// segments against `stats()`. False on a mismatch.
pub(crate) async fn write_history(
    alloc: &Allocator,
    devices: u32,
    path: &std::path::Path,
) -> Result<bool, Error> {
    alloc.dump_snapshot(path).await?;
    let bytes = std::fs::read(path).map_err(|e| Error::Internal(format!("{e}")))?;
    let snap = gpualloc::trace::Snapshot::from_pickle(&bytes)
        .map_err(|e| Error::Internal(format!("reading {}: {e}", path.display())))?;
    let mut ok = true;
    for d in 0..devices {
        let reserved: u64 = snap
            .segments
            .iter()
            .filter(|s| s.device == i64::from(d))
            .map(|s| s.total_size)
            .sum();
        let stats = alloc.stats(DeviceId(d)).await?;
        if reserved != stats.reserved_bytes[0].current {
            eprintln!(
                "history: device {d}: the snapshot's segments hold {reserved} bytes, stats() {}",
                stats.reserved_bytes[0].current
            );
            ok = false;
        }
    }
    let entries: Vec<usize> = snap.device_traces.iter().map(Vec::len).collect();
    println!(
        "history: {} bytes written to {} (entries per device: {entries:?}); open it in PyTorch's memory viewer",
        bytes.len(),
        path.display()
    );
    Ok(ok)
}
