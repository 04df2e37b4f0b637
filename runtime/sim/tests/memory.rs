//! Sim device memory, capacity, VMM rules, pinned/registered host memory and IPC handles.
#![cfg(not(loom))] // the sim runs real threads; loom builds run only the loom models

use std::sync::Arc;

use gpualloc_runtime::{
    Backend, BackendError, DeviceId, DevicePtr, HostRegisterFlags, IpcMemHandle,
};
use gpualloc_sim::{Op, SimBackend, SimConfig};

const D0: DeviceId = DeviceId(0);
const D1: DeviceId = DeviceId(1);

fn small(devices: u32, capacity: u64) -> Arc<SimBackend> {
    SimBackend::new(SimConfig {
        capacity_per_device: capacity,
        ..SimConfig::fast(devices)
    })
    .unwrap()
}

fn invalid<T: std::fmt::Debug>(r: Result<T, BackendError>) -> bool {
    matches!(r, Err(BackendError::InvalidValue(_)))
}

#[test]
fn config_is_validated() {
    assert!(SimBackend::new(SimConfig {
        devices: 0,
        ..SimConfig::fast(1)
    })
    .is_err());
    assert!(SimBackend::new(SimConfig {
        granularity: 3 << 20,
        ..SimConfig::fast(1)
    })
    .is_err());
    assert!(SimBackend::new(SimConfig {
        capacity_per_device: 0,
        ..SimConfig::fast(1)
    })
    .is_err());
}

#[test]
fn capacity_is_enforced_per_device() {
    let sim = small(2, 8 << 20);
    assert_eq!(sim.mem_info(D0).unwrap().total, 8 << 20);
    let a = sim.malloc(D0, 4 << 20).unwrap();
    let b = sim.malloc(D0, 3 << 20).unwrap();
    assert_eq!(sim.mem_info(D0).unwrap().free, 1 << 20);
    let err = sim.malloc(D0, 2 << 20).unwrap_err();
    assert!(err.is_oom(), "{err:?}");
    // Device 1 has its own capacity.
    let c = sim.malloc(D1, 8 << 20).unwrap();
    assert_eq!(sim.mem_info(D1).unwrap().free, 0);
    // Physical handles count too.
    assert!(sim.phys_create(D0, 2 << 20).unwrap_err().is_oom());
    sim.free(D0, a).unwrap();
    let h = sim.phys_create(D0, 2 << 20).unwrap();
    assert_eq!(sim.mem_info(D0).unwrap().free, 3 << 20);
    sim.phys_release(h).unwrap();
    assert_eq!(sim.mem_info(D0).unwrap().free, 5 << 20);
    // Sizes round up to whole pages.
    let d = sim.malloc(D0, 1).unwrap();
    assert_eq!(
        sim.used_bytes(D0).unwrap(),
        (3 << 20) + rustix::param::page_size() as u64
    );
    for (dev, p) in [(D0, b), (D1, c), (D0, d)] {
        sim.free(dev, p).unwrap();
    }
    assert_eq!(sim.used_bytes(D0).unwrap(), 0);
}

#[test]
fn bad_device_and_pointer_arguments() {
    let sim = small(2, 16 << 20);
    assert_eq!(
        sim.malloc(DeviceId(2), 64),
        Err(BackendError::InvalidDevice(2))
    );
    assert_eq!(
        sim.stream_create(DeviceId(9)).unwrap_err(),
        BackendError::InvalidDevice(9)
    );
    let p = sim.malloc(D0, 4096).unwrap();
    assert!(invalid(sim.free(D1, p)), "free on the wrong device");
    assert!(
        invalid(sim.free(D0, DevicePtr(p.0 + 64))),
        "interior pointer"
    );
    sim.free(D0, p).unwrap();
    assert!(invalid(sim.free(D0, p)), "double free");
    let s = sim.stream_create(D0).unwrap();
    assert!(
        invalid(sim.memcpy_async(s, p.0, p.0, 16)),
        "copy of freed memory"
    );
    assert!(invalid(sim.copy_to_device(s, DevicePtr(0x10), b"x")));
    assert!(invalid(sim.memset_async(s, DevicePtr(u64::MAX - 2), 0, 16)));
    sim.stream_destroy(s).unwrap();
}

