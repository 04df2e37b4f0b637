//! Bad input from the other process gets a typed error, never a crash: fds that are not
//! shared memory, sizes larger than the object, truncated and garbage messages, a peer of
//! another user, bogus device offers, and a hostile importer (whose exports are still
//! taken back).

use std::io::Write;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpualloc_ipc::counter::{SharedCounter, OFFERED};
use gpualloc_ipc::fdpass::send_step;
use gpualloc_ipc::frame;
use gpualloc_ipc::message::{DeviceOffer, Message, OfferedMemory, Readiness};
use gpualloc_ipc::refcount::RefCountFile;
use gpualloc_ipc::{
    shm, Backing, DeviceRegion, ExportConn, ImportConn, IpcError, MapOptions, OnRelease,
    PeerPolicy, SegmentMemory,
};
use gpualloc_runtime::{Backend, BackendError, DeviceId};
use gpualloc_sim::{SimBackend, SimConfig};

const DEV: DeviceId = DeviceId(0);

fn backend() -> Arc<dyn Backend> {
    SimBackend::new(SimConfig::fast(1)).unwrap()
}

fn send_raw(sock: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) {
    let mut sent = 0;
    while sent < bytes.len() {
        sent += send_step(sock.as_fd(), bytes, sent, fds).unwrap();
    }
}

