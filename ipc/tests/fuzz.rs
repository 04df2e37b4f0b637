//! Seeded fuzzing of both ends of a connection, in one test (it counts this process's fds and
//! mappings, so nothing else may run beside it in this binary):
//! - the exporter is fed hostile bytes by its importer (random bytes, frames of every message
//!   kind with wrong fields, wrong fd counts, truncation), while that importer legitimately
//!   holds some of its exports: nothing it holds is freed before its EOF, everything is freed
//!   after it, and nothing panics;
//! - the importer is fed hostile offers by its exporter (hellos with the wrong fds, host
//!   memory of wrong sizes or unsealed, device offers with unarmed slots, foreign or bogus
//!   handles, windows past their allocation, VMM chunk lists that do not add up): each is a
//!   typed error or a buffer that lies inside what was opened.
//!
//! Both end with the fds and memfd mappings they started with.
//!
//! `GPUALLOC_FUZZ_ITERS` (default 1500 per end) and `GPUALLOC_FUZZ_SEED` (default 1) tune it.

use std::io::Write;
use std::net::Shutdown;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpualloc_ipc::counter::{SharedCounter, OFFERED};
use gpualloc_ipc::fdpass::{recv_step, send_step};
use gpualloc_ipc::frame::{self, Frame, FrameReader};
use gpualloc_ipc::message::{DeviceOffer, Message, OfferedMemory, Readiness, WireChunk};
use gpualloc_ipc::refcount::RefCountFile;
use gpualloc_ipc::{
    DeviceRegion, ExportConn, ImportConn, OnRelease, PeerPolicy, Received, SegmentMemory,
};
use gpualloc_runtime::{Backend, DeviceId, DevicePtr};
use gpualloc_sim::{SimBackend, SimConfig};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const DEV: DeviceId = DeviceId(0);

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn memfd_mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains("memfd:"))
        .count()
}