#[test]
fn device_pointers_are_real_addresses_shared_by_ipc() {
    let sim = small(1, 64 << 20);
    let s = sim.stream_create(D0).unwrap();
    let p = sim.malloc(D0, 1 << 20).unwrap();
    sim.copy_to_device(s, DevicePtr(p.0 + 100), b"shared bytes")
        .unwrap();
    // A handle for an interior pointer names the whole allocation.
    let h = sim.ipc_get_mem_handle(DevicePtr(p.0 + 100)).unwrap();
    assert!(!sim.opened_by_another_process(p), "not opened yet");
    let q = sim.ipc_open_mem_handle(D0, &h).unwrap();
    assert_ne!(q, p, "the opened allocation is a second mapping");
    // An open of the handle holds a shared lock on the memory, which the exporter sees (the
    // emulated driver's check for a free under a live import; here the open is this process's
    // own, a second open file of the memory all the same).
    assert!(sim.opened_by_another_process(p));
    assert!(
        !sim.opened_by_another_process(DevicePtr(p.0 + 100)),
        "not a start"
    );
    let mut out = [0u8; 12];
    sim.copy_from_device(s, &mut out, DevicePtr(q.0 + 100))
        .unwrap();
    assert_eq!(&out, b"shared bytes");
    // Writes through the opened mapping show in the original.
    sim.memset_async(s, q, 0xEE, 4).unwrap();
    let mut head = [0u8; 4];
    sim.copy_from_device(s, &mut head, p).unwrap();
    assert_eq!(head, [0xEE; 4]);
    // Live device memory: the allocation and the opened mapping; not past the end.
    assert!(sim.device_memory_covers(p.0, 1 << 20));
    assert!(sim.device_memory_covers(q.0 + 4096, 4096));
    assert!(!sim.device_memory_covers(p.0, (1 << 20) + 1));
    sim.ipc_close_mem_handle(q).unwrap();
    assert!(!sim.opened_by_another_process(p), "closed");
    assert!(
        !sim.device_memory_covers(q.0, 1),
        "an opened mapping, closed"
    );
    assert!(invalid(sim.ipc_close_mem_handle(q)));
    assert!(invalid(sim.ipc_open_mem_handle(D0, &IpcMemHandle([0; 64]))));
    let mut forged = h;
    forged.0[24] ^= 0x40; // wrong size
    assert!(invalid(sim.ipc_open_mem_handle(D0, &forged)));
    assert!(invalid(sim.ipc_get_mem_handle(DevicePtr(8))));
    sim.free(D0, p).unwrap();
    assert!(!sim.device_memory_covers(p.0, 1), "freed");
    sim.stream_destroy(s).unwrap();
}

