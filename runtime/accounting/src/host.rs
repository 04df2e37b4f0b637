//! The pinned-host calls the [`Backend`] trait marks `unsafe`, offered safe: the accounting
//! backend never touches memory.

use super::*;

/// The calls the [`Backend`] trait marks `unsafe` because a GPU reads and writes host memory
/// by address: the accounting backend never touches memory (addresses are numbers to it), so
/// it offers them safe.
impl AccountingBackend {
    /// [`Backend::host_free`], safe here (no memory is touched).
    pub fn host_free(&self, ptr: *mut u8) -> Result<()> {
        let mut state = lock(&self.state);
        let size = state.host.allocs.remove(ptr as u64).ok_or_else(|| {
            BackendError::invalid(format!("host_free of unknown pointer {ptr:?}"))
        })?;
        state.host.used -= size;
        state.counts.host_frees += 1;
        Ok(())
    }

    /// [`Backend::host_register`], safe here (no memory is touched).
    pub fn host_register(&self, ptr: *mut u8, len: u64, _flags: HostRegisterFlags) -> Result<()> {
        let start = ptr as u64;
        if start == 0 || len == 0 || start % HOST_PAGE != 0 || len % HOST_PAGE != 0 {
            return Err(BackendError::invalid(format!(
                "host_register of {len} bytes at {ptr:?}: not a non-empty page-aligned range"
            )));
        }
        if start.checked_add(len).is_none() {
            return Err(BackendError::invalid("host_register range overflows"));
        }
        let mut state = lock(&self.state);
        if HostState::overlaps(&state.host.registered, start, len)
            || HostState::overlaps(state.host.allocs.ranges(), start, len)
        {
            return Err(BackendError::invalid(format!(
                "host_register of {len} bytes at {ptr:?} overlaps pinned memory"
            )));
        }
        if state.host.used + len > self.host_capacity {
            return Err(BackendError::OutOfMemory {
                requested: len,
                what: "pinned host".into(),
            });
        }
        state.host.registered.insert(start, len);
        state.host.used += len;
        state.counts.host_registers += 1;
        Ok(())
    }

    /// [`Backend::host_unregister`], safe here (no memory is touched).
    pub fn host_unregister(&self, ptr: *mut u8) -> Result<()> {
        let mut state = lock(&self.state);
        let len = state.host.registered.remove(&(ptr as u64)).ok_or_else(|| {
            BackendError::invalid(format!(
                "host_unregister of {ptr:?}: not a registered range"
            ))
        })?;
        state.host.used -= len;
        state.counts.host_unregisters += 1;
        Ok(())
    }
}
