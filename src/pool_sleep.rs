//! [`Pool::sleep`] and [`Pool::wake`]: a pool's physical memory released and mapped back at
//! the same addresses (vLLM's sleep mode; the core's rules are in `gpualloc_devices`'
//! `sleep.rs`).
//!
//! - Needs expandable segments (the default where the backend has virtual memory;
//!   `expandable_segments:False` refuses it with `AllocError::NotSupported`).
//! - Refused with `AllocError::PoolExported` while a buffer of the pool is exported to
//!   another process ([`Allocator::export_region`](crate::Allocator::export_region) marks it
//!   until it is freed): the importer maps the pool's physical pages, and after a sleep and a
//!   wake the two processes would see different memory at that buffer.
//! - [`SleepMode::Offload`] copies every live block (the bytes its user asked for, no
//!   rounding) into pinned host memory from the allocator's pinned pool, packed into
//!   power-of-two chunks that the pool serves at their exact size: the host memory held is
//!   the data rounded up to 4 KiB, whatever the block sizes. [`SleepMode::Discard`] copies
//!   nothing.
//! - The sleep waits for the work queued on every stream that used the pool (an event on
//!   each, not a device-wide synchronize), copies, then releases the physical memory; the
//!   wake maps new memory at the same addresses and resolves once the data is back.
//! - Neither holds the device's gate while it waits, copies or makes driver calls: other
//!   pools (and the default pools) keep serving meanwhile.
//! - While a pool is not awake its mallocs fail with `AllocError::PoolAsleep`, or with
//!   [`MallocOptions::wait_for`](crate::MallocOptions::wait_for) wait for the wake. A request
//!   of the pool already past the cache when the sleep begins (a miss, its driver calls off
//!   the device's gate) either gets its memory first (the sleep waits while the pool's pages
//!   are being mapped, and the buffer sleeps with the rest) or ends as one made after the
//!   sleep: it maps nothing into the sleeping pool. Its live
//!   buffers stay valid handles (and can be dropped), but device work on their memory is the
//!   caller's error from the sleep's call until the wake has resolved: work that runs while
//!   the pages are unmapped fails (a sticky stream error on a GPU), and work queued then that
//!   runs during the wake reads memory not yet restored (zeros on the sim). Work queued
//!   before the `sleep` call is waited for; queue none after it until `wake` returns.
//! - A wake without enough device memory (or room under `per_process_memory_fraction`) first
//!   gives the allocator's cache back to the device, as a malloc's out-of-memory path does:
//!   the events pending frees wait on are synchronized, every pool's unused segments and
//!   free pages are released; then it tries once more. Still short, it leaves the pool
//!   asleep, with its host copy, and fails with `AllocError::WakeOutOfMemory` (what it
//!   needed, what was free): free memory and wake again.
//! - Dropping a `sleep()` or `wake()` future does not stop it: once begun it runs to its end
//!   on the allocator's runtime (asleep, awake, or rolled back), so the pool is never left
//!   half asleep. One dropped before it began (its first step under the device's gate) never
//!   begins: the pool stays as the caller last saw it. Calls on the same pool and device run
//!   one at a time.
//! - A backend that panics during a sleep's or a wake's copies (a custom backend's bug) rolls
//!   it back as a failed copy does, with a `BackendError::Unavailable` error (`crate::guarded`).
//! - A pool dropped while asleep drops its host copy; its address ranges stay reserved until
//!   the allocator shuts down.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use gpualloc_devices::{
    map_wake, release_slept_pages, wait_for_pool_streams, AllocError, DeviceCore, Leftovers,
    MemPoolId, PoolState, SleepMode, SleepPlan,
};
use gpualloc_runtime::{Backend, DeviceId, DevicePtr};
use tokio::sync::Mutex;

use crate::actor::DeviceActor;
use crate::guarded::{guarded, guarded_step};
use crate::pinned::PinnedBuffer;
use crate::pool::Pool;
use crate::{Error, HostAllocator};

/// How long a sleep waits before asking again when pages of the pool are being mapped or
/// unmapped by a request in flight (`AllocError::PoolBusy`).
const BUSY_RETRY: Duration = Duration::from_micros(200);

/// Host memory is packed in chunks of whole multiples of this.
const HOST_GRANULE: u64 = 4096;

/// A pool's data on one device while it sleeps.
#[derive(Debug, Default)]
pub(crate) struct HostCopy {
    chunks: Vec<PinnedBuffer>,
    copies: Vec<(DevicePtr, u64)>,
}

