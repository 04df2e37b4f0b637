//! Following a history recorded by an owner that serves misses off the core (the facade's
//! actor does: a device malloc or a page map is slow, so it runs off the gate while other
//! requests go on). Two of its steps happen in an order a sequential `malloc` cannot repeat,
//! and a replay that wants the recorded addresses (`gpualloc replay --warm`) makes them
//! itself:
//!
//! - An ordinary segment allocated off the core is adopted by the request that asked for it,
//!   even when a block freed meanwhile would serve it by now
//!   ([`DeviceCore::malloc_with_segment`]). In the history the `segment_alloc` comes right
//!   before that request's `alloc`, after the frees; a sequential `malloc` would take the freed
//!   block. [`DeviceCore::segment_request`] makes the request without looking in the cache.
//! - Pages of an expandable segment mapped off the core join the cache before the request
//!   that wanted them looks in it again, so it takes the best fit among the new pages and the
//!   blocks freed meanwhile. In the history the `segment_map` comes before that `alloc`, after
//!   the frees. [`DeviceCore::map_recorded_pages`] maps the recorded range at its
//!   `segment_map`; the `malloc` that follows then finds what the live request found.

use gpualloc_runtime::StreamHandle;

use crate::block::BlockState;
use crate::core::{DeviceCore, SegmentRequest};
use crate::error::AllocError;
use crate::pool::unmapped_key;

impl DeviceCore {
    /// The request a miss of `size` bytes on `stream` makes (its rounded size, segment size
    /// and pool), made without looking in the cache or processing events. Finish it like a
    /// miss from [`DeviceCore::try_cached`]: [`SegmentRequest::claim_fraction`], a device
    /// malloc of [`SegmentRequest::alloc_size`] bytes and
    /// [`DeviceCore::malloc_with_segment`], or [`DeviceCore::malloc_after_miss`].
    pub fn segment_request(
        &mut self,
        size: u64,
        stream: StreamHandle,
    ) -> Result<SegmentRequest, AllocError> {
        if self.shut_down {
            return Err(AllocError::Shutdown);
        }
        self.check_stream(stream)?;
        if size == 0 {
            return Err(AllocError::InvalidSize {
                size,
                reason: "a request of 0 bytes takes no segment",
            });
        }
        let params = self.params_for(size, stream, None)?;
        Ok(SegmentRequest { params, size })
    }

    /// Maps the pages `[addr, addr + len)` of an expandable segment as one free block, merged
    /// with its free neighbours, as a growth made off the core for another request does
    /// (one `segment_map` in the history). `Ok(false)`, changing nothing, when the range is
    /// not whole pages inside one free unmapped block (of a pool that is awake), when mapping it would pass
    /// `per_process_memory_fraction` or a pool's quota, or when the device has no memory for
    /// it.
    pub fn map_recorded_pages(&mut self, addr: u64, len: u64) -> Result<bool, AllocError> {
        if self.shut_down {
            return Err(AllocError::Shutdown);
        }
        let Some(end) = addr.checked_add(len).filter(|_| len > 0) else {
            return Ok(false);
        };
        let Some((seg, page)) = self
            .expandable
            .range(..=addr)
            .next_back()
            .filter(|(&base, es)| end <= base + es.size() && es.slept.is_none())
            .map(|(&base, es)| (base, es.page))
        else {
            return Ok(false);
        };
        if (addr - seg) % page != 0 || len % page != 0 {
            return Ok(false);
        }
        let Some(pool) = self.segments.get(&seg).map(|m| m.pool) else {
            return Ok(false);
        };
        let found = self.pools[pool].unmapped.values().copied().find(|&id| {
            let b = self.blocks.get(id);
            b.segment == seg
                && b.state == BlockState::Free
                && b.addr <= addr
                && end <= b.addr + b.size
        });
        let Some(id) = found else {
            return Ok(false);
        };
        let over_fraction = self
            .allowed_max
            .is_some_and(|max| self.total_reserved + self.growing_bytes + len > max);
        if over_fraction || self.pool_room(pool).is_some_and(|room| len > room) {
            return Ok(false);
        }
        // Cut the block to the range: the parts before and after stay unmapped blocks.
        let b = self.blocks.get(id).clone();
        let stream = b.stream.raw;
        self.pools[pool]
            .unmapped
            .remove(&unmapped_key(stream, b.addr, b.size));
        let mut range = id;
        if b.addr < addr {
            range = self.split_unmapped_back(id, addr - b.addr);
            self.pools[pool]
                .unmapped
                .insert(unmapped_key(stream, b.addr, addr - b.addr), id);
        }
        if end < b.addr + b.size {
            let rest = self.split_unmapped_back(range, len);
            self.pools[pool]
                .unmapped
                .insert(unmapped_key(stream, end, b.addr + b.size - end), rest);
        }
        match self.es_map((seg, pool, addr), len, len) {
            Ok(_) => {
                self.book_mapped(range);
                Ok(true)
            }
            Err(e) => {
                // `es_map` released what it created: the range is unmapped again, as before.
                self.file_unmapped(range);
                if e.is_oom() {
                    Ok(false)
                } else {
                    Err(e.into())
                }
            }
        }
    }
}
