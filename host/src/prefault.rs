//! [`prefault`]: fault the pages of a buffer in, in parallel, before it is page-locked.
//!
//! `cudaHostRegister` on memory whose pages are not yet backed makes the driver fault them in
//! one by one under its global lock; PyTorch's register path therefore touches one byte per page
//! first, on `pinned_num_register_threads` threads. This is the same work, on scoped threads,
//! and it is real on any machine (every touched page is a kernel page fault), so it is
//! benchmarked in `benches/host_core.rs`. Safe code: it works on a `&mut [u8]`.

/// [`prefault_with_page`] with the system page size.
pub fn prefault(region: &mut [u8], threads: usize) -> usize {
    prefault_with_page(region, threads, crate::mapping::page_size())
}

/// Writes 0 to the first byte of every page of `region` (every byte whose address is a multiple
/// of `page`, plus the first byte), splitting the pages evenly over `threads` threads
/// (`threads` ≤ 1, or fewer pages than threads: on the calling thread). Meant for fresh,
/// zero-filled memory, where the writes change nothing but back every page. Returns the number
/// of bytes written (pages touched).
pub fn prefault_with_page(region: &mut [u8], threads: usize, page: usize) -> usize {
    let page = page.max(1);
    if region.is_empty() {
        return 0;
    }
    // Offset of the first page boundary inside the region.
    let head = (page - (region.as_ptr() as usize % page)) % page;
    let mut touched = 0;
    if head != 0 {
        region[0] = 0;
        touched += 1;
    }
    let start = head.min(region.len());
    let body = &mut region[start..];
    let pages = body.len().div_ceil(page);
    let threads = threads.max(1);
    if threads == 1 || pages < threads {
        return touched + touch_pages(body, page);
    }
    let per_thread = pages.div_ceil(threads) * page;
    let counts: Vec<usize> = std::thread::scope(|s| {
        let mut chunks = body.chunks_mut(per_thread);
        let first = chunks.next();
        let handles: Vec<_> = chunks
            .map(|c| s.spawn(move || touch_pages(c, page)))
            .collect();
        let mine = first.map_or(0, |c| touch_pages(c, page));
        // A worker can only panic on an out-of-bounds index, which `touch_pages` never makes;
        // count such a chunk as untouched rather than propagate a panic.
        std::iter::once(mine)
            .chain(handles.into_iter().map(|h| h.join().unwrap_or(0)))
            .collect()
    });
    touched + counts.iter().sum::<usize>()
}

/// Touches byte 0 of every `page`-sized piece of `chunk` (which starts on a page boundary).
fn touch_pages(chunk: &mut [u8], page: usize) -> usize {
    let mut n = 0;
    for p in chunk.chunks_mut(page) {
        p[0] = 0;
        n += 1;
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mapping::{page_size, PageMapping};

    #[test]
    fn touches_every_page_once_with_any_thread_count() {
        let page = page_size();
        for threads in [1, 2, 3, 8, 64] {
            let mut m = PageMapping::new(37 * page).unwrap();
            m.as_mut_slice()
                .iter_mut()
                .step_by(page)
                .for_each(|b| *b = 9);
            assert_eq!(prefault(m.as_mut_slice(), threads), 37, "{threads} threads");
            assert!(m.as_slice().iter().step_by(page).all(|b| *b == 0));
            assert_eq!(m.as_slice()[1], 0, "untouched bytes stay as they were");
        }
    }

    #[test]
    fn unaligned_and_tiny_regions() {
        let page = page_size();
        let mut m = PageMapping::new(4 * page).unwrap();
        let s = m.as_mut_slice();
        s.fill(5);
        // Starts 10 bytes into page 0 and ends 10 bytes into page 3: touches the first byte,
        // then the boundaries of pages 1, 2 and 3.
        let n = prefault_with_page(&mut s[10..3 * page + 10], 2, page);
        assert_eq!(n, 4);
        assert_eq!(
            (s[10], s[11], s[page], s[2 * page], s[3 * page]),
            (0, 5, 0, 0, 0)
        );
        assert_eq!(prefault(&mut [], 4), 0);
        assert_eq!(prefault_with_page(&mut [1u8; 3], 4, page), 1);
    }
}
