//! The device memory the core may hold: what it holds from the backend (PyTorch's
//! `total_allocated_memory`), what is being obtained off the core right now (segments claimed
//! by an owner's device malloc, pages being mapped), what is being given back off the core
//! right now (segments taken out of the books whose driver frees have not returned, pages
//! being unmapped), and the cap `per_process_memory_fraction` puts on all of it together
//! (PyTorch's `allowed_memory_maximum`). A component that owns its fields: every check
//! against the cap is [`Budget::fits`], so the rule "what is in flight, either way, counts
//! against the cap until the driver call returns" is written once. (PyTorch holds its lock
//! across `cudaFree` and lowers `total_allocated_memory` after it: a request made meanwhile
//! waits, and never sees the memory as gone before the device has it back.)
//!
//! It also keeps the most the core has ever held (its high-water mark, which no stats reset
//! lowers) and the releases before a growth that are still allowed
//! ([`Budget::take_release_before_growth`], the `gpualloc` policy's rules in `miss/chain.rs`):
//! of the whole cache after the user's `empty_cache`, and of the default pools' free pages
//! once per rise of the high-water mark.

/// See the module docs.
#[derive(Debug, Clone)]
pub(crate) struct Budget {
    /// Bytes held from the backend: segments, and the mapped pages of expandable ones.
    reserved: u64,
    /// Bytes being obtained off the core, counted against the cap until they land.
    in_flight: u64,
    /// Bytes out of the books whose driver release has not returned yet (off the core),
    /// counted against the cap until it has.
    releasing: u64,
    /// The cap, when `per_process_memory_fraction` sets one.
    allowed: Option<u64>,
    /// The device's total memory, read once.
    device_total: u64,
    /// The most ever held.
    high_water: u64,
    /// Growths past the high-water mark that may still release the cache first (set by the
    /// user's `empty_cache`, one taken by each such release).
    releases_allowed: u32,
    /// Whether the next growth past the high-water mark may release the default pools' free
    /// pages first: set by each rise of the mark, taken by that release.
    page_move_allowed: bool,
    /// Whether such a page move was ever made: from then on growths map no pages ahead
    /// (`malloc/map_ahead.rs`).
    pages_moved: bool,
}

/// What a growth past the high-water mark releases first ([`Budget::take_release_before_growth`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReleaseBeforeGrowth {
    /// Nothing: the growth stays within the mark, or no release is allowed.
    Nothing,
    /// The whole cache, as `empty_cache` does (allowed by the user's `empty_cache`).
    Cache,
    /// The free pages of the default pools, which the growth maps again where the request
    /// needs them (allowed once per rise of the high-water mark).
    PoolPages,
}

/// How many growths past the high-water mark may release the cache first after each
/// `empty_cache` of the user's (`miss/chain.rs`'s `ReleaseBeforeGrowth`). Measured on
/// llama7b-offload-10streams, which empties its cache 39 times: 2 leave it at 2.71%
/// fragmentation, 3 at 0.64%, 4 at 0.56%, no limit at 0.50%; a bound, so a job that stops
/// emptying its cache stops releasing after at most this many.
pub(crate) const RELEASES_PER_EMPTY_CACHE: u32 = 4;

impl Budget {
    /// The budget of a device of `device_total` bytes, capped at `fraction` of it.
    pub fn new(device_total: u64, fraction: Option<f64>) -> Self {
        Budget {
            reserved: 0,
            in_flight: 0,
            releasing: 0,
            allowed: fraction.map(|f| (device_total as f64 * f) as u64),
            device_total,
            high_water: 0,
            releases_allowed: 0,
            page_move_allowed: false,
            pages_moved: false,
        }
    }

    /// The most the core has held.
    #[cfg(test)]
    pub fn high_water(&self) -> u64 {
        self.high_water
    }

    /// The user emptied the cache: the next [`RELEASES_PER_EMPTY_CACHE`] growths past the
    /// high-water mark may release the cache first.
    pub fn user_released(&mut self) {
        self.releases_allowed = RELEASES_PER_EMPTY_CACHE;
    }

