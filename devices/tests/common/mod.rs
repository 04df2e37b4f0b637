//! Setup shared by the device-core tests.

// Not every test crate including this module uses every helper.
#![allow(dead_code)]

use std::sync::Arc;

use gpualloc_accounting::AccountingBackend;
use gpualloc_devices::{AllocatorConfig, DeviceCore, Miss, MissIo, MissStep, PoolOptions};
use gpualloc_runtime::{Backend, BackendError, DeviceId, StreamHandle};

/// A core on one accounting device of `capacity` bytes under config `conf`, its backend and a
/// stream of it. Not recording history.
pub fn rig(capacity: u64, conf: &str) -> (Arc<AccountingBackend>, DeviceCore, StreamHandle) {
    let backend = Arc::new(AccountingBackend::new(1, capacity));
    let dynb: Arc<dyn Backend> = backend.clone();
    let s = dynb.stream_create(DeviceId(0)).unwrap();
    let config = AllocatorConfig::parse(conf).unwrap();
    let core = DeviceCore::new(dynb, DeviceId(0), config).unwrap();
    (backend, core, s)
}

/// A named pool's options with a quota of `bytes` and nothing else.
pub fn quota(bytes: u64) -> PoolOptions {
    PoolOptions {
        quota: Some(bytes),
        ..PoolOptions::default()
    }
}

/// Drives `miss` (started on `core`) to its end, as an owner does: each driver call the chain
/// asks for is made, except those `refuse` picks, which fail as a device without memory
/// does (the owner tried it and found no room). Returns the last step.
pub fn drive_miss(
    core: &mut DeviceCore,
    mut miss: Miss,
    mut refuse: impl FnMut(&MissIo) -> bool,
) -> MissStep {
    let mut done = None;
    for _ in 0..64 {
        match core.advance_miss(&mut miss, done.take()) {
            MissStep::Io(io) => {
                done = Some(if refuse(&io) {
                    io.fail(BackendError::OutOfMemory {
                        requested: 0,
                        what: "device 0".into(),
                    })
                } else {
                    let backend = core.backend().clone();
                    io.perform(backend.as_ref())
                });
            }
            end => return end,
        }
    }
    panic!("a miss with no end after 64 steps");
}

/// True for the chain's request of a new segment.
pub fn segment_malloc(io: &MissIo) -> bool {
    matches!(io, MissIo::AllocSegment { .. })
}
