//! The miss chain, written once: what a malloc does when the cache has no block for it, as a
//! sans-IO step machine (quinn-proto's shape).
//!
//! The core starts a miss from the [`SegmentRequest`] a cache lookup returned
//! ([`Miss::new`]) and advances it ([`DeviceCore::advance_miss`]); each step comes back as a
//! [`MissStep`]: done, failed, or a driver call for the caller to make ([`MissIo`]: allocate a
//! segment, map pages, free segments, synchronize events, unmap pages). The caller makes the
//! call ([`MissIo::perform`], or [`MissIo::fail`] to feed an outcome it knows) and advances
//! the miss with the result ([`IoDone`]). The core's books change only inside
//! `advance_miss`, never during a driver call.
//!
//! The chain's order is the table `CHAIN` in `chain.rs`, PyTorch's `malloc` after its cache
//! lookup:
//!
//! 1. garbage collection (`garbage_collection_threshold`): free old cached segments;
//! 2. at a named pool's quota (`pools/`): only the pool's own memory can help (its
//!    orphans, growth of its segments, a block the policy passed over, its own cached
//!    segments released, growth again), else the quota error;
//! 3. a segment of a stream its user dropped (`orphans.rs`), then a new segment (or pages of
//!    an expandable segment), then a block the `gpualloc` policy passed over
//!    (`placement.rs`), then a private pool marked `use_on_oom`;
//! 4. release cached oversize blocks of the stream and allocate again;
//! 5. synchronize the events pending frees wait on, release every cached segment (and the
//!    free pages of expandable segments), allocate again;
//! 6. out of memory.
//!
//! What stays inside the core's steps: reserving address space for a new expandable segment
//! and freeing a reservation left with nothing mapped (no memory changes hands), and the
//! event queries of `process_events` (they never block).
//!
//! A driver that fails changes the chain as the in-place calls did: a device without memory
//! moves to the next link; any other error fails the miss with it, after the books have
//! taken in what was already done (segments detached before a failing free stay out of the
//! books; pages detached before a failing synchronization count as unmapped).
//!
//! [`DeviceCore::malloc_after_miss`] is the in-place driver: it makes each call as it comes.

mod chain;
mod ops;

use gpualloc_runtime::{guarded, Backend, BackendError, DeviceId, DevicePtr, EventHandle};

use crate::core::{Allocation, DeviceCore};
use crate::error::AllocError;
use crate::expandable::growth::{map_growth, release_reservation, GrowthPlan, Refused};
use crate::expandable::segment::MappedPages;
use crate::expandable::shrink::{release_pages, PageRelease};
use crate::free::detached::{free_detached, DetachedSegment};
use crate::malloc::segment_request::SegmentRequest;

pub(crate) use ops::Op;

/// A miss on its way through the chain (see the module docs). Hold it while its driver call
/// runs; advance it with [`DeviceCore::advance_miss`] on the core it came from.
#[must_use = "a miss must be advanced until it is done or failed"]
pub struct Miss {
    request: SegmentRequest,
    /// The link of `CHAIN` the miss is at.
    at: usize,
    /// The last oversize release freed enough for the request (PyTorch's
    /// `release_available_cached_blocks` returned true).
    released: bool,
    /// The operation waiting for the caller's driver call, if any.
    op: Option<Op>,
    /// Other requests run while the driver calls do (see [`Miss::off_core`]).
    off_core: bool,
    /// Growths made again by an off-core miss that lost its new pages to another request.
    regrowths: usize,
    /// The block found is another stream's, to lend (the `BorrowFree` link).
    borrowed: bool,
    /// The block found is the large pool's, for a small request (the `SpillSmall` link).
    spilled: bool,
}

/// How many times an off-core miss grows again after another request took the pages it
/// mapped (each growth maps what the request still lacks).
pub(crate) const REGROWTHS: usize = 3;