fn send_msg(sock: &UnixStream, msg: &Message, fds: &[BorrowedFd<'_>]) {
    send_raw(sock, &frame::encode(msg).unwrap(), fds);
}

/// A socket pair whose importer end has read a valid hello. Returns (exporter end, importer).
fn hello_pair(refs: &RefCountFile) -> (UnixStream, ImportConn) {
    let (a, b) = UnixStream::pair().unwrap();
    send_msg(
        &a,
        &Message::Hello { pid: 1, slots: 8 },
        &[refs.fd().unwrap()],
    );
    let conn = ImportConn::new(b, &PeerPolicy::default(), backend(), DEV).unwrap();
    (a, conn)
}

#[test]
fn a_pipe_is_not_shared_memory() {
    let refs = RefCountFile::create(8).unwrap();
    let (a, mut conn) = hello_pair(&refs);
    let (r, _w): (OwnedFd, OwnedFd) = rustix::pipe::pipe().unwrap();
    send_msg(&a, &Message::Host { len: 4096, tag: 0 }, &[r.as_fd()]);
    match conn.recv() {
        Err(IpcError::NotSharedMemory { kind }) => assert_eq!(kind, "pipe"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_size_larger_than_the_object_is_refused() {
    let refs = RefCountFile::create(8).unwrap();
    let (a, mut conn) = hello_pair(&refs);
    let m = shm::create(4096, Backing::Memfd, MapOptions::shared_rw()).unwrap();
    send_msg(&a, &Message::Host { len: 8192, tag: 0 }, &[m.fd().unwrap()]);
    match conn.recv() {
        Err(IpcError::SizeMismatch { requested, actual }) => {
            assert_eq!((requested, actual), (8192, 4096))
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn truncated_and_garbage_messages_are_typed_errors() {
    let refs = RefCountFile::create(8).unwrap();
    // Truncated: half a frame, then the writer goes away.
    let (a, mut conn) = hello_pair(&refs);
    let bytes = frame::encode(&Message::Released { id: 3 }).unwrap();
    send_raw(&a, &bytes[..bytes.len() / 2], &[]);
    drop(a);
    match conn.recv() {
        Err(IpcError::Truncated { got, expected }) => {
            assert_eq!((got, expected), (bytes.len() / 2, bytes.len()))
        }
        other => panic!("{other:?}"),
    }
    // Garbage.
    let (mut a, mut conn) = hello_pair(&refs);
    a.write_all(b"this is not a gpualloc frame at all").unwrap();
    assert!(matches!(conn.recv(), Err(IpcError::Malformed(_))));
    // A clean close between frames.
    let (a, mut conn) = hello_pair(&refs);
    drop(a);
    assert!(matches!(conn.recv(), Err(IpcError::Closed)));
    // Garbage instead of the hello; a hello that is another message.
    let (mut a, b) = UnixStream::pair().unwrap();
    a.write_all(&[0xff; 40]).unwrap();
    assert!(matches!(
        ImportConn::new(b, &PeerPolicy::default(), backend(), DEV),
        Err(IpcError::Malformed(_))
    ));
    let (a, b) = UnixStream::pair().unwrap();
    send_msg(&a, &Message::Released { id: 1 }, &[]);
    assert!(matches!(
        ImportConn::new(b, &PeerPolicy::default(), backend(), DEV),
        Err(IpcError::Unexpected {
            expected: "hello",
            ..
        })
    ));
}

#[test]
fn a_peer_of_another_user_is_rejected_on_both_ends() {
    let me = rustix::process::geteuid().as_raw();
    let policy = PeerPolicy::allow_uid(me.wrapping_add(1000));
    let (a, b) = UnixStream::pair().unwrap();
    match ExportConn::new(a, &policy, backend()) {
        Err(IpcError::PeerNotAllowed { uid, allowed, pid }) => {
            assert_eq!(
                (uid, allowed, pid),
                (me, me.wrapping_add(1000), std::process::id())
            )
        }
        Err(e) => panic!("{e:?}"),
        Ok(_) => panic!("accepted"),
    }
    assert!(matches!(
        ImportConn::new(b, &policy, backend(), DEV),
        Err(IpcError::PeerNotAllowed { .. })
    ));
}

#[test]
fn bogus_device_offers_are_typed_errors() {
    let refs = RefCountFile::create(8).unwrap();
    let (a, mut conn) = hello_pair(&refs);
    let offer = |slot, handle: Vec<u8>| {
        Message::Device(DeviceOffer {
            id: 1,
            slot,
            device: 0,
            len: 4096,
            ready: Readiness::Synchronized,
            memory: OfferedMemory::Legacy { handle, offset: 0 },
        })
    };
    // Each offer names a slot the exporter armed, as a real one would; every refusal gives
    // the slot back.
    let slot = &refs.counters()[0];
    slot.arm(OFFERED);
    send_msg(&a, &offer(0, vec![0; 64]), &[]);
    assert!(matches!(
        conn.recv(),
        Err(IpcError::Backend(BackendError::InvalidValue(_)))
    ));
    assert!(slot.is_free());
    slot.arm(OFFERED);
    send_msg(&a, &offer(0, vec![0; 10]), &[]);
    assert!(matches!(conn.recv(), Err(IpcError::Malformed(_))));
    assert!(slot.is_free());
    send_msg(&a, &offer(99, vec![0; 64]), &[]);
    assert!(matches!(conn.recv(), Err(IpcError::Malformed(_))));
    // A slot that holds no offer (never armed, or taken back): refused before anything opens.
    send_msg(&a, &offer(1, vec![0; 64]), &[]);
    assert!(matches!(conn.recv(), Err(IpcError::Withdrawn(1))));
    slot.arm(OFFERED);
    // A VMM offer whose span cannot hold the buffer.
    let vmm = Message::Device(DeviceOffer {
        id: 2,
        slot: 0,
        device: 0,
        len: 4096,
        ready: Readiness::Synchronized,
        memory: OfferedMemory::Vmm {
            span: 1024,
            offset: 0,
            chunks: vec![],
        },
    });
    send_msg(&a, &vmm, &[]);
    assert!(matches!(conn.recv(), Err(IpcError::Malformed(_))));
    assert!(slot.is_free());
}

#[test]
fn a_legacy_offer_must_lie_inside_the_allocation_it_names() {
    let refs = RefCountFile::create(8).unwrap();
    let (a, mut conn) = hello_pair(&refs);
    let exporter = backend();
    let size = 2u64 << 20;
    let ptr = exporter.malloc(DEV, size).unwrap();
    let handle = exporter.ipc_get_mem_handle(ptr).unwrap().0.to_vec();
    let offer = |offset, len| {
        Message::Device(DeviceOffer {
            id: 1,
            slot: 0,
            device: 0,
            len,
            ready: Readiness::Synchronized,
            memory: OfferedMemory::Legacy {
                handle: handle.clone(),
                offset,
            },
        })
    };
    let slot = &refs.counters()[0];
    for (offset, len) in [
        (size, 1 << 62),
        (size, 1),
        (0, size + 1),
        (size - 4096, 8192),
    ] {
        slot.arm(OFFERED);
        send_msg(&a, &offer(offset, len), &[]);
        match conn.recv() {
            Err(IpcError::Malformed(m)) => assert!(m.contains("runs past"), "{m}"),
            other => panic!("offset {offset} len {len}: {other:?}"),
        }
        assert!(slot.is_free(), "the refused offer's slot is given back");
    }
    // The exact fit is accepted.
    slot.arm(OFFERED);
    send_msg(&a, &offer(size - 4096, 4096), &[]);
    let Ok(gpualloc_ipc::Received::Device(buf)) = conn.recv() else {
        panic!("the last page is a valid window");
    };
    assert_eq!(buf.len(), 4096);
    assert!(!slot.is_free());
    drop(buf);
    assert!(slot.is_free());
    exporter.free(DEV, ptr).unwrap();
}

#[test]
fn a_hostile_importer_still_gets_its_exports_taken_back() {
    let sim = SimBackend::new(SimConfig::fast(1)).unwrap();
    let backend: Arc<dyn Backend> = sim.clone();
    let ptr = backend.malloc(DEV, 1 << 20).unwrap();
    let (a, mut b) = UnixStream::pair().unwrap();
    let mut conn = ExportConn::new(a, &PeerPolicy::default(), backend.clone()).unwrap();
    let released = Arc::new(AtomicBool::new(false));
    let flag = released.clone();
    let region = DeviceRegion {
        device: DEV,
        ptr,
        len: 1 << 20,
        segment: SegmentMemory::Allocation { base: ptr },
    };
    conn.send_device(
        &region,
        None,
        Box::new(OnRelease::new(move || flag.store(true, Ordering::SeqCst))),
    )
    .unwrap();
    // A region that is not inside its segment is refused before anything is sent, and its
    // guard is released at once.
    let bad = DeviceRegion {
        segment: SegmentMemory::Allocation {
            base: gpualloc_runtime::DevicePtr(ptr.0 + 4096),
        },
        ..region.clone()
    };
    let bad_flag = Arc::new(AtomicBool::new(false));
    let f2 = bad_flag.clone();
    assert!(matches!(
        conn.send_device(
            &bad,
            None,
            Box::new(OnRelease::new(move || f2.store(true, Ordering::SeqCst)))
        ),
        Err(IpcError::InvalidExport(_))
    ));
    assert!(bad_flag.load(Ordering::SeqCst));
    assert_eq!(conn.outstanding(), 1);
    b.write_all(b"\x00garbage from a hostile importer\x00")
        .unwrap();
    assert!(matches!(conn.serve(), Err(IpcError::Malformed(_))));
    // The connection is gone, but the importer still holds its socket (and may still hold
    // the memory): its export is kept until EOF, then taken back.
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        !released.load(Ordering::SeqCst),
        "freed under a live importer"
    );
    drop(b);
    let t = Instant::now();
    while !released.load(Ordering::SeqCst) {
        assert!(t.elapsed() < Duration::from_secs(5), "never taken back");
        std::thread::sleep(Duration::from_millis(2));
    }
    backend.free(DEV, ptr).unwrap();
}

/// An unsealed memfd of `len` bytes: its owner could still truncate it under a mapping.
fn unsealed(len: u64) -> OwnedFd {
    let flags = rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING;
    let fd = rustix::fs::memfd_create("unsealed", flags).unwrap();
    rustix::fs::ftruncate(&fd, len).unwrap();
    fd
}

#[test]
fn an_importer_refuses_memory_the_exporter_could_still_truncate() {
    // The reference-count file of the hello.
    let (a, b) = UnixStream::pair().unwrap();
    let refs = unsealed(4096);
    send_msg(&a, &Message::Hello { pid: 1, slots: 8 }, &[refs.as_fd()]);
    match ImportConn::new(b, &PeerPolicy::default(), backend(), DEV) {
        Err(IpcError::NotSealed { seals: 0 }) => {}
        other => panic!("{:?}", other.map(|_| ())),
    }
    // A host buffer.
    let good = RefCountFile::create(8).unwrap();
    let (a, mut conn) = hello_pair(&good);
    let host = unsealed(1 << 20);
    send_msg(&a, &Message::Host { len: 4096, tag: 0 }, &[host.as_fd()]);
    assert!(matches!(conn.recv(), Err(IpcError::NotSealed { .. })));
    // The same memfd once sealed is accepted.
    shm::ensure_sealed(host.as_fd()).unwrap();
    send_msg(&a, &Message::Host { len: 4096, tag: 3 }, &[host.as_fd()]);
    assert!(matches!(
        conn.recv(),
        Ok(gpualloc_ipc::Received::Host { tag: 3, .. })
    ));
    assert!(rustix::fs::ftruncate(&host, 0).is_err());
}

/// A host mapping whose memfd shrank before it was sealed is refused by the exporter itself
/// (the importer would refuse it with the same error after it crossed the socket).
#[test]
fn the_exporter_refuses_a_host_mapping_longer_than_its_object() {
    let (a, b) = UnixStream::pair().unwrap();
    let mut conn = ExportConn::new(a, &PeerPolicy::default(), backend()).unwrap();
    // A memfd of the caller's, mapped whole (8 KiB), then shrunk before anything sealed it.
    let fd = unsealed(8192);
    let host = shm::open_fd(
        fd.try_clone().unwrap(),
        Some(8192),
        MapOptions::shared_rw().with_fd(gpualloc_ipc::FdAfterMap::Keep),
    )
    .unwrap();
    rustix::fs::ftruncate(&fd, 4096).unwrap();
    match conn.send_host(&host, 1) {
        Err(IpcError::SizeMismatch { requested, actual }) => {
            assert_eq!((requested, actual), (8192, 4096))
        }
        other => panic!("{other:?}"),
    }
    drop(b);
}

/// What an importer of a buffer of an ordinary segment reaches: the whole allocation (a
/// legacy IPC handle opens all of it), as `DeviceRegion::exposed` tells the exporter.
#[test]
fn an_ordinary_segments_buffer_exposes_its_whole_allocation() {
    let backend = backend();
    let base = backend.malloc(DEV, 4 << 20).unwrap();
    let region = DeviceRegion {
        device: DEV,
        ptr: base.checked_add(1 << 20).unwrap(),
        len: 4096,
        segment: SegmentMemory::Allocation { base },
    };
    assert_eq!(region.exposed(&*backend).unwrap(), (base, 4 << 20));
    let none = DeviceRegion {
        segment: SegmentMemory::Vmm { chunks: Vec::new() },
        ..region
    };
    assert!(matches!(
        none.exposed(&*backend),
        Err(IpcError::InvalidExport(_))
    ));
    backend.free(DEV, base).unwrap();
}
