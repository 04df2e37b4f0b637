//! How long an imported buffer holds the exporter's block, with a real second process (this
//! test binary re-executed in a role named by an environment variable) and a control socket
//! that orders the two processes' steps:
//! - a buffer kept after its connection is dropped still holds the block (the exporter does
//!   not read EOF as "released": a second allocation is not corrupted by the importer's
//!   later writes);
//! - a buffer dropped on a live connection wakes an exporter waiting for it at once;
//! - `wait_returned` answers at once for ids it does not know or that already came back.
//!
//! The two-process tests run on the sim, or on the CUDA backend with `GPUALLOC_BACKEND=cuda`
//! (see common/); the in-process one stays on the sim, since a CUDA process cannot open its own
//! legacy IPC handle.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{core_guard, dev, region, TestBackend};
use gpualloc_devices::{AllocatorConfig, DeviceCore};
use gpualloc_ipc::{
    DeviceRegion, ExportConn, ImportConn, IpcError, OnRelease, PeerPolicy, Received, Returned,
    SegmentMemory,
};
use gpualloc_runtime::{Backend, DevicePtr, StreamHandle};
use gpualloc_sim::{SimBackend, SimConfig};

const ROLE: &str = "GPUALLOC_IPC_LIFETIME_ROLE";
const SOCK: &str = "GPUALLOC_IPC_LIFETIME_SOCK";
const CTRL: &str = "GPUALLOC_IPC_LIFETIME_CTRL";
const LEN: u64 = 2 << 20;

fn path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "gpualloc-lifetime-{}-{name}.sock",
        std::process::id()
    ))
}

fn byte(ctrl: &mut UnixStream) -> u8 {
    let mut b = [0u8];
    ctrl.read_exact(&mut b).unwrap();
    b[0]
}

// ---------------------------------------------------------------- the child process

/// The importer, when this binary runs as the child; a no-op in the normal run.
#[test]
fn importer_entry() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let tb = TestBackend::from_env(dev());
    let backend = tb.backend.clone();
    let stream = backend.stream_create(dev()).unwrap();
    let sock = UnixStream::connect(std::env::var(SOCK).unwrap()).unwrap();
    if role == "consume" {
        // A consumer that would wait for ever fails instead.
        sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    }
    let mut ctrl = UnixStream::connect(std::env::var(CTRL).unwrap()).unwrap();
    ctrl.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut conn = ImportConn::new(sock, &PeerPolicy::default(), backend.clone(), dev()).unwrap();
    if role == "late" {
        // Read the offer only after the exporter dropped its connection and reused the block.
        ctrl.write_all(b"r").unwrap();
        assert_eq!(byte(&mut ctrl), b'g');
        // The exporter kept the block for this offer: importing it is safe.
        let Ok(Received::Device(buf)) = conn.recv() else {
            panic!("the kept offer could not be imported");
        };
        backend
            .copy_to_device(stream, buf.ptr(), &[0xee; 4096])
            .unwrap();
        ctrl.write_all(b"w").unwrap();
        assert_eq!(byte(&mut ctrl), b'q');
        drop(buf);
        return;
    }
    let Received::Device(buf) = conn.recv().unwrap() else {
        panic!("expected a device buffer");
    };
    match role.as_str() {
        "keep" => {
            drop(conn);
            ctrl.write_all(b"d").unwrap();
            assert_eq!(byte(&mut ctrl), b'g');
            backend
                .copy_to_device(stream, buf.ptr(), &[0xee; 4096])
                .unwrap();
            ctrl.write_all(b"w").unwrap();
            drop(buf);
        }
        "hold" => {
            // Hold the buffer and the connection while the exporter drops its end.
            ctrl.write_all(b"h").unwrap();
            assert_eq!(byte(&mut ctrl), b'g');
            backend
                .copy_to_device(stream, buf.ptr(), &[0xee; 4096])
                .unwrap();
            ctrl.write_all(b"w").unwrap();
            assert_eq!(byte(&mut ctrl), b'q');
            drop(buf);
            drop(conn);
        }
        "consume" => {
            // The ordinary consumer: keep the newest buffer, release the one before, stop at
            // `Closed`. The buffer held when the exporter goes must not keep `recv` waiting.
            let mut newest = Some(buf);
            let mut received = 1;
            loop {
                match conn.recv() {
                    Ok(Received::Device(b)) => {
                        received += 1;
                        newest = Some(b);
                    }
                    Ok(other) => panic!("unexpected {other:?}"),
                    Err(IpcError::Closed) => break,
                    Err(e) => panic!("recv after {received} buffers: {e}"),
                }
            }
            assert_eq!(received, 2);
            ctrl.write_all(b"c").unwrap();
            assert_eq!(byte(&mut ctrl), b'q');
            drop(newest);
            drop(conn);
        }
        "drop" => {
            drop(buf);
            // Hold the connection until told to go (or 5 s pass).
            let mut b = [0u8];
            let _ = ctrl.read(&mut b);
        }
        other => panic!("unknown role {other}"),
    }
    backend.stream_destroy(stream).unwrap();
}

