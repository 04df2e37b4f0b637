//! Conformance checks of memory, copies, events, host functions and the order a stream's
//! work runs in.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpualloc_runtime::types::{DeviceId, DevicePtr, HostRegisterFlags};
use gpualloc_runtime::Backend;

use super::rig::*;

pub(crate) fn memory_read_write(b: &Arc<dyn Backend>, d: DeviceId) -> Result<(), String> {
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

pub(crate) fn memset_and_memcpy_async(b: &Arc<dyn Backend>, d: DeviceId) -> Result<(), String> {
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

pub(crate) fn events_order_across_streams(b: &Arc<dyn Backend>, d: DeviceId) -> Result<(), String> {
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

pub(crate) fn host_callback_after_work(b: &Arc<dyn Backend>, d: DeviceId) -> Result<(), String> {
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

pub(crate) fn event_query_tracks_progress(b: &Arc<dyn Backend>, d: DeviceId) -> Result<(), String> {
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

pub(crate) fn wait_uses_current_record(b: &Arc<dyn Backend>, d: DeviceId) -> Result<(), String> {
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

pub(crate) fn free_synchronizes(b: &Arc<dyn Backend>, d: DeviceId) -> Result<(), String> {
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
