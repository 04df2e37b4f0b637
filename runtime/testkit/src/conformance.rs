//! The backend conformance suite: checks written once against `Arc<dyn Backend>`, using
//! only trait methods, that every backend must pass. The sim runs them in
//! `runtime/sim/tests/conformance.rs`; the CUDA backend runs the same list in
//! `runtime/cuda/tests/conformance_cuda.rs` (on a GPU, or the emulated driver in CI).
//!
//! Delays are made with host functions that block (on a gate or a short sleep), which is
//! legal on every backend; no check calls the backend from a host function.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpualloc_runtime::types::{DeviceId, DevicePtr, HostRegisterFlags, StreamHandle};
use gpualloc_runtime::Backend;
use gpualloc_runtime::BackendError;

/// One conformance check: a name and a function that returns `Err(reason)` on failure.
pub struct Check {
    /// Short name, e.g. `"memory_read_write"`.
    pub name: &'static str,
    /// Runs the check on `device` of the backend.
    pub run: fn(&Arc<dyn Backend>, DeviceId) -> Result<(), String>,
}

impl std::fmt::Debug for Check {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Check").field("name", &self.name).finish()
    }
}

/// Every check, in a stable order.
pub fn checks() -> &'static [Check] {
    CHECKS
}

/// Runs every check on `device`; returns `(name, result)` for each.
pub fn run_all(
    backend: &Arc<dyn Backend>,
    device: DeviceId,
) -> Vec<(&'static str, Result<(), String>)> {
    checks()
        .iter()
        .map(|c| (c.name, (c.run)(backend, device)))
        .collect()
}

static CHECKS: &[Check] = &[
    Check {
        name: "graph_replays_captured_work",
        run: crate::capture_checks::graph_replays_captured_work,
    },
    Check {
        name: "capture_refuses_conflicting_calls",
        run: crate::capture_checks::capture_refuses_conflicting_calls,
    },
    Check {
        name: "capture_modes_across_threads",
        run: crate::capture_checks::capture_modes_across_threads,
    },
    Check {
        name: "capture_keeps_its_boundaries",
        run: crate::capture_checks::capture_keeps_its_boundaries,
    },
    Check {
        name: "memory_read_write",
        run: memory_read_write,
    },
    Check {
        name: "memset_and_memcpy_async",
        run: memset_and_memcpy_async,
    },
    Check {
        name: "events_order_across_streams",
        run: events_order_across_streams,
    },
    Check {
        name: "host_callback_runs_after_preceding_work",
        run: host_callback_after_work,
    },
    Check {
        name: "event_query_tracks_progress",
        run: event_query_tracks_progress,
    },
    Check {
        name: "stream_wait_event_uses_record_at_call_time",
        run: wait_uses_current_record,
    },
    Check {
        name: "free_synchronizes_the_device",
        run: free_synchronizes,
    },
    Check {
        name: "vmm_map_export_import_roundtrip",
        run: vmm_roundtrip,
    },
    Check {
        name: "vmm_bad_mappings_are_rejected",
        run: vmm_bad_mappings,
    },
    Check {
        name: "oom_at_capacity",
        run: oom_at_capacity,
    },
    Check {
        name: "zero_sizes_are_invalid",
        run: zero_sizes,
    },
    Check {
        name: "overflowing_sizes_are_rejected",
        run: overflowing_sizes,
    },
    Check {
        name: "unmapping_what_is_not_mapped",
        run: unmap_not_mapped,
    },
    Check {
        name: "event_of_another_device",
        run: event_other_device,
    },
    Check {
        name: "importing_a_non_memory_fd",
        run: import_non_memory_fd,
    },
    Check {
        name: "host_register_takes_any_byte_range",
        run: host_register_byte_ranges,
    },
    Check {
        name: "free_runs_release_hooks_after_queued_work",
        run: free_runs_release_hooks_after_queued_work,
    },
];

/// How long a gate waits before a check gives up (a hung backend fails, never hangs).
const GATE_TIMEOUT: Duration = Duration::from_secs(10);

pub(crate) fn ok<T>(r: Result<T, BackendError>, what: &str) -> Result<T, String> {
    r.map_err(|e| format!("{what}: {e}"))
}

pub(crate) fn ensure(cond: bool, msg: impl FnOnce() -> String) -> Result<(), String> {
    if cond {
        Ok(())
    } else {
        Err(msg())
    }
}

