//! What an importer can reach, with a real second process (this test binary re-executed in a
//! role named by an environment variable):
//! - a buffer of a pool of unsplit blocks (`PoolOptions::unsplit`, the way to export a buffer
//!   alone) is imported as its own 2 MiB range: its neighbour's bytes are out of reach; a
//!   buffer of the default pools is imported with the whole physical handle behind it, and
//!   the neighbour on that handle is within reach, as `ImportedBuffer::reachable` and the
//!   export docs say;
//! - 2,000 imports of 2 MiB buffers held at once reserve at most twice the bytes imported in
//!   the importer's address space: a handle behind several buffers of a connection is mapped
//!   once.
//!
//! Both run on the sim, or on the CUDA backend with `GPUALLOC_BACKEND=cuda` (see common/).

mod common;

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{core_guard, dev, region, TestBackend};
use gpualloc_devices::{AllocatorConfig, DeviceCore, PoolOptions, StatType};
use gpualloc_ipc::{DeviceRegion, ExportConn, ImportConn, PeerPolicy, Received};
use gpualloc_runtime::{Backend, DevicePtr, StreamHandle};

const ROLE: &str = "GPUALLOC_IPC_REACH_ROLE";
const SOCK: &str = "GPUALLOC_IPC_REACH_SOCK";
const MIB: u64 = 1 << 20;
/// Connections of the many-imports test (a connection has 512 slots).
const CONNS: usize = 4;
const PER_CONN: usize = 500;

fn path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("gpualloc-reach-{}-{name}.sock", std::process::id()))
}

/// A 4 KiB pattern no other bytes of these tests hold.
fn pattern(seed: u8) -> Vec<u8> {
    (0..4096u32)
        .map(|i| (i.wrapping_mul(31) as u8) ^ seed)
        .collect()
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// This process's virtual address space (VmSize), in bytes.
fn vm_size() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmSize:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib << 10
}

// ---------------------------------------------------------------- the child process

/// The importer, when this binary runs as the child; a no-op in the normal run.
#[test]
fn reach_entry() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let tb = TestBackend::from_env(dev());
    let backend = tb.backend.clone();
    let stream = backend.stream_create(dev()).unwrap();
    let connect = || {
        let sock = UnixStream::connect(std::env::var(SOCK).unwrap()).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        ImportConn::new(sock, &PeerPolicy::default(), backend.clone(), dev()).unwrap()
    };
    match role.as_str() {
        "neighbours" => {
            let mut conn = connect();
            let mut next = || match conn.recv().unwrap() {
                Received::Device(b) => b,
                other => panic!("expected a device buffer, got {other:?}"),
            };
            let (alone, shared) = (next(), next());
            let read_all = |buf: &gpualloc_ipc::ImportedBuffer| {
                let (start, len) = buf.reachable();
                let mut bytes = vec![0u8; len as usize];
                backend.copy_from_device(stream, &mut bytes, start).unwrap();
                (len, bytes)
            };
            // The buffer of the unsplit pool: its own 2 MiB, its own bytes, not its
            // neighbour's.
            let (len, bytes) = read_all(&alone);
            assert_eq!(
                len,
                2 * MIB,
                "reachable from the buffer of the unsplit pool"
            );
            assert!(contains(&bytes, &pattern(0xa1)), "its own bytes");
            assert!(!contains(&bytes, &pattern(0xb2)), "its neighbour's bytes");
            // The buffer of the default pools: the whole 2 MiB page of the small pool, with
            // the neighbour on it.
            let (len, bytes) = read_all(&shared);
            assert_eq!(
                len,
                2 * MIB,
                "reachable from the buffer of the default pool"
            );
            assert!(contains(&bytes, &pattern(0xc3)), "its own bytes");
            assert!(
                contains(&bytes, &pattern(0xd4)),
                "the neighbour on its handle, as documented"
            );
        }
        "many" => {
            let mut conns: Vec<ImportConn> = (0..CONNS).map(|_| connect()).collect();
            let before = vm_size();
            let mut held = Vec::new();
            for conn in &mut conns {
                for _ in 0..PER_CONN {
                    match conn.recv().unwrap() {
                        Received::Device(b) => held.push(b),
                        other => panic!("expected a device buffer, got {other:?}"),
                    }
                }
            }
            let grown = vm_size().saturating_sub(before);
            let imported: u64 = held.iter().map(|b| b.len()).sum();
            eprintln!(
                "{} imports, {} MiB imported, address space grew by {} MiB ({:.2}x)",
                held.len(),
                imported >> 20,
                grown >> 20,
                grown as f64 / imported as f64
            );
            assert_eq!(imported, (CONNS * PER_CONN) as u64 * 2 * MIB);
            assert!(
                grown <= 2 * imported,
                "{grown} bytes for {imported} imported"
            );
        }
        other => panic!("unknown role {other}"),
    }
    backend.stream_destroy(stream).unwrap();
}

