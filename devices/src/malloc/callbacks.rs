//! The free-memory callbacks: functions the owner registers that, when the pools have no
//! block for a request, name live allocations that may be freed now (blocks another process
//! has let go of, a cache of the user's). The malloc path runs them before a device malloc,
//! frees what they name and searches again (PyTorch's `FreeMemoryCallbacksRegistry`).
//!
//! A leaf: the callbacks and the order they run in. What the core does with the pointers
//! (free each, skip a bad one with a warning) is `malloc/mod.rs`'s.

use gpualloc_runtime::DevicePtr;

/// A callback run when the pools have no block for a request, before a device malloc. It
/// returns pointers of this allocator's live allocations that may now be freed (e.g. blocks
/// another process has released); the core frees them and searches again.
pub type FreeMemoryCallback = Box<dyn FnMut() -> Vec<DevicePtr> + Send>;

/// The registered callbacks, in the order they were added.
#[derive(Default)]
pub(crate) struct FreeMemoryCallbacks {
    callbacks: Vec<FreeMemoryCallback>,
}

impl FreeMemoryCallbacks {
    /// Registers `callback`; it runs after those registered before it.
    pub fn add(&mut self, callback: FreeMemoryCallback) {
        self.callbacks.push(callback);
    }

    /// No callback is registered (a miss then skips this step).
    pub fn is_empty(&self) -> bool {
        self.callbacks.is_empty()
    }

    /// Runs every callback once, in the order they were added, and returns what they named,
    /// in that order.
    pub fn collect(&mut self) -> Vec<DevicePtr> {
        let mut named = Vec::new();
        for callback in &mut self.callbacks {
            named.extend(callback());
        }
        named
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use super::*;

    #[test]
    fn every_callback_runs_once_per_collect_in_the_order_added() {
        let mut callbacks = FreeMemoryCallbacks::default();
        assert!(callbacks.is_empty());
        assert!(callbacks.collect().is_empty());
        let runs = Arc::new(AtomicUsize::new(0));
        for base in [0x1000u64, 0x2000] {
            let runs = runs.clone();
            callbacks.add(Box::new(move || {
                runs.fetch_add(1, Ordering::Relaxed);
                vec![DevicePtr(base), DevicePtr(base + 0x200)]
            }));
        }
        assert!(!callbacks.is_empty());
        let named = callbacks.collect();
        assert_eq!(
            named,
            [0x1000, 0x1200, 0x2000, 0x2200].map(DevicePtr).to_vec()
        );
        assert_eq!(runs.load(Ordering::Relaxed), 2);
        callbacks.collect();
        assert_eq!(runs.load(Ordering::Relaxed), 4);
    }
}