// ---------------------------------------------------------------- the parent process

struct Exporter {
    tb: TestBackend,
    backend: Arc<dyn Backend>,
    core: Arc<Mutex<DeviceCore>>,
    stream: StreamHandle,
    child: Child,
    /// `None` once a test handed it to `serve`.
    conn: Option<ExportConn>,
    ctrl: UnixStream,
    paths: [PathBuf; 2],
}

impl Exporter {
    fn start(role: &str) -> Exporter {
        Exporter::start_with(role, |_| {})
    }

    /// `start`, with `setup` applied to the exporter's socket before the connection is made.
    fn start_with(role: &str, setup: impl FnOnce(&UnixStream)) -> Exporter {
        let tb = TestBackend::from_env(dev());
        let backend = tb.backend.clone();
        let core = DeviceCore::new(backend.clone(), dev(), AllocatorConfig::default()).unwrap();
        let stream = backend.stream_create(dev()).unwrap();
        let paths = [path(&format!("{role}-data")), path(&format!("{role}-ctrl"))];
        for p in &paths {
            let _ = std::fs::remove_file(p);
        }
        let data = UnixListener::bind(&paths[0]).unwrap();
        let ctrl = UnixListener::bind(&paths[1]).unwrap();
        let child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "importer_entry",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ROLE, role)
            .env(SOCK, &paths[0])
            .env(CTRL, &paths[1])
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let (sock, _) = data.accept().unwrap();
        let (ctrl, _) = ctrl.accept().unwrap();
        ctrl.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        setup(&sock);
        let conn = ExportConn::new(sock, &PeerPolicy::default(), backend.clone()).unwrap();
        Exporter {
            tb,
            backend,
            core: Arc::new(Mutex::new(core)),
            stream,
            child,
            conn: Some(conn),
            ctrl,
            paths,
        }
    }

    fn malloc(&self) -> DevicePtr {
        self.core
            .lock()
            .unwrap()
            .malloc(LEN, self.stream)
            .unwrap()
            .ptr
    }

    fn export(&mut self, ptr: DevicePtr) -> u64 {
        let region = region(&self.core.lock().unwrap(), ptr);
        let guard = core_guard(self.core.clone(), ptr);
        let stream = self.stream;
        self.conn()
            .send_device(&region, Some(stream), guard)
            .unwrap()
    }

    fn conn(&mut self) -> &mut ExportConn {
        self.conn.as_mut().expect("the connection is being served")
    }

    fn read(&self, ptr: DevicePtr) -> Vec<u8> {
        let mut v = vec![0u8; 4096];
        self.backend
            .copy_from_device(self.stream, &mut v, ptr)
            .unwrap();
        v
    }

    /// Allocates a second block of the exported size, fills it, lets the importer write
    /// 0xee through its buffer (`g`, then `w` back), and checks that the write landed in the
    /// exported block, not in the second one.
    fn second_allocation_survives_the_importers_writes(&mut self, exported: DevicePtr) {
        let second = self.malloc();
        assert_ne!(second, exported, "the exported block was handed out again");
        self.backend
            .copy_to_device(self.stream, second, &[0x11; 4096])
            .unwrap();
        self.ctrl.write_all(b"g").unwrap();
        assert_eq!(byte(&mut self.ctrl), b'w');
        assert_eq!(
            self.read(second),
            vec![0x11; 4096],
            "the second allocation was corrupted"
        );
        assert_eq!(
            self.read(exported),
            vec![0xee; 4096],
            "the importer's writes"
        );
        self.core.lock().unwrap().free(second).unwrap();
    }

    /// The importer succeeded, and once the cache is emptied this process holds no device
    /// memory.
    fn finish(mut self) {
        assert!(self.child.wait().unwrap().success(), "the importer failed");
        for p in &self.paths {
            let _ = std::fs::remove_file(p);
        }
        let mut core = self.core.lock().unwrap();
        core.empty_cache().unwrap();
        assert_eq!(core.reserved_bytes(), 0);
        drop(core);
        self.backend.stream_destroy(self.stream).unwrap();
        self.tb.assert_nothing_leaked();
    }
}

