//! The exporter's ledger of one connection: which buffers it has sent, in which
//! reference-count slot, and the [`ExportGuard`](crate::export::ExportGuard)-like value `G`
//! that keeps each block alive. Sans-IO: it never touches a socket; the connection types
//! call [`ExportLedger::collect`] when the importer says it released something (or at any
//! time, like PyTorch's `CudaIPCCollect`) and [`ExportLedger::reclaim_all`] on EOF.

use std::collections::BTreeMap;

use crate::counter::SharedCounter;
use crate::error::{IpcError, Result};

/// Identifies one exported buffer on one connection.
pub type ExportId = u64;

/// See the module docs.
#[derive(Debug)]
pub struct ExportLedger<G> {
    entries: BTreeMap<ExportId, (u32, G)>,
    free_slots: Vec<u32>,
    slots: usize,
    next_id: ExportId,
}

impl<G> ExportLedger<G> {
    /// A ledger over `slots` counters.
    pub fn new(slots: usize) -> Self {
        let top = u32::try_from(slots).unwrap_or(u32::MAX);
        ExportLedger {
            entries: BTreeMap::new(),
            free_slots: (0..top).rev().collect(),
            slots,
            next_id: 1,
        }
    }

    /// Records a new export holding `guard`: takes a free slot and offers it
    /// ([`OFFERED`](crate::counter::OFFERED), before the buffer is sent). Returns the export's id and slot.
    pub fn offer<C: SharedCounter>(&mut self, counters: &[C], guard: G) -> Result<(ExportId, u32)> {
        let slot = self
            .free_slots
            .pop()
            .ok_or(IpcError::SlotsExhausted(self.slots))?;
        let Some(counter) = counters.get(slot as usize) else {
            self.free_slots.push(slot);
            return Err(IpcError::SlotsExhausted(counters.len()));
        };
        counter.arm(crate::counter::OFFERED);
        let id = self.next_id;
        self.next_id += 1;
        self.entries.insert(id, (slot, guard));
        Ok((id, slot))
    }

    /// Undoes an offer whose message never left (the send failed): disarms its slot and
    /// returns its guard.
    pub fn cancel<C: SharedCounter>(&mut self, counters: &[C], id: ExportId) -> Result<G> {
        let (slot, guard) = self
            .entries
            .remove(&id)
            .ok_or(IpcError::UnknownExport(id))?;
        if let Some(c) = counters.get(slot as usize) {
            c.take_all();
        }
        self.free_slots.push(slot);
        Ok(guard)
    }

    /// Removes and returns every export whose references are all gone; their slots become
    /// free for later exports.
    pub fn collect<C: SharedCounter>(&mut self, counters: &[C]) -> Vec<(ExportId, G)> {
        let done: Vec<ExportId> = self
            .entries
            .iter()
            .filter(|(_, (slot, _))| counters.get(*slot as usize).is_none_or(|c| c.is_free()))
            .map(|(&id, _)| id)
            .collect();
        let mut out = Vec::with_capacity(done.len());
        for id in done {
            if let Some((slot, guard)) = self.entries.remove(&id) {
                self.free_slots.push(slot);
                out.push((id, guard));
            }
        }
        out
    }

    /// The importer is gone: takes every slot's remaining references and returns every
    /// export's guard.
    pub fn reclaim_all<C: SharedCounter>(&mut self, counters: &[C]) -> Vec<(ExportId, G)> {
        let entries = std::mem::take(&mut self.entries);
        entries
            .into_iter()
            .map(|(id, (slot, guard))| {
                if let Some(c) = counters.get(slot as usize) {
                    let left = c.take_all();
                    if left > 0 {
                        tracing::debug!(id, left, "reclaimed references of a gone importer");
                    }
                }
                self.free_slots.push(slot);
                (id, guard)
            })
            .collect()
    }

    /// Exports still referenced (or not yet collected).
    pub fn outstanding(&self) -> usize {
        self.entries.len()
    }

    /// True when `id` was handed out by [`ExportLedger::offer`] (whether or not it is back).
    pub fn issued(&self, id: ExportId) -> bool {
        id >= 1 && id < self.next_id
    }

    /// True when export `id` is still out.
    pub fn is_out(&self, id: ExportId) -> bool {
        self.entries.contains_key(&id)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use gpualloc_runtime::sync::atomic::AtomicU64;

    fn counters(n: usize) -> Vec<AtomicU64> {
        (0..n).map(|_| AtomicU64::new(0)).collect()
    }

    #[test]
    fn collect_returns_only_released_exports_and_reuses_slots() {
        let c = counters(2);
        let mut l = ExportLedger::new(2);
        let (a, sa) = l.offer(&c, "a").unwrap();
        let (b, sb) = l.offer(&c, "b").unwrap();
        assert_ne!(sa, sb);
        assert!(matches!(l.offer(&c, "c"), Err(IpcError::SlotsExhausted(2))));
        assert!(l.collect(&c).is_empty());
        assert!(c[sb as usize].accept());
        assert!(c[sb as usize].release_one());
        assert_eq!(l.collect(&c), vec![(b, "b")]);
        assert_eq!(l.outstanding(), 1);
        let (_, sc) = l.offer(&c, "c").unwrap();
        assert_eq!(sc, sb);
        let all = l.reclaim_all(&c);
        assert_eq!(all.len(), 2);
        assert_eq!(all[0], (a, "a"));
        assert!(c.iter().all(|x| x.is_free()));
        assert_eq!(l.outstanding(), 0);
    }

    #[test]
    fn cancel_disarms() {
        let c = counters(1);
        let mut l = ExportLedger::new(1);
        let (a, _) = l.offer(&c, 5u32).unwrap();
        assert_eq!(l.cancel(&c, a).unwrap(), 5);
        assert!(c[0].is_free());
        assert!(matches!(l.cancel(&c, a), Err(IpcError::UnknownExport(_))));
    }
}
