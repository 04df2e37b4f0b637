//! Which physical pages back a range of an expandable segment: what exporting a buffer of
//! such a segment to another process needs (the ipc crate sends one fd per page).

use gpualloc_runtime::{DevicePtr, PhysHandle};

use crate::core::DeviceCore;

impl DeviceCore {
    /// The mapped pages covering `[ptr, ptr + len)` of an expandable segment, in address
    /// order, as (page address, page size, physical handle; mapped at handle offset 0).
    /// `None` when the range is empty, not inside one expandable segment, or touches an
    /// unmapped page.
    pub fn expandable_pages(
        &self,
        ptr: DevicePtr,
        len: u64,
    ) -> Option<Vec<(DevicePtr, u64, PhysHandle)>> {
        let end = ptr.0.checked_add(len).filter(|_| len > 0)?;
        let (_, es) = self.expandable.range(..=ptr.0).next_back()?;
        if end > es.base.checked_add(es.size())? {
            return None;
        }
        let first = ((ptr.0 - es.base) / es.page) as usize;
        let last = (end - es.base).div_ceil(es.page) as usize;
        (first..last)
            .map(|i| {
                let h = (*es.handles.get(i)?)?;
                Some((DevicePtr(es.base + i as u64 * es.page), es.page, h))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use gpualloc_runtime::sim::{SimBackend, SimConfig};
    use gpualloc_runtime::{Backend, DeviceId};

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
}