pub(crate) fn expect_err<T: std::fmt::Debug>(
    r: Result<T, BackendError>,
    what: &str,
    accept: impl Fn(&BackendError) -> bool,
) -> Result<(), String> {
    match r {
        Ok(v) => Err(format!("{what}: expected an error, got Ok({v:?})")),
        Err(e) if accept(&e) => Ok(()),
        Err(e) => Err(format!("{what}: wrong error {e:?}")),
    }
}

pub(crate) fn is_invalid(e: &BackendError) -> bool {
    matches!(
        e,
        BackendError::InvalidValue(_) | BackendError::InvalidHandle(_)
    )
}

/// What a rejected import may fail with: the driver's code for "not exported memory" varies
/// (the sim says `InvalidValue`, which its own tests assert).
fn is_rejected_import(e: &BackendError) -> bool {
    is_invalid(e)
        || matches!(
            e,
            BackendError::NotSupported(_) | BackendError::Driver { .. }
        )
}

fn is_oom_or_invalid(e: &BackendError) -> bool {
    e.is_oom() || matches!(e, BackendError::InvalidValue(_))
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// A stream destroyed on drop (errors ignored: checks report their own).
pub(crate) struct TestStream<'a> {
    b: &'a Arc<dyn Backend>,
    pub(crate) h: StreamHandle,
}

impl<'a> TestStream<'a> {
    pub(crate) fn new(b: &'a Arc<dyn Backend>, d: DeviceId) -> Result<Self, String> {
        Ok(TestStream {
            b,
            h: ok(b.stream_create(d), "stream_create")?,
        })
    }
}

impl Drop for TestStream<'_> {
    fn drop(&mut self) {
        let _ = self.b.stream_destroy(self.h);
    }
}

/// A device allocation freed on drop.
pub(crate) struct TestAlloc<'a> {
    b: &'a Arc<dyn Backend>,
    d: DeviceId,
    pub(crate) p: DevicePtr,
}

impl<'a> TestAlloc<'a> {
    pub(crate) fn new(b: &'a Arc<dyn Backend>, d: DeviceId, size: u64) -> Result<Self, String> {
        Ok(TestAlloc {
            b,
            d,
            p: ok(b.malloc(d, size), "malloc")?,
        })
    }
}

impl Drop for TestAlloc<'_> {
    fn drop(&mut self) {
        let _ = self.b.free(self.d, self.p);
    }
}

/// A host function that blocks its stream until the returned sender is used (or dropped).
fn gate(b: &Arc<dyn Backend>, s: StreamHandle) -> Result<mpsc::Sender<()>, String> {
    let (tx, rx) = mpsc::channel::<()>();
    ok(
        b.launch_host_func(
            s,
            Box::new(move |_| {
                let _ = rx.recv_timeout(GATE_TIMEOUT);
            }),
        ),
        "launch_host_func (gate)",
    )?;
    Ok(tx)
}

fn memory_read_write(b: &Arc<dyn Backend>, d: DeviceId) -> Result<(), String> {
    let s = TestStream::new(b, d)?;
    let len = (1 << 20) + 123;
    let a = TestAlloc::new(b, d, len as u64)?;
    let data = pattern(len, 7);
    ok(b.copy_to_device(s.h, a.p, &data), "copy_to_device")?;
    let mut back = vec![0u8; len];
    ok(b.copy_from_device(s.h, &mut back, a.p), "copy_from_device")?;
    ensure(back == data, || {
        "bytes read back differ from bytes written".into()
    })?;
    // An interior offset.
    let off = 4096 + 5;
    let mut part = vec![0u8; 1000];
    ok(
        b.copy_from_device(s.h, &mut part, DevicePtr(a.p.0 + off as u64)),
        "copy_from_device+off",
    )?;
    ensure(part[..] == data[off..off + 1000], || {
        "interior read differs".into()
    })
}

