//! [`Stat`]: one allocator counter with PyTorch's four readings (current, peak, allocated,
//! freed), shared by the device and pinned-host allocators' statistics.

/// A counter with PyTorch's four readings.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stat {
    /// Current value.
    pub current: u64,
    /// Highest `current` since creation or the last [`Stat::reset_peak`].
    pub peak: u64,
    /// Total ever added.
    pub allocated: u64,
    /// Total ever removed.
    pub freed: u64,
}

impl Stat {
    /// Adds `n`.
    #[inline]
    pub fn increase(&mut self, n: u64) {
        self.current += n;
        self.allocated += n;
        self.peak = self.peak.max(self.current);
    }

    /// Removes `n` (saturating: a bookkeeping bug must not panic the allocator).
    #[inline]
    pub fn decrease(&mut self, n: u64) {
        debug_assert!(n <= self.current, "stat underflow");
        self.current = self.current.saturating_sub(n);
        self.freed += n;
    }

    /// Takes back a [`Stat::decrease`] of `n` (a release that was rolled back): as if it had
    /// not happened, peak included.
    pub fn undo_decrease(&mut self, n: u64) {
        self.current += n;
        self.freed = self.freed.saturating_sub(n);
        self.peak = self.peak.max(self.current);
    }

    /// Counts `n` added and removed again, with `current` (and so `peak`) as it was: what an
    /// increase followed at once by an equal decrease leaves behind.
    #[inline]
    pub fn round_trip(&mut self, n: u64) {
        self.allocated += n;
        self.freed += n;
    }

    /// Sets the peak to the current value.
    pub fn reset_peak(&mut self) {
        self.peak = self.current;
    }

    /// Zeroes the accumulated totals.
    pub fn reset_accumulated(&mut self) {
        self.allocated = 0;
        self.freed = 0;
    }
}
