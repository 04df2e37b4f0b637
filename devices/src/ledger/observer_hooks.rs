//! The core's side of the segment observer (`observer.rs`): installing the sink, announcing
//! what the core maps, unmaps, allocates and frees, and listing the ranges held now.

use crate::core::{DeviceCore, MemPoolId};
use crate::ledger::observer::{SegmentAction, SegmentEvent, SegmentRange, SegmentSink};
use crate::ledger::trace::TraceAction;

impl DeviceCore {
    /// Installs (or with `None` removes) the segment sink (see `observer.rs`).
    pub fn set_segment_sink(&mut self, sink: Option<SegmentSink>) {
        self.observer.set(sink);
    }

    /// The ranges of device memory held now, in address order: each ordinary segment whole,
    /// each stretch of mapped pages of an expandable segment.
    pub fn segment_ranges(&self) -> Vec<SegmentRange> {
        let mut out = Vec::new();
        for (&base, meta) in self.segments.iter() {
            let pool = self.owner_of(meta.pool);
            let stream = meta.stream.raw;
            match self.expandable.get(base) {
                Some(es) => {
                    out.extend(
                        es.mapped_stretches()
                            .into_iter()
                            .map(|(first, n)| SegmentRange {
                                addr: es.page_addr(first),
                                size: n as u64 * es.page,
                                stream,
                                pool,
                                expandable: true,
                            }),
                    )
                }
                None => out.push(SegmentRange {
                    addr: base,
                    size: meta.size,
                    stream,
                    pool,
                    expandable: false,
                }),
            }
        }
        out
    }

    /// Sends the segment event of trace action `action`, if it is one and a sink is set.
    pub(crate) fn announce(&mut self, action: TraceAction, addr: u64, size: u64, stream: u64) {
        if !self.observer.is_set() {
            return;
        }
        let action = match action {
            TraceAction::SegmentAlloc => SegmentAction::Alloc,
            TraceAction::SegmentFree => SegmentAction::Free,
            TraceAction::SegmentMap => SegmentAction::Map,
            TraceAction::SegmentUnmap => SegmentAction::Unmap,
            _ => return,
        };
        let pool = self
            .segments
            .holding(addr)
            .and_then(|(_, meta)| self.owner_of(meta.pool));
        self.send_event(action, addr, size, stream, pool);
    }

    /// Sends a pool's sleep or wake.
    pub(crate) fn announce_pool(&mut self, action: SegmentAction, pool: MemPoolId, size: u64) {
        self.send_event(action, 0, size, 0, Some(pool));
    }

    fn send_event(
        &mut self,
        action: SegmentAction,
        addr: u64,
        size: u64,
        stream: u64,
        pool: Option<MemPoolId>,
    ) {
        let device = self.device;
        self.observer.send(SegmentEvent {
            action,
            device,
            addr,
            size,
            stream,
            pool,
        });
    }
}
