//! The keeper of dropped exporter connections (`keeper.rs`), at scale and at the edge of the
//! process's resources, in one process on the sim (both ends here: the keeper's thread, fds
//! and bounds are the exporter's, whoever the importer is). The tests of this binary hold a
//! lock in turn: the keeper is process-wide, and one of them exhausts the process's fds.

use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpualloc_ipc::keeper::{self, MAX_CONNECTIONS_PER_PEER};
use gpualloc_ipc::{
    DeviceRegion, ExportConn, ImportConn, IpcError, OnRelease, PeerPolicy, Received, SegmentMemory,
};
use gpualloc_runtime::{Backend, DeviceId, DevicePtr};
use gpualloc_sim::{SimBackend, SimConfig};

static SERIAL: Mutex<()> = Mutex::new(());
const DEV: DeviceId = DeviceId(0);

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Threads of this process named as the keeper's (`gpualloc-ipc-keeper`, which the kernel
/// keeps as its first 15 bytes). The test harness's own threads come and go.
fn keeper_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.trim_end() == "gpualloc-ipc-ke")
        .count()
}

/// Waits up to 10 s for `done`.
fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let t = Instant::now();
    while !done() {
        assert!(t.elapsed() < Duration::from_secs(10), "never: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Raises the soft fd limit to the hard one (1,000 connections with both ends here need a
/// few thousand fds).
fn raise_fd_limit() {
    let lim = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    rustix::process::setrlimit(
        rustix::process::Resource::Nofile,
        rustix::process::Rlimit {
            current: lim.maximum,
            maximum: lim.maximum,
        },
    )
    .unwrap();
}

struct Rig {
    backend: Arc<dyn Backend>,
    ptr: DevicePtr,
    region: DeviceRegion,
    released: Arc<AtomicUsize>,
}

impl Rig {
    fn new() -> Rig {
        let backend: Arc<dyn Backend> = SimBackend::new(SimConfig::fast(1)).unwrap();
        let ptr = backend.malloc(DEV, 2 << 20).unwrap();
        let region = DeviceRegion {
            device: DEV,
            ptr,
            len: 4096,
            segment: SegmentMemory::Allocation { base: ptr },
        };
        Rig {
            backend,
            ptr,
            region,
            released: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Exports the region over `conn`; its release counts in `released`.
    fn export(&self, conn: &mut ExportConn) {
        let released = self.released.clone();
        conn.send_device(
            &self.region,
            None,
            Box::new(OnRelease::new(move || {
                released.fetch_add(1, Ordering::SeqCst);
            })),
        )
        .unwrap();
    }

    /// A connection with one export the importer received and holds.
    fn exported(&self) -> (ExportConn, ImportConn, gpualloc_ipc::ImportedBuffer) {
        let (a, b) = UnixStream::pair().unwrap();
        let mut conn = ExportConn::new(a, &PeerPolicy::default(), self.backend.clone()).unwrap();
        let mut imp =
            ImportConn::new(b, &PeerPolicy::default(), self.backend.clone(), DEV).unwrap();
        self.export(&mut conn);
        let Received::Device(buf) = imp.recv().unwrap() else {
            panic!("expected a device buffer");
        };
        (conn, imp, buf)
    }
}

/// 1,000 connections dropped with an export each held by the importer: one keeper thread
/// keeps them all; every export comes back exactly once when the importers let go, and the
/// keeper's thread and every fd are gone after. Past the per-peer bound a new connection is
/// refused up front.
#[test]
fn a_thousand_dropped_connections_are_kept_by_one_thread_and_all_come_back_once() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    raise_fd_limit();
    let rig = Rig::new();
    let fds = open_fds();
    assert!(!keeper::running());
    assert_eq!(keeper_threads(), 0);
    let mut held = Vec::new();
    let mut conns = Vec::new();
    for _ in 0..1000 {
        let (conn, imp, buf) = rig.exported();
        conns.push(conn);
        held.push((imp, buf));
    }
    assert!(keeper::running());
    assert_eq!(keeper_threads(), 1, "one keeper thread");
    // The per-peer bound: 1,024 connections of this process, the next refused.
    let mut extra = Vec::new();
    while keeper::connections() < MAX_CONNECTIONS_PER_PEER {
        let (a, b) = UnixStream::pair().unwrap();
        extra.push((
            ExportConn::new(a, &PeerPolicy::default(), rig.backend.clone()).unwrap(),
            b,
        ));
    }
    let (a, b) = UnixStream::pair().unwrap();
    match ExportConn::new(a, &PeerPolicy::default(), rig.backend.clone()) {
        Err(IpcError::KeeperLimit { limit, .. }) => assert_eq!(limit, MAX_CONNECTIONS_PER_PEER),
        Err(e) => panic!("refused with {e}"),
        Ok(_) => panic!("connection {} accepted", MAX_CONNECTIONS_PER_PEER + 1),
    }
    drop(b);
    // One goes, one more comes, and the bound holds again.
    extra.pop();
    let (a, b) = UnixStream::pair().unwrap();
    extra.push((
        ExportConn::new(a, &PeerPolicy::default(), rig.backend.clone()).unwrap(),
        b,
    ));
    let (a, b) = UnixStream::pair().unwrap();
    assert!(matches!(
        ExportConn::new(a, &PeerPolicy::default(), rig.backend.clone()),
        Err(IpcError::KeeperLimit { .. })
    ));
    drop(b);
    drop(extra);
    // Dropped with the exports out: all kept, none released.
    drop(conns);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(rig.released.load(Ordering::SeqCst), 0);
    assert_eq!(keeper::connections(), 1000);
    assert_eq!(keeper_threads(), 1, "still one keeper thread");
    // Half the importers release their buffer and keep their connection; the other half
    // drop their connection first and then the buffer.
    for (i, (imp, buf)) in held.into_iter().enumerate() {
        if i % 2 == 0 {
            drop(buf);
            drop(imp);
        } else {
            drop(imp);
            drop(buf);
        }
    }
    wait_until("every export back", || {
        rig.released.load(Ordering::SeqCst) == 1000
    });
    wait_until("the keeper's thread gone", || !keeper::running());
    assert_eq!(keeper::connections(), 0);
    wait_until("no keeper thread left", || keeper_threads() == 0);
    assert_eq!(open_fds(), fds, "fds back to the start");
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        rig.released.load(Ordering::SeqCst),
        1000,
        "each exactly once"
    );
    rig.backend.free(DEV, rig.ptr).unwrap();
}

/// The importer of `with_no_fd_left_...`, when this binary runs as the child: receives one
/// buffer, says so, holds it until told to go, then writes 0xee through it and releases it.
#[test]
fn holder_entry() {
    let Ok(sock) = std::env::var(HOLDER_SOCK) else {
        return;
    };
    let backend: Arc<dyn Backend> = SimBackend::new(SimConfig::fast(1)).unwrap();
    let stream = backend.stream_create(DEV).unwrap();
    let data = UnixStream::connect(&sock).unwrap();
    data.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut ctrl = UnixStream::connect(&sock).unwrap();
    ctrl.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut imp = ImportConn::new(data, &PeerPolicy::default(), backend.clone(), DEV).unwrap();
    let Received::Device(buf) = imp.recv().unwrap() else {
        panic!("expected a device buffer");
    };
    // The exporter's end is closed for sending once the keeper has it: `Closed`.
    assert!(matches!(imp.recv(), Err(IpcError::Closed)));
    std::io::Write::write_all(&mut ctrl, b"c").unwrap();
    let mut g = [0u8];
    std::io::Read::read_exact(&mut ctrl, &mut g).unwrap();
    assert_eq!(&g, b"g");
    backend
        .copy_to_device(stream, buf.ptr(), &[0xee; 4096])
        .unwrap();
    backend.stream_synchronize(stream).unwrap();
    std::io::Write::write_all(&mut ctrl, b"w").unwrap();
    drop(buf);
    drop(imp);
    backend.stream_destroy(stream).unwrap();
}

const HOLDER_SOCK: &str = "GPUALLOC_IPC_KEEPER_HOLDER_SOCK";

/// With every fd of the exporter process in use, dropping a connection whose export an
/// importer (a second process) holds frees nothing: the keeper needs no fd then, it took its
/// socket's duplicate when the connection was made, and its thread runs already. A new
/// connection is refused with a typed error meanwhile.
#[test]
fn with_no_fd_left_a_dropped_connection_frees_nothing_the_importer_holds() {
    use std::io::Read;
    use std::os::unix::net::UnixListener;
    use std::process::{Command, Stdio};
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let rig = Rig::new();
    let path = std::env::temp_dir().join(format!("gpualloc-keeper-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "holder_entry", "--nocapture", "--test-threads=1"])
        .env(HOLDER_SOCK, &path)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let (sock, _) = listener.accept().unwrap();
    let (mut ctrl, _) = listener.accept().unwrap();
    ctrl.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut conn = ExportConn::new(sock, &PeerPolicy::default(), rig.backend.clone()).unwrap();
    rig.export(&mut conn);
    let (a, b) = UnixStream::pair().unwrap();
    // Use up every fd (under a soft limit just above what is open, so that it is quick).
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let limit = getrlimit(Resource::Nofile);
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(open_fds() as u64 + 32),
            maximum: limit.maximum,
        },
    )
    .unwrap();
    let mut hog = Vec::new();
    while let Ok(f) = std::fs::File::open("/dev/null") {
        hog.push(f);
    }
    assert!(keeper::running(), "the keeper's thread runs already");
    drop(conn);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        rig.released.load(Ordering::SeqCst),
        0,
        "freed under the importer"
    );
    match ExportConn::new(a, &PeerPolicy::default(), rig.backend.clone()) {
        Err(IpcError::Os { .. }) => {}
        Err(e) => panic!("refused with {e}"),
        Ok(_) => panic!("a connection without an fd for its keeper"),
    }
    drop(hog);
    setrlimit(Resource::Nofile, limit).unwrap();
    drop(b);
    // The importer saw `Closed`; told to, it writes through its buffer (the block is still
    // the export's), then lets go: released once.
    let mut c = [0u8];
    ctrl.read_exact(&mut c).unwrap();
    assert_eq!(&c, b"c");
    assert_eq!(rig.released.load(Ordering::SeqCst), 0);
    std::io::Write::write_all(&mut ctrl, b"g").unwrap();
    ctrl.read_exact(&mut c).unwrap();
    assert_eq!(&c, b"w");
    assert!(child.wait().unwrap().success(), "the importer failed");
    let mut got = vec![0u8; 4096];
    let s = rig.backend.stream_create(DEV).unwrap();
    rig.backend.copy_from_device(s, &mut got, rig.ptr).unwrap();
    assert_eq!(got, vec![0xee; 4096]);
    rig.backend.stream_destroy(s).unwrap();
    wait_until("the export back", || {
        rig.released.load(Ordering::SeqCst) == 1
    });
    wait_until("the keeper's thread gone", || !keeper::running());
    let _ = std::fs::remove_file(&path);
    rig.backend.free(DEV, rig.ptr).unwrap();
}

/// A release made through the shared counter alone (no frame, the importer's connection
/// open and silent: a minimal importer, or one that lies) is collected by the keeper within
/// a few of its collection periods, not held until the importer's next byte or its end.
#[test]
fn the_keeper_collects_a_release_made_through_the_counter_alone() {
    use gpualloc_ipc::counter::SharedCounter;
    use gpualloc_ipc::fdpass::recv_step;
    use gpualloc_ipc::frame::{Frame, FrameReader};
    use gpualloc_ipc::keeper::COLLECT_EVERY;
    use gpualloc_ipc::message::Message;
    use gpualloc_ipc::refcount::RefCountFile;
    use std::os::fd::AsFd;
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let rig = Rig::new();
    let (a, b) = UnixStream::pair().unwrap();
    let mut conn = ExportConn::new(a, &PeerPolicy::default(), rig.backend.clone()).unwrap();
    rig.export(&mut conn);
    // The raw importer: the hello's counters, the offer's slot, accepted.
    let mut reader = FrameReader::new();
    let mut frame = || -> Frame {
        loop {
            let n = recv_step(b.as_fd(), &mut reader).unwrap();
            assert!(n > 0);
            if let Some(f) = reader.advance(n).unwrap() {
                return f;
            }
        }
    };
    let mut hello = frame();
    let refs = RefCountFile::open(hello.fds.remove(0)).unwrap();
    let Message::Device(offer) = frame().message else {
        panic!("expected a device offer");
    };
    let counter = &refs.counters()[offer.slot as usize];
    assert!(counter.accept());
    drop(conn);
    std::thread::sleep(COLLECT_EVERY * 2);
    assert_eq!(rig.released.load(Ordering::SeqCst), 0);
    assert!(counter.release_one());
    wait_until("the counter's release collected", || {
        rig.released.load(Ordering::SeqCst) == 1
    });
    drop(b);
    wait_until("the keeper's thread gone", || !keeper::running());
    rig.backend.free(DEV, rig.ptr).unwrap();
}
