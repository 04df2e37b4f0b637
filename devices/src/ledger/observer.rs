//! What the device maps and unmaps, for those who must know every range of device memory the
//! allocator holds: NCCL's user-buffer registration (`ncclCommRegister`, PyTorch's allocator
//! trace tracker), UCX's registration cache (invalidated when a range is released),
//! NVSHMEM.
//!
//! - [`DeviceCore::set_segment_sink`](crate::DeviceCore::set_segment_sink) installs a
//!   function the core calls with a [`SegmentEvent`] whenever a segment is allocated or freed, pages of an expandable segment
//!   are mapped or unmapped, or a named pool falls asleep or wakes. The owner's sink must be
//!   quick and must not block (the device actor's sends on a `tokio::sync::broadcast`
//!   channel, so user code runs in the receivers' tasks, never under the core).
//! - [`DeviceCore::segment_ranges`](crate::DeviceCore::segment_ranges) lists the ranges held
//!   now, for a late subscriber: taken in the same hold of the core as its subscription, it is exactly what the events that
//!   follow change.
//! - When an event is sent: a range is announced mapped (or allocated) once the driver call
//!   that made it has returned and before any block of it is handed out; it is announced
//!   unmapped (or freed) when it leaves the books, before or (in place, under the core)
//!   just after the driver call that releases it, and never after the range could have been
//!   handed out again. A sleep announces its unmaps when it begins, its
//!   [`SegmentAction::PoolAsleep`] when it ends; a wake announces its maps and then
//!   [`SegmentAction::PoolAwake`] when it ends.
//! - A shutdown returns every segment without events (the allocator is gone).
//! - [`HeldRanges`] keeps the ranges held from such a list and the events after it, for a
//!   watcher that must know them (a registration cache).
//!
//! The types are here, a leaf; the core's side (installing the sink, announcing, listing the
//! ranges) is in `observer_hooks.rs`.

use std::collections::BTreeMap;

use gpualloc_runtime::DeviceId;

use crate::blocks::pool_id::MemPoolId;

/// What happened to a range of device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegmentAction {
    /// An ordinary segment was allocated from the device (`cudaMalloc`).
    Alloc,
    /// An ordinary segment went back to the device.
    Free,
    /// Physical memory was mapped into an expandable segment at this range.
    Map,
    /// The physical memory at this range was unmapped.
    Unmap,
    /// A named pool is asleep (`size`: the bytes its sleep released; `addr` 0).
    PoolAsleep,
    /// A named pool is awake again (`size`: the bytes its wake mapped; `addr` 0).
    PoolAwake,
}

/// One change of the device memory the allocator holds. See the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentEvent {
    /// What happened.
    pub action: SegmentAction,
    /// The device.
    pub device: DeviceId,
    /// First address of the range.
    pub addr: u64,
    /// Bytes of the range.
    pub size: u64,
    /// The stream the segment belongs to (its raw handle).
    pub stream: u64,
    /// The named or private pool whose segment it is (`None`: the default pools).
    pub pool: Option<MemPoolId>,
}

/// A range of device memory held now, for
/// [`DeviceCore::segment_ranges`](crate::DeviceCore::segment_ranges).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentRange {
    /// First address.
    pub addr: u64,
    /// Bytes.
    pub size: u64,
    /// The stream the segment belongs to (its raw handle).
    pub stream: u64,
    /// Its pool (`None`: the default pools).
    pub pool: Option<MemPoolId>,
    /// Mapped pages of an expandable segment (else a whole ordinary segment).
    pub expandable: bool,
}

/// The function a core calls with each [`SegmentEvent`].
pub type SegmentSink = Box<dyn FnMut(SegmentEvent) + Send>;

/// The core's sink, if one is installed: the one place events leave the core.
#[derive(Default)]
pub(crate) struct SegmentObserver {
    sink: Option<SegmentSink>,
}

impl SegmentObserver {
    /// Installs `sink` in place of the one before (`None`: removes it).
    pub fn set(&mut self, sink: Option<SegmentSink>) {
        self.sink = sink;
    }

    /// A sink is installed (the core builds no event otherwise).
    #[inline]
    pub fn is_set(&self) -> bool {
        self.sink.is_some()
    }