fn memset_and_memcpy_async(b: &Arc<dyn Backend>, d: DeviceId) -> Result<(), String> {
    let s = TestStream::new(b, d)?;
    let len = 256 << 10;
    let x = TestAlloc::new(b, d, len)?;
    let y = TestAlloc::new(b, d, len)?;
    ok(b.memset_async(s.h, x.p, 0x5A, len), "memset_async")?;
    ok(
        b.memset_async(s.h, DevicePtr(x.p.0 + 1000), 0x11, 24),
        "memset_async (inner)",
    )?;
    // SAFETY: both sides are device memory (checked by the backend).
    ok(
        unsafe { b.memcpy_async(s.h, y.p.0, x.p.0, len) },
        "memcpy_async",
    )?;
    ok(b.stream_synchronize(s.h), "stream_synchronize")?;
    let mut back = vec![0u8; len as usize];
    ok(b.copy_from_device(s.h, &mut back, y.p), "copy_from_device")?;
    for (i, v) in back.iter().enumerate() {
        let want = if (1000..1024).contains(&i) {
            0x11
        } else {
            0x5A
        };
        ensure(*v == want, || {
            format!("byte {i} is {v:#x}, expected {want:#x}")
        })?;
    }
    Ok(())
}

fn events_order_across_streams(b: &Arc<dyn Backend>, d: DeviceId) -> Result<(), String> {
    let sa = TestStream::new(b, d)?;
    let sb = TestStream::new(b, d)?;
    let len = 64 << 10;
    let x = TestAlloc::new(b, d, len)?;
    let y = TestAlloc::new(b, d, len)?;
    ok(b.memset_async(sa.h, x.p, 0, len), "memset x")?;
    ok(b.memset_async(sa.h, y.p, 0, len), "memset y")?;
    ok(b.stream_synchronize(sa.h), "sync a")?;
    let a_done = Arc::new(AtomicBool::new(false));
    let b_saw = Arc::new(Mutex::new(None::<bool>));
    // A is held back by a gate, then writes x and sets a flag.
    let open = gate(b, sa.h)?;
    ok(b.memset_async(sa.h, x.p, 7, len), "memset x=7 on a")?;
    let flag = a_done.clone();
    ok(
        b.launch_host_func(sa.h, Box::new(move |_| flag.store(true, Ordering::SeqCst))),
        "host fn a",
    )?;
    let e = ok(b.event_create(d), "event_create")?;
    ok(b.event_record(e, sa.h), "event_record")?;
    // B waits for the event, copies x to y, and looks at A's flag.
    ok(b.stream_wait_event(sb.h, e), "stream_wait_event")?;
    // SAFETY: both sides are device memory (checked by the backend).
    ok(
        unsafe { b.memcpy_async(sb.h, y.p.0, x.p.0, len) },
        "memcpy on b",
    )?;
    let (flag, saw) = (a_done.clone(), b_saw.clone());
    ok(
        b.launch_host_func(
            sb.h,
            Box::new(move |_| {
                if let Ok(mut s) = saw.lock() {
                    *s = Some(flag.load(Ordering::SeqCst));
                }
            }),
        ),
        "host fn b",
    )?;
    std::thread::sleep(Duration::from_millis(30));
    let early = b_saw
        .lock()
        .map(|s| *s)
        .map_err(|_| "poisoned".to_string())?;
    ensure(early.is_none(), || {
        "stream b ran past its wait while a was still blocked".into()
    })?;
    ensure(!ok(b.event_query(e), "event_query")?, || {
        "event complete while a is blocked".into()
    })?;
    let _ = open.send(());
    ok(b.stream_synchronize(sb.h), "sync b")?;
    let saw = b_saw
        .lock()
        .map(|s| *s)
        .map_err(|_| "poisoned".to_string())?;
    ensure(saw == Some(true), || {
        format!("b's host fn saw a's flag as {saw:?}")
    })?;
    let mut back = vec![0u8; len as usize];
    ok(b.copy_from_device(sb.h, &mut back, y.p), "copy_from_device")?;
    ensure(back.iter().all(|v| *v == 7), || {
        "b copied x before a wrote it".into()
    })?;
    ok(b.stream_synchronize(sa.h), "sync a")?;
    ok(b.event_destroy(e), "event_destroy")
}

