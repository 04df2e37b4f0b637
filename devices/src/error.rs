//! Errors of the device allocator, with an out-of-memory report a user can act on.

use std::fmt;

use gpualloc_runtime::{BackendError, DeviceId, DevicePtr};

use crate::config::ConfigError;
use crate::pools::pool_state::PoolState;

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
    /// A request would take a private pool past its quota (after the pool's own cached
    /// segments were returned to the device).
    #[error(
        "memory pool {pool:?} is at its quota: tried to allocate {} with {} of {} reserved{}",
        format_size(*requested),
        format_size(*reserved),
        format_size(*quota),
        on_its_way(*in_flight)
    )]
    PoolQuota {
        /// The pool's name.
        pool: String,
        /// Its quota in bytes.
        quota: u64,
        /// Bytes it reserves now.
        reserved: u64,
        /// Bytes the request asked for.
        requested: u64,
        /// Bytes of the pool on their way to or from the device right now (segments being
        /// allocated or freed, pages being mapped or unmapped off the core): they count
        /// against the quota until the driver call returns, and a retry after may fit.
        in_flight: u64,
    },
    /// A named pool that is asleep, falling asleep or waking (`sleep.rs`) was asked to
    /// allocate, or to sleep again.
    #[error("memory pool {pool:?} is {state}: it serves no allocations until it is awake")]
    PoolAsleep {
        /// The pool's name.
        pool: String,
        /// Where it is in its sleep cycle.
        state: PoolState,
    },
    /// A pool cannot sleep now: pages of its segments are being mapped or unmapped by a
    /// request in flight, or launches of a dropped graph captured into it may still run.
    /// Retrying shortly succeeds (`Pool::sleep` retries by itself).
    #[error("memory pool {pool:?} has pages being mapped or unmapped, or graph launches running; try again")]
    PoolBusy {
        /// The pool's name.
        pool: String,
    },
    /// A pool cannot sleep while buffers of it are exported to another process
    /// ([`DeviceCore::mark_exported`](crate::DeviceCore::mark_exported)): the importer maps
    /// the pool's physical pages, which a sleep releases and a wake replaces.
    #[error(
        "memory pool {pool:?} has {buffers} buffer(s) exported to another process: it cannot \
         sleep until they are freed"
    )]
    PoolExported {
        /// The pool's name.
        pool: String,
        /// Its live buffers exported.
        buffers: usize,
    },
    /// A pool cannot sleep while a graph captured into it lives, or a capture into it is
    /// under way: the graph's work has the pool's addresses baked in, and a sleep releases
    /// the pages behind them.
    #[error(
        "memory pool {pool:?} is held by {graphs} live graph(s){}: it cannot sleep until they \
         are dropped",
        if *capturing { " and a capture under way" } else { "" }
    )]
    PoolInGraph {
        /// The pool's name.
        pool: String,
        /// Live graphs captured into it.
        graphs: usize,
        /// A capture into it is under way.
        capturing: bool,
    },
    /// Waking a pool found too little device memory: the pool stays asleep, its data kept.
    #[error(
        "waking memory pool {pool:?} needs {} of device memory, {} free: it stays asleep, its data kept",
        format_size(*needed),
        format_size(*free)
    )]
    WakeOutOfMemory {
        /// The pool's name.
        pool: String,
        /// Bytes the wake maps.
        needed: u64,
        /// Bytes it could have (free device memory, or room under the memory-fraction cap).
        free: u64,
    },
    /// The call would synchronize the device, or wait for a stream that is capturing, which a
    /// stream capture under way forbids (the driver would invalidate the capture, or the
    /// event it waits for would be the graph's); PyTorch refuses `empty_cache` during a
    /// capture too.
    #[error(
        "{0} is not allowed while a stream capture is under way (it would wait for a capturing stream)"
    )]
    CaptureUnderway(&'static str),
    /// No capture of this id is under way (or one already is, for a begin).
    #[error("stream capture {0} is not under way as this call needs")]
    UnknownCapture(u64),
    /// The operation needs something this allocator's configuration or backend lacks.
    #[error("not supported: {0}")]
    NotSupported(&'static str),
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
    /// True for [`AllocError::OutOfMemory`] and [`AllocError::PoolQuota`] (a pool out of
    /// its memory: waiting for frees can help both), and [`AllocError::WakeOutOfMemory`].
    pub fn is_oom(&self) -> bool {
        matches!(
            self,
            AllocError::OutOfMemory(_)
                | AllocError::PoolQuota { .. }
                | AllocError::WakeOutOfMemory { .. }
        )
    }

    /// True when waiting can make a malloc that failed with this succeed: out of memory (a
    /// free makes room) or a sleeping pool (a wake).
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            AllocError::OutOfMemory(_)
                | AllocError::PoolQuota { .. }
                | AllocError::PoolAsleep { .. }
        )
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
    /// Bytes being obtained from the device off the core right now by other requests
    /// (`DeviceCore::growing_bytes`: segments allocated and pages mapped by the owner's misses).
    /// Memory of a cancelled request counts here until it lands in the cache.
    pub in_flight: u64,
    /// Bytes being given back to the device off the core right now (`DeviceCore::releasing_bytes`:
    /// segments being freed and pages being unmapped by the owner's releases): out of the
    /// books, but the device's until the driver call returns, so they count against
    /// `per_process_memory_fraction` until then. A retry once they are back may succeed.
    pub releasing: u64,
    /// Device memory this process has in use, inside the allocator and out, where the backend
    /// can tell (PyTorch's "this process has X memory in use"); `None` where it cannot.
    pub process_used: Option<u64>,
    /// Whether the allocator grows expandable segments (its config, resolved for the
    /// backend). With them on the fragmentation hint is left out: it suggests turning them on.
    pub expandable_segments: bool,
}

