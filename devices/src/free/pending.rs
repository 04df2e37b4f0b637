//! Frees that wait on other streams (PyTorch's `cuda_events`): per stream, in record order,
//! the event recorded on it at the free and the block waiting for it, so one busy stream does
//! not hold up the others; and the spare events, recorded again rather than made anew (making
//! one is a driver call). A component that owns its fields: the core queues, pops and counts
//! through it (`events.rs`, `sleep.rs`, `orphans.rs`, `release.rs`), and a block leaves a queue
//! only through it.

use std::collections::{BTreeMap, VecDeque};

use gpualloc_runtime::{BackendError, DeviceId, EventHandle, StreamHandle};

use crate::blocks::block::BlockId;

/// See the module docs.
#[derive(Debug, Default)]
pub(crate) struct PendingFrees {
    /// Per stream, in record order: the event and the block waiting for it.
    queues: BTreeMap<StreamHandle, VecDeque<(EventHandle, BlockId)>>,
    /// Events to record again.
    spare: Vec<EventHandle>,
}

impl PendingFrees {
    /// True when no free waits.
    pub fn is_empty(&self) -> bool {
        self.queues.is_empty()
    }

    /// How many (free, stream) pairs wait.
    pub fn len(&self) -> usize {
        self.queues.values().map(VecDeque::len).sum()
    }

    /// The events the waiting frees wait on.
    pub fn events(&self) -> Vec<EventHandle> {
        self.queues
            .values()
            .flatten()
            .map(|(event, _)| *event)
            .collect()
    }