fn host_callback_after_work(b: &Arc<dyn Backend>, d: DeviceId) -> Result<(), String> {
    let s = TestStream::new(b, d)?;
    let len: usize = 64 << 10;
    let a = TestAlloc::new(b, d, len as u64)?;
    // Registered host memory the device writes into; atomics make host reads sound.
    let page: usize = rustix::param::page_size();
    let host: Arc<Vec<AtomicU8>> =
        Arc::new((0..len + 2 * page).map(|_| AtomicU8::new(0)).collect());
    let base = host.as_ptr() as usize;
    let start = base.next_multiple_of(page);
    let offset = start - base;
    let ptr = start as *mut u8;
    // SAFETY: `[ptr, ptr + len)` lies in `host`, which this function keeps alive (and only
    // reads through atomics) until after `host_unregister` below.
    ok(
        unsafe { b.host_register(ptr, len as u64, HostRegisterFlags::default()) },
        "host_register",
    )?;
    let result = (|| {
        let open = gate(b, s.h)?;
        ok(b.memset_async(s.h, a.p, 0xC3, len as u64), "memset")?;
        // SAFETY: the host side is the range registered above, read only through atomics
        // and kept registered until the stream is synchronized below.
        ok(
            unsafe { b.memcpy_async(s.h, start as u64, a.p.0, len as u64) },
            "memcpy to host",
        )?;
        let seen = Arc::new(AtomicU64::new(u64::MAX));
        let (h, seen2) = (host.clone(), seen.clone());
        ok(
            b.launch_host_func(
                s.h,
                Box::new(move |_| {
                    let n = h[offset..offset + len]
                        .iter()
                        .filter(|v| v.load(Ordering::Acquire) == 0xC3)
                        .count();
                    seen2.store(n as u64, Ordering::SeqCst);
                }),
            ),
            "launch_host_func",
        )?;
        let _ = open.send(());
        ok(b.stream_synchronize(s.h), "stream_synchronize")?;
        let n = seen.load(Ordering::SeqCst);
        ensure(n == len as u64, || {
            format!("host fn saw {n} of {len} copied bytes")
        })
    })();
    // SAFETY: the stream was synchronized (or the copy failed to queue): nothing is pending
    // on the range.
    ok(unsafe { b.host_unregister(ptr) }, "host_unregister")?;
    result
}

fn event_query_tracks_progress(b: &Arc<dyn Backend>, d: DeviceId) -> Result<(), String> {
    let s = TestStream::new(b, d)?;
    let e = ok(b.event_create(d), "event_create")?;
    ensure(ok(b.event_query(e), "query")?, || {
        "a never-recorded event must query complete".into()
    })?;
    ok(b.event_synchronize(e), "synchronize never-recorded")?;
    ensure(ok(b.stream_query(s.h), "stream_query")?, || {
        "a new stream must query idle".into()
    })?;
    let open = gate(b, s.h)?;
    ok(b.event_record(e, s.h), "event_record")?;
    ensure(!ok(b.event_query(e), "query")?, || {
        "event complete before its stream got there".into()
    })?;
    ensure(!ok(b.stream_query(s.h), "stream_query")?, || {
        "stream idle with work queued".into()
    })?;
    let _ = open.send(());
    ok(b.event_synchronize(e), "event_synchronize")?;
    ensure(ok(b.event_query(e), "query")?, || {
        "event not complete after synchronize".into()
    })?;
    ok(b.stream_synchronize(s.h), "stream_synchronize")?;
    ensure(ok(b.stream_query(s.h), "stream_query")?, || {
        "stream not idle after synchronize".into()
    })?;
    ok(b.event_destroy(e), "event_destroy")
}

