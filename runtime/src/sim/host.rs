//! Host-side helpers of the sim: reading this process's memory map for `host_register`.

use crate::error::{BackendError, Result};

/// One line of `/proc/self/maps`: a range and its access.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MapEntry {
    pub(crate) start: u64,
    pub(crate) end: u64,
    pub(crate) readable: bool,
    pub(crate) writable: bool,
}

/// Parses `/proc/self/maps` text.
pub(crate) fn parse_maps(text: &str) -> Vec<MapEntry> {
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

/// Counts the mappings `[start, end)` crosses in `maps` (sorted), or errors when part of the
/// range is not mapped, or not readable (and writable, when `need_write`): the device must
/// be able to access all of it, or a copy would fault.
pub(crate) fn mappings_crossed(
    maps: &[MapEntry],
    start: u64,
    end: u64,
    need_write: bool,
) -> Result<u64> {
    let mut cur = start;
    let mut count = 0u64;
    for m in maps {
        if m.end <= cur {
            continue;
        }
        if m.start > cur {
            break;
        }
        if !m.readable || (need_write && !m.writable) {
            return Err(BackendError::invalid(format!(
                "host range {start:#x}..{end:#x}: {cur:#x} is not accessible memory"
            )));
        }
        count += 1;
        cur = m.end;
        if cur >= end {
            return Ok(count);
        }
    }
    Err(BackendError::invalid(format!(
        "host range {start:#x}..{end:#x} is not mapped at {cur:#x}"
    )))
}

/// Counts the mappings of this process that `[start, end)` crosses (see
/// [`mappings_crossed`]).
pub(crate) fn count_own_mappings(start: u64, end: u64, need_write: bool) -> Result<u64> {
    let text = std::fs::read_to_string("/proc/self/maps")
        .map_err(|e| BackendError::os("read /proc/self/maps", e))?;
    mappings_crossed(&parse_maps(&text), start, end, need_write)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_crossed_mappings_and_finds_holes() {
        let text = "1000-3000 rw-p 00000000 00:00 0\n3000-4000 r--p 0 00:00 0 [heap]\n\
                    6000-8000 rw-p 0 0:0 0\n8000-9000 ---p 0 0:0 0\n";
        let maps = parse_maps(text);
        assert_eq!(maps.len(), 4);
        assert_eq!(
            (
                maps[1].start,
                maps[1].end,
                maps[1].readable,
                maps[1].writable
            ),
            (0x3000, 0x4000, true, false)
        );
        assert_eq!(mappings_crossed(&maps, 0x1000, 0x2000, true).unwrap(), 1);
        assert_eq!(mappings_crossed(&maps, 0x2000, 0x4000, false).unwrap(), 2);
        assert!(
            mappings_crossed(&maps, 0x2000, 0x4000, true).is_err(),
            "read-only part"
        );
        assert!(
            mappings_crossed(&maps, 0x3000, 0x7000, false).is_err(),
            "hole"
        );
        assert!(
            mappings_crossed(&maps, 0x9000, 0xa000, false).is_err(),
            "unmapped"
        );
        assert_eq!(mappings_crossed(&maps, 0x6000, 0x8000, true).unwrap(), 1);
        assert!(
            mappings_crossed(&maps, 0x7000, 0x9000, false).is_err(),
            "PROT_NONE part"
        );
    }
}
