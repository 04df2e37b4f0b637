//! The streams a device's core still needs, kept alive by the actor.
//!
//! A user may drop a [`Stream`] while the core caches blocks of it, or while a buffer recorded
//! on it (`record_stream`) is still live. The core calls the backend with those streams later
//! (an expandable segment synchronizes its stream before unmapping pages; a free records an
//! event on every stream the block was used on), so the actor holds a clone of every stream it
//! hands to the core on a path that can leave something behind: a miss (which may create a
//! segment of that stream) and `record_stream`. A miss keeps its stream when it ends, in the
//! hold of its last step: until then it holds the stream itself, and while its driver calls
//! run off the gate (a release before its segment is made, an ordinary segment's device
//! malloc) nothing in the core may name the stream, so a pass meanwhile would let go of it.
//!
//! PyTorch keeps its streams forever; we let go of a stream as soon as the core no longer
//! names it ([`DeviceCore::streams_in_use`]): after its segments went back (`empty_cache`,
//! the out-of-memory chain, shutdown), its recorded frees were made and its retirement ended.
//! The pass that finds them runs on the slow paths, and on a miss or in the reaper once the
//! number kept has doubled since the last pass, so a server making a stream per request
//! keeps at most twice the streams its cache needs.
//!
//! Releasing a stream is a driver call (a backend may block in it, and the latency model
//! charges the sim's), so pruned streams are handed back to the caller to drop after the
//! gate is released.
//!
//! A kept stream whose clone here is the last one was dropped by its users (no buffer holds
//! it either): a miss retires it in the core, so its free segments serve other streams once
//! its work is done instead of staying cached for nobody ([`KeptStreams::dropped_by_users`],
//! `gpualloc_devices::orphans`).

use std::collections::HashMap;

use gpualloc_devices::DeviceCore;
use gpualloc_runtime::{Stream, StreamHandle};

/// Below this many kept streams no pass runs on its own.
const PRUNE_FLOOR: usize = 16;

/// Streams kept alive for the core. See the module docs.
#[derive(Debug)]
pub(crate) struct KeptStreams {
    streams: HashMap<StreamHandle, Stream>,
    /// Kept streams already found dropped by their users (`dropped_by_users`).
    retired: std::collections::HashSet<StreamHandle>,
    /// A pass runs on its own once more than this many are kept.
    prune_at: usize,
}

impl Default for KeptStreams {
    fn default() -> Self {
        KeptStreams {
            streams: HashMap::new(),
            retired: std::collections::HashSet::new(),
            prune_at: PRUNE_FLOOR,
        }
    }
}

impl KeptStreams {
    /// Keeps `stream` alive until a pass finds the core no longer names it.
    pub fn keep(&mut self, stream: &Stream) {
        self.streams
            .entry(stream.handle())
            .or_insert_with(|| stream.clone());
    }

    /// A clone of kept stream `handle`, if kept.
    pub fn get(&self, handle: StreamHandle) -> Option<Stream> {
        self.streams.get(&handle).cloned()
    }

    /// The kept streams whose users dropped every clone since the last call (only ours is
    /// left: no user and no buffer holds one), for the core to retire (`orphans.rs`).
    pub fn dropped_by_users(&mut self) -> Vec<StreamHandle> {
        let dropped: Vec<StreamHandle> = self
            .streams
            .iter()
            .filter(|(h, s)| s.clone_count() == 1 && !self.retired.contains(h))
            .map(|(h, _)| *h)
            .collect();
        self.retired.extend(dropped.iter().copied());
        dropped
    }

    /// True once the number kept has doubled since the last pass.
    pub fn wants_prune(&self) -> bool {
        self.streams.len() > self.prune_at
    }

    /// Lets go of every stream `core` no longer names; returns them, to be dropped by the
    /// caller outside the gate.
    pub fn prune(&mut self, core: &DeviceCore) -> Vec<Stream> {
        let in_use = core.streams_in_use();
        let gone: Vec<StreamHandle> = self
            .streams
            .keys()
            .filter(|h| !in_use.contains(h))
            .copied()
            .collect();
        for h in &gone {
            self.retired.remove(h);
        }
        let out = gone.iter().filter_map(|h| self.streams.remove(h)).collect();
        self.prune_at = (2 * self.streams.len()).max(PRUNE_FLOOR);
        out
    }

    /// Every stream kept (after the core shut down).
    pub fn take_all(&mut self) -> Vec<Stream> {
        self.prune_at = PRUNE_FLOOR;
        self.retired.clear();
        self.streams.drain().map(|(_, s)| s).collect()
    }

    /// How many streams are kept.
    pub fn len(&self) -> usize {
        self.streams.len()
    }
}