#[test]
fn vmm_rules() {
    let sim = small(2, 64 << 20);
    let g = sim.vmm_granularity(D0).unwrap();
    assert_eq!(g, 2 << 20);
    assert!(invalid(sim.va_reserve(D0, g + 1, 0)), "size not granular");
    assert!(
        invalid(sim.va_reserve(D0, g, 3 << 20)),
        "alignment not a power of two"
    );
    assert!(invalid(sim.phys_create(D0, g / 2)));
    let va = sim.va_reserve(D0, 4 * g, 8 * g).unwrap();
    assert_eq!(va.0 % (8 * g), 0, "alignment honoured");
    let h = sim.phys_create(D0, 2 * g).unwrap();
    assert!(
        invalid(sim.set_access(D0, va, g)),
        "set_access of an unmapped range"
    );
    sim.map(va, g, 0, h).unwrap();
    sim.map(DevicePtr(va.0 + g), g, g, h).unwrap();
    // Unmap must cover whole mappings.
    assert!(invalid(sim.unmap(va, g / 2)));
    assert!(invalid(sim.unmap(va, 3 * g)));
    assert!(invalid(sim.va_free(D0, va, 4 * g)), "live mappings");
    assert!(invalid(sim.va_free(D1, va, 4 * g)), "wrong device");
    sim.set_access(D0, va, 2 * g).unwrap();
    sim.phys_release(h).unwrap();
    assert!(matches!(
        sim.phys_release(h),
        Err(BackendError::InvalidHandle(_))
    ));
    assert!(matches!(
        sim.phys_export_fd(h),
        Err(BackendError::InvalidHandle(_))
    ));
    assert_eq!(sim.live_phys(), 1, "released but still mapped");
    assert_eq!(sim.used_bytes(D0).unwrap(), 2 * g);
    sim.unmap(va, 2 * g).unwrap();
    assert_eq!(sim.live_phys(), 0);
    assert_eq!(sim.used_bytes(D0).unwrap(), 0);
    assert!(invalid(sim.unmap(va, g)), "unmap twice");
    sim.va_free(D0, va, 4 * g).unwrap();
    assert!(invalid(sim.va_free(D0, va, 4 * g)), "va_free twice");
    // Overlapping or out-of-reservation mappings.
    let va = sim.va_reserve(D0, 2 * g, 0).unwrap();
    let h = sim.phys_create(D0, g).unwrap();
    sim.map(va, g, 0, h).unwrap();
    assert!(invalid(sim.map(va, g, 0, h)), "map over a mapping");
    assert!(
        invalid(sim.map(DevicePtr(va.0 + g), 2 * g, 0, h)),
        "map past the reservation"
    );
    assert!(
        invalid(sim.map(DevicePtr(va.0 + 4 * g), g, 0, h)),
        "map outside any reservation"
    );
    sim.unmap(va, g).unwrap();
    sim.va_free(D0, va, 2 * g).unwrap();
    sim.phys_release(h).unwrap();
    // An imported handle maps like a created one and is not counted twice.
    let h = sim.phys_create(D0, g).unwrap();
    let imported = sim
        .phys_import_fd(D1, sim.phys_export_fd(h).unwrap())
        .unwrap();
    assert_eq!((imported.device, imported.size), (D1, g));
    assert_eq!(sim.used_bytes(D1).unwrap(), 0);
    sim.phys_release(imported).unwrap();
    sim.phys_release(h).unwrap();
    assert_eq!(sim.counts().get(Op::PhysImportFd), 1);
}

#[repr(align(65536))]
struct Aligned([u8; 65536]);

/// Immutable, so it lives in a read-only mapping of the test binary.
static READ_ONLY: Aligned = Aligned([7; 65536]);

#[test]
fn read_only_registration_is_read_only_for_the_device() {
    let sim = small(1, 64 << 20);
    let s = sim.stream_create(D0).unwrap();
    let ro = READ_ONLY.0.as_ptr() as *mut u8;
    let page = rustix::param::page_size() as u64;
    let rw = HostRegisterFlags::default();
    let ro_flags = HostRegisterFlags {
        read_only: true,
        ..HostRegisterFlags::default()
    };
    // SAFETY: the range is this test's own buffer, which outlives it and every copy.
    assert!(
        invalid(unsafe { sim.host_register(ro, page, rw) }),
        "read-only pages registered writable"
    );
    // SAFETY: the range is this test's own buffer, which outlives it and every copy.
    unsafe { sim.host_register(ro, page, ro_flags) }.unwrap();
    let dev = sim.malloc(D0, page).unwrap();
    sim.memcpy_async(s, dev.0, ro as u64, page).unwrap();
    let mut out = vec![0u8; page as usize];
    sim.copy_from_device(s, &mut out, dev).unwrap();
    assert!(out.iter().all(|b| *b == 7));
    assert!(
        invalid(sim.memcpy_async(s, ro as u64, dev.0, 16)),
        "device write to read-only"
    );
    assert!(invalid(sim.memset_async(s, DevicePtr(ro as u64), 0, 16)));
    // A kernel trying it gets a sticky error, not a SIGSEGV.
    let target = DevicePtr(ro as u64);
    sim.launch_kernel(s, std::time::Duration::ZERO, move |m| m.fill(target, 16, 0))
        .unwrap();
    assert!(invalid(sim.stream_synchronize(s)));
    sim.host_unregister(ro).unwrap();
    sim.free(D0, dev).unwrap();
    sim.stream_destroy(s).unwrap();
}