    /// The streams some free waits on.
    pub fn streams(&self) -> impl Iterator<Item = StreamHandle> + '_ {
        self.queues.keys().copied()
    }

    /// The blocks waiting (a block waiting on several streams once per stream).
    pub fn blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.queues.values().flatten().map(|(_, id)| *id)
    }

    /// The streams some block `waits` picks is waiting on.
    pub fn streams_of(&self, waits: impl Fn(BlockId) -> bool) -> Vec<StreamHandle> {
        self.queues
            .iter()
            .filter(|(_, queue)| queue.iter().any(|(_, id)| waits(*id)))
            .map(|(stream, _)| *stream)
            .collect()
    }

    /// Queues block `id` behind `event`, just recorded on `stream`.
    pub fn push(&mut self, stream: StreamHandle, event: EventHandle, id: BlockId) {
        self.queues
            .entry(stream)
            .or_default()
            .push_back((event, id));
    }

    /// A spare event of `device`, the last one given back.
    pub fn take_spare_of(&mut self, device: DeviceId) -> Option<EventHandle> {
        let i = self.spare.iter().rposition(|e| e.device == device)?;
        Some(self.spare.swap_remove(i))
    }

    /// The last spare event given back, of any device.
    pub fn take_spare(&mut self) -> Option<EventHandle> {
        self.spare.pop()
    }

    /// `events` may be recorded again.
    pub fn give_back(&mut self, events: impl IntoIterator<Item = EventHandle>) {
        self.spare.extend(events);
    }

    /// Every spare event, for the caller to destroy (the core shut down).
    pub fn drain_spare(&mut self) -> Vec<EventHandle> {
        std::mem::take(&mut self.spare)
    }

    /// Pops, stream by stream, the frees whose events `query` says completed, up to each
    /// queue's first that has not; their events become spare. Returns the blocks popped, in
    /// that order, and the first error of `query` (where the popping stopped).
    pub fn pop_completed(
        &mut self,
        mut query: impl FnMut(EventHandle) -> Result<bool, BackendError>,
    ) -> (Vec<BlockId>, Result<(), BackendError>) {
        let mut done = Vec::new();
        let streams: Vec<StreamHandle> = self.queues.keys().copied().collect();
        for stream in streams {
            let Some(queue) = self.queues.get_mut(&stream) else {
                continue;
            };
            while let Some(&(event, id)) = queue.front() {
                match query(event) {
                    Ok(true) => {}
                    Ok(false) => break,
                    Err(e) => return (done, Err(e)),
                }
                queue.pop_front();
                self.spare.push(event);
                done.push(id);
            }
            if queue.is_empty() {
                self.queues.remove(&stream);
            }
        }
        (done, Ok(()))
    }

    /// Pops every free after `wait` returned for its event, stream by stream in order; their
    /// events become spare. On an error of `wait` the free it was waiting for stays queued
    /// (with those behind it). Returns the blocks popped and the error, if any.
    pub fn pop_all(
        &mut self,
        mut wait: impl FnMut(EventHandle) -> Result<(), BackendError>,
    ) -> (Vec<BlockId>, Result<(), BackendError>) {
        let mut done = Vec::new();
        while let Some((stream, mut queue)) = self.queues.pop_first() {
            while let Some((event, id)) = queue.pop_front() {
                if let Err(e) = wait(event) {
                    queue.push_front((event, id));
                    self.queues.insert(stream, queue);
                    return (done, Err(e));
                }
                self.spare.push(event);
                done.push(id);
            }
        }
        (done, Ok(()))
    }

    /// Pops the first `n` frees in the order [`PendingFrees::events`] lists their events
    /// (stream by stream), whose events the caller synchronized; their events become spare.
    /// A count past the waiting frees pops them all.
    pub fn pop_first(&mut self, mut n: usize) -> Vec<BlockId> {
        let mut done = Vec::new();
        while n > 0 {
            let Some(mut entry) = self.queues.first_entry() else {
                break;
            };
            let Some((event, id)) = entry.get_mut().pop_front() else {
                entry.remove();
                continue;
            };
            if entry.get().is_empty() {
                entry.remove();
            }
            self.spare.push(event);
            done.push(id);
            n -= 1;
        }
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(raw: u64) -> StreamHandle {
        StreamHandle {
            device: DeviceId(0),
            raw,
        }
    }

    fn event(device: u32, raw: u64) -> EventHandle {
        EventHandle {
            device: DeviceId(device),
            raw,
        }
    }

    /// Three frees on stream 1 (events 11, 12, 13), one on stream 2 (event 21).
    fn queued() -> PendingFrees {
        let mut p = PendingFrees::default();
        for (s, e, id) in [(1, 11, 1), (1, 12, 2), (2, 21, 3), (1, 13, 4)] {
            p.push(stream(s), event(0, e), id);
        }
        p
    }

    #[test]
    fn completed_frees_pop_in_order_up_to_each_streams_first_waiting() {
        let mut p = queued();
        assert_eq!((p.len(), p.events().len()), (4, 4));
        // Event 12 has not completed: 13 behind it waits too, stream 2 goes on.
        let (done, r) = p.pop_completed(|e| Ok(e.raw != 12));
        assert!(r.is_ok());
        assert_eq!(done, [1, 3]);
        assert_eq!(p.blocks().collect::<Vec<_>>(), [2, 4]);
        assert_eq!(p.drain_spare(), [event(0, 11), event(0, 21)]);
        // An error stops the popping; what was popped is returned, the rest stays.
        let mut p = queued();
        let (done, r) = p.pop_completed(|e| {
            if e.raw == 21 {
                Err(BackendError::invalid("query"))
            } else {
                Ok(true)
            }
        });
        assert!(r.is_err());
        assert_eq!(done, [1, 2, 4]);
        assert_eq!(p.blocks().collect::<Vec<_>>(), [3]);
        assert!(!p.is_empty());
    }

    #[test]
    fn a_failed_wait_keeps_its_free_and_those_behind_it() {
        let mut p = queued();
        let (done, r) = p.pop_all(|e| {
            if e.raw == 12 {
                Err(BackendError::invalid("sync"))
            } else {
                Ok(())
            }
        });
        assert!(r.is_err());
        assert_eq!(done, [1]);
        assert_eq!(p.blocks().collect::<Vec<_>>(), [2, 4, 3]);
        let (done, r) = p.pop_all(|_| Ok(()));
        assert!(r.is_ok() && p.is_empty());
        assert_eq!(done, [2, 4, 3]);
    }

    #[test]
    fn the_first_n_pop_in_the_order_of_the_events() {
        let mut p = queued();
        let order: Vec<u64> = p.events().iter().map(|e| e.raw).collect();
        assert_eq!(order, [11, 12, 13, 21]);
        assert_eq!(p.pop_first(2), [1, 2]);
        assert_eq!(p.pop_first(9), [4, 3], "past the end: all");
        assert!(p.is_empty());
        assert_eq!(p.pop_first(1), Vec::<BlockId>::new());
    }

    #[test]
    fn spare_events_are_taken_by_device_newest_first() {
        let mut p = PendingFrees::default();
        p.give_back([event(0, 1), event(1, 2), event(0, 3)]);
        assert_eq!(p.take_spare_of(DeviceId(0)), Some(event(0, 3)));
        assert_eq!(p.take_spare_of(DeviceId(2)), None);
        assert_eq!(p.take_spare(), Some(event(1, 2)));
        assert_eq!(p.take_spare_of(DeviceId(0)), Some(event(0, 1)));
        assert_eq!(p.take_spare(), None);
        let mut q = queued();
        q.push(stream(2), event(0, 22), 5);
        assert_eq!(q.streams_of(|id| id == 5), [stream(2)]);
        assert_eq!(
            q.streams_of(|id| id == 2 || id == 3),
            [stream(1), stream(2)]
        );
    }
}
