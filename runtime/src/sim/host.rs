//! Host-side helpers of the sim: reading this process's memory map for `host_register`.

use crate::error::{BackendError, Result};

/// Parses the `start-end` ranges of `/proc/self/maps` text.
pub(crate) fn parse_maps(text: &str) -> Vec<(u64, u64)> {
    text.lines()
        .filter_map(|line| {
            let range = line.split_whitespace().next()?;
            let (a, b) = range.split_once('-')?;
            Some((
                u64::from_str_radix(a, 16).ok()?,
                u64::from_str_radix(b, 16).ok()?,
            ))
        })
        .collect()
}

/// Counts the mappings `[start, end)` crosses in `maps` (sorted ranges), or errors when
/// part of the range is not mapped.
pub(crate) fn mappings_crossed(maps: &[(u64, u64)], start: u64, end: u64) -> Result<u64> {
    let mut cur = start;
    let mut count = 0u64;
    for &(a, b) in maps {
        if b <= cur {
            continue;
        }
        if a > cur {
            break;
        }
        count += 1;
        cur = b;
        if cur >= end {
            return Ok(count);
        }
    }
    Err(BackendError::invalid(format!(
        "host range {start:#x}..{end:#x} is not mapped at {cur:#x}"
    )))
}

/// Counts the mappings of this process that `[start, end)` crosses.
pub(crate) fn count_own_mappings(start: u64, end: u64) -> Result<u64> {
    let text = std::fs::read_to_string("/proc/self/maps")
        .map_err(|e| BackendError::os("read /proc/self/maps", e))?;
    mappings_crossed(&parse_maps(&text), start, end)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_crossed_mappings_and_finds_holes() {
        let text = "1000-3000 rw-p 00000000 00:00 0\n3000-4000 r--p 0 00:00 0 [heap]\n6000-8000 rw-p 0 0:0 0\n";
        let maps = parse_maps(text);
        assert_eq!(
            maps,
            vec![(0x1000, 0x3000), (0x3000, 0x4000), (0x6000, 0x8000)]
        );
        assert_eq!(mappings_crossed(&maps, 0x1000, 0x2000).unwrap(), 1);
        assert_eq!(mappings_crossed(&maps, 0x2000, 0x4000).unwrap(), 2);
        assert!(mappings_crossed(&maps, 0x3000, 0x7000).is_err());
        assert!(mappings_crossed(&maps, 0x9000, 0xa000).is_err());
        assert_eq!(mappings_crossed(&maps, 0x6000, 0x8000).unwrap(), 1);
    }
}
