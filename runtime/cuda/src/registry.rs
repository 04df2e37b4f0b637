//! Live streams and events of the CUDA backend, by the backend's own handle values.
//!
//! A handle is only passed to the driver after it is found here, and the lookup hands out an
//! `Arc` clone, so a concurrent destroy cannot free the driver object while a call uses it.
//! An entry is reference counted: adopting the same cudarc stream twice needs two destroys.
//!
//! Handle values are the backend's, never reused ([`Registry::fresh`]), not the driver's
//! pointers: the driver reuses a destroyed object's pointer, and a stale handle a user kept
//! would otherwise name the newer object.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use gpualloc_runtime::error::{BackendError, Result};
use gpualloc_runtime::types::DeviceId;

struct Entry<T> {
    device: DeviceId,
    value: Arc<T>,
    refs: usize,
}

/// Handle value → live object, with the device it belongs to.
pub(crate) struct Registry<T> {
    kind: &'static str,
    map: Mutex<HashMap<u64, Entry<T>>>,
    /// The last handle value handed out.
    last: std::sync::atomic::AtomicU64,
}

impl<T> Registry<T> {
    /// An empty registry of `kind` ("stream", "event") objects.
    pub(crate) fn new(kind: &'static str) -> Self {
        Registry {
            kind,
            map: Mutex::new(HashMap::new()),
            last: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// A handle value never handed out before (never 0).
    pub(crate) fn fresh(&self) -> u64 {
        self.last
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            .wrapping_add(1)
    }

    /// The handle value of the live object `matches` picks on `device`, if any (adopting a
    /// cudarc stream already adopted names the same entry).
    pub(crate) fn find(&self, device: DeviceId, matches: impl Fn(&T) -> bool) -> Option<u64> {
        self.lock()
            .iter()
            .find(|(_, e)| e.device == device && matches(&e.value))
            .map(|(raw, _)| *raw)
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Entry<T>>> {
        // A panic while holding this lock cannot leave the map inconsistent (every update
        // is a single insert/remove), so a poisoned lock is still usable.
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds `value` under `raw`, or one more reference if it is already there.
    pub(crate) fn insert(&self, device: DeviceId, raw: u64, value: Arc<T>) -> Result<()> {
        let mut map = self.lock();
        match map.get_mut(&raw) {
            Some(e) if e.device != device => Err(BackendError::invalid(format!(
                "{} {raw:#x} is registered on {}, not {device}",
                self.kind, e.device
            ))),
            Some(e) => {
                e.refs += 1;
                Ok(())
            }
            None => {
                map.insert(
                    raw,
                    Entry {
                        device,
                        value,
                        refs: 1,
                    },
                );
                Ok(())
            }
        }
    }

    /// The live object named by (`device`, `raw`).
    pub(crate) fn get(&self, device: DeviceId, raw: u64) -> Result<Arc<T>> {
        match self.lock().get(&raw) {
            Some(e) if e.device == device => Ok(e.value.clone()),
            _ => Err(self.unknown(device, raw)),
        }
    }

    /// Drops one reference; returns the object when it was the last, so the caller drops
    /// it (and with it the driver object) outside the lock.
    pub(crate) fn remove(&self, device: DeviceId, raw: u64) -> Result<Option<Arc<T>>> {
        let mut map = self.lock();
        match map.get_mut(&raw) {
            Some(e) if e.device == device => {
                e.refs -= 1;
                if e.refs == 0 {
                    Ok(map.remove(&raw).map(|e| e.value))
                } else {
                    Ok(None)
                }
            }
            _ => Err(self.unknown(device, raw)),
        }
    }

    /// Number of live entries.
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }

    /// Removes everything (backend teardown), returning the objects to drop.
    pub(crate) fn drain(&self) -> Vec<Arc<T>> {
        self.lock().drain().map(|(_, e)| e.value).collect()
    }

    fn unknown(&self, device: DeviceId, raw: u64) -> BackendError {
        BackendError::InvalidHandle(format!("unknown {} {raw:#x} on {device}", self.kind))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_checks_device_and_liveness() {
        let r = Registry::new("stream");
        r.insert(DeviceId(0), 0x10, Arc::new(7u32)).unwrap();
        assert_eq!(*r.get(DeviceId(0), 0x10).unwrap(), 7);
        assert!(matches!(
            r.get(DeviceId(1), 0x10),
            Err(BackendError::InvalidHandle(_))
        ));
        assert!(matches!(
            r.get(DeviceId(0), 0x20),
            Err(BackendError::InvalidHandle(_))
        ));
        assert!(matches!(
            r.insert(DeviceId(1), 0x10, Arc::new(8)),
            Err(BackendError::InvalidValue(_))
        ));
    }

    #[test]
    fn references_are_counted() {
        let r = Registry::new("stream");
        let v = Arc::new(1u32);
        r.insert(DeviceId(0), 1, v.clone()).unwrap();
        r.insert(DeviceId(0), 1, v.clone()).unwrap();
        assert_eq!(r.remove(DeviceId(0), 1), Ok(None));
        assert_eq!(r.len(), 1);
        let last = r.remove(DeviceId(0), 1).unwrap().unwrap();
        assert!(Arc::ptr_eq(&last, &v));
        assert_eq!(r.len(), 0);
        assert!(matches!(
            r.remove(DeviceId(0), 1),
            Err(BackendError::InvalidHandle(_))
        ));
    }

    #[test]
    fn drain_empties() {
        let r = Registry::new("event");
        r.insert(DeviceId(0), 1, Arc::new(1u8)).unwrap();
        r.insert(DeviceId(1), 2, Arc::new(2u8)).unwrap();
        assert_eq!(r.drain().len(), 2);
        assert_eq!(r.len(), 0);
    }
}