    /// What a growth of `bytes` releases first: nothing unless it would pass the high-water
    /// mark; then the cache (if `may_release`) while the user's last `empty_cache` allows it,
    /// else the default pools' free pages (if `may_move`) if the mark rose since the last such
    /// release. Takes the allowance used, and only that.
    pub fn take_release_before_growth(
        &mut self,
        bytes: u64,
        may_release: bool,
        may_move: bool,
    ) -> ReleaseBeforeGrowth {
        if !self.passes_high_water(bytes) {
            ReleaseBeforeGrowth::Nothing
        } else if may_release && self.releases_allowed > 0 {
            self.releases_allowed -= 1;
            ReleaseBeforeGrowth::Cache
        } else if may_move && std::mem::take(&mut self.page_move_allowed) {
            self.pages_moved = true;
            ReleaseBeforeGrowth::PoolPages
        } else {
            ReleaseBeforeGrowth::Nothing
        }
    }

    /// Whether a release of the default pools' free pages before a growth was ever taken
    /// ([`ReleaseBeforeGrowth::PoolPages`]).
    pub fn pages_moved(&self) -> bool {
        self.pages_moved
    }

    /// Whether a growth of `bytes` would pass the high-water mark.
    pub fn passes_high_water(&self, bytes: u64) -> bool {
        self.held().saturating_add(bytes) > self.high_water
    }

    /// Bytes held from the backend.
    pub fn reserved(&self) -> u64 {
        self.reserved
    }

    /// Bytes being obtained off the core.
    pub fn in_flight(&self) -> u64 {
        self.in_flight
    }

    /// The cap, if any.
    pub fn allowed(&self) -> Option<u64> {
        self.allowed
    }

    /// The device's total memory.
    pub fn device_total(&self) -> u64 {
        self.device_total
    }

    /// Bytes out of the books whose driver release has not returned yet.
    pub fn releasing(&self) -> u64 {
        self.releasing
    }

    /// Held and in flight (either way) together: what the cap is checked against.
    pub fn held(&self) -> u64 {
        self.reserved
            .saturating_add(self.in_flight)
            .saturating_add(self.releasing)
    }

    /// True when `bytes` more fit under the cap (always, without one).
    pub fn fits(&self, bytes: u64) -> bool {
        self.allowed
            .is_none_or(|max| self.held().saturating_add(bytes) <= max)
    }

    /// Counts `bytes` as being obtained off the core.
    pub fn claim(&mut self, bytes: u64) {
        self.in_flight += bytes;
    }

    /// `bytes` claimed earlier landed or were not obtained.
    pub fn unclaim(&mut self, bytes: u64) {
        self.in_flight = self.in_flight.saturating_sub(bytes);
    }

    /// `bytes` more are held from the backend.
    pub fn reserve(&mut self, bytes: u64) {
        self.reserved += bytes;
        if self.reserved > self.high_water {
            self.high_water = self.reserved;
            self.page_move_allowed = true;
        }
    }

    /// `bytes` went back to the backend.
    pub fn unreserve(&mut self, bytes: u64) {
        self.reserved -= bytes;
    }

    /// `bytes` left the books ([`Budget::unreserve`]) before the driver call that gives them
    /// back, made off the core: they count against the cap until [`Budget::released`].
    pub fn releasing_begins(&mut self, bytes: u64) {
        self.releasing += bytes;
    }

    /// The driver call that gives back `bytes` of [`Budget::releasing_begins`] returned
    /// (or failed: the books let them go either way).
    pub fn released(&mut self, bytes: u64) {
        self.releasing = self.releasing.saturating_sub(bytes);
    }