/// A device's [`HostCopy`] behind a lock that serializes the pool's sleeps and wakes there.
pub(crate) type HostSlot = Arc<Mutex<HostCopy>>;

/// One [`HostSlot`] per device.
pub(crate) type HostCopies = Vec<HostSlot>;

impl Pool {
    /// Puts the pool to sleep on every device (see the module docs).
    pub async fn sleep(&self, mode: SleepMode) -> Result<(), Error> {
        for device in 0..self.devices() {
            self.sleep_on(DeviceId(device), mode).await?;
        }
        Ok(())
    }

    /// Wakes the pool on every device (see the module docs); nothing to do where it is awake.
    pub async fn wake(&self) -> Result<(), Error> {
        for device in 0..self.devices() {
            self.wake_on(DeviceId(device)).await?;
        }
        Ok(())
    }

    /// Where the pool is in its sleep cycle on `device`.
    pub async fn state(&self, device: DeviceId) -> Result<PoolState, Error> {
        Ok(self.usage(device).await?.state)
    }

    /// Puts the pool to sleep on `device`.
    pub async fn sleep_on(&self, device: DeviceId, mode: SleepMode) -> Result<(), Error> {
        let (actor, id, slot) = self.sleep_parts(device)?;
        let host = self.allocator().host();
        let runtime = actor.runtime.clone();
        let dropped = Dropped::default();
        runtime
            .spawn(sleep_task(actor, id, mode, host, slot, dropped.flag()))
            .await
            .map_err(|e| Error::Internal(format!("sleep task failed: {e}")))?
    }

    /// Wakes the pool on `device`.
    pub async fn wake_on(&self, device: DeviceId) -> Result<(), Error> {
        let (actor, id, slot) = self.sleep_parts(device)?;
        let runtime = actor.runtime.clone();
        let dropped = Dropped::default();
        runtime
            .spawn(wake_task(actor, id, slot, dropped.flag()))
            .await
            .map_err(|e| Error::Internal(format!("wake task failed: {e}")))?
    }

    fn sleep_parts(
        &self,
        device: DeviceId,
    ) -> Result<(Arc<DeviceActor>, MemPoolId, HostSlot), Error> {
        self.allocator().check()?;
        let id = self.id(device)?;
        let actor = self.allocator().device_actor(device)?.clone();
        Ok((actor, id, self.host_copy(device)))
    }
}

/// Set when the future that spawned a sleep's or a wake's task is dropped (or done): a task
/// that has not begun by then does nothing. The task looks under the device's gate, in the
/// step that begins it, so a caller that dropped the future and then asked the pool's state
/// (through the gate too) never sees it begin afterwards.
#[derive(Debug, Default)]
struct Dropped(Arc<AtomicBool>);

impl Dropped {
    fn flag(&self) -> Arc<AtomicBool> {
        self.0.clone()
    }
}

