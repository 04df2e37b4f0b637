//! `Deref<Target = [u8]>` / `DerefMut` for [`PinnedBuffer`]: pinned memory is CPU memory.
//! The only `unsafe` code of the facade, kept here on its own.
//!
//! Copies on a stream may read or write the bytes after the call that enqueued them returned:
//! touch the bytes only once the stream has passed the copy (e.g. `stream.synchronize()`),
//! as with any asynchronous CUDA copy.

use std::ops::{Deref, DerefMut};

use crate::pinned::buffer::PinnedBuffer;

impl Deref for PinnedBuffer {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` is the start of a live block of at least `len` bytes (the core handed
        // it out for a request of `len > 0` bytes, rounded up) and `len` fits in the address
        // space (the core refuses sizes that do not fit `usize`). The block is exclusively
        // owned by this buffer for its whole lifetime: the core hands it out again only after
        // this buffer's `Drop` freed it (and after the streams it was used on passed that
        // free), and the core never releases a live block, not even at shutdown or when the
        // core itself is dropped. The returned slice borrows `self`, so it cannot outlive it.
        unsafe { std::slice::from_raw_parts(self.ptr().as_mut_ptr(), self.len() as usize) }
    }
}

impl DerefMut for PinnedBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`; `&mut self` makes this the only reference to the bytes.
        unsafe { std::slice::from_raw_parts_mut(self.ptr().as_mut_ptr(), self.len() as usize) }
    }
}
