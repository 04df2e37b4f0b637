//! Streams that go away: their cached segments serve other streams instead of being stranded.
//!
//! Cached blocks serve only the stream they were freed on (stream-ordered reuse, as in
//! PyTorch), so a server that makes a fresh stream per request or per weight sync and drops it
//! leaves every segment of that stream cached for nobody: vllm#52951 measured 2 GiB stranded
//! per weight sync. Here the owner tells the core when its users dropped a stream
//! ([`DeviceCore::retire_stream`]); the core records an event on it and, once the work queued
//! so far is done ([`DeviceCore::orphan_retired`]), with no synchronization at all:
//! - each wholly free ordinary segment of the stream becomes an orphan: filed under
//!   [`ORPHAN_STREAM`], it is adopted by the next request of any stream of the device that
//!   misses its own stream's blocks and that it fits, by PyTorch's size rules
//!   (the miss chain's `AdoptOrphan` link, before any new segment is allocated). Freeing it
//!   instead would cost a device-wide synchronize (`cudaFree`);
//! - the free pages of the stream's expandable segment are unmapped (a synchronize of that
//!   stream alone, whose work is done) and the reservation freed once empty: the next stream
//!   maps its own.
//!
//! Segments of the stream still in use (a free waiting on events of other streams) are
//! orphaned by a later pass, once free. Orphans are released by `empty_cache` and the
//! out-of-memory chain like any cached segment.
//!
//! The same holds in named pools (`pools/`): an orphan stays in its pool and serves
//! only that pool's requests, and unmapped pages count off its quota. PyTorch's unnamed
//! private pools keep their segments, as PyTorch does.

use gpualloc_runtime::StreamHandle;

use crate::blocks::block::BlockState;
use crate::blocks::pool::key;
use crate::core::{AllocParams, DeviceCore};
use crate::error::AllocError;

/// The raw stream handle orphaned segments are filed under (no stream has it).
pub const ORPHAN_STREAM: u64 = u64::MAX;

impl DeviceCore {
    /// The owner's users dropped `stream`: once the work queued on it so far is done, its free
    /// segments serve other streams (see the module docs). Does nothing for a stream that
    /// names no segment, or one retired already.
    pub fn retire_stream(&mut self, stream: StreamHandle) -> Result<(), AllocError> {
        if self.shut_down || stream.raw == ORPHAN_STREAM {
            return Ok(());
        }
        if !self.names_segment(stream) || self.retiring.contains(stream) {
            return Ok(());
        }
        // An idle stream's segments are orphaned at once (those still in use by later passes,
        // with no event needed); otherwise an event says when its work is done.
        if self.backend.stream_query(stream)? {
            self.orphan_segments_of(stream)?;
            if self.names_segment(stream) {
                self.retiring.add(stream, None);
            }
            return Ok(());
        }
        // Pooled events are this device's (streams of other devices are refused).
        let event = match self.pending.take_spare() {
            Some(e) => e,
            None => self.backend.event_create(stream.device)?,
        };
        if let Err(e) = self.backend.event_record(event, stream) {
            self.pending.give_back([event]);
            return Err(e.into());
        }
        self.retiring.add(stream, Some(event));
        self.orphan_retired()
    }

    /// Orphans the free segments of retired streams whose work is done. A stream leaves the
    /// list once it names no segment.
    pub fn orphan_retired(&mut self) -> Result<(), AllocError> {
        let mut i = 0;
        while i < self.retiring.len() {
            let (stream, event) = self.retiring.get(i);
            // Done when the event is, or when the stream is idle now (all it had then is done).
            let done = match event {
                None => true,
                Some(e) => self.backend.event_query(e)? || self.backend.stream_query(stream)?,
            };
            if !done {
                i += 1;
                continue;
            }
            // Its work is done: the event is not needed any more.
            if let Some(e) = self.retiring.take_event(i) {
                self.pending.give_back([e]);
            }
            self.orphan_segments_of(stream)?;
            if self.names_segment(stream) {
                i += 1;
                continue;
            }
            self.retiring.remove(i);
        }
        Ok(())
    }

