//! What the loom models of the thread slots share: a slot that holds a bag of block numbers.

use gpualloc_actor::{SlotState, ThreadSlots};
use loom::sync::Arc;

/// A slot's content: the blocks parked in it.
#[derive(Default)]
pub struct Bag(pub Vec<u32>);

impl SlotState for Bag {
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Two slots of bags.
pub fn slots() -> Arc<ThreadSlots<Bag>> {
    Arc::new(ThreadSlots::new(2, Bag::default))
}
