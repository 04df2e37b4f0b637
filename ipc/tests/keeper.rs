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
use gpualloc_runtime::sim::{SimBackend, SimConfig};
use gpualloc_runtime::{Backend, DeviceId, DevicePtr};

static SERIAL: Mutex<()> = Mutex::new(());
const DEV: DeviceId = DeviceId(0);

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
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

    /// A connection with one export the importer received and holds.
    fn exported(&self) -> (ExportConn, ImportConn, gpualloc_ipc::ImportedBuffer) {
        let (a, b) = UnixStream::pair().unwrap();
        let mut conn = ExportConn::new(a, &PeerPolicy::default(), self.backend.clone()).unwrap();
        let mut imp =
            ImportConn::new(b, &PeerPolicy::default(), self.backend.clone(), DEV).unwrap();
        let released = self.released.clone();
        conn.send_device(
            &self.region,
            None,
            Box::new(OnRelease::new(move || {
                released.fetch_add(1, Ordering::SeqCst);
            })),
        )
        .unwrap();
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
    let (fds, threads_at_start) = (open_fds(), threads());
    assert!(!keeper::running());
    let mut held = Vec::new();
    let mut conns = Vec::new();
    for _ in 0..1000 {
        let (conn, imp, buf) = rig.exported();
        conns.push(conn);
        held.push((imp, buf));
    }
    assert!(keeper::running());
    assert_eq!(threads(), threads_at_start + 1, "one keeper thread");
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
    assert_eq!(threads(), threads_at_start + 1, "still one keeper thread");
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
    wait_until("threads back to the start", || {
        threads() == threads_at_start
    });
    assert_eq!(open_fds(), fds, "fds back to the start");
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        rig.released.load(Ordering::SeqCst),
        1000,
        "each exactly once"
    );
    rig.backend.free(DEV, rig.ptr).unwrap();
}

/// With every fd of the process in use, dropping a connection whose export the importer
/// holds frees nothing (the keeper needs no fd then: it took its socket's duplicate when the
/// connection was made); a new connection is refused with a typed error.
#[test]
fn with_no_fd_left_a_dropped_connection_frees_nothing_the_importer_holds() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let rig = Rig::new();
    let (conn, imp, buf) = rig.exported();
    let (a, b) = UnixStream::pair().unwrap();
    // Use up every fd.
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
    drop(b);
    // The importer lets go: released once.
    drop(buf);
    drop(imp);
    wait_until("the export back", || {
        rig.released.load(Ordering::SeqCst) == 1
    });
    wait_until("the keeper's thread gone", || !keeper::running());
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
    let released = rig.released.clone();
    conn.send_device(
        &rig.region,
        None,
        Box::new(OnRelease::new(move || {
            released.fetch_add(1, Ordering::SeqCst);
        })),
    )
    .unwrap();
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