#[test]
fn a_buffer_kept_after_its_connection_is_dropped_still_holds_the_block() {
    let mut ex = Exporter::start("keep");
    let exported = ex.malloc();
    ex.export(exported);
    let conn = ex.conn.take().unwrap();
    let serving = std::thread::spawn(move || conn.serve().unwrap());
    // The importer dropped its connection but keeps the buffer.
    assert_eq!(byte(&mut ex.ctrl), b'd');
    let t = Instant::now();
    while !serving.is_finished() && t.elapsed() < Duration::from_millis(300) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        !serving.is_finished(),
        "the exporter read EOF while the buffer lives"
    );
    // A second allocation of the same size, filled, while the importer still writes.
    ex.second_allocation_survives_the_importers_writes(exported);
    let end = serving.join().unwrap();
    assert_eq!((end.released, end.reclaimed), (1, 0));
    assert!(ex.core.lock().unwrap().allocation(exported).is_none());
    ex.finish();
}

#[test]
fn a_buffer_dropped_on_a_live_connection_wakes_the_waiting_exporter() {
    let mut ex = Exporter::start("drop");
    let ptr = ex.malloc();
    let id = ex.export(ptr);
    let t = Instant::now();
    assert_eq!(ex.conn().wait_returned(id).unwrap(), Returned::Released);
    let waited = t.elapsed();
    assert!(
        waited < Duration::from_secs(2),
        "woken after {waited:?}: the drop sent nothing"
    );
    assert!(ex.core.lock().unwrap().allocation(ptr).is_none());
    // Asked again: the recorded outcome, at once.
    assert_eq!(ex.conn().wait_returned(id).unwrap(), Returned::Released);
    ex.ctrl.write_all(b"q").unwrap();
    ex.finish();
}

#[test]
fn an_offer_unread_when_the_exporter_drops_its_connection_is_kept_for_the_importer() {
    let mut ex = Exporter::start("late");
    assert_eq!(byte(&mut ex.ctrl), b'r');
    let exported = ex.malloc();
    ex.export(exported);
    // The exporter's connection ends with the offer unread. The block is not taken back
    // while the importer may still accept the offer.
    drop(ex.conn.take());
    assert!(ex.core.lock().unwrap().allocation(exported).is_some());
    ex.second_allocation_survives_the_importers_writes(exported);
    assert!(ex.core.lock().unwrap().allocation(exported).is_some());
    // The importer lets go: the keeper frees the block.
    ex.ctrl.write_all(b"q").unwrap();
    ex.wait_freed(exported);
    ex.finish();
}