impl Miss {
    /// A miss for `request`, at the chain's first link, for a caller that makes each driver
    /// call before anything else touches the core (the in-place driver, the replay).
    pub fn new(request: SegmentRequest) -> Self {
        Miss {
            request,
            at: 0,
            released: false,
            op: None,
            off_core: false,
            regrowths: 0,
            borrowed: false,
            spilled: false,
        }
    }

    /// A miss whose driver calls run while other requests use the core (the device actor:
    /// the calls run off its gate). The chain and its order are the same; three rules keep it
    /// right with others around:
    /// - a segment being allocated, and pages being mapped, count against
    ///   `per_process_memory_fraction` and a pool's quota until they land, so misses in flight
    ///   together cannot pass the cap;
    /// - after each driver call the request looks in the cache again before the next link:
    ///   blocks freed meanwhile (or pages just mapped, which join the cache as a free block)
    ///   serve it by best fit, as any request's lookup would;
    /// - a segment allocated for it is its own, even if the cache could serve it by now (it
    ///   is adopted, as PyTorch adopts a segment malloc'd with the lock released).
    pub fn off_core(request: SegmentRequest) -> Self {
        Miss {
            off_core: true,
            ..Miss::new(request)
        }
    }
}

/// One step of a miss.
#[must_use = "a driver call the chain asked for must be made or failed"]
pub enum MissStep {
    /// The request is served.
    Done(Allocation),
    /// The request failed (out of memory, a pool's quota, a driver error, a shutdown).
    Failed(AllocError),
    /// Make this driver call, then advance the miss with its outcome.
    Io(MissIo),
}

/// A driver call the chain asks its caller to make.
#[derive(Debug)]
#[must_use = "make the call with `perform` (or `fail`) and advance the miss with the outcome"]
pub enum MissIo {
    /// `cuMemAlloc` of a new segment of `size` bytes.
    AllocSegment {
        /// The device.
        device: DeviceId,
        /// Bytes.
        size: u64,
    },
    /// Create, map and give access to pages of an expandable segment.
    MapPages(GrowthPlan),
    /// Free segments taken out of the books.
    FreeSegments {
        /// The device.
        device: DeviceId,
        /// The segments, in the order PyTorch frees them.
        segments: Vec<DetachedSegment>,
    },
    /// Wait for the events pending frees wait on, in this order.
    SynchronizeEvents(Vec<EventHandle>),
    /// Wait for each segment's stream, then unmap and release pages taken out of the books.
    UnmapPages(Vec<PageRelease>),
    /// Give back what a miss held when the core shut down under it (pages mapped for it, or a
    /// reservation left to it); the miss then fails with [`AllocError::Shutdown`].
    GiveBack(Leftover),
}

/// What a miss gives back after a shutdown.
#[derive(Debug)]
pub enum Leftover {
    /// Pages mapped for a growth the core refused.
    Pages(Refused),
    /// A segment's address-space reservation (base, bytes).
    Reservation(DeviceId, DevicePtr, u64),
}

/// The outcome of a [`MissIo`], to advance the miss with.
#[derive(Debug)]
pub struct IoDone(pub(crate) Outcome);

#[derive(Debug)]
pub(crate) enum Outcome {
    /// The segment's size, and the allocation.
    Segment(u64, Result<DevicePtr, BackendError>),
    Mapped(GrowthPlan, Result<MappedPages, BackendError>),
    /// The segments, and the first error.
    Freed(Vec<DetachedSegment>, Result<(), AllocError>),
    /// How many events were synchronized, and the error that stopped the rest.
    Synced(usize, Option<BackendError>),
    /// The pages, and the error of a stream synchronization before unmapping them.
    Unmapped(Vec<PageRelease>, Option<BackendError>),
    GaveBack,
}

impl MissIo {
    /// True for a call that gives memory back to the device (other requests waiting for
    /// memory may now find some).
    pub fn releases_memory(&self) -> bool {
        matches!(
            self,
            MissIo::FreeSegments { .. } | MissIo::UnmapPages(_) | MissIo::GiveBack(_)
        )
    }