impl Drop for Dropped {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

async fn sleep_task(
    actor: Arc<DeviceActor>,
    id: MemPoolId,
    mode: SleepMode,
    host: HostAllocator,
    slot: HostSlot,
    dropped: Arc<AtomicBool>,
) -> Result<(), Error> {
    let mut held = slot.lock_owned().await;
    let plan = loop {
        let dropped = dropped.clone();
        let begun = actor
            .call(move |st| {
                (!dropped.load(Ordering::Acquire)).then(|| st.core.begin_sleep(id, mode))
            })
            .await?;
        match begun {
            None => return Ok(()),
            Some(Ok(plan)) => break plan,
            Some(Err(AllocError::PoolBusy { .. })) => tokio::time::sleep(BUSY_RETRY).await,
            Some(Err(e)) => return Err(e.into()),
        }
    };
    let total: u64 = plan.copies().iter().map(|c| c.1).sum();
    let mut chunks = Vec::new();
    for size in chunk_sizes(total) {
        match host.malloc(size).await {
            Ok(c) => chunks.push(c),
            Err(e) => {
                let left = actor.call(move |st| st.core.abort_sleep(plan)).await?;
                release_leftovers(&actor, left).await;
                return Err(e);
            }
        }
    }
    let backend = actor.backend.clone();
    let device = actor.device;
    let (plan, chunks, copied) = actor
        .runtime
        .spawn_blocking(move || {
            let copied = guarded("a sleep's copies", || {
                wait_for_pool_streams(backend.as_ref(), &plan)?;
                copy(
                    backend.as_ref(),
                    device,
                    plan.copies(),
                    &chunks,
                    Direction::Out,
                )
            });
            if copied.is_ok() {
                // The bytes are safe on the host: the sleep finishes even if releasing
                // panics (the pages it did not release stay mapped, unaccounted).
                guarded_step("a sleep's page release", || {
                    release_slept_pages(backend.as_ref(), &plan)
                });
            }
            (plan, chunks, copied)
        })
        .await
        .map_err(|e| Error::Internal(format!("sleep copy failed: {e}")))?;
    let copies = plan.copies().to_vec();
    let ok = copied.is_ok();
    let left = actor
        .call(move |st| finish_or_abort(&mut st.core, plan, ok))
        .await?;
    release_leftovers(&actor, left).await;
    copied.map_err(|e| Error::Alloc(AllocError::Backend(e)))?;
    *held = HostCopy { chunks, copies };
    Ok(())
}

async fn wake_task(
    actor: Arc<DeviceActor>,
    id: MemPoolId,
    slot: HostSlot,
    dropped: Arc<AtomicBool>,
) -> Result<(), Error> {
    let mut held = slot.lock_owned().await;
    let first = wake_once(&actor, id, &mut held, Some(dropped)).await;
    if !matches!(first, Err(Error::Alloc(AllocError::WakeOutOfMemory { .. }))) {
        return first;
    }
    // Short of memory: the allocator's own cache goes back to the device first (every pool's
    // unused segments and free pages, after the events their frees wait on), as a malloc's
    // out-of-memory path does; then the wake tries once more. It had begun: a dropped
    // future does not stop the second try.
    let releasing = actor.clone();
    let released = actor
        .runtime
        .spawn_blocking(move || releasing.release_cache_blocking())
        .await
        .map_err(|e| Error::Internal(format!("releasing the cache failed: {e}")))?;
    if released == 0 {
        return first;
    }
    wake_once(&actor, id, &mut held, None).await
}

/// One try of a wake: begins it (unless `dropped` says its future went before it began),
/// maps the pool's pages and copies its data back, or rolls back and leaves it asleep.
async fn wake_once(
    actor: &Arc<DeviceActor>,
    id: MemPoolId,
    held: &mut HostCopy,
    dropped: Option<Arc<AtomicBool>>,
) -> Result<(), Error> {
    let begun = actor
        .call(move |st| {
            let gone = dropped.is_some_and(|d| d.load(Ordering::Acquire));
            (!gone).then(|| st.core.begin_wake(id))
        })
        .await?;
    let Some(Some(plan)) = begun.transpose()? else {
        return Ok(());
    };
    let backend = actor.backend.clone();
    let device = actor.device;
    let copy = std::mem::take(&mut *held);
    let (plan, copy, woken) = actor
        .runtime
        .spawn_blocking(move || {
            let woken = guarded("a wake's mapping", || map_wake(backend.as_ref(), &plan));
            let woken = woken.and_then(|woken| {
                let (copies, chunks) = (&copy.copies, &copy.chunks);
                let copied = guarded("a wake's copies", || {
                    self::copy(backend.as_ref(), device, copies, chunks, Direction::In)
                });
                match copied {
                    Ok(()) => Ok(woken),
                    Err(e) => {
                        woken.release(backend.as_ref());
                        Err(e)
                    }
                }
            });
            (plan, copy, woken)
        })
        .await
        .map_err(|e| Error::Internal(format!("wake failed: {e}")))?;
    match woken {
        Ok(woken) => {
            let left = actor
                .call(move |st| st.core.finish_wake(plan, woken))
                .await?;
            release_leftovers(actor, left).await;
            // Requests waiting for the pool may go now; the host copy goes back to the
            // pinned pool.
            actor.signals.waiters.wake_head();
            drop(copy);
            Ok(())
        }
        Err(e) => {
            *held = copy;
            let needed = plan.bytes();
            let name = actor
                .call(move |st| {
                    let name = st.core.pool_usage(id).map(|u| u.name).unwrap_or_default();
                    (name, st.core.abort_wake(plan))
                })
                .await?;
            release_leftovers(actor, name.1).await;
            if !e.is_oom() {
                return Err(Error::Alloc(AllocError::Backend(e)));
            }
            let free = actor.backend.mem_info(device).map(|m| m.free).unwrap_or(0);
            Err(Error::Alloc(AllocError::WakeOutOfMemory {
                pool: name.0,
                needed,
                free,
            }))
        }
    }
}

fn finish_or_abort(core: &mut DeviceCore, plan: SleepPlan, ok: bool) -> Leftovers {
    if ok {
        core.finish_sleep(plan)
    } else {
        core.abort_sleep(plan)
    }
}

/// Releases what a finish or abort left (a shutdown meanwhile), off the async runtime.
async fn release_leftovers(actor: &Arc<DeviceActor>, left: Leftovers) {
    if left.is_empty() {
        return;
    }
    let backend = actor.backend.clone();
    let _ = actor
        .runtime
        .spawn_blocking(move || left.release(backend.as_ref()))
        .await;
}

/// Chunk sizes holding `total` bytes: `total` rounded up to [`HOST_GRANULE`], split into its
/// powers of two, largest first, so each chunk is one size class of the pinned pool.
pub(crate) fn chunk_sizes(total: u64) -> Vec<u64> {
    let rounded = total.div_ceil(HOST_GRANULE) * HOST_GRANULE;
    (0..64)
        .rev()
        .map(|bit| 1u64 << bit)
        .filter(|b| rounded & b != 0)
        .collect()
}

/// The copies of `copies` packed one after another into `chunks`: (device address, chunk,
/// offset in the chunk, bytes), a copy crossing a chunk's end split in two.
pub(crate) fn pieces(copies: &[(DevicePtr, u64)], chunks: &[u64]) -> Vec<(u64, usize, u64, u64)> {
    let mut out = Vec::new();
    let (mut chunk, mut offset) = (0usize, 0u64);
    for &(ptr, len) in copies {
        let mut done = 0;
        while done < len {
            let Some(&cap) = chunks.get(chunk) else {
                return out; // the chunks were sized for the copies: never reached
            };
            if offset == cap {
                chunk += 1;
                offset = 0;
                continue;
            }
            let n = (len - done).min(cap - offset);
            out.push((ptr.0 + done, chunk, offset, n));
            done += n;
            offset += n;
        }
    }
    out
}

/// Which way [`copy`] copies.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    /// The live blocks into the chunks (a sleep).
    Out,
    /// The chunks back into the blocks (a wake).
    In,
}

