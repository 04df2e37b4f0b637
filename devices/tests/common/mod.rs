//! Setup shared by the device-core tests.

use std::sync::Arc;

use gpualloc_accounting::AccountingBackend;
use gpualloc_devices::{AllocatorConfig, DeviceCore, PoolOptions};
use gpualloc_runtime::{Backend, DeviceId, StreamHandle};

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
#[allow(dead_code)] // not every test crate including this module makes pools
pub fn quota(bytes: u64) -> PoolOptions {
    PoolOptions {
        quota: Some(bytes),
        ..PoolOptions::default()
    }
}
