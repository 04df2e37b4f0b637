//! [`AddrMap`]: a hash map keyed by address with a cheap hasher, shared by the allocator
//! cores and the replay.
//!
//! Block addresses are at least 4 KiB apart in the common case, so their low bits are zero;
//! the hasher folds a 128-bit multiply so every output bit depends on every input bit, at a
//! fraction of SipHash's cost on the malloc/free hot path. Keys are our own addresses, not
//! attacker-chosen, so HashDoS resistance buys nothing here.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

/// A `HashMap` from block address to `V`.
pub type AddrMap<V> = HashMap<u64, V, BuildHasherDefault<AddrHasher>>;

/// A `HashSet` of addresses.
pub type AddrSet = HashSet<u64, BuildHasherDefault<AddrHasher>>;

/// Folded-multiply hasher for `u64` keys (other input is folded in 8 bytes at a time).
#[derive(Debug, Default, Clone, Copy)]
pub struct AddrHasher(u64);

const K: u64 = 0x9E37_79B9_7F4A_7C15;

impl Hasher for AddrHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut buf = [0u8; 8];
            buf[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(buf));
        }
    }

    fn write_u64(&mut self, x: u64) {
        let p = u128::from(self.0 ^ x) * u128::from(K);
        self.0 = (p as u64) ^ ((p >> 64) as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    #[test]
    fn aligned_addresses_spread_over_low_and_high_bits() {
        let b = BuildHasherDefault::<AddrHasher>::default();
        let hashes: Vec<u64> = (0..1024u64)
            .map(|i| b.hash_one(0x6000_0000_0000 + i * 4096))
            .collect();
        let low: std::collections::HashSet<u64> = hashes.iter().map(|h| h & 1023).collect();
        let high: std::collections::HashSet<u64> = hashes.iter().map(|h| h >> 57).collect();
        assert!(low.len() > 550, "{} distinct low buckets", low.len());
        assert_eq!(high.len(), 128, "every top-7-bit tag used");
        let mut m: AddrMap<u32> = AddrMap::default();
        m.insert(4096, 1);
        assert_eq!(m.get(&4096), Some(&1));
    }
}
