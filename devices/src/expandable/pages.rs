//! Which memory backs a live allocation: what exporting a buffer to another process needs
//! (the ipc crate opens an ordinary segment by a legacy IPC handle of its base, and sends an
//! expandable one's physical pages as one fd each). The ipc crate knows nothing of the core:
//! its user (the facade, or a test) turns [`AllocationMemory`] into the ipc crate's region.

use gpualloc_runtime::{DevicePtr, PhysHandle};

use crate::core::DeviceCore;
use crate::error::AllocError;

/// The memory behind a live allocation (see [`DeviceCore::allocation_memory`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AllocationMemory {
    /// In an ordinary segment starting at `base` (one driver allocation).
    Segment {
        /// The segment's base address.
        base: DevicePtr,
    },
    /// In an expandable segment: the physical handles covering it, in address order (see
    /// [`DeviceCore::expandable_pages`]).
    Pages(Vec<(DevicePtr, u64, PhysHandle)>),
}

impl DeviceCore {
    /// The requested length of live allocation `ptr` and the memory behind it: its ordinary
    /// segment's base, or the mapped physical handles of its expandable segment that cover
    /// it. `UnknownPointer` for anything but the start of a live allocation.
    pub fn allocation_memory(&self, ptr: DevicePtr) -> Result<(u64, AllocationMemory), AllocError> {
        let alloc = self
            .allocation(ptr)
            .ok_or(AllocError::UnknownPointer(ptr))?;
        if let Some(pages) = self.expandable_pages(ptr, alloc.size) {
            return Ok((alloc.size, AllocationMemory::Pages(pages)));
        }
        let snap = self.snapshot();
        let seg = snap
            .segments
            .iter()
            .find(|s| s.address <= ptr.0 && ptr.0 < s.address.saturating_add(s.total_size))
            .ok_or(AllocError::UnknownPointer(ptr))?;
        if seg.is_expandable {
            return Err(AllocError::NotSupported(
                "an allocation on unmapped pages of its expandable segment",
            ));
        }
        Ok((
            alloc.size,
            AllocationMemory::Segment {
                base: DevicePtr(seg.address),
            },
        ))
    }

