//! The stream captures the core's owner announced ([`DeviceCore::begin_capture`]), and the
//! frees they hold back: a leaf type the core keeps (`capture.rs` acts on it).
//!
//! [`DeviceCore::begin_capture`]: crate::DeviceCore::begin_capture

use std::collections::HashMap;

use gpualloc_runtime::StreamHandle;

use crate::blocks::block::BlockId;

/// One announced capture: its id (the backend's), the private pool its allocations go to,
/// and the streams routed there for it (the one it began on, and those that joined), each with
/// the stamp the core's next allocation had when it joined (0 for the one it began on: see
/// `malloc/spill_state.rs`).
#[derive(Debug, Clone)]
pub(crate) struct Capture {
    pub id: u64,
    pub pool: u64,
    joined: Vec<(StreamHandle, u64)>,
}

impl Capture {
    /// True when `stream` is one of the capture's.
    pub(crate) fn has(&self, stream: StreamHandle) -> bool {
        self.joined.iter().any(|(s, _)| *s == stream)
    }

    /// The capture's streams, the one it began on first.
    pub(crate) fn streams(&self) -> impl Iterator<Item = StreamHandle> + '_ {
        self.joined.iter().map(|(s, _)| *s)
    }
}

/// Captures under way and the frees they hold back.
#[derive(Debug, Default)]
pub(crate) struct Captures {
    underway: Vec<Capture>,
    /// Blocks freed with uses on other streams while a capture was under way: their events
    /// are recorded once none is (PyTorch's `needs_events_deferred_until_no_capture`).
    deferred: Vec<BlockId>,
    /// Streams a live block was recorded on while a capture was under way: that work is the
    /// graph's, ordered by it, so no event is recorded for it later (PyTorch's
    /// `block_to_cudagraph_stream_uses`).
    graph_uses: HashMap<BlockId, Vec<StreamHandle>>,
    /// Streams about to begin a capture ([`Captures::prepare`]; the core prepares each once).
    preparing: Vec<StreamHandle>,
}

impl Captures {
    /// True when no announced capture is under way.
    #[inline]
    pub(crate) fn is_quiet(&self) -> bool {
        self.underway.is_empty()
    }

    /// Adds capture `id` on `stream` into pool `pool` (the caller checked that `id` is not
    /// under way: [`Captures::get`]).
    pub(crate) fn begin(&mut self, id: u64, pool: u64, stream: StreamHandle) {
        self.underway.push(Capture {
            id,
            pool,
            joined: vec![(stream, 0)],
        });
    }

    /// `stream` is about to begin a capture, until [`Captures::unprepare`].
    pub(crate) fn prepare(&mut self, stream: StreamHandle) {
        self.preparing.push(stream);
    }

    /// One preparation of `stream` ends (its capture began, or it was given up).
    pub(crate) fn unprepare(&mut self, stream: StreamHandle) {
        if let Some(at) = self.preparing.iter().position(|s| *s == stream) {
            self.preparing.swap_remove(at);
        }
    }

    /// True while a capture is being begun on `stream`.
    pub(crate) fn preparing(&self, stream: StreamHandle) -> bool {
        self.preparing.contains(&stream)
    }

    /// The capture `id`, if under way.
    pub(crate) fn get(&self, id: u64) -> Option<&Capture> {
        self.underway.iter().find(|c| c.id == id)
    }

    /// The capture under way on `stream`, if any.
    pub(crate) fn of_stream(&self, stream: StreamHandle) -> Option<u64> {
        self.underway.iter().find(|c| c.has(stream)).map(|c| c.id)
    }

    /// `stream` joined capture `id` when the next allocation's stamp was `clock` (or before:
    /// the core learns of a join at the stream's next request): its pool, if the capture is
    /// under way.
    pub(crate) fn join(&mut self, id: u64, stream: StreamHandle, clock: u64) -> Option<u64> {
        let c = self.underway.iter_mut().find(|c| c.id == id)?;
        if !c.has(stream) {
            c.joined.push((stream, clock));
        }
        Some(c.pool)
    }

    /// The next allocation's stamp when `stream` joined the capture under way on it (0 for
    /// the stream it began on); `None` for a stream in no announced capture.
    pub(crate) fn joined_at(&self, stream: StreamHandle) -> Option<u64> {
        self.underway.iter().find_map(|c| {
            c.joined
                .iter()
                .find(|(s, _)| *s == stream)
                .map(|(_, at)| *at)
        })
    }

    /// Ends capture `id`, returning it.
    pub(crate) fn end(&mut self, id: u64) -> Option<Capture> {
        let at = self.underway.iter().position(|c| c.id == id)?;
        Some(self.underway.swap_remove(at))
    }

    /// True when a capture under way allocates into pool `pool`.
    pub(crate) fn fills(&self, pool: u64) -> bool {
        self.underway.iter().any(|c| c.pool == pool)
    }

    /// Holds block `id`'s free back until no capture is under way.
    pub(crate) fn defer(&mut self, id: BlockId) {
        self.deferred.push(id);
    }

    /// Notes that block `id` was used on `stream` during a capture.
    pub(crate) fn note_use(&mut self, id: BlockId, stream: StreamHandle) {
        let uses = self.graph_uses.entry(id).or_default();
        if !uses.contains(&stream) {
            uses.push(stream);
        }
    }

    /// The streams block `id` was used on during captures (and forgets them).
    pub(crate) fn take_uses(&mut self, id: BlockId) -> Vec<StreamHandle> {
        self.graph_uses.remove(&id).unwrap_or_default()
    }

    /// The frees held back, to be made now.
    pub(crate) fn take_deferred(&mut self) -> Vec<BlockId> {
        std::mem::take(&mut self.deferred)
    }

    /// True when frees are held back.
    #[inline]
    pub(crate) fn has_deferred(&self) -> bool {
        !self.deferred.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpualloc_runtime::DeviceId;

    fn s(raw: u64) -> StreamHandle {
        StreamHandle {
            device: DeviceId(0),
            raw,
        }
    }

    #[test]
    fn captures_route_their_streams_to_their_pool_until_they_end() {
        let mut c = Captures::default();
        assert!(c.is_quiet());
        c.begin(7, 3, s(1));
        assert_eq!(c.get(7).map(|c| c.pool), Some(3));
        assert!(c.get(8).is_none());
        assert_eq!(c.join(7, s(2), 40), Some(3));
        assert_eq!(c.join(7, s(2), 50), Some(3));
        assert_eq!(c.join(8, s(3), 60), None);
        assert_eq!(
            (c.joined_at(s(1)), c.joined_at(s(2)), c.joined_at(s(3))),
            (Some(0), Some(40), None),
            "the first join counts"
        );
        assert!(c.fills(3) && !c.fills(4));
        let ended = c.end(7).unwrap();
        assert_eq!(ended.streams().collect::<Vec<_>>(), vec![s(1), s(2)]);
        assert!(c.is_quiet() && c.end(7).is_none());
    }

    #[test]
    fn deferred_frees_and_graph_uses_are_handed_out_once() {
        let mut c = Captures::default();
        c.note_use(5, s(2));
        c.note_use(5, s(2));
        c.note_use(5, s(3));
        c.defer(5);
        assert!(c.has_deferred());
        assert_eq!(c.take_deferred(), vec![5]);
        assert!(!c.has_deferred());
        assert_eq!(c.take_uses(5), vec![s(2), s(3)]);
        assert!(c.take_uses(5).is_empty());
    }
}
