//! `Deref<Target = [u8]>` / `DerefMut` for [`PinnedBuffer`]: pinned memory is CPU memory.
//! The only `unsafe` code of the facade, kept here on its own.
//!
//! Copies on a stream read or write the bytes after the call that enqueued them returned, so
//! the safe copies take the buffer and hand it back only once the stream has passed the copy
//! (`copy.rs`): safe code cannot reach the bytes while a copy may touch them.

use std::ops::{Deref, DerefMut};

use crate::pinned::buffer::PinnedBuffer;

impl Deref for PinnedBuffer {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        if self.is_empty() {
            // The empty buffer of `malloc(0)` has a null pointer: never make a slice of it.
            return &[];
        }
        // SAFETY: `ptr` is the start of a live block of at least `len` bytes (the core handed
        // it out for a request of `len > 0` bytes, rounded up; empty buffers returned above) and `len` fits in the address
        // space (the core refuses sizes that do not fit `usize`). The block is exclusively
        // owned by this buffer for its whole lifetime: the core hands it out again only after
        // this buffer's `Drop` freed it (and after the streams it was used on passed that
        // free), and the core never releases a live block, not even at shutdown or when the
        // core itself is dropped. The returned slice borrows `self`, so it cannot outlive it.
        // No copy touches the bytes meanwhile: the safe copies hold the buffer until the
        // stream has passed them, and the unsafe ones make that the caller's promise.
        unsafe { std::slice::from_raw_parts(self.ptr().as_mut_ptr(), self.len() as usize) }
    }
}

impl DerefMut for PinnedBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        if self.is_empty() {
            return &mut [];
        }
        // SAFETY: as in `deref`; `&mut self` makes this the only reference to the bytes.
        unsafe { std::slice::from_raw_parts_mut(self.ptr().as_mut_ptr(), self.len() as usize) }
    }
}