/// The fragmentation hint needs at least this much reserved but unallocated memory.
pub const HINT_FLOOR: u64 = 20 << 20;

impl OomReport {
    /// Reserved but not allocated bytes (fragmentation and cache).
    pub fn reserved_unallocated(&self) -> u64 {
        self.reserved.saturating_sub(self.allocated)
    }

    /// True when the request cannot fit even on an empty device: larger than its total memory
    /// or than the `per_process_memory_fraction` cap.
    pub fn exceeds_device(&self) -> bool {
        let limit = self
            .allowed
            .unwrap_or(self.device_total)
            .min(self.device_total);
        self.requested > limit || self.alloc_size > limit
    }

    /// Whether the message suggests `expandable_segments` against fragmentation: only when
    /// reserved but unallocated memory is more than a fifth of what is reserved and at least
    /// [`HINT_FLOOR`], never for a request that exceeds the device (no setting helps it), and
    /// never where expandable segments are on already (PyTorch prints its hint whatever the
    /// config; with the `gpualloc` policy they are on by default, and the advice would name
    /// what the user has).
    pub fn suggests_expandable_segments(&self) -> bool {
        let idle = self.reserved_unallocated();
        !self.expandable_segments
            && !self.exceeds_device()
            && idle >= HINT_FLOOR
            && idle * 5 > self.reserved
    }
}