#[test]
fn non_memory_fds_and_foreign_events_are_invalid_values() {
    let sim = small(2, 64 << 20);
    let null = std::fs::File::open("/dev/null").unwrap();
    assert!(invalid(sim.phys_import_fd(D0, null.into())));
    let (sock, _peer) = std::os::unix::net::UnixStream::pair().unwrap();
    assert!(invalid(sim.phys_import_fd(D0, sock.into())));
    // A regular file is not a memory handle either (no memfd seals).
    let exe = std::fs::File::open(std::env::current_exe().unwrap()).unwrap();
    assert!(invalid(sim.phys_import_fd(D0, exe.into())));
    // A memfd whose size is not a whole number of granules.
    let odd = rustix::fs::memfd_create("odd", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&odd, 4096).unwrap();
    assert!(invalid(sim.phys_import_fd(D0, odd)));
    let e = sim.event_create(D0).unwrap();
    let s1 = sim.stream_create(D1).unwrap();
    assert!(invalid(sim.event_record(e, s1)));
    // Waiting on another device's event is allowed (as in CUDA).
    sim.stream_wait_event(s1, e).unwrap();
    sim.stream_destroy(s1).unwrap();
    sim.event_destroy(e).unwrap();
}

#[test]
fn pinned_and_registered_host_memory() {
    let sim = small(1, 64 << 20);
    let page = rustix::param::page_size() as u64;
    let s = sim.stream_create(D0).unwrap();
    let dev = sim.malloc(D0, 3 * page).unwrap();
    let pinned = sim.host_alloc(3 * page).unwrap();
    assert_eq!(pinned as u64 % page, 0);
    // Device -> pinned -> device, all stream-ordered.
    sim.memset_async(s, dev, 0x42, 3 * page).unwrap();
    sim.memcpy_async(s, pinned as u64, dev.0, 3 * page).unwrap();
    sim.memset_async(s, dev, 0, 3 * page).unwrap();
    sim.memcpy_async(s, dev.0, pinned as u64, page).unwrap();
    let mut out = vec![0u8; 3 * page as usize];
    sim.copy_from_device(s, &mut out, dev).unwrap();
    assert!(out[..page as usize].iter().all(|x| *x == 0x42));
    assert!(out[page as usize..].iter().all(|x| *x == 0));
    assert!(
        invalid(sim.host_free(byte_offset(pinned, 1))),
        "interior pointer"
    );
    sim.host_free(pinned).unwrap();
    assert!(invalid(sim.host_free(pinned)), "double free");
    assert!(
        invalid(sim.memcpy_async(s, pinned as u64, dev.0, 16)),
        "freed pinned memory"
    );

    // Registering: mapped ranges, any alignment (as the driver).
    let mut buf = vec![0u8; 6 * page as usize];
    let start = (buf.as_mut_ptr() as u64).next_multiple_of(page);
    let flags = HostRegisterFlags::default();
    let at = |a: u64| a as *mut u8;
    // SAFETY: the range is this test's own buffer, which outlives it and every copy.
    unsafe { sim.host_register(at(start + 4 * page + 1), page - 2, flags) }
        .expect("an unaligned range registers");
    sim.host_unregister(at(start + 4 * page + 1)).unwrap();
    // SAFETY: the range is this test's own buffer, which outlives it and every copy.
    assert!(
        invalid(unsafe { sim.host_register(at(start), 0, flags) }),
        "empty"
    );
    // SAFETY: the range is this test's own buffer, which outlives it and every copy.
    assert!(
        invalid(unsafe { sim.host_register(at(0x1000), page, flags) }),
        "unmapped range"
    );
    // A reserved (PROT_NONE) range is mapped but not accessible: registering it is refused.
    let g = sim.vmm_granularity(D0).unwrap();
    let va = sim.va_reserve(D0, g, 0).unwrap();
    // SAFETY: the range is this test's own buffer, which outlives it and every copy.
    assert!(
        invalid(unsafe { sim.host_register(at(va.0), page, flags) }),
        "PROT_NONE range"
    );
    sim.va_free(D0, va, g).unwrap();
    // SAFETY: the range is this test's own buffer, which outlives it and every copy.
    unsafe { sim.host_register(at(start), 2 * page, flags) }.unwrap();
    // SAFETY: the range is this test's own buffer, which outlives it and every copy.
    assert!(
        invalid(unsafe { sim.host_register(at(start + page), 2 * page, flags) }),
        "overlap"
    );
    sim.memset_async(s, dev, 0x17, page).unwrap();
    sim.memcpy_async(s, start + 8, dev.0, 100).unwrap();
    sim.stream_synchronize(s).unwrap();
    let off = (start - buf.as_ptr() as u64) as usize;
    assert!(buf[off + 8..off + 108].iter().all(|x| *x == 0x17));
    assert_eq!(buf[off + 108], 0);
    assert!(invalid(sim.host_unregister(at(start + page))));
    sim.host_unregister(at(start)).unwrap();
    assert!(
        invalid(sim.memcpy_async(s, start, dev.0, 16)),
        "unregistered memory"
    );
    sim.free(D0, dev).unwrap();
    sim.stream_destroy(s).unwrap();
}

