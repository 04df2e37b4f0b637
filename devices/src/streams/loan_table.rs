//! The loans table (a leaf: the core holds it, `loans.rs` lends through it).

use std::collections::HashMap;

use gpualloc_runtime::StreamHandle;

/// The live allocations lent to another stream than their block's, by address: their
/// borrower. Kept beside the blocks, not in them, so the hit path carries nothing for loans
/// (an entry is read only for a block with recorded uses).
#[derive(Debug, Default)]
pub(crate) struct Loans {
    borrowers: HashMap<u64, StreamHandle>,
    /// A replay that follows a history: the miss chain lends nothing, only
    /// `DeviceCore::malloc_borrowed` does, where the history shows a loan.
    pub(crate) as_recorded: bool,
}

impl Loans {
    /// True when no allocation is lent.
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.borrowers.is_empty()
    }

    /// The stream the allocation at `addr` is lent to, if it is.
    pub(crate) fn borrower(&self, addr: u64) -> Option<StreamHandle> {
        self.borrowers.get(&addr).copied()
    }

    /// The allocation at `addr` is lent to `borrower`.
    pub(crate) fn begin(&mut self, addr: u64, borrower: StreamHandle) {
        self.borrowers.insert(addr, borrower);
    }

    /// The loan of `addr` ends (its block is back in its lender's pool): its borrower.
    pub(crate) fn end(&mut self, addr: u64) -> Option<StreamHandle> {
        self.borrowers.remove(&addr)
    }
}