// ---------------------------------------------------------------- the parent process

struct Parent {
    tb: TestBackend,
    backend: Arc<dyn Backend>,
    core: Arc<Mutex<DeviceCore>>,
    stream: StreamHandle,
    child: Child,
    listener: UnixListener,
    path: PathBuf,
}

impl Parent {
    fn start(role: &str) -> Parent {
        let tb = TestBackend::from_env(dev());
        let backend = tb.backend.clone();
        let config = AllocatorConfig::parse("expandable_segments:True").unwrap();
        let core = DeviceCore::new(backend.clone(), dev(), config).unwrap();
        let stream = backend.stream_create(dev()).unwrap();
        let path = path(role);
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        let child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "reach_entry", "--nocapture", "--test-threads=1"])
            .env(ROLE, role)
            .env(SOCK, &path)
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        Parent {
            tb,
            backend,
            core: Arc::new(Mutex::new(core)),
            stream,
            child,
            listener,
            path,
        }
    }

    fn accept(&self) -> ExportConn {
        let (sock, _) = self.listener.accept().unwrap();
        ExportConn::new(sock, &PeerPolicy::default(), self.backend.clone()).unwrap()
    }

    fn fill(&self, ptr: DevicePtr, seed: u8) {
        self.backend
            .copy_to_device(self.stream, ptr, &pattern(seed))
            .unwrap();
    }

    fn export(&self, conn: &mut ExportConn, ptr: DevicePtr) {
        let region = region(&self.core.lock().unwrap(), ptr);
        let guard = core_guard(self.core.clone(), ptr);
        conn.send_device(&region, Some(self.stream), guard).unwrap();
    }

    /// The importer succeeded; its exports all came back; nothing leaked.
    fn finish(mut self, conns: Vec<ExportConn>) {
        assert!(self.child.wait().unwrap().success(), "the importer failed");
        drop(conns);
        let t = Instant::now();
        while self.core.lock().unwrap().stats().allocated_bytes[StatType::All as usize].current > 0
        {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "exports never came back"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = std::fs::remove_file(&self.path);
        let mut core = self.core.lock().unwrap();
        core.empty_cache().unwrap();
        assert_eq!(core.reserved_bytes(), 0);
        drop(core);
        self.backend.stream_destroy(self.stream).unwrap();
        self.tb.assert_nothing_leaked();
    }
}

#[test]
fn a_buffer_of_an_unsplit_pool_is_imported_alone() {
    let p = Parent::start("neighbours");
    let mut conn = p.accept();
    let (pool, alone, neighbour, shared, shared_neighbour) = {
        let mut core = p.core.lock().unwrap();
        let pool = core.create_named_pool(
            "export",
            PoolOptions {
                unsplit: Some(2 * MIB),
                ..PoolOptions::default()
            },
        );
        (
            pool,
            core.malloc_in(pool, MIB, p.stream).unwrap().ptr,
            core.malloc_in(pool, MIB, p.stream).unwrap().ptr,
            core.malloc(MIB, p.stream).unwrap().ptr,
            core.malloc(MIB, p.stream).unwrap().ptr,
        )
    };
    for (ptr, seed) in [
        (alone, 0xa1),
        (neighbour, 0xb2),
        (shared, 0xc3),
        (shared_neighbour, 0xd4),
    ] {
        p.fill(ptr, seed);
    }
    // What the exporter can tell before sending.
    let exposed = |ptr| {
        region(&p.core.lock().unwrap(), ptr)
            .exposed(&*p.backend)
            .unwrap()
    };
    assert_eq!(exposed(alone), (alone, 2 * MIB));
    let (start, len) = exposed(shared);
    assert_eq!(len, 2 * MIB);
    assert!(start.0 <= shared_neighbour.0 && shared_neighbour.0 < start.0 + len);
    p.export(&mut conn, alone);
    p.export(&mut conn, shared);
    // Served until the importer is done (`finish` checks it succeeded): both come back.
    let end = conn.serve().unwrap();
    assert_eq!(end.released + end.reclaimed, 2);
    let mut core = p.core.lock().unwrap();
    core.free(neighbour).unwrap();
    core.free(shared_neighbour).unwrap();
    core.release_pool(pool).unwrap();
    drop(core);
    p.finish(Vec::new());
}