/// The tail of a pool quota's message: the bytes on their way, if any.
fn on_its_way(in_flight: u64) -> String {
    if in_flight == 0 {
        String::new()
    } else {
        format!(
            " and {} on its way to or from the device",
            format_size(in_flight)
        )
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
        if self.in_flight > 0 {
            write!(
                f,
                "{} is being allocated by requests in flight. ",
                format_size(self.in_flight)
            )?;
        }
        if self.releasing > 0 {
            write!(
                f,
                "{} is being returned to the device by releases in flight. ",
                format_size(self.releasing)
            )?;
        }
        if let Some(used) = self.process_used {
            write!(
                f,
                "Including memory outside gpualloc, this process has {} in use. ",
                format_size(used)
            )?;
        }
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
        if self.suggests_expandable_segments() {
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
            in_flight: 0,
            releasing: 0,
            process_used: None,
            expandable_segments: false,
        };
        let s = AllocError::OutOfMemory(Box::new(r.clone())).to_string();
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
        assert!(
            !s.contains("in flight") && !s.contains("this process"),
            "{s}"
        );

        let busy = OomReport {
            in_flight: 15 << 30,
            releasing: 0,
            process_used: Some(15 << 30),
            ..r.clone()
        }
        .to_string();
        assert!(
            busy.contains("15.00 GiB is being allocated by requests in flight"),
            "{busy}"
        );
        assert!(busy.contains("this process has 15.00 GiB in use"), "{busy}");
    }

    #[test]
    fn the_fragmentation_hint_appears_only_when_true() {
        let base = OomReport {
            device: DeviceId(0),
            requested: 1 << 30,
            alloc_size: 1 << 30,
            device_total: 16 << 30,
            device_free: 0,
            allowed: None,
            allocated: 10 << 30,
            reserved: 16 << 30,
            in_flight: 0,
            releasing: 0,
            process_used: None,
            expandable_segments: false,
        };
        let hint = |r: &OomReport| r.to_string().contains("expandable_segments");
        assert!(hint(&base), "6 GiB of 16 idle: more than a fifth");
        let tight = OomReport {
            allocated: 13 << 30,
            ..base.clone()
        };
        assert!(!hint(&tight), "3 GiB of 16 idle: under a fifth");
        let small = OomReport {
            allocated: 10 << 20,
            reserved: 20 << 20,
            ..base.clone()
        };
        assert!(!hint(&small), "10 MiB idle: under the floor");
        let huge = OomReport {
            requested: 17 << 30,
            alloc_size: 17 << 30,
            ..base.clone()
        };
        assert!(!hint(&huge), "larger than the device: no setting helps");
        let expandable = OomReport {
            expandable_segments: true,
            ..base.clone()
        };
        assert!(
            !hint(&expandable),
            "expandable segments on: nothing to suggest"
        );
        assert!(huge.exceeds_device() && !base.exceeds_device());
        let capped = OomReport {
            allowed: Some(8 << 30),
            requested: 9 << 30,
            alloc_size: 9 << 30,
            ..base
        };
        assert!(capped.exceeds_device() && !hint(&capped));
    }

    #[test]
    fn exceeds_device_at_the_boundaries() {
        let r = |requested: u64, alloc_size: u64, allowed: Option<u64>| OomReport {
            device: DeviceId(0),
            requested,
            alloc_size,
            device_total: 64 << 20,
            device_free: 0,
            allowed,
            allocated: 0,
            reserved: 0,
            in_flight: 0,
            releasing: 0,
            process_used: None,
            expandable_segments: false,
        };
        assert!(
            !r(64 << 20, 64 << 20, None).exceeds_device(),
            "exactly the device fits"
        );
        assert!(r((64 << 20) + 1, 66 << 20, None).exceeds_device());
        assert!(
            r(63 << 20, (64 << 20) + 1, None).exceeds_device(),
            "the rounded size counts"
        );
        assert!(!r(32 << 20, 32 << 20, Some(32 << 20)).exceeds_device());
        assert!(
            r(32 << 20, 34 << 20, Some(32 << 20)).exceeds_device(),
            "the cap counts"
        );
        assert!(
            !r(1, 64 << 20, Some(128 << 20)).exceeds_device(),
            "a cap above the device"
        );
        // The hint at its boundary: idle exactly a fifth of reserved is not "large".
        let idle = |allocated: u64, reserved: u64| OomReport {
            allocated,
            reserved,
            ..r(1 << 20, 2 << 20, None)
        };
        assert!(!idle(80 << 20, 100 << 20).suggests_expandable_segments());
        assert!(idle((80 << 20) - 1, 100 << 20).suggests_expandable_segments());
        assert!(
            !idle(100 << 20, (120 << 20) - 1).suggests_expandable_segments(),
            "under 20 MiB idle"
        );
    }
}
