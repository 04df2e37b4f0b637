//! Nothing leaks: dropping the sim with work in flight (or a stream, which returns at once)
//! drains and joins the worker threads, unmaps all memory and closes every fd. One test per
//! binary, so no other test's threads or fds disturb the counts.
#![cfg(not(loom))] // the sim runs real threads; loom builds run only the loom models

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use gpualloc_runtime::{Backend, DeviceId, DevicePtr, Stream};
use gpualloc_sim::{SimBackend, SimConfig};

const D0: DeviceId = DeviceId(0);

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

/// Waits up to a second for the process to have `want` threads (a destroyed stream's worker
/// ends once its queued work has run), then checks it has.
fn wait_for_threads(want: usize) {
    for _ in 0..1000 {
        if threads() == want {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(threads(), want, "a destroyed stream's worker did not end");
}

/// Mappings of sim memfds (device memory, physical handles, opened IPC handles).
fn memfd_mappings() -> usize {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .filter(|l| l.contains("memfd:gpualloc-sim"))
        .count()
}

/// True when any byte of `[start, start + len)` is mapped.
fn is_mapped(start: u64, len: u64) -> bool {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines().any(|l| {
        let range = l.split_whitespace().next().unwrap();
        let (a, b) = range.split_once('-').unwrap();
        let (a, b) = (
            u64::from_str_radix(a, 16).unwrap(),
            u64::from_str_radix(b, 16).unwrap(),
        );
        a < start + len && start < b
    })
}

#[test]
fn dropping_streams_and_the_sim_with_work_in_flight_leaks_nothing() {
    // Warm up lazily-initialized process state (thread-locals, the allocator) first.
    drop(SimBackend::new(SimConfig::fast(1)).unwrap());
    let (fds0, threads0) = (open_fds(), threads());
    assert_eq!(memfd_mappings(), 0);

    let ran = Arc::new(AtomicU32::new(0));
    let (va_range, pinned_range);
    {
        let sim = SimBackend::new(SimConfig::fast(2)).unwrap();
        let backend: Arc<dyn Backend> = sim.clone();
        // Streams with slow work queued.
        let streams: Vec<_> = (0..4)
            .map(|i| sim.stream_create(DeviceId(i % 2)).unwrap())
            .collect();
        assert_eq!(threads(), threads0 + 4);
        // Each stream's kernel adds its own bit.
        for (i, s) in streams.iter().enumerate() {
            let r = ran.clone();
            sim.launch_kernel(*s, Duration::from_millis(40), move |_| {
                r.fetch_or(1 << i, Ordering::SeqCst);
                Ok(())
            })
            .unwrap();
        }
        // Destroying a stream returns at once (`cuStreamDestroy`): its work still runs, the
        // device's synchronize waits for it, and its thread ends after it.
        sim.stream_destroy(streams[0]).unwrap();
        sim.device_synchronize(D0).unwrap();
        assert_eq!(ran.load(Ordering::SeqCst) & 1, 1);
        wait_for_threads(threads0 + 3);
        // An RAII stream dropped with work in flight.
        let s = Stream::new(&backend, D0).unwrap();
        let r = ran.clone();
        backend
            .launch_host_func(
                s.handle(),
                Box::new(move |_| {
                    std::thread::sleep(Duration::from_millis(30));
                    r.fetch_or(1 << 4, Ordering::SeqCst);
                }),
            )
            .unwrap();
        drop(s);
        sim.device_synchronize(D0).unwrap();
        assert_eq!(ran.load(Ordering::SeqCst) & (1 << 4), 1 << 4);
        // Memory of every kind, left allocated.
        let g = sim.vmm_granularity(D0).unwrap();
        let _dev = sim.malloc(D0, 1 << 20).unwrap();
        let dev1 = sim.malloc(DeviceId(1), 1 << 20).unwrap();
        let pinned = sim.host_alloc(1 << 16).unwrap();
        pinned_range = (pinned as u64, 1 << 16);
        let va = sim.va_reserve(D0, 2 * g, 0).unwrap();
        va_range = (va.0, 2 * g);
        let h = sim.phys_create(D0, g).unwrap();
        sim.map(va, g, 0, h).unwrap();
        sim.set_access(D0, va, g).unwrap();
        let exported = sim.phys_export_fd(h).unwrap();
        let imported = sim.phys_import_fd(D0, exported).unwrap();
        sim.map(DevicePtr(va.0 + g), g, 0, imported).unwrap();
        let _unmapped = sim.phys_create(D0, g).unwrap();
        let ipc = sim.ipc_get_mem_handle(dev1).unwrap();
        let _opened = sim.ipc_open_mem_handle(D0, &ipc).unwrap();
        let _event = sim.event_create(D0).unwrap();
        assert!(open_fds() > fds0 + 4);
        assert_eq!(
            memfd_mappings(),
            5,
            "2 allocations, 2 VMM mappings, 1 opened IPC handle"
        );
        assert!(is_mapped(va_range.0, va_range.1) && is_mapped(pinned_range.0, pinned_range.1));
        // Slow work still queued when the last handle goes.
        for (i, s) in streams.iter().enumerate().skip(1) {
            let r = ran.clone();
            sim.launch_kernel(*s, Duration::from_millis(40), move |_| {
                r.fetch_or(1 << (8 + i), Ordering::SeqCst);
                Ok(())
            })
            .unwrap();
        }
        drop(backend);
        drop(sim);
    }
    assert_eq!(
        ran.load(Ordering::SeqCst),
        0b1110_0001_1111,
        "every queued kernel ran before the drop returned"
    );
    assert_eq!(threads(), threads0, "stream threads joined");
    assert_eq!(open_fds(), fds0, "every memfd and dup closed");
    assert_eq!(memfd_mappings(), 0, "every device mapping unmapped");
    assert!(
        !is_mapped(va_range.0, va_range.1),
        "VA reservation unmapped"
    );
    assert!(
        !is_mapped(pinned_range.0, pinned_range.1),
        "pinned memory unmapped"
    );
}