    fn orphan_segments_of(&mut self, stream: StreamHandle) -> Result<(), AllocError> {
        let segments: Vec<(u64, u64, usize)> = self
            .segments
            .iter()
            .filter(|(_, m)| m.stream == stream && self.orphans_apply(m.pool))
            // A graph's memory stays its capture stream's (`pools/capture.rs`): a later
            // pass orphans it once the graph and its launches are gone.
            .filter(|(_, m)| !self.pool_in_graph_use(m.pool))
            .map(|(base, m)| (*base, m.size, m.pool))
            .collect();
        for (base, size, pool) in segments {
            if self.expandable.contains(base) {
                self.release_free_pages_of(base)?;
                continue;
            }
            let k = key(stream.raw, size, base);
            let Some(id) = self.pools[pool].take_free(&k) else {
                continue; // not wholly free: a later pass
            };
            let orphan = StreamHandle {
                device: stream.device,
                raw: ORPHAN_STREAM,
            };
            self.blocks.get_mut(id).move_to_stream(orphan);
            self.pools[pool].file_free(self.blocks.get(id), id);
            if let Some(m) = self.segments.get_mut(base) {
                m.stream = orphan;
            }
            tracing::debug!(
                device = self.device.0,
                addr = base,
                size,
                "segment orphaned"
            );
        }
        Ok(())
    }

    /// Unmaps the free pages of expandable segment `seg` and frees its reservation if nothing
    /// is left mapped.
    fn release_free_pages_of(&mut self, seg: u64) -> Result<(), AllocError> {
        let free: Vec<_> = self
            .pools
            .iter()
            .flat_map(|p| p.free_ids())
            .filter(|id| self.blocks.get(*id).segment() == seg)
            .collect();
        for id in free {
            // Unmapping merges neighbours: skip blocks merged away by an earlier unmap.
            if self.blocks.contains(id)
                && self.blocks.get(id).state() == BlockState::Free
                && self.blocks.get(id).mapped()
            {
                self.unmap_block(id)?;
            }
        }
        self.release_expandable_segment_if_empty(seg)
    }

    /// Adopts the best-fitting orphan of the request's pool for its stream, if PyTorch's size
    /// rules let the request have it, and takes it (into `params.block`).
    pub(crate) fn adopt_orphan(&mut self, params: &mut AllocParams) -> bool {
        if !self.orphans_apply(params.pool) {
            return false;
        }
        let Some((k, id)) = self.pools[params.pool].lower_bound(ORPHAN_STREAM, params.size) else {
            return false;
        };
        let expandable = self.blocks.get(id).expandable();
        if k.0 != ORPHAN_STREAM || !self.size_rules_allow(k.1, params.size, expandable) {
            return false;
        }
        let (size, base) = (k.1, k.2);
        self.pools[params.pool].take_free(&k);
        self.blocks.get_mut(id).move_to_stream(params.stream);
        if let Some(m) = self.segments.get_mut(base) {
            m.stream = params.stream;
        }
        self.pools[params.pool].file_free(self.blocks.get(id), id);
        tracing::debug!(
            device = self.device.0,
            addr = base,
            size,
            "orphan segment adopted"
        );
        self.get_free_block(params)
    }

    /// True for block pools whose dropped streams' segments are orphaned: the default pools
    /// and named pools (`pools/`; an orphan of a pool serves only that pool's requests).
    /// PyTorch's unnamed private pools keep theirs, as PyTorch does.
    fn orphans_apply(&self, pool: usize) -> bool {
        match self.owner_of(pool) {
            None => true,
            Some(id) => self.private.is_named(id.0),
        }
    }

    /// True while a segment of the device belongs to `stream`.
    fn names_segment(&self, stream: StreamHandle) -> bool {
        self.segments.names_stream(stream)
    }
}
