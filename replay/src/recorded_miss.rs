//! The miss chain's third driver: a warm replay's miss, driven from what the history shows.
//!
//! The core's miss chain (`gpualloc_devices` `miss/`) is one step machine with three drivers:
//! in place (`DeviceCore::malloc_after_miss`, each driver call made as it comes: tests and the
//! replay's ordinary requests), the device actor (its calls made off the gate, while other
//! requests run), and this one. A history recorded by the actor shows two misses a sequential
//! `malloc` would not repeat, because the live request's cache lookup came before frees the
//! history shows before its `alloc`:
//!
//! - **A new segment** (`segment_alloc` right before the `alloc` inside it): the live request
//!   missed, its segment was allocated off the gate, and it adopted it even though a block
//!   freed meanwhile would serve it by now. The replay starts the miss without a lookup and
//!   makes the chain's calls; the segment malloc goes where the history's segment was (the
//!   caller places it).
//! - **A block the policy passed over** (`TraceEntry::passed_over`): the live request could
//!   not get new memory right then and took the best fit with a remainder. That is one link
//!   of the chain, applied by the caller directly (`DeviceCore::malloc_passed_over`, then the
//!   in-place driver if it finds nothing): how the live request's new memory was refused (the
//!   memory-fraction cap, or a device without room for its pages, and a second lookup after
//!   it) is not in the history, and answering a planned growth with the device's refusal
//!   makes the off-core miss look in the cache again, where a replay can find a block the
//!   live request did not (measured: a serve history's 445 of 450 addresses against 450).
//!
//! - **A loan** (`TraceEntry::borrowed`): the live request's chain lent it another stream's
//!   free block. Applied directly too (`DeviceCore::malloc_borrowed`, of the block the
//!   history names, then an ordinary malloc if that block is not free): the live chain ran
//!   at its own time, before frees the history shows ahead of the `alloc`, where a replay's
//!   lookup would take the request's own block. For the same reason a replay of a history
//!   recorded under a policy that lends lends nowhere else (`DeviceCore::lend_as_recorded`):
//!   its chain would find a block freed meanwhile before the segment the history shows.
//!
//! The segment events between (`segment_map`, `segment_free`, `segment_unmap`) are still
//! applied where the history shows them (`gpualloc_devices` `recorded/`), not answered to a
//! miss: see ARCHITECTURE.md for what a full third driver needs.

use gpualloc_devices::{
    AllocError, Allocation, DeviceCore, MemPoolId, Miss, MissStep, SegmentRequest,
};
use gpualloc_runtime::StreamHandle;

/// A miss of `size` bytes on `stream` in `pool` (`None`: the default pools) that the history
/// shows served by a new segment (see the module docs): started without a cache lookup, as
/// the live request's off-core miss after its lookup, and driven to its end, each call made
/// on the core's backend (the caller places the segment malloc where the history's segment
/// was). `Ok(None)`: the request maps pages (a config with expandable segments replaying a
/// history without): nothing was done, and the caller serves it as an ordinary malloc.
pub(crate) fn malloc_with_new_segment(
    core: &mut DeviceCore,
    pool: Option<MemPoolId>,
    size: u64,
    stream: StreamHandle,
) -> Result<Option<Allocation>, AllocError> {
    let request: SegmentRequest = core.segment_request_in(pool, size, stream)?;
    if request.maps_pages(core) {
        return Ok(None);
    }
    let backend = core.backend().clone();
    let mut miss = Miss::off_core(request);
    let mut done = None;
    loop {
        match core.advance_miss(&mut miss, done.take()) {
            MissStep::Done(a) => return Ok(Some(a)),
            MissStep::Failed(e) => return Err(e),
            MissStep::Io(io) => done = Some(io.perform(backend.as_ref())),
        }
    }
}
