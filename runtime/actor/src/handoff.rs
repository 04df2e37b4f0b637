//! Posting a message to a [`Mailbox`] from anywhere, never blocking: the free hand-off a
//! buffer's `Drop` uses on any thread, inside or outside an async runtime.
//!
//! If the gate is free the poster takes it and handles the message inline (no allocation,
//! no wake-up). Otherwise it pushes the message on the lock-free channel and announces it
//! on the gate, which hands it to the current holder (who drains before releasing) or, if
//! the holder released in between, back to the poster, who then drains itself.

use crate::mailbox::{Actor, Mailbox};

impl<S: Actor> Mailbox<S> {
    /// Delivers `msg`; never waits for the gate. See the module docs.
    pub fn post(&self, msg: S::Msg) {
        if let Some(mut held) = self.try_hold() {
            held.state().handle(msg);
            return;
        }
        // The receiver lives as long as the mailbox, so the send cannot fail.
        let _ = self.tx.send(msg);
        if let Some(acquired) = self.gate().announce() {
            drop(self.hold(acquired));
        }
    }
}
