//! The cache-hit path (malloc + free of a cached size) makes no heap allocation in steady
//! state. Counted with a global allocator wrapper, on the test's own thread only: the test
//! harness's other threads allocate when they like (in about half the runs of this binary,
//! 4 allocations landed in the window while the hits ran).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use gpualloc_accounting::AccountingBackend;
use gpualloc_devices::{AllocatorConfig, DeviceCore};
use gpualloc_runtime::{Backend, DeviceId};

struct Counting;
static ALLOCS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// Set on the test's thread while it counts (a const `Cell`: reading it never allocates).
    static COUNTING: Cell<bool> = const { Cell::new(false) };
}

// SAFETY: forwards every call unchanged to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.with(Cell::get) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn cache_hits_do_not_allocate() {
    let backend: Arc<dyn Backend> = Arc::new(AccountingBackend::new(1, 64 << 30));
    let s = backend.stream_create(DeviceId(0)).unwrap();
    let mut core = DeviceCore::new(backend, DeviceId(0), AllocatorConfig::default()).unwrap();
    let warm: Vec<_> = (1..64u64)
        .map(|i| core.malloc(i * 8192, s).unwrap())
        .collect();
    for a in &warm {
        core.free(a.ptr).unwrap();
    }
    for size in [4096u64, 100_000, 5 << 20, 64 << 20] {
        let a = core.malloc(size, s).unwrap();
        core.free(a.ptr).unwrap();
    }
    let before = ALLOCS.load(Ordering::Relaxed);
    COUNTING.with(|c| c.set(true));
    for _ in 0..1000 {
        for size in [4096u64, 100_000, 5 << 20, 64 << 20] {
            let a = core.malloc(size, s).unwrap();
            core.free(a.ptr).unwrap();
        }
    }
    COUNTING.with(|c| c.set(false));
    let after = ALLOCS.load(Ordering::Relaxed);
    assert_eq!(after - before, 0, "heap allocations on 4000 cache hits");
}