    /// Everything went back (the core shut down). A release still in flight ends with
    /// [`Budget::released`] as usual, which then changes nothing.
    pub fn release_all(&mut self) {
        self.reserved = 0;
        self.releasing = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_in_flight_counts_against_the_cap() {
        let mut b = Budget::new(100, Some(0.5));
        assert_eq!((b.allowed(), b.device_total()), (Some(50), 100));
        b.reserve(30);
        assert!(b.fits(20) && !b.fits(21));
        b.claim(15);
        assert_eq!(b.held(), 45);
        assert!(b.fits(5) && !b.fits(6));
        b.unclaim(15);
        b.unclaim(1); // never below zero
        assert_eq!(b.in_flight(), 0);
        b.unreserve(30);
        assert!(b.fits(50));
        assert!(!b.fits(u64::MAX), "no overflow past the cap");
        let open = Budget::new(100, None);
        assert!(open.fits(u64::MAX), "no cap");
        // Memory out of the books counts until its driver release returns.
        let mut r = Budget::new(100, Some(0.5));
        r.reserve(40);
        r.unreserve(40);
        r.releasing_begins(40);
        assert_eq!((r.reserved(), r.releasing(), r.held()), (0, 40, 40));
        assert!(r.fits(10) && !r.fits(11));
        r.released(40);
        r.released(1); // never below zero
        assert_eq!(r.releasing(), 0);
        assert!(r.fits(50));
        r.releasing_begins(5);
        r.release_all();
        assert_eq!(r.held(), 0, "a shutdown ends every release");
        b.reserve(7);
        b.release_all();
        assert_eq!(b.reserved(), 0);
    }

    impl Budget {
        fn take(&mut self, bytes: u64) -> ReleaseBeforeGrowth {
            self.take_release_before_growth(bytes, true, true)
        }
    }

    #[test]
    fn what_is_not_allowed_is_not_taken() {
        use ReleaseBeforeGrowth::{Cache, Nothing, PoolPages};
        let mut b = Budget::new(1 << 40, None);
        b.reserve(100);
        b.user_released();
        assert_eq!(b.take_release_before_growth(1, false, false), Nothing);
        assert!(!b.pages_moved());
        assert_eq!(b.take_release_before_growth(1, false, true), PoolPages);
        assert!(b.pages_moved(), "a page move is remembered");
        assert_eq!(b.take_release_before_growth(1, false, true), Nothing);
        b.reserve(1);
        assert_eq!(b.take_release_before_growth(1, true, false), Cache);
        assert!(b.pages_moved(), "and stays remembered");
        let mut c = Budget::new(1 << 40, None);
        c.reserve(100);
        c.user_released();
        assert_eq!(c.take(1), Cache);
        assert!(!c.pages_moved(), "a release of the cache is no page move");
        assert_eq!(b.take_release_before_growth(1, false, true), PoolPages);
        for _ in 1..RELEASES_PER_EMPTY_CACHE {
            assert_eq!(b.take(1), Cache);
        }
        assert_eq!(b.take(1), Nothing);
    }

    #[test]
    fn releases_before_growth_are_allowed_after_an_empty_cache_and_counted() {
        use ReleaseBeforeGrowth::{Cache, Nothing, PoolPages};
        let mut b = Budget::new(1 << 40, None);
        b.reserve(300);
        b.unreserve(100);
        assert_eq!((b.reserved(), b.high_water()), (200, 300));
        // The mark rose (to 300): one page move, then none until it rises again.
        assert_eq!(b.take(101), PoolPages);
        assert_eq!(b.take(101), Nothing);
        b.user_released();
        // Within the high-water mark: nothing to release for, nothing taken.
        assert_eq!(b.take(100), Nothing);
        for _ in 0..RELEASES_PER_EMPTY_CACHE {
            assert_eq!(b.take(101), Cache);
        }
        assert_eq!(b.take(101), Nothing, "the allowance is spent");
        // What is in flight counts: 200 held + 50 claimed + 51 passes 300.
        b.user_released();
        b.claim(50);
        assert_eq!(b.take(50), Nothing);
        assert_eq!(b.take(51), Cache);
    }

    #[test]
    fn each_rise_of_the_high_water_mark_allows_one_page_move() {
        use ReleaseBeforeGrowth::{Nothing, PoolPages};
        let mut b = Budget::new(1 << 40, None);
        assert_eq!(b.take(1), Nothing, "nothing held yet: no rise");
        b.reserve(100);
        b.reserve(50);
        // Two rises before a release allow one move, not two.
        assert_eq!(b.take(1), PoolPages);
        assert_eq!(b.take(1), Nothing);
        // Back to the mark is no rise.
        b.unreserve(50);
        b.reserve(50);
        assert_eq!(b.take(1), Nothing);
        b.reserve(1);
        assert_eq!(b.high_water(), 151);
        // Within the mark a growth takes nothing, and keeps the allowance for one past it.
        b.unreserve(100);
        assert_eq!(b.take(100), Nothing);
        assert_eq!(b.take(101), PoolPages);
    }
}
