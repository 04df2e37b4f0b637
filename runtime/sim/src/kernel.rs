//! [`KernelMemory`]: what a simulated kernel sees of device memory.

use std::sync::Arc;

use crate::memory::Memory;
use gpualloc_runtime::error::Result;
use gpualloc_runtime::types::DevicePtr;

/// Safe access to device memory from a simulated kernel. Every access is validated against
/// the sim's region table (a freed or unmapped pointer is an `InvalidValue` error, the sim's
/// "illegal address"), and performed while no unmap can run.
#[derive(Debug)]
pub struct KernelMemory {
    mem: Arc<Memory>,
}

impl KernelMemory {
    pub(crate) fn new(mem: Arc<Memory>) -> Self {
        KernelMemory { mem }
    }

    /// Reads `len` bytes at `ptr`.
    pub fn read(&mut self, ptr: DevicePtr, len: u64) -> Result<Vec<u8>> {
        self.mem.read(ptr.0, len)
    }

    /// Writes `data` at `ptr`.
    pub fn write(&mut self, ptr: DevicePtr, data: &[u8]) -> Result<()> {
        self.mem.write(ptr.0, data)
    }

    /// Sets `len` bytes at `ptr` to `byte`.
    pub fn fill(&mut self, ptr: DevicePtr, len: u64, byte: u8) -> Result<()> {
        self.mem.fill(ptr.0, len, byte)
    }

    /// True when all `len` bytes at `ptr` equal `byte`.
    pub fn check(&mut self, ptr: DevicePtr, len: u64, byte: u8) -> Result<bool> {
        self.mem.check(ptr.0, len, byte)
    }
}