fn byte_offset(p: *mut u8, by: usize) -> *mut u8 {
    p.wrapping_add(by)
}

#[test]
fn device_memory_is_sealed_at_its_size_and_unsealed_handles_are_refused() {
    let sim = small(1, 64 << 20);
    // A legacy IPC open goes through the allocation's memfd: nobody can resize it.
    let ptr = sim.malloc(D0, 2 << 20).unwrap();
    assert_eq!(
        sim.mem_address_range(DevicePtr(ptr.0 + 4097)).unwrap(),
        (ptr, 2 << 20)
    );
    assert!(invalid(sim.mem_address_range(DevicePtr(ptr.0 + (2 << 20)))));
    let h = sim.ipc_get_mem_handle(ptr).unwrap();
    let fd = i32::from_le_bytes(h.0[12..16].try_into().unwrap());
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(format!("/proc/self/fd/{fd}"))
        .unwrap();
    assert!(rustix::fs::ftruncate(&file, 0).is_err(), "shrink is sealed");
    assert!(
        rustix::fs::ftruncate(&file, 4 << 20).is_err(),
        "grow is sealed"
    );
    drop(file);
    // So is exported physical memory.
    let gran = sim.vmm_granularity(D0).unwrap();
    let phys = sim.phys_create(D0, gran).unwrap();
    let exported = sim.phys_export_fd(phys).unwrap();
    assert!(rustix::fs::ftruncate(&exported, 0).is_err());
    drop(exported);
    // A memfd its owner could still truncate under our mapping is refused on import.
    let open = rustix::fs::memfd_create("unsealed", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&open, gran).unwrap();
    assert!(invalid(sim.phys_import_fd(D0, open)));
    sim.phys_release(phys).unwrap();
    sim.free(D0, ptr).unwrap();
}