impl Exporter {
    /// Waits (up to 5 s) until the core no longer holds `ptr`.
    fn wait_freed(&self, ptr: DevicePtr) {
        let t = Instant::now();
        while self.core.lock().unwrap().allocation(ptr).is_some() {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "the keeper never freed it"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// A read timeout on the exporter's socket (the caller's, taken as it is) is not the
/// importer's end: the connection dropped while the importer holds the buffer keeps the block
/// for as long as it holds it, well past the timeout.
#[test]
fn a_read_timeout_on_the_exporters_socket_frees_nothing_the_importer_holds() {
    let mut ex = Exporter::start_with("hold", |sock| {
        sock.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap()
    });
    let exported = ex.malloc();
    ex.export(exported);
    assert_eq!(byte(&mut ex.ctrl), b'h');
    drop(ex.conn.take());
    std::thread::sleep(Duration::from_millis(600));
    assert!(
        ex.core.lock().unwrap().allocation(exported).is_some(),
        "the block was freed while the importer holds it"
    );
    ex.second_allocation_survives_the_importers_writes(exported);
    ex.ctrl.write_all(b"q").unwrap();
    ex.wait_freed(exported);
    ex.finish();
}

/// An importer holding a buffer sees `Closed` as soon as the exporter drops its connection
/// (its consumer loop ends and releases the buffer, and only then is the block freed).
#[test]
fn a_consumer_holding_a_buffer_sees_the_exporters_drop() {
    let mut ex = Exporter::start("consume");
    let (a, b) = (ex.malloc(), ex.malloc());
    ex.export(a);
    ex.export(b);
    drop(ex.conn.take());
    assert_eq!(byte(&mut ex.ctrl), b'c', "the consumer never saw the end");
    // `a` was released by the consumer; `b` is held until it is told to go.
    ex.wait_freed(a);
    assert!(ex.core.lock().unwrap().allocation(b).is_some());
    ex.ctrl.write_all(b"q").unwrap();
    ex.wait_freed(b);
    ex.finish();
}

/// An allocation of `LEN` bytes on the backend, and its first page as an exportable region.
fn allocation(backend: &Arc<dyn Backend>) -> (DevicePtr, DeviceRegion) {
    let ptr = backend.malloc(dev(), LEN).unwrap();
    let region = DeviceRegion {
        device: dev(),
        ptr,
        len: 4096,
        segment: SegmentMemory::Allocation { base: ptr },
    };
    (ptr, region)
}

#[test]
fn wait_returned_answers_at_once_for_unknown_and_returned_ids() {
    let backend: Arc<dyn Backend> = SimBackend::new(SimConfig::fast(dev().0 + 1)).unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    // A wait that would block fails after 2 s instead of hanging the test.
    a.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut conn = ExportConn::new(a, &PeerPolicy::default(), backend.clone()).unwrap();
    let mut imp = ImportConn::new(b, &PeerPolicy::default(), backend.clone(), dev()).unwrap();
    let unknown = |conn: &mut ExportConn| {
        for id in [0, 4, 99] {
            match conn.wait_returned(id) {
                Err(IpcError::UnknownExport(x)) => assert_eq!(x, id),
                other => panic!("id {id}: {other:?}"),
            }
        }
    };
    unknown(&mut conn);
    let (ptr, region) = allocation(&backend);
    let guard = || Box::new(OnRelease::new(|| {}));
    // Released by a drop on a live connection.
    let first = conn.send_device(&region, None, guard()).unwrap();
    let Received::Device(buf) = imp.recv().unwrap() else {
        panic!("expected a device buffer");
    };
    drop(buf);
    assert_eq!(conn.wait_returned(first).unwrap(), Returned::Released);
    assert_eq!(conn.wait_returned(first).unwrap(), Returned::Released);
    // Never read by the importer, which then goes: reclaimed at EOF.
    let second = conn.send_device(&region, None, guard()).unwrap();
    let third = conn.send_device(&region, None, guard()).unwrap();
    let Received::Device(kept) = imp.recv().unwrap() else {
        panic!("expected a device buffer");
    };
    drop(imp);
    drop(kept);
    assert_eq!(conn.wait_returned(third).unwrap(), Returned::Reclaimed);
    assert_eq!(conn.wait_returned(second).unwrap(), Returned::Released);
    assert_eq!(conn.wait_returned(third).unwrap(), Returned::Reclaimed);
    assert_eq!(conn.wait_returned(first).unwrap(), Returned::Released);
    unknown(&mut conn);
    drop(conn);
    backend.free(dev(), ptr).unwrap();
}

/// A close that fails keeps the reference: the importer may still have the memory mapped, so
/// the exporter must not get the block back (it would hand it out under the importer's
/// mapping). In one process on the sim, with the close failed by fault injection.
#[test]
fn a_failed_close_does_not_release_the_block() {
    use gpualloc_runtime::BackendError;
    use gpualloc_sim::{Fault, Op};
    let sim = SimBackend::new(SimConfig::fast(dev().0 + 1)).unwrap();
    let backend: Arc<dyn Backend> = sim.clone();
    let (a, b) = UnixStream::pair().unwrap();
    let mut conn = ExportConn::new(a, &PeerPolicy::default(), backend.clone()).unwrap();
    let mut imp = ImportConn::new(b, &PeerPolicy::default(), backend.clone(), dev()).unwrap();
    let (ptr, region) = allocation(&backend);
    let released = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = released.clone();
    conn.send_device(
        &region,
        None,
        Box::new(OnRelease::new(move || {
            flag.store(true, std::sync::atomic::Ordering::SeqCst)
        })),
    )
    .unwrap();
    let Received::Device(buf) = imp.recv().unwrap() else {
        panic!("expected a device buffer");
    };
    sim.inject(
        Op::IpcCloseMemHandle,
        Fault::FailNext {
            skip: 0,
            count: 1,
            error: BackendError::Injected("ipc_close_mem_handle"),
        },
    );
    drop(buf);
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        conn.collect().is_empty(),
        "a failed close released the block"
    );
    assert_eq!(conn.outstanding(), 1);
    assert!(!released.load(std::sync::atomic::Ordering::SeqCst));
    drop(imp);
    drop(conn);
    backend.free(dev(), ptr).unwrap();
}