/// Waits (up to 5 s) until this process has `fds` fds and `maps` memfd mappings again.
fn settles_to(fds: usize, maps: usize, what: &str) {
    let t = Instant::now();
    while fd_count() != fds || memfd_mappings() != maps {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "{what}: fds {} (was {fds}), memfd mappings {} (was {maps})",
            fd_count(),
            memfd_mappings()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn send_all(sock: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) {
    let mut sent = 0;
    while sent < bytes.len() {
        match send_step(sock.as_fd(), bytes, sent, fds) {
            Ok(n) => sent += n,
            // The other end stopped reading (it failed and dropped): fine for a fuzzer.
            Err(_) => return,
        }
    }
}

fn recv_frame(sock: &UnixStream) -> Frame {
    let mut reader = FrameReader::new();
    loop {
        let n = recv_step(sock.as_fd(), &mut reader).unwrap();
        if let Some(f) = reader.advance(n).unwrap() {
            return f;
        }
    }
}

fn memfd(len: u64, sealed: bool) -> OwnedFd {
    let flags = rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING;
    let fd = rustix::fs::memfd_create("fuzz", flags).unwrap();
    rustix::fs::ftruncate(&fd, len).unwrap();
    if sealed {
        gpualloc_ipc::shm::ensure_sealed(fd.as_fd()).unwrap();
    }
    fd
}

/// Some fd a hostile peer might attach: a sealed or unsealed memfd, or a pipe end.
fn some_fd(rng: &mut StdRng) -> OwnedFd {
    match rng.random_range(0..3) {
        0 => memfd(rng.random_range(1..=16) * 4096, true),
        1 => memfd(4096, false),
        _ => rustix::pipe::pipe().unwrap().0,
    }
}

fn interesting(rng: &mut StdRng, around: u64) -> u64 {
    match rng.random_range(0..6) {
        0 => 0,
        1 => around,
        2 => around.saturating_add(1),
        3 => around.saturating_sub(4096),
        4 => 1 << 62,
        _ => rng.random_range(0..=around.saturating_mul(2)),
    }
}

fn random_message(rng: &mut StdRng, ids: u64) -> Message {
    match rng.random_range(0..5) {
        0 => Message::Released {
            id: rng.random_range(0..ids + 3),
        },
        1 => Message::Hello {
            pid: rng.random(),
            slots: rng.random(),
        },
        2 => Message::Host {
            len: interesting(rng, 4096),
            tag: rng.random(),
        },
        3 => Message::Device(DeviceOffer {
            id: rng.random(),
            slot: rng.random_range(0..20),
            device: rng.random_range(0..2),
            len: interesting(rng, 4096),
            ready: Readiness::Synchronized,
            memory: OfferedMemory::Legacy {
                handle: (0..rng.random_range(0..80)).map(|_| rng.random()).collect(),
                offset: interesting(rng, 4096),
            },
        }),
        _ => Message::Released { id: rng.random() },
    }
}

/// The exporter's end, fed hostile input. Returns how many iterations ran.
fn fuzz_exporter(rng: &mut StdRng, iters: u64) {
    let backend: Arc<dyn Backend> = SimBackend::new(SimConfig::fast(1)).unwrap();
    let base = backend.malloc(DEV, 1 << 20).unwrap();
    let (fds, maps) = (fd_count(), memfd_mappings());
    for i in 0..iters {
        let (a, b) = UnixStream::pair().unwrap();
        let mut conn = ExportConn::new(a, &PeerPolicy::default(), backend.clone()).unwrap();
        let hello = recv_frame(&b);
        let legit = rng.random_bool(0.5);
        let refs =
            legit.then(|| RefCountFile::open(hello.fds.into_iter().next().unwrap()).unwrap());
        let n = rng.random_range(1..=3u64);
        let released: Vec<Arc<AtomicUsize>> = (0..n).map(|_| Arc::default()).collect();
        for (k, flag) in released.iter().enumerate() {
            let ptr = DevicePtr(base.0 + k as u64 * 4096);
            let region = DeviceRegion {
                device: DEV,
                ptr,
                len: 4096,
                segment: SegmentMemory::Allocation { base },
            };
            let flag = flag.clone();
            conn.send_device(
                &region,
                None,
                Box::new(OnRelease::new(move || {
                    flag.fetch_add(1, Ordering::SeqCst);
                })),
            )
            .unwrap();
        }
        // A legitimate importer accepts every offer and releases some.
        let mut held = vec![false; n as usize];
        let mut let_go = vec![false; n as usize];
        for k in 0..n as usize {
            let Message::Device(offer) = recv_frame(&b).message else {
                panic!("expected an offer");
            };
            if let Some(refs) = &refs {
                let slot = &refs.counters()[offer.slot as usize];
                assert!(slot.accept());
                if rng.random_bool(0.5) {
                    assert!(slot.release_one());
                    let_go[k] = true;
                } else {
                    held[k] = true;
                }
            }
        }
        // Then hostile bytes.
        for _ in 0..rng.random_range(1..=4) {
            match rng.random_range(0..4) {
                0 => {
                    let junk: Vec<u8> =
                        (0..rng.random_range(1..64)).map(|_| rng.random()).collect();
                    send_all(&b, &junk, &[]);
                }
                1 | 2 => {
                    let bytes = frame::encode(&random_message(rng, n)).unwrap();
                    let attached: Vec<OwnedFd> =
                        (0..rng.random_range(0..3)).map(|_| some_fd(rng)).collect();
                    let borrowed: Vec<BorrowedFd<'_>> =
                        attached.iter().map(|f| f.as_fd()).collect();
                    let cut = if rng.random_bool(0.2) {
                        rng.random_range(1..bytes.len())
                    } else {
                        bytes.len()
                    };
                    send_all(&b, &bytes[..cut], &borrowed);
                }
                _ => {
                    let bytes = frame::encode(&Message::Released {
                        id: rng.random_range(0..=n),
                    })
                    .unwrap();
                    send_all(&b, &bytes, &[]);
                }
            }
        }
        // While the importer is connected, only what it let go of is freed.
        conn.collect();
        for k in 0..n as usize {
            let got = released[k].load(Ordering::SeqCst);
            assert_eq!(
                got,
                usize::from(let_go[k]),
                "iteration {i}: export {k} freed {got} times"
            );
        }
        // Serving ends in an error (keeper takes over) or at EOF; either way nothing held is
        // freed before the importer's EOF.
        let serving = std::thread::spawn(move || {
            let _ = conn.serve();
        });
        std::thread::sleep(Duration::from_micros(200));
        for k in 0..n as usize {
            if held[k] {
                assert_eq!(
                    released[k].load(Ordering::SeqCst),
                    0,
                    "iteration {i}: held export {k} freed"
                );
            }
        }
        let _ = (&b).flush();
        b.shutdown(Shutdown::Write).unwrap();
        serving.join().unwrap();
        drop(b);
        let t = Instant::now();
        while released.iter().any(|r| r.load(Ordering::SeqCst) == 0) {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "iteration {i}: an export never came back"
            );
            std::thread::sleep(Duration::from_micros(100));
        }
        for (k, r) in released.iter().enumerate() {
            assert_eq!(
                r.load(Ordering::SeqCst),
                1,
                "iteration {i}: export {k} freed twice"
            );
        }
        drop(refs);
    }
    settles_to(fds, maps, "exporter fuzz");
    backend.free(DEV, base).unwrap();
}

/// The importer's end, fed hostile offers.
fn fuzz_importer(rng: &mut StdRng, iters: u64) {
    let exporter = SimBackend::new(SimConfig::fast(1)).unwrap();
    let importer: Arc<dyn Backend> = SimBackend::new(SimConfig::fast(1)).unwrap();
    let size = 2u64 << 20;
    let alloc = exporter.malloc(DEV, size).unwrap();
    let handle = exporter.ipc_get_mem_handle(alloc).unwrap().0.to_vec();
    let gran = exporter.vmm_granularity(DEV).unwrap();
    let phys = exporter.phys_create(DEV, 2 * gran).unwrap();
    let (fds, maps) = (fd_count(), memfd_mappings());
    let (mut accepted, mut refused) = (0u64, 0u64);
    for i in 0..iters {
        let (a, b) = UnixStream::pair().unwrap();
        let refs = RefCountFile::create(8).unwrap();
        // The hello: usually right, sometimes not.
        let hello_fd: Option<OwnedFd> = match rng.random_range(0..10) {
            0 => None,
            1 => Some(some_fd(rng)),
            _ => Some(refs.fd().unwrap().try_clone_to_owned().unwrap()),
        };
        let hello = if rng.random_range(0..20) == 0 {
            random_message(rng, 1)
        } else {
            Message::Hello { pid: 1, slots: 8 }
        };
        let borrowed: Vec<BorrowedFd<'_>> = hello_fd.iter().map(|f| f.as_fd()).collect();
        send_all(&a, &frame::encode(&hello).unwrap(), &borrowed);
        let mut conn = match ImportConn::new(b, &PeerPolicy::default(), importer.clone(), DEV) {
            Ok(c) => c,
            Err(_) => {
                refused += 1;
                continue;
            }
        };
        for _ in 0..rng.random_range(1..=4) {
            let (msg, attached): (Message, Vec<OwnedFd>) = match rng.random_range(0..4) {
                0 => {
                    let obj = rng.random_range(1..=4u64) * 4096;
                    let fd = memfd(obj, rng.random_bool(0.8));
                    (
                        Message::Host {
                            len: interesting(rng, obj),
                            tag: 0,
                        },
                        vec![fd],
                    )
                }
                1 | 2 => {
                    let slot = rng.random_range(0..10u32);
                    if (slot as usize) < refs.slots() && rng.random_bool(0.8) {
                        refs.counters()[slot as usize].arm(OFFERED);
                    }
                    let handle = if rng.random_bool(0.8) {
                        handle.clone()
                    } else {
                        (0..64).map(|_| rng.random()).collect()
                    };
                    let offer = DeviceOffer {
                        id: rng.random(),
                        slot,
                        device: 0,
                        len: interesting(rng, 4096).max(u64::from(rng.random_bool(0.5))),
                        ready: Readiness::Synchronized,
                        memory: OfferedMemory::Legacy {
                            handle,
                            offset: interesting(rng, size),
                        },
                    };
                    (Message::Device(offer), vec![])
                }
                _ => {
                    let chunks: Vec<WireChunk> = (0..rng.random_range(0..3))
                        .map(|_| WireChunk {
                            handle: rng.random_range(0..4),
                            va_offset: interesting(rng, gran),
                            size: interesting(rng, gran),
                            handle_offset: interesting(rng, gran),
                        })
                        .collect();
                    let fds: Vec<OwnedFd> = chunks
                        .iter()
                        .map(|_| {
                            if rng.random_bool(0.7) {
                                exporter.phys_export_fd(phys).unwrap()
                            } else {
                                some_fd(rng)
                            }
                        })
                        .collect();
                    if rng.random_bool(0.8) {
                        refs.counters()[0].arm(OFFERED);
                    }
                    let offer = DeviceOffer {
                        id: rng.random(),
                        slot: 0,
                        device: 0,
                        len: interesting(rng, gran),
                        ready: Readiness::Synchronized,
                        memory: OfferedMemory::Vmm {
                            span: interesting(rng, 2 * gran),
                            offset: interesting(rng, gran),
                            chunks,
                        },
                    };
                    (Message::Device(offer), fds)
                }
            };
            let borrowed: Vec<BorrowedFd<'_>> = attached.iter().map(|f| f.as_fd()).collect();
            send_all(&a, &frame::encode(&msg).unwrap(), &borrowed);
            drop(attached);
            match conn.recv() {
                Ok(Received::Host { mapping, .. }) => {
                    assert!(!mapping.is_empty());
                    accepted += 1;
                }
                Ok(Received::Device(buf)) => {
                    assert!(!buf.is_empty(), "iteration {i}");
                    if !buf.is_vmm() {
                        // Both ends of the window lie in the one allocation opened.
                        let first = importer.mem_address_range(buf.ptr());
                        let last =
                            importer.mem_address_range(DevicePtr(buf.ptr().0 + buf.len() - 1));
                        match (first, last) {
                            (Ok((a, _)), Ok((b, _))) => assert_eq!(a, b, "iteration {i}"),
                            other => {
                                panic!("iteration {i}: window outside what was opened: {other:?}")
                            }
                        }
                    }
                    accepted += 1;
                }
                Err(_) => refused += 1,
            }
        }
        drop(conn);
        drop(a);
    }
    settles_to(fds, maps, "importer fuzz");
    assert!(
        accepted > 0 && refused > 0,
        "accepted {accepted}, refused {refused}"
    );
    println!("importer fuzz: {accepted} accepted, {refused} refused");
    exporter.phys_release(phys).unwrap();
    exporter.free(DEV, alloc).unwrap();
}

#[test]
fn both_ends_survive_hostile_peers() {
    let iters = env_u64("GPUALLOC_FUZZ_ITERS", 1500);
    let seed = env_u64("GPUALLOC_FUZZ_SEED", 1);
    println!("fuzz: {iters} iterations per end, seed {seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    fuzz_exporter(&mut rng, iters);
    fuzz_importer(&mut rng, iters);
}
