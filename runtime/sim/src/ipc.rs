//! The sim's legacy IPC handle layout: which process, which memfd, which allocation.

use gpualloc_runtime::error::{BackendError, Result};
use gpualloc_runtime::types::IpcMemHandle;

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
