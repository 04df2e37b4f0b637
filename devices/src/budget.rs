//! The device memory the core may hold: what it holds from the backend (PyTorch's
//! `total_allocated_memory`), what is being obtained off the core right now (segments claimed
//! by an owner's device malloc, pages being mapped), and the cap `per_process_memory_fraction`
//! puts on both together (PyTorch's `allowed_memory_maximum`). A component that owns its
//! fields: every check against the cap is [`Budget::fits`], so the rule "what is in flight
//! counts against the cap until it lands" is written once.

/// See the module docs.
#[derive(Debug, Clone)]
pub(crate) struct Budget {
    /// Bytes held from the backend: segments, and the mapped pages of expandable ones.
    reserved: u64,
    /// Bytes being obtained off the core, counted against the cap until they land.
    in_flight: u64,
    /// The cap, when `per_process_memory_fraction` sets one.
    allowed: Option<u64>,
    /// The device's total memory, read once.
    device_total: u64,
}

impl Budget {
    /// The budget of a device of `device_total` bytes, capped at `fraction` of it.
    pub fn new(device_total: u64, fraction: Option<f64>) -> Self {
        Budget {
            reserved: 0,
            in_flight: 0,
            allowed: fraction.map(|f| (device_total as f64 * f) as u64),
            device_total,
        }
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

    /// Held and in flight together: what the cap is checked against.
    pub fn held(&self) -> u64 {
        self.reserved.saturating_add(self.in_flight)
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
    }

    /// `bytes` went back to the backend.
    pub fn unreserve(&mut self, bytes: u64) {
        self.reserved -= bytes;
    }

    /// Everything went back (the core shut down).
    pub fn release_all(&mut self) {
        self.reserved = 0;
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
        b.reserve(7);
        b.release_all();
        assert_eq!(b.reserved(), 0);
    }
}
