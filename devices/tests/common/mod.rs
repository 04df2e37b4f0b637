//! Setup shared by the device-core tests.

use std::sync::Arc;

use gpualloc_devices::{AllocatorConfig, DeviceCore};
use gpualloc_runtime::accounting::AccountingBackend;
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
