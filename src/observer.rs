//! [`Allocator::watch_segments`]: every range of device memory the allocator maps and
//! unmaps, for NCCL buffer registration, UCX's registration cache, NVSHMEM.
//!
//! ```no_run
//! # async fn demo(alloc: gpualloc::Allocator) -> Result<(), gpualloc::Error> {
//! use gpualloc::{DeviceId, SegmentAction};
//! let mut watch = alloc.watch_segments(DeviceId(0)).await?;
//! for r in &watch.ranges {
//!     // register r.addr .. r.addr + r.size (held when the watch began)
//! }
//! tokio::spawn(async move {
//!     while let Ok(e) = watch.events.recv().await {
//!         match e.action {
//!             SegmentAction::Alloc | SegmentAction::Map => { /* register */ }
//!             SegmentAction::Free | SegmentAction::Unmap => { /* deregister / invalidate */ }
//!             SegmentAction::PoolAsleep | SegmentAction::PoolAwake => {}
//!         }
//!     }
//! });
//! # Ok(()) }
//! ```
//!
//! - The ranges and the receiver come from one hold of the device's core: the events that
//!   follow are exactly the changes to those ranges, none missed, none twice.
//! - Events are sent on a `tokio::sync::broadcast` channel: the allocator never runs
//!   observer code and never waits for an observer. An observer that panics only ends its
//!   own task. One that falls more than [`SEGMENT_EVENTS_BUFFERED`] events behind gets
//!   `RecvError::Lagged` (the allocator is not slowed); it should watch again for a fresh
//!   snapshot.
//! - When each event is sent (the core's rules, `gpualloc_devices`' `observer.rs`): a range
//!   is announced once mapped and before any of it is handed out; an unmap or free is
//!   announced when the range leaves the allocator's books, around the driver call, and
//!   delivered asynchronously, so treat it as an invalidation (UCX's model). An observer
//!   that must finish before the memory goes (NCCL's deregistration) uses
//!   [`Allocator::register_segments`] instead, whose deregistration runs just before the
//!   driver call.
//! - A shutdown returns every segment without events.

use gpualloc_devices::SegmentEvent;
use gpualloc_runtime::DeviceId;
use tokio::sync::broadcast;

pub use gpualloc_devices::{SegmentAction, SegmentRange};

use std::sync::Arc;

use crate::{Allocator, DeviceActor, Error};

/// Events an observer may fall behind before it gets `RecvError::Lagged`.
pub const SEGMENT_EVENTS_BUFFERED: usize = 1024;

/// What [`Allocator::watch_segments`] returns.
#[derive(Debug)]
pub struct SegmentWatch {
    /// The ranges held when the watch began, in address order.
    pub ranges: Vec<SegmentRange>,
    /// Every change after those, in order.
    pub events: broadcast::Receiver<SegmentEvent>,
}

impl Allocator {
    /// Watches the device memory of `device` (see the module docs).
    pub async fn watch_segments(&self, device: DeviceId) -> Result<SegmentWatch, Error> {
        self.check()?;
        watch_actor(self.device_actor(device)?).await
    }
}

/// [`Allocator::watch_segments`] on one device's actor.
pub(crate) async fn watch_actor(actor: &Arc<DeviceActor>) -> Result<SegmentWatch, Error> {
    actor
        .call(|st| {
            let tx = match &st.segment_tx {
                Some(tx) => tx.clone(),
                None => {
                    let (tx, _) = broadcast::channel(SEGMENT_EVENTS_BUFFERED);
                    let sender = tx.clone();
                    st.core.set_segment_sink(Some(Box::new(move |e| {
                        // No receiver: nobody watches now; nothing to do.
                        let _ = sender.send(e);
                    })));
                    st.segment_tx = Some(tx.clone());
                    tx
                }
            };
            SegmentWatch {
                ranges: st.core.segment_ranges(),
                events: tx.subscribe(),
            }
        })
        .await
}