#[test]
fn two_thousand_imports_reserve_at_most_twice_the_bytes_imported() {
    let p = Parent::start("many");
    let mut conns: Vec<ExportConn> = (0..CONNS).map(|_| p.accept()).collect();
    let ptrs: Vec<DevicePtr> = {
        let mut core = p.core.lock().unwrap();
        (0..CONNS * PER_CONN)
            .map(|_| core.malloc(2 * MIB, p.stream).unwrap().ptr)
            .collect()
    };
    for (i, ptr) in ptrs.into_iter().enumerate() {
        p.export(&mut conns[i / PER_CONN], ptr);
    }
    p.finish(conns);
}

/// Buffers on one physical handle share the importer's mapping of it: it stays mapped (the
/// remaining buffer reads its bytes) until the last of them is released, then goes with its
/// reservation and handle; a last release whose unmap fails keeps its reference (the
/// exporter does not get the block back while this process may still reach it). In one
/// process, with a sim for each side (the fds of VMM memory cross between them).
#[test]
fn buffers_on_one_handle_share_a_mapping_until_the_last_goes() {
    use gpualloc_ipc::OnRelease;
    use gpualloc_runtime::{BackendError, DeviceId};
    use gpualloc_sim::{Fault, Op, SimBackend, SimConfig};
    use std::sync::atomic::{AtomicUsize, Ordering};
    const DEV: DeviceId = DeviceId(0);
    let exporter: Arc<dyn Backend> = SimBackend::new(SimConfig::fast(1)).unwrap();
    let sim = SimBackend::new(SimConfig::fast(1)).unwrap();
    let importer: Arc<dyn Backend> = sim.clone();
    let config = AllocatorConfig::parse("expandable_segments:True").unwrap();
    let mut core = DeviceCore::new(exporter.clone(), DEV, config).unwrap();
    let es = exporter.stream_create(DEV).unwrap();
    let is = importer.stream_create(DEV).unwrap();
    // Three 1 MiB buffers of the small pool: one 2 MiB page, one handle.
    let ptrs: Vec<DevicePtr> = (0..3).map(|_| core.malloc(MIB, es).unwrap().ptr).collect();
    for (i, p) in ptrs.iter().enumerate() {
        exporter
            .copy_to_device(es, *p, &pattern(0x10 + i as u8))
            .unwrap();
    }
    let regions: Vec<DeviceRegion> = ptrs.iter().map(|p| region(&core, *p)).collect();
    let (a, b) = UnixStream::pair().unwrap();
    let mut conn = ExportConn::new(a, &PeerPolicy::default(), exporter.clone()).unwrap();
    let mut imp = ImportConn::new(b, &PeerPolicy::default(), importer.clone(), DEV).unwrap();
    let released = Arc::new(AtomicUsize::new(0));
    fn recv(
        conn: &mut ExportConn,
        imp: &mut ImportConn,
        region: &DeviceRegion,
        released: &Arc<AtomicUsize>,
    ) -> gpualloc_ipc::ImportedBuffer {
        let r = released.clone();
        conn.send_device(
            region,
            None,
            Box::new(OnRelease::new(move || {
                r.fetch_add(1, Ordering::SeqCst);
            })),
        )
        .unwrap();
        match imp.recv().unwrap() {
            Received::Device(buf) => buf,
            other => panic!("expected a device buffer, got {other:?}"),
        }
    }
    let first = recv(&mut conn, &mut imp, &regions[0], &released);
    let second = recv(&mut conn, &mut imp, &regions[1], &released);
    assert_eq!(first.reachable(), second.reachable(), "one mapping");
    assert_eq!(sim.live_reservations(), 1);
    drop(first);
    // The mapping stays for the second buffer.
    let mut got = vec![0u8; 4096];
    importer
        .copy_from_device(is, &mut got, second.ptr())
        .unwrap();
    assert_eq!(got, pattern(0x11));
    assert_eq!(sim.live_reservations(), 1);
    drop(second);
    assert_eq!((sim.live_reservations(), sim.live_phys()), (0, 0));
    assert_eq!(conn.collect().len(), 2);
    // A last release whose unmap fails keeps its reference.
    let third = recv(&mut conn, &mut imp, &regions[2], &released);
    sim.inject(
        Op::Unmap,
        Fault::FailNext {
            skip: 0,
            count: 1,
            error: BackendError::Injected("unmap"),
        },
    );
    drop(third);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(conn.collect().len(), 0, "a failed unmap released the block");
    assert_eq!(released.load(Ordering::SeqCst), 2);
    assert_eq!(sim.live_reservations(), 1);
    sim.clear_faults();
    drop(imp);
    drop(conn);
    for p in ptrs {
        let _ = core.free(p);
    }
}