fn wait_uses_current_record(b: &Arc<dyn Backend>, d: DeviceId) -> Result<(), String> {
    let sa = TestStream::new(b, d)?;
    let sb = TestStream::new(b, d)?;
    let e = ok(b.event_create(d), "event_create")?;
    ok(b.event_record(e, sa.h), "record #1")?;
    ok(b.stream_wait_event(sb.h, e), "stream_wait_event")?;
    // A re-record behind a closed gate must not hold up the wait made before it. Stream b's
    // progress is watched with an event, not a host function: the gate is a host function
    // that blocks, and a driver may run every stream's host functions on one thread, where
    // b's would wait for the gate whatever b's wait did.
    let open = gate(b, sa.h)?;
    ok(b.event_record(e, sa.h), "record #2")?;
    let f = ok(b.event_create(d), "event_create")?;
    ok(b.event_record(f, sb.h), "record on b")?;
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let passed = loop {
        if ok(b.event_query(f), "event_query")? {
            break true;
        }
        if std::time::Instant::now() > deadline {
            break false;
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    let _ = open.send(());
    ok(b.stream_synchronize(sa.h), "sync a")?;
    ok(b.stream_synchronize(sb.h), "sync b")?;
    ok(b.event_destroy(e), "event_destroy")?;
    ok(b.event_destroy(f), "event_destroy")?;
    ensure(passed, || {
        "stream b waited for a record made after its wait".into()
    })
}

fn free_synchronizes(b: &Arc<dyn Backend>, d: DeviceId) -> Result<(), String> {
    let s = TestStream::new(b, d)?;
    let p = ok(b.malloc(d, 1 << 20), "malloc")?;
    let done = Arc::new(AtomicBool::new(false));
    let flag = done.clone();
    ok(
        b.launch_host_func(
            s.h,
            Box::new(move |_| {
                std::thread::sleep(Duration::from_millis(50));
                flag.store(true, Ordering::SeqCst);
            }),
        ),
        "launch_host_func",
    )?;
    ok(b.free(d, p), "free")?;
    ensure(done.load(Ordering::SeqCst), || {
        "free returned before the device was idle".into()
    })
}

fn vmm_roundtrip(b: &Arc<dyn Backend>, d: DeviceId) -> Result<(), String> {
    let g = ok(b.vmm_granularity(d), "vmm_granularity")?;
    ensure(g.is_power_of_two(), || {
        format!("granularity {g} is not a power of two")
    })?;
    let s = TestStream::new(b, d)?;
    // Offsets into a handle stay 0 (CUDA's cuMemMap requires it); two handles, one per granule.
    let first = ok(b.phys_create(d, g), "phys_create 1")?;
    let phys = ok(b.phys_create(d, 2 * g), "phys_create 2")?;
    let va1 = ok(b.va_reserve(d, 4 * g, 0), "va_reserve 1")?;
    ensure(va1.0 % g == 0, || {
        format!("reservation {va1} not aligned to {g}")
    })?;
    // `first` at granule 0, `phys` at granules 1..3, one set_access over both mappings.
    ok(b.map(va1, g, 0, first), "map 1a")?;
    let at1 = DevicePtr(va1.0 + g);
    ok(b.map(at1, 2 * g, 0, phys), "map 1b")?;
    ok(b.set_access(d, va1, 3 * g), "set_access 1")?;
    // A write straddling the two mappings.
    let data = pattern(2 * g as usize, 42);
    let straddle = DevicePtr(va1.0 + g / 2);
    ok(
        b.copy_to_device(s.h, straddle, &data),
        "write through mapping 1",
    )?;
    // Another mapping of `phys`, through an exported and imported fd.
    let fd = ok(b.phys_export_fd(phys), "phys_export_fd")?;
    let imported = ok(b.phys_import_fd(d, fd), "phys_import_fd")?;
    ensure(imported.size == 2 * g || imported.size == 0, || {
        format!(
            "imported size {} is neither {} nor unknown (0)",
            imported.size,
            2 * g
        )
    })?;
    let va2 = ok(b.va_reserve(d, 2 * g, 0), "va_reserve 2")?;
    ok(b.map(va2, 2 * g, 0, imported), "map 2")?;
    ok(b.set_access(d, va2, 2 * g), "set_access 2")?;
    let mut back = vec![0u8; (3 * g / 2) as usize];
    ok(
        b.copy_from_device(s.h, &mut back, va2),
        "read through mapping 2",
    )?;
    ensure(back[..] == data[(g / 2) as usize..], || {
        "mapping 2 does not show what was written through mapping 1".into()
    })?;
    // And the other way round, with a device-side memset.
    ok(
        b.memset_async(s.h, va2, 0x77, 16),
        "memset through mapping 2",
    )?;
    ok(b.stream_synchronize(s.h), "sync")?;
    ok(b.unmap(va2, 2 * g), "unmap 2")?;
    ok(b.va_free(d, va2, 2 * g), "va_free 2")?;
    ok(b.phys_release(imported), "phys_release imported")?;
    let mut head = vec![0u8; 16];
    ok(b.copy_from_device(s.h, &mut head, at1), "read mapping 1b")?;
    ensure(head == vec![0x77; 16], || {
        format!("mapping 1 reads {head:?}")
    })?;
    // Released while mapped: the memory lives on until unmapped.
    ok(b.phys_release(phys), "phys_release while mapped")?;
    ok(b.phys_release(first), "phys_release 1 while mapped")?;
    let mut again = vec![0u8; 16];
    ok(
        b.copy_from_device(s.h, &mut again, straddle),
        "read after release",
    )?;
    ensure(again[..] == data[..16], || {
        "released-but-mapped memory changed".into()
    })?;
    ok(b.unmap(at1, 2 * g), "unmap 1b")?;
    ok(b.unmap(va1, g), "unmap 1a")?;
    ok(b.va_free(d, va1, 4 * g), "va_free 1")
}

fn vmm_bad_mappings(b: &Arc<dyn Backend>, d: DeviceId) -> Result<(), String> {
    let g = ok(b.vmm_granularity(d), "vmm_granularity")?;
    let phys = ok(b.phys_create(d, g), "phys_create")?;
    let va = ok(b.va_reserve(d, 4 * g, 0), "va_reserve")?;
    let r = (|| {
        let page = rustix::param::page_size() as u64;
        expect_err(
            b.map(DevicePtr(va.0 + page), g, 0, phys),
            "unaligned map",
            is_invalid,
        )?;
        expect_err(
            b.map(va, 2 * g, 0, phys),
            "map past the handle's end",
            is_invalid,
        )?;
        expect_err(
            b.map(va, g / 2, 0, phys),
            "map of part of a granule",
            is_invalid,
        )?;
        ok(b.map(va, g, 0, phys), "map")?;
        ok(b.unmap(va, g), "unmap")
    })();
    let _ = b.va_free(d, va, 4 * g);
    let _ = b.phys_release(phys);
    r
}

fn oom_at_capacity(b: &Arc<dyn Backend>, d: DeviceId) -> Result<(), String> {
    let info = ok(b.mem_info(d), "mem_info")?;
    ensure(info.free <= info.total && info.total > 0, || {
        format!("bad mem_info {info:?}")
    })?;
    let g = ok(b.vmm_granularity(d), "vmm_granularity")?;
    let too_big = info.total.saturating_add(g);
    expect_err(b.malloc(d, too_big), "malloc beyond total", |e| e.is_oom())?;
    let phys_big = too_big.next_multiple_of(g);
    expect_err(
        b.phys_create(d, phys_big),
        "phys_create beyond total",
        |e| e.is_oom(),
    )
}

fn zero_sizes(b: &Arc<dyn Backend>, d: DeviceId) -> Result<(), String> {
    expect_err(b.malloc(d, 0), "malloc(0)", is_invalid)?;
    expect_err(b.phys_create(d, 0), "phys_create(0)", is_invalid)?;
    expect_err(b.va_reserve(d, 0, 0), "va_reserve(0)", is_invalid)
}

fn overflowing_sizes(b: &Arc<dyn Backend>, d: DeviceId) -> Result<(), String> {
    expect_err(b.malloc(d, u64::MAX), "malloc(u64::MAX)", is_oom_or_invalid)?;
    expect_err(
        b.phys_create(d, u64::MAX),
        "phys_create(u64::MAX)",
        is_oom_or_invalid,
    )?;
    expect_err(
        b.va_reserve(d, u64::MAX, 0),
        "va_reserve(u64::MAX)",
        is_oom_or_invalid,
    )?;
    expect_err(
        b.host_alloc(u64::MAX),
        "host_alloc(u64::MAX)",
        is_oom_or_invalid,
    )
}

fn unmap_not_mapped(b: &Arc<dyn Backend>, d: DeviceId) -> Result<(), String> {
    let g = ok(b.vmm_granularity(d), "vmm_granularity")?;
    let va = ok(b.va_reserve(d, 2 * g, 0), "va_reserve")?;
    let r = expect_err(
        b.unmap(va, g),
        "unmap of a reserved, unmapped range",
        is_invalid,
    );
    ok(b.va_free(d, va, 2 * g), "va_free")?;
    r
}

fn event_other_device(b: &Arc<dyn Backend>, d: DeviceId) -> Result<(), String> {
    let n = ok(b.device_count(), "device_count")?;
    if n < 2 {
        return Ok(()); // needs two devices; nothing to check
    }
    let other = DeviceId((d.0 + 1) % n);
    let s = TestStream::new(b, other)?;
    let e = ok(b.event_create(d), "event_create")?;
    let r = expect_err(
        b.event_record(e, s.h),
        "event of another device",
        is_invalid,
    );
    ok(b.event_destroy(e), "event_destroy")?;
    r
}

fn import_non_memory_fd(b: &Arc<dyn Backend>, d: DeviceId) -> Result<(), String> {
    let null = std::fs::File::open("/dev/null").map_err(|e| format!("open /dev/null: {e}"))?;
    expect_err(
        b.phys_import_fd(d, OwnedFd::from(null)),
        "import /dev/null",
        is_rejected_import,
    )?;
    let (sock, _peer) =
        std::os::unix::net::UnixStream::pair().map_err(|e| format!("socketpair: {e}"))?;
    expect_err(
        b.phys_import_fd(d, OwnedFd::from(sock)),
        "import a socket",
        is_rejected_import,
    )
}

/// `cuMemHostRegister` asks for no alignment (the driver locks the pages a range touches):
/// an unaligned pointer and length register, and copies into the range are pinned; an empty
/// range is refused.
fn host_register_byte_ranges(b: &Arc<dyn Backend>, d: DeviceId) -> Result<(), String> {
    let page: usize = rustix::param::page_size();
    let mut buf = vec![0u8; 4 * page];
    let base = buf.as_mut_ptr();
    let offset = (base as usize).next_multiple_of(page) - base as usize;
    let unaligned = base.wrapping_add(offset + 24);
    let len = page as u64 + 100;
    let flags = HostRegisterFlags::default();
    // SAFETY (both registrations and the copy): the range lies in `buf`, which stays alive
    // and untouched until the stream is synchronized and the range unregistered below.
    expect_err(
        unsafe { b.host_register(unaligned, 0, flags) },
        "zero length",
        is_invalid,
    )?;
    ok(
        unsafe { b.host_register(unaligned, len, flags) },
        "host_register of an unaligned range",
    )?;
    let copied = (|| {
        let s = b.stream_create(d)?;
        let dev = b.malloc(d, len)?;
        b.memset_async(s, dev, 0x5c, len)?;
        // SAFETY: as above.
        unsafe { b.memcpy_async(s, unaligned as u64, dev.0, len) }?;
        b.stream_synchronize(s)?;
        b.free(d, dev)?;
        b.stream_destroy(s)
    })();
    ok(copied, "a copy into the registered range")?;
    // SAFETY: the stream was synchronized, or the copy was not queued, or the context is
    // lost (a lost context runs no more work).
    let ok_unreg = ok(unsafe { b.host_unregister(unaligned) }, "host_unregister");
    let range = offset + 24..offset + 24 + len as usize;
    if !buf[range.clone()].iter().all(|x| *x == 0x5c) || buf[range.end] != 0 {
        return Err("the copy into the unaligned registered range went wrong".into());
    }
    ok_unreg
}

/// `free` synchronizes the device before it runs the release hooks: a hook that drops a
/// registration (NCCL's deregistration) must not run while work queued before the free (a
/// collective on the buffer) may still use the memory.
fn free_runs_release_hooks_after_queued_work(
    b: &Arc<dyn Backend>,
    d: DeviceId,
) -> Result<(), String> {
    use gpualloc_runtime::release_hooks::{Release, ReleaseHook};
    struct Seen {
        addr: u64,
        work_done: Arc<AtomicBool>,
        /// 0: not called; 1: called with the work done; 2: called before it was.
        at_hook: AtomicU64,
    }
    impl ReleaseHook for Seen {
        fn before_release(&self, r: Release) {
            if matches!(r, Release::Free { addr, .. } if addr == self.addr) {
                let done = self.work_done.load(Ordering::SeqCst);
                self.at_hook
                    .store(if done { 1 } else { 2 }, Ordering::SeqCst);
            }
        }
    }
    let Some(hooks) = b.release_hooks() else {
        return Ok(());
    };
    let p = ok(b.malloc(d, 1 << 20), "malloc")?;
    let s = ok(b.stream_create(d), "stream_create")?;
    let work_done = Arc::new(AtomicBool::new(false));
    let done = work_done.clone();
    ok(
        b.launch_host_func(
            s,
            Box::new(move |_| {
                std::thread::sleep(Duration::from_millis(100));
                done.store(true, Ordering::SeqCst);
            }),
        ),
        "launch_host_func",
    )?;
    let seen = Arc::new(Seen {
        addr: p.0,
        work_done,
        at_hook: AtomicU64::new(0),
    });
    let id = hooks.add(seen.clone());
    let freed = b.free(d, p);
    hooks.remove(id);
    ok(freed, "free")?;
    ok(b.stream_synchronize(s), "stream_synchronize")?;
    ok(b.stream_destroy(s), "stream_destroy")?;
    match seen.at_hook.load(Ordering::SeqCst) {
        1 => Ok(()),
        0 => Err("free ran no release hook".into()),
        _ => Err("free ran its release hooks while queued work was still running".into()),
    }
}
