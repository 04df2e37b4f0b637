//! The sim's legacy IPC: its handle layout (which process, which memfd, which allocation),
//! and exporting, opening and closing handles.

use gpualloc_runtime::error::{BackendError, Result};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use gpualloc_runtime::types::{DeviceId, DevicePtr, IpcMemHandle};

use crate::memory::{Region, RegionKind};
use crate::os::{self, Mapping};
use crate::{latency, Op, SimBackend};

const MAGIC: &[u8; 8] = b"GPUASIM\x01";

/// What a sim IPC handle names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct IpcInfo {
    pub(crate) pid: u32,
    pub(crate) fd: i32,
    pub(crate) base: u64,
    pub(crate) size: u64,
    pub(crate) device: u32,
}

impl IpcInfo {
    pub(crate) fn encode(&self) -> IpcMemHandle {
        let mut b = [0u8; 64];
        b[0..8].copy_from_slice(MAGIC);
        b[8..12].copy_from_slice(&self.pid.to_le_bytes());
        b[12..16].copy_from_slice(&self.fd.to_le_bytes());
        b[16..24].copy_from_slice(&self.base.to_le_bytes());
        b[24..32].copy_from_slice(&self.size.to_le_bytes());
        b[32..36].copy_from_slice(&self.device.to_le_bytes());
        IpcMemHandle(b)
    }

    pub(crate) fn decode(handle: &IpcMemHandle) -> Result<IpcInfo> {
        let b = &handle.0;
        let bad = || BackendError::invalid("not a sim IPC memory handle");
        if &b[0..8] != MAGIC || b[36..].iter().any(|x| *x != 0) {
            return Err(bad());
        }
        let u32_at = |i: usize| -> Result<u32> {
            Ok(u32::from_le_bytes(
                b[i..i + 4].try_into().map_err(|_| bad())?,
            ))
        };
        let u64_at = |i: usize| -> Result<u64> {
            Ok(u64::from_le_bytes(
                b[i..i + 8].try_into().map_err(|_| bad())?,
            ))
        };
        let info = IpcInfo {
            pid: u32_at(8)?,
            fd: u32_at(12)? as i32,
            base: u64_at(16)?,
            size: u64_at(24)?,
            device: u32_at(32)?,
        };
        if info.fd < 0 || info.size == 0 || info.pid == 0 {
            return Err(bad());
        }
        Ok(info)
    }
}

impl SimBackend {
    /// [`gpualloc_runtime::Backend::ipc_get_mem_handle`]: a handle naming the device
    /// allocation that contains `ptr` (its memfd, base and size, and this process).
    pub(crate) fn ipc_export(&self, ptr: DevicePtr) -> Result<IpcMemHandle> {
        self.enter(Op::IpcGetMemHandle)?;
        let info = self
            .mem
            .find_containing(ptr.0, |start, r| {
                let fd = r.fd.as_ref().map(|fd| fd.as_raw_fd());
                match (r.kind, r.device, fd) {
                    (RegionKind::Device, Some(device), Some(fd)) => Some(IpcInfo {
                        pid: rustix::process::getpid().as_raw_nonzero().get() as u32,
                        fd,
                        base: start,
                        size: r.len,
                        device: device.0,
                    }),
                    _ => None,
                }
            })
            .flatten()
            .ok_or_else(|| BackendError::invalid(format!("{ptr} is not in a device allocation")))?;
        latency::pay(self.latency().ipc);
        Ok(info.encode())
    }

    /// [`gpualloc_runtime::Backend::ipc_open_mem_handle`]: maps the memory a handle names
    /// (through the exporting process's fd), with a shared lock on it while it is open.
    pub(crate) fn ipc_open(&self, device: DeviceId, handle: &IpcMemHandle) -> Result<DevicePtr> {
        self.enter(Op::IpcOpenMemHandle)?;
        self.check_device(device)?;
        let info = IpcInfo::decode(handle)?;
        let path = format!("/proc/{}/fd/{}", info.pid, info.fd);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| BackendError::invalid(format!("cannot open IPC handle ({e})")))?;
        let fd = OwnedFd::from(file);
        // A shared lock on the memory's file while it is open here: the exporter can tell that
        // its allocation is still in use by another process (`opened_by_another_process`).
        // Advisory only; the kernel drops it with the last fd of this open.
        let _ = rustix::fs::flock(&fd, rustix::fs::FlockOperation::NonBlockingLockShared);
        let size = os::memory_file_size(fd.as_fd())?;
        if size != info.size {
            return Err(BackendError::invalid(format!(
                "IPC handle names {} bytes but the memory has {size}",
                info.size
            )));
        }
        let mapping = Mapping::shared(&fd, size, &device.to_string())?;
        let addr = mapping.addr();
        let region = Region {
            len: size,
            kind: RegionKind::IpcOpened,
            device: Some(device),
            accessible: true,
            read_only: false,
            _mapping: Some(mapping),
            fd: Some(fd),
        };
        self.mem.insert(addr, region)?;
        latency::pay(self.latency().ipc);
        Ok(DevicePtr(addr))
    }

    /// [`gpualloc_runtime::Backend::ipc_close_mem_handle`]: unmaps an opened handle's memory.
    pub(crate) fn ipc_close(&self, ptr: DevicePtr) -> Result<()> {
        self.enter(Op::IpcCloseMemHandle)?;
        let region = self.mem.remove(ptr.0, RegionKind::IpcOpened)?;
        drop(region);
        latency::pay(self.latency().ipc);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_garbage() {
        let info = IpcInfo {
            pid: 42,
            fd: 7,
            base: 0x7f00_0000_0000,
            size: 2 << 20,
            device: 1,
        };
        assert_eq!(IpcInfo::decode(&info.encode()).unwrap(), info);
        assert!(IpcInfo::decode(&IpcMemHandle([0u8; 64])).is_err());
        let mut h = info.encode();
        h.0[50] = 1;
        assert!(IpcInfo::decode(&h).is_err());
    }
}