    /// Makes the driver calls with `backend` (the one the core was made with).
    ///
    /// A backend that panics (a custom backend's bug) gives the outcome of a failed call,
    /// [`BackendError::Unavailable`], logged as an error: the chain's failure path then runs
    /// (a claim goes back, planned pages go back to the unmapped set), where an unwinding
    /// caller would have left the core counting work that never lands. What the call had done
    /// before it panicked is not undone: the backend's state is unknown.
    pub fn perform(self, backend: &dyn Backend) -> IoDone {
        IoDone(match self {
            MissIo::AllocSegment { device, size } => Outcome::Segment(
                size,
                guarded("a miss's segment malloc", || backend.malloc(device, size)),
            ),
            MissIo::MapPages(plan) => {
                let mapped = guarded("a miss's page mapping", || map_growth(backend, &plan));
                Outcome::Mapped(plan, mapped)
            }
            MissIo::FreeSegments { device, segments } => {
                let freed = guarded("a miss's segment frees", || {
                    free_detached(backend, device, &segments)
                });
                Outcome::Freed(segments, freed)
            }
            MissIo::SynchronizeEvents(events) => {
                let mut done = 0;
                for e in &events {
                    let synced = guarded("a miss's event synchronization", || {
                        backend.event_synchronize(*e)
                    });
                    if let Err(err) = synced {
                        return IoDone(Outcome::Synced(done, Some(err)));
                    }
                    done += 1;
                }
                Outcome::Synced(done, None)
            }
            MissIo::UnmapPages(releases) => {
                let released =
                    guarded("a miss's page unmaps", || release_pages(backend, &releases));
                Outcome::Unmapped(releases, released.err())
            }
            MissIo::GiveBack(Leftover::Pages(refused)) => {
                let _ = guarded("giving back a refused growth", || {
                    refused.release(backend);
                    Ok::<(), BackendError>(())
                });
                Outcome::GaveBack
            }
            MissIo::GiveBack(Leftover::Reservation(device, ptr, size)) => {
                let _ = guarded("freeing an orphaned reservation", || {
                    release_reservation(backend, device, (ptr, size));
                    Ok::<(), BackendError>(())
                });
                Outcome::GaveBack
            }
        })
    }

    /// The outcome of this call as if the driver had refused it with `error` (out of memory
    /// moves the chain on; anything else fails the miss). Nothing is called: pages to unmap
    /// stay mapped, what was to be given back is not. For tests, and for a driver that
    /// follows a recorded history.
    pub fn fail(self, error: BackendError) -> IoDone {
        IoDone(match self {
            MissIo::AllocSegment { size, .. } => Outcome::Segment(size, Err(error)),
            MissIo::MapPages(plan) => Outcome::Mapped(plan, Err(error)),
            MissIo::FreeSegments { segments, .. } => {
                Outcome::Freed(segments, Err(AllocError::Backend(error)))
            }
            MissIo::SynchronizeEvents(_) => Outcome::Synced(0, Some(error)),
            MissIo::UnmapPages(releases) => Outcome::Unmapped(releases, Some(error)),
            MissIo::GiveBack(_) => Outcome::GaveBack,
        })
    }
}

impl DeviceCore {
    /// Continues a miss from [`DeviceCore::try_cached`] in place: the whole chain, each driver
    /// call made as it comes, on this thread.
    pub fn malloc_after_miss(&mut self, request: SegmentRequest) -> Result<Allocation, AllocError> {
        let backend = self.backend().clone();
        let mut miss = Miss::new(request);
        let mut done = None;
        loop {
            match self.advance_miss(&mut miss, done.take()) {
                MissStep::Done(a) => return Ok(a),
                MissStep::Failed(e) => return Err(e),
                MissStep::Io(io) => done = Some(io.perform(backend.as_ref())),
            }
        }
    }
}
