//! The `debug_cross_stream_frees` check: a free while another stream still has queued work on
//! the block, which `record_stream` was not told about.
//!
//! Stream-ordered reuse is only safe when every stream that used a buffer was either the
//! allocation stream, `record_stream`ed, or made the allocation stream wait for its work
//! (an event). Otherwise the freed block is handed to the next request on the allocation
//! stream at once, and the other stream's pending work reads or writes the new owner's
//! bytes: silent corruption. With the key on, each free asks the backend
//! ([`Backend::unordered_users`](gpualloc_runtime::Backend::unordered_users)) which other
//! streams still have work touching the block that the allocation stream does not wait for,
//! drops the `record_stream`ed ones (their events already guard the reuse), and reports the
//! rest: a `tracing` warning, [`DeviceStats::num_cross_stream_frees`](crate::DeviceStats), and
//! the last [`CROSS_STREAM_LOG`] reports in
//! [`DeviceCore::cross_stream_frees`](crate::DeviceCore::cross_stream_frees).
//!
//! What it can see is what the backend can: the sim knows the ranges of queued copies and
//! memsets and of kernels launched with `launch_kernel_touching`; a real driver says nothing
//! (the check is then a no-op, with one warning). It looks when the core processes the free,
//! so work that finished in between is not reported. An ordering through a third stream
//! (A waits on C, which waited on B) is not followed, and is reported: `record_stream` is the
//! rule the check enforces.

//!
//! A component of the core that owns its state ([`CrossStreamLog`]): the core hands it the
//! freed block and the backend, and counts what it reports.
use std::collections::VecDeque;

use gpualloc_runtime::{Backend, DevicePtr, StreamHandle};

use crate::blocks::block::Block;

/// Reports kept by [`DeviceCore::cross_stream_frees`](crate::DeviceCore::cross_stream_frees)
/// (older ones are dropped; the count in the stats keeps growing).
pub const CROSS_STREAM_LOG: usize = 64;

/// A free that raced other streams' pending work on the block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CrossStreamFree {
    /// The freed allocation.
    pub ptr: DevicePtr,
    /// Its block size in bytes.
    pub size: u64,
    /// The stream it was allocated on (where it will be reused).
    pub stream: StreamHandle,
    /// Streams with pending work touching it, neither recorded nor waited for.
    pub others: Vec<StreamHandle>,
}

/// The reports so far and whether the backend said it cannot tell.
#[derive(Debug, Default)]
pub(crate) struct CrossStreamLog {
    reports: VecDeque<CrossStreamFree>,
    blind_warned: bool,
}

impl CrossStreamLog {
    /// Checks the free of `block` (see the module docs); called only with the key on. True
    /// when it reported the free (the caller counts it in the stats).
    pub(crate) fn check_free(&mut self, backend: &dyn Backend, block: &Block) -> bool {
        let (ptr, size, stream) = (DevicePtr(block.addr()), block.size(), block.stream());
        let others = match backend.unordered_users(stream, ptr, size) {
            Ok(Some(users)) => users,
            Ok(None) => {
                if !self.blind_warned {
                    self.blind_warned = true;
                    tracing::warn!(
                        backend = backend.name(),
                        "debug_cross_stream_frees: this backend cannot tell which streams use \
                         a buffer; frees are not checked"
                    );
                }
                return false;
            }
            Err(e) => {
                tracing::debug!(error = %e, "debug_cross_stream_frees: check failed");
                return false;
            }
        };
        let others: Vec<StreamHandle> = others
            .into_iter()
            .filter(|s| *s != stream && !block.stream_uses().contains(s))
            .collect();
        if others.is_empty() {
            return false;
        }
        tracing::warn!(
            ptr = format_args!("{:#x}", ptr.0),
            size,
            stream = stream.raw,
            others = ?others.iter().map(|s| s.raw).collect::<Vec<_>>(),
            "buffer freed while other streams still have work on it that was not \
             record_stream'ed: its memory may be reused under that work"
        );
        if self.reports.len() == CROSS_STREAM_LOG {
            self.reports.pop_front();
        }
        self.reports.push_back(CrossStreamFree {
            ptr,
            size,
            stream,
            others,
        });
        true
    }

    /// The reports kept, oldest first.
    pub(crate) fn reports(&self) -> Vec<CrossStreamFree> {
        self.reports.iter().cloned().collect()
    }
}
