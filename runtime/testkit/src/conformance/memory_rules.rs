//! Conformance checks of virtual memory and IPC handles, the sizes and handles a driver
//! refuses, host registration and release hooks.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use gpualloc_runtime::types::{DeviceId, DevicePtr, HostRegisterFlags};
use gpualloc_runtime::Backend;

use super::rig::*;

pub(crate) fn vmm_roundtrip(b: &Arc<dyn Backend>, d: DeviceId) -> Result<(), String> {
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

pub(crate) fn vmm_bad_mappings(b: &Arc<dyn Backend>, d: DeviceId) -> Result<(), String> {
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

pub(crate) fn oom_at_capacity(b: &Arc<dyn Backend>, d: DeviceId) -> Result<(), String> {
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

pub(crate) fn zero_sizes(b: &Arc<dyn Backend>, d: DeviceId) -> Result<(), String> {
    expect_err(b.malloc(d, 0), "malloc(0)", is_invalid)?;
    expect_err(b.phys_create(d, 0), "phys_create(0)", is_invalid)?;
    expect_err(b.va_reserve(d, 0, 0), "va_reserve(0)", is_invalid)
}

pub(crate) fn overflowing_sizes(b: &Arc<dyn Backend>, d: DeviceId) -> Result<(), String> {
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

pub(crate) fn unmap_not_mapped(b: &Arc<dyn Backend>, d: DeviceId) -> Result<(), String> {
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

pub(crate) fn event_other_device(b: &Arc<dyn Backend>, d: DeviceId) -> Result<(), String> {
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

pub(crate) fn import_non_memory_fd(b: &Arc<dyn Backend>, d: DeviceId) -> Result<(), String> {
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
pub(crate) fn host_register_byte_ranges(b: &Arc<dyn Backend>, d: DeviceId) -> Result<(), String> {
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
pub(crate) fn free_runs_release_hooks_after_queued_work(
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