    /// The physical handles covering `[ptr, ptr + len)` of an expandable segment, in address
    /// order, as (where the handle is mapped, its size, the handle; mapped whole, at handle
    /// offset 0, as CUDA requires). A handle may cover several pages (`map_ahead.rs`), so the
    /// list may reach before and after the range. `None` when the range is empty, not inside
    /// one expandable segment, or touches an unmapped page.
    pub fn expandable_pages(
        &self,
        ptr: DevicePtr,
        len: u64,
    ) -> Option<Vec<(DevicePtr, u64, PhysHandle)>> {
        let end = ptr.0.checked_add(len).filter(|_| len > 0)?;
        let (_, es) = self.expandable.at_or_below(ptr.0)?;
        if end > es.base.checked_add(es.size())? {
            return None;
        }
        let first = ((ptr.0 - es.base) / es.page) as usize;
        let last = (end - es.base).div_ceil(es.page) as usize;
        let mut out: Vec<(DevicePtr, u64, PhysHandle)> = Vec::new();
        let mut i = first;
        while i < last {
            let (run, h, n) = es.run_at(i)?;
            out.push((DevicePtr(es.page_addr(run)), n as u64 * es.page, h));
            i = run + n;
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use gpualloc_runtime::{Backend, DeviceId, DevicePtr};
    use gpualloc_sim::{SimBackend, SimConfig};

    use crate::{AllocatorConfig, DeviceCore};

    #[test]
    fn pages_cover_an_expandable_allocation_and_nothing_else() {
        let sim: Arc<dyn Backend> = SimBackend::new(SimConfig::fast(1)).unwrap();
        let stream = sim.stream_create(DeviceId(0)).unwrap();
        let config = AllocatorConfig::default().with_expandable_segments(true);
        let mut core = DeviceCore::new(sim.clone(), DeviceId(0), config).unwrap();
        let a = core.malloc(3 << 20, stream).unwrap();
        let pages = core.expandable_pages(a.ptr, a.size).unwrap();
        let covered: u64 = pages.iter().map(|p| p.1).sum();
        assert!(covered >= a.size);
        assert!(pages[0].0 .0 <= a.ptr.0);
        assert!(pages.windows(2).all(|w| w[0].0 .0 + w[0].1 == w[1].0 .0));
        assert!(core.expandable_pages(a.ptr, 0).is_none());
        assert!(core.expandable_pages(a.ptr, 1 << 40).is_none());
        let mut plain = DeviceCore::new(sim, DeviceId(0), AllocatorConfig::default()).unwrap();
        let b = plain.malloc(3 << 20, stream).unwrap();
        assert!(plain.expandable_pages(b.ptr, b.size).is_none());
        plain.free(b.ptr).unwrap();
        core.free(a.ptr).unwrap();
    }

    #[test]
    fn allocation_memory_names_the_segment_base_or_the_pages() {
        use crate::{AllocError, AllocationMemory};
        let sim: Arc<dyn Backend> = SimBackend::new(SimConfig::fast(1)).unwrap();
        let stream = sim.stream_create(DeviceId(0)).unwrap();
        let config = AllocatorConfig::default().with_expandable_segments(false);
        let mut plain = DeviceCore::new(sim.clone(), DeviceId(0), config).unwrap();
        let first = plain.malloc(3 << 20, stream).unwrap();
        let second = plain.malloc(1 << 20, stream).unwrap();
        assert_eq!(
            plain.allocation_memory(first.ptr),
            Ok((3 << 20, AllocationMemory::Segment { base: first.ptr }))
        );
        // A block inside a segment: the segment's base, not its own address.
        let (len, memory) = plain.allocation_memory(second.ptr).unwrap();
        assert_eq!(len, 1 << 20);
        let AllocationMemory::Segment { base } = memory else {
            panic!("{memory:?}")
        };
        assert!(base.0 <= second.ptr.0);
        let inner = DevicePtr(first.ptr.0 + 512);
        assert_eq!(
            plain.allocation_memory(inner),
            Err(AllocError::UnknownPointer(inner))
        );
        let config = AllocatorConfig::default().with_expandable_segments(true);
        let mut core = DeviceCore::new(sim, DeviceId(0), config).unwrap();
        let a = core.malloc(3 << 20, stream).unwrap();
        assert_eq!(
            core.allocation_memory(a.ptr),
            Ok((
                3 << 20,
                AllocationMemory::Pages(core.expandable_pages(a.ptr, a.size).unwrap())
            ))
        );
        plain.free(first.ptr).unwrap();
        plain.free(second.ptr).unwrap();
        core.free(a.ptr).unwrap();
    }

    #[test]
    fn pages_are_whole_physical_handles() {
        const MIB: u64 = 1 << 20;
        let sim: Arc<dyn Backend> = SimBackend::new(SimConfig::fast(1)).unwrap();
        let stream = sim.stream_create(DeviceId(0)).unwrap();
        let config = AllocatorConfig::default().with_expandable_segments(true);
        let mut core = DeviceCore::new(sim.clone(), DeviceId(0), config).unwrap();
        // 30 MiB in 2 MiB pages: two handles, of 20 and 10 MiB.
        let a = core.malloc(30 * MIB, stream).unwrap();
        let both = core.expandable_pages(a.ptr, a.size).unwrap();
        let sizes: Vec<u64> = both.iter().map(|p| p.1).collect();
        assert_eq!(sizes, [20 * MIB, 10 * MIB]);
        assert_eq!(both[0].0, a.ptr);
        assert_eq!(both[0].2.size, 20 * MIB);
        // A range inside the second handle gets all of it, from where it is mapped.
        let second = core
            .expandable_pages(DevicePtr(a.ptr.0 + 21 * MIB), MIB)
            .unwrap();
        assert_eq!(second, vec![both[1]]);
        assert_eq!(second[0].0 .0, a.ptr.0 + 20 * MIB);
        core.free(a.ptr).unwrap();
    }
}