    /// Hands `event` to the sink, if one is installed.
    pub fn send(&mut self, event: SegmentEvent) {
        if let Some(sink) = &mut self.sink {
            sink(event);
        }
    }
}

/// The ranges of device memory held, kept from a list of ranges
/// ([`DeviceCore::segment_ranges`](crate::DeviceCore::segment_ranges), or a watch's) and the
/// [`SegmentEvent`]s after it. An unmap may cover several announced ranges, or part of one (a sleep, a release of whole handles):
/// what it covers goes, the rest stays.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeldRanges(BTreeMap<u64, u64>);

/// An event that contradicts what [`HeldRanges`] holds (a watcher that missed events).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HeldRangesError {
    /// A range was announced mapped (or allocated) where one is held already.
    #[error("mapped twice: {0:?}")]
    MappedTwice(SegmentEvent),
    /// A range was announced unmapped (or freed) where nothing is held.
    #[error("released what was not held: {0:?}")]
    NotHeld(SegmentEvent),
}

impl HeldRanges {
    /// Starts from `ranges`, as `(addr, size)`.
    pub fn new(ranges: impl IntoIterator<Item = (u64, u64)>) -> Self {
        HeldRanges(ranges.into_iter().collect())
    }

    /// Applies one event (sleeps and wakes change nothing: their maps and unmaps are
    /// announced one by one).
    pub fn apply(&mut self, e: &SegmentEvent) -> Result<(), HeldRangesError> {
        match e.action {
            SegmentAction::Alloc | SegmentAction::Map => {
                if self.0.contains_key(&e.addr) {
                    return Err(HeldRangesError::MappedTwice(*e));
                }
                self.0.insert(e.addr, e.size);
            }
            SegmentAction::Free | SegmentAction::Unmap => {
                let end = e.addr + e.size;
                let inside: Vec<(u64, u64)> = self
                    .0
                    .range(..end)
                    .filter(|(a, s)| **a + **s > e.addr)
                    .map(|(a, s)| (*a, *s))
                    .collect();
                if inside.is_empty() {
                    return Err(HeldRangesError::NotHeld(*e));
                }
                for (a, s) in inside {
                    self.0.remove(&a);
                    if a < e.addr {
                        self.0.insert(a, e.addr - a);
                    }
                    if a + s > end {
                        self.0.insert(end, a + s - end);
                    }
                }
            }
            SegmentAction::PoolAsleep | SegmentAction::PoolAwake => {}
        }
        Ok(())
    }

    /// The ranges held, as `(addr, size)` in address order.
    pub fn ranges(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.0.iter().map(|(a, s)| (*a, *s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(action: SegmentAction, addr: u64, size: u64) -> SegmentEvent {
        SegmentEvent {
            action,
            device: DeviceId(0),
            addr,
            size,
            stream: 0,
            pool: None,
        }
    }

    #[test]
    fn held_ranges_follow_maps_and_unmaps_that_cover_several_or_part() {
        let mut held = HeldRanges::new([(100, 10)]);
        held.apply(&event(SegmentAction::Map, 110, 10)).unwrap();
        held.apply(&event(SegmentAction::Alloc, 200, 50)).unwrap();
        held.apply(&event(SegmentAction::PoolAsleep, 0, 20))
            .unwrap();
        // One unmap over the end of one range and the start of the next.
        held.apply(&event(SegmentAction::Unmap, 105, 10)).unwrap();
        assert_eq!(
            held.ranges().collect::<Vec<_>>(),
            vec![(100, 5), (115, 5), (200, 50)]
        );
        held.apply(&event(SegmentAction::Free, 200, 50)).unwrap();
        assert_eq!(held.ranges().collect::<Vec<_>>(), vec![(100, 5), (115, 5)]);
        let twice = event(SegmentAction::Map, 100, 5);
        assert_eq!(held.apply(&twice), Err(HeldRangesError::MappedTwice(twice)));
        let unheld = event(SegmentAction::Unmap, 105, 10);
        assert_eq!(held.apply(&unheld), Err(HeldRangesError::NotHeld(unheld)));
        assert!(HeldRangesError::NotHeld(unheld)
            .to_string()
            .starts_with("released what was not held"));
        assert_eq!(held.ranges().count(), 2, "a refused event changes nothing");
    }
}