/// Copies between the blocks of `copies` and the chunks they are packed into, on a stream of
/// the allocator's own, and waits.
fn copy(
    backend: &dyn Backend,
    device: DeviceId,
    copies: &[(DevicePtr, u64)],
    chunks: &[PinnedBuffer],
    direction: Direction,
) -> Result<(), gpualloc_runtime::BackendError> {
    if copies.is_empty() {
        return Ok(());
    }
    let sizes: Vec<u64> = chunks.iter().map(PinnedBuffer::len).collect();
    let stream = backend.stream_create(device)?;
    let mut result = Ok(());
    for (dev, chunk, offset, len) in pieces(copies, &sizes) {
        let host = chunks[chunk].ptr().0 + offset;
        let (dst, src) = match direction {
            Direction::Out => (host, dev),
            Direction::In => (dev, host),
        };
        // SAFETY: the host side lies in `chunks[chunk]` (`pieces` keeps `offset + len` within
        // it), pinned memory of the host pool that only this sleep or wake uses, borrowed until
        // this function returns: after the stream is synchronized below (or the device was
        // lost, and runs no more work). The device side is the pool's block (checked by the
        // backend).
        result = unsafe { backend.memcpy_async(stream, dst, src, len) };
        if result.is_err() {
            break;
        }
    }
    let synced = backend.stream_synchronize(stream);
    let _ = backend.stream_destroy(stream);
    result.and(synced)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_powers_of_two_summing_to_the_data_in_pages() {
        assert_eq!(chunk_sizes(0), Vec::<u64>::new());
        assert_eq!(chunk_sizes(1), vec![4096]);
        assert_eq!(chunk_sizes(4096 * 3 + 1), vec![16384]);
        assert_eq!(chunk_sizes(4096 * 3), vec![8192, 4096]);
        let total = (1u64 << 30) + 5 * (1 << 20) + 17;
        let c = chunk_sizes(total);
        assert!(c.iter().all(|s| s.is_power_of_two()));
        assert_eq!(c.iter().sum::<u64>(), total.div_ceil(4096) * 4096);
        assert_eq!(c[0], 1 << 30);
    }

    #[test]
    fn pieces_pack_copies_in_order_and_split_at_chunk_ends() {
        let copies = [
            (DevicePtr(1000), 5000),
            (DevicePtr(90_000), 100),
            (DevicePtr(50), 3100),
        ];
        let chunks = chunk_sizes(8200); // 8192 + 4096
        assert_eq!(
            pieces(&copies, &chunks),
            vec![
                (1000, 0, 0, 5000),
                (90_000, 0, 5000, 100),
                (50, 0, 5100, 3092),
                (50 + 3092, 1, 0, 8),
            ]
        );
    }
}
