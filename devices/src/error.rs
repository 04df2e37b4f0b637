//! Errors of the device allocator, with an out-of-memory report a user can act on.

use std::fmt;

use gpualloc_runtime::{BackendError, DeviceId, DevicePtr};

use crate::config::ConfigError;

/// What a device allocator call can fail with.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AllocError {
    /// No memory could be found or allocated after the whole retry chain.
    #[error("{0}")]
    OutOfMemory(Box<OomReport>),
    /// The size cannot be served at all (it overflows when rounded).
    #[error("invalid allocation size {size}: {reason}")]
    InvalidSize {
        /// Requested bytes.
        size: u64,
        /// Why it is invalid.
        reason: &'static str,
    },
    /// The pointer is not a live allocation of this allocator (double free, foreign pointer).
    #[error("{0} is not a live allocation of this allocator")]
    UnknownPointer(DevicePtr),
    /// A stream of another device was passed.
    #[error("stream belongs to {got}, but this allocator serves {expected}")]
    WrongDevice {
        /// The allocator's device.
        expected: DeviceId,
        /// The stream's device.
        got: DeviceId,
    },
    /// No such private memory pool.
    #[error("unknown memory pool {0}")]
    UnknownPool(u64),
    /// The allocator has been shut down.
    #[error("the allocator has been shut down")]
    Shutdown,
    /// A bad configuration.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A backend call failed with something other than out-of-memory.
    #[error("backend error: {0}")]
    Backend(#[from] BackendError),
}

impl AllocError {
    /// True for [`AllocError::OutOfMemory`].
    pub fn is_oom(&self) -> bool {
        matches!(self, AllocError::OutOfMemory(_))
    }
}

/// The numbers behind an out-of-memory error, in PyTorch's terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OomReport {
    /// Device that ran out.
    pub device: DeviceId,
    /// Bytes the user asked for.
    pub requested: u64,
    /// Bytes the allocator tried to get from the device (the segment size).
    pub alloc_size: u64,
    /// Device memory in total.
    pub device_total: u64,
    /// Device memory free, as the backend reports it.
    pub device_free: u64,
    /// The cap from `per_process_memory_fraction`, if set.
    pub allowed: Option<u64>,
    /// Bytes allocated to users by this allocator.
    pub allocated: u64,
    /// Bytes this allocator holds from the device.
    pub reserved: u64,
}

impl OomReport {
    /// Reserved but not allocated bytes (fragmentation and cache).
    pub fn reserved_unallocated(&self) -> u64 {
        self.reserved.saturating_sub(self.allocated)
    }
}

/// Formats bytes as PyTorch's `format_size` does (B, KiB, MiB, GiB with two decimals).
pub fn format_size(bytes: u64) -> String {
    const KIB: f64 = 1024.0;
    let b = bytes as f64;
    if bytes <= 1024 {
        format!("{bytes} bytes")
    } else if b <= 1048576.0 {
        format!("{:.2} KiB", b / KIB)
    } else if b <= 1073741824.0 {
        format!("{:.2} MiB", b / KIB / KIB)
    } else {
        format!("{:.2} GiB", b / KIB / KIB / KIB)
    }
}

impl fmt::Display for OomReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "out of memory on {}: tried to allocate {} (a {} segment). The device has a total \
             capacity of {} of which {} is free. ",
            self.device,
            format_size(self.requested),
            format_size(self.alloc_size),
            format_size(self.device_total),
            format_size(self.device_free)
        )?;
        if let Some(allowed) = self.allowed {
            write!(
                f,
                "{} allowed (per_process_memory_fraction). ",
                format_size(allowed)
            )?;
        }
        write!(
            f,
            "Of the allocated memory {} is allocated by gpualloc, and {} is reserved by gpualloc \
             but unallocated.",
            format_size(self.allocated),
            format_size(self.reserved_unallocated())
        )?;
        if self.reserved_unallocated() > self.requested.min(self.reserved / 4) {
            write!(
                f,
                " Reserved but unallocated memory is large: try expandable_segments:True in \
                 GPUALLOC_CONF (or max_split_size_mb) to reduce fragmentation."
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_like_pytorch() {
        assert_eq!(format_size(1000), "1000 bytes");
        assert_eq!(format_size(600 << 10), "600.00 KiB");
        assert_eq!(format_size(20 << 20), "20.00 MiB");
        assert_eq!(format_size(3 << 30), "3.00 GiB");
    }

    #[test]
    fn oom_message_carries_the_numbers_and_a_hint() {
        let r = OomReport {
            device: DeviceId(1),
            requested: 3 << 30,
            alloc_size: 3 << 30,
            device_total: 16 << 30,
            device_free: 1 << 30,
            allowed: None,
            allocated: 10 << 30,
            reserved: 14 << 30,
        };
        let s = AllocError::OutOfMemory(Box::new(r)).to_string();
        assert!(s.contains("device 1"), "{s}");
        assert!(s.contains("tried to allocate 3.00 GiB"), "{s}");
        assert!(
            s.contains("total capacity of 16.00 GiB of which 1024.00 MiB is free"),
            "{s}"
        );
        assert!(s.contains("10.00 GiB is allocated"), "{s}");
        assert!(
            s.contains("4.00 GiB is reserved by gpualloc but unallocated"),
            "{s}"
        );
        assert!(s.contains("expandable_segments:True"), "{s}");
    }
}
