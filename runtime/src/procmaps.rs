//! Reading this process's memory map (`/proc/self/maps`): the sim's `host_register` checks and
//! costs ranges with it, and the host registry uses it for diagnostics.
//!
//! The cost of registering host memory grows with the number of OS mappings the range
//! crosses (seed §2.1: a 512 MiB buffer cut into thousands of small mappings took a second to
//! register). The registry counts them for a slow registration's log line, and checks a range
//! that the backend refused for holes, to report an unmapped range.

use std::ops::Range;

/// One line of `/proc/self/maps`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MapEntry {
    /// First address.
    pub start: u64,
    /// One past the last address.
    pub end: u64,
    /// Mapped readable.
    pub readable: bool,
    /// Mapped writable.
    pub writable: bool,
}

/// Parses `/proc/self/maps` text; malformed lines are skipped.
pub fn parse_maps(text: &str) -> Vec<MapEntry> {
    text.lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (a, b) = fields.next()?.split_once('-')?;
            let perms = fields.next()?.as_bytes();
            Some(MapEntry {
                start: u64::from_str_radix(a, 16).ok()?,
                end: u64::from_str_radix(b, 16).ok()?,
                readable: perms.first() == Some(&b'r'),
                writable: perms.get(1) == Some(&b'w'),
            })
        })
        .collect()
}

/// How many mappings of `maps` (sorted) `range` crosses; `Err(addr)` with the first address
/// that is not mapped readable (and writable, when `need_write`).
pub fn mappings_crossed(
    maps: &[MapEntry],
    range: &Range<u64>,
    need_write: bool,
) -> Result<u64, u64> {
    let mut cur = range.start;
    let mut count = 0u64;
    for m in maps {
        if m.end <= cur {
            continue;
        }
        if m.start > cur || !m.readable || (need_write && !m.writable) {
            return Err(cur);
        }
        count += 1;
        cur = m.end;
        if cur >= range.end {
            return Ok(count);
        }
    }
    if cur >= range.end {
        Ok(count)
    } else {
        Err(cur)
    }
}

/// [`mappings_crossed`] over this process's current map. `None` when the map cannot be read
/// (not Linux, no procfs): diagnostics are then skipped.
pub fn own_mappings_crossed(range: &Range<u64>, need_write: bool) -> Option<Result<u64, u64>> {
    let text = std::fs::read_to_string("/proc/self/maps").ok()?;
    Some(mappings_crossed(&parse_maps(&text), range, need_write))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_mappings_and_finds_holes() {
        let maps = parse_maps(
            "1000-3000 rw-p 0 00:00 0\n3000-4000 r--p 0 00:00 0 [heap]\n\
             6000-8000 rw-p 0 0:0 0\n8000-9000 ---p 0 0:0 0\nbad line\n",
        );
        assert_eq!(maps.len(), 4);
        assert_eq!(mappings_crossed(&maps, &(0x1000..0x2000), true), Ok(1));
        assert_eq!(mappings_crossed(&maps, &(0x2000..0x4000), false), Ok(2));
        assert_eq!(
            mappings_crossed(&maps, &(0x2000..0x4000), true),
            Err(0x3000)
        );
        assert_eq!(
            mappings_crossed(&maps, &(0x3000..0x7000), false),
            Err(0x4000)
        );
        assert_eq!(
            mappings_crossed(&maps, &(0x7000..0x9000), false),
            Err(0x8000)
        );
        assert_eq!(
            mappings_crossed(&maps, &(0xa000..0xb000), false),
            Err(0xa000)
        );
    }

    #[test]
    fn own_map_has_the_stack() {
        let local = 7u64;
        let addr = &local as *const u64 as u64;
        let page = addr - addr % 4096;
        assert_eq!(
            own_mappings_crossed(&(page..page + 4096), true),
            Some(Ok(1))
        );
        assert_eq!(own_mappings_crossed(&(4096..8192), false), Some(Err(4096)));
    }
}
