//! Plain handle and value types that cross the [`Backend`](crate::Backend) boundary.
//!
//! Handles are small `Copy` values (an ordinal plus the backend's raw handle); the backend
//! owns what they name. The RAII wrappers users hold ([`Stream`](crate::Stream),
//! [`Event`](crate::Event)) live in their own modules.

use std::fmt;

/// A device ordinal (0-based), as CUDA numbers them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct DeviceId(pub u32);

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "device {}", self.0)
    }
}

/// A device virtual address. On the sim it is a real address in this process, so simulated
/// kernels can read and write it; on CUDA it is a `CUdeviceptr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    /// The address `bytes` past this one, or `None` on overflow.
    pub fn checked_add(self, bytes: u64) -> Option<DevicePtr> {
        self.0.checked_add(bytes).map(DevicePtr)
    }
}

impl fmt::Display for DevicePtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// A stream: an in-order queue of device work on one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StreamHandle {
    /// Device the stream belongs to.
    pub device: DeviceId,
    /// Backend's raw handle (`CUstream` on CUDA, an id on the sim).
    pub raw: u64,
}

/// An event: a marker recorded on a stream that completes when the stream reaches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EventHandle {
    /// Device the event belongs to.
    pub device: DeviceId,
    /// Backend's raw handle (`CUevent` on CUDA, an id on the sim).
    pub raw: u64,
}

/// A physical memory allocation for virtual memory mapping (`CUmemGenericAllocationHandle`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PhysHandle {
    /// Device whose memory it is.
    pub device: DeviceId,
    /// Backend's raw handle.
    pub raw: u64,
    /// Size in bytes, a multiple of the device's granularity.
    pub size: u64,
}

/// Opaque 64-byte handle that lets another process open a device allocation
/// (`CUipcMemHandle`'s size and role).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcMemHandle(pub [u8; 64]);

impl fmt::Debug for IpcMemHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IpcMemHandle(")?;
        for b in &self.0[..16] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "..)")
    }
}

/// Free and total memory of a device, as `cuMemGetInfo` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemInfo {
    /// Bytes the device can still allocate.
    pub free: u64,
    /// Bytes of memory the device has.
    pub total: u64,
}

/// Flags for registering existing host memory (`cuMemHostRegister`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct HostRegisterFlags {
    /// Pinned for every context (`CU_MEMHOSTREGISTER_PORTABLE`). The CUDA backend registers
    /// portable whatever this says: memory pinned for one GPU's context only would be staged
    /// (synchronously) on every other GPU.
    pub portable: bool,
    /// Also mapped into the device address space (`CU_MEMHOSTREGISTER_DEVICEMAP`).
    pub device_map: bool,
    /// Read-only for the device (`CU_MEMHOSTREGISTER_READ_ONLY`).
    pub read_only: bool,
}

/// A work item run on a stream's thread after the work before it (`cuLaunchHostFunc`).
/// It must not call back into the backend's stream operations.
///
/// It is called exactly once when its launch succeeded: with `Ok(())` when the stream
/// reaches it, or with an error (`BackendError::DeviceLost`) when the backend learns that
/// the stream never will (the device hit a sticky error, after which the driver runs no
/// host function). A launch that fails drops it uncalled.
pub type HostFn = Box<dyn FnOnce(crate::error::Result<()>) + Send + 'static>;
