//! Real two-process tests: this test binary spawns itself as the consumer (an env var says
//! which role), the parent exports shared host memory and device buffers to it over a
//! Unix socket, and checks what comes back: the consumer's writes, the block reused only
//! after release, and everything reclaimed when the consumer is killed mid-use.
//! They run on the sim, or on the CUDA backend with `GPUALLOC_BACKEND=cuda` (see common/).

mod common;

use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{core_guard, dev, region, TestBackend};
use gpualloc_devices::{AllocatorConfig, DeviceCore};
use gpualloc_ipc::{
    shm, AsyncExportConn, Backing, DeviceRegion, ExportConn, ImportConn, MapOptions, OnRelease,
    PeerPolicy, Received, Returned, SegmentMemory, VmmChunk,
};
use gpualloc_runtime::{Backend, DevicePtr, StreamHandle};

const ROLE: &str = "GPUALLOC_IPC_TEST_ROLE";
const SOCK: &str = "GPUALLOC_IPC_TEST_SOCK";
const HOST_LEN: usize = 1 << 20;
const DEV_LEN: usize = 3 << 20;
const BACK_LEN: usize = 64 << 10;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64 * 7 + seed as u64) as u8 % 251)
        .collect()
}

fn writeback() -> Vec<u8> {
    (0..BACK_LEN).map(|i| (i % 253) as u8 ^ 0xA5).collect()
}

fn test_backend() -> (TestBackend, Arc<dyn Backend>) {
    let tb = TestBackend::from_env(dev());
    let backend = tb.backend.clone();
    (tb, backend)
}

fn sock_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("gpualloc-ipc-{}-{name}.sock", std::process::id()))
}

fn spawn(role: &str, path: &PathBuf, expect_vmm: bool) -> Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "consumer_entry",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(ROLE, role)
    .env(SOCK, path)
    .stdout(Stdio::null());
    if expect_vmm {
        cmd.env("EXPECT_VMM", "1");
    }
    cmd.spawn().unwrap()
}

fn shm_names(pid: u32) -> Vec<String> {
    let prefix = format!("{}{pid}-", shm::SHM_PREFIX);
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(&prefix))
                .collect()
        })
        .unwrap_or_default()
}

// ---------------------------------------------------------------- the child process

/// The consumer, when this binary runs as the child; a no-op in the normal test run.
#[test]
fn consumer_entry() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let path = std::env::var(SOCK).unwrap();
    let (_tb, backend) = test_backend();
    let stream = backend.stream_create(dev()).unwrap();
    let sock = UnixStream::connect(path).unwrap();
    let mut conn = ImportConn::new(sock, &PeerPolicy::default(), backend.clone(), dev()).unwrap();
    let Received::Host { mapping, tag } = conn.recv().unwrap() else {
        panic!("expected host memory first");
    };
    assert_eq!(tag, 7);
    assert_eq!(mapping.to_vec(), pattern(HOST_LEN, 1));
    let Received::Device(buf) = conn.recv().unwrap() else {
        panic!("expected a device buffer");
    };
    let len = buf.len() as usize;
    let mut got = vec![0u8; len];
    backend
        .copy_from_device(stream, &mut got, buf.ptr())
        .unwrap();
    assert_eq!(got, pattern(len, 2));
    backend
        .copy_to_device(stream, buf.ptr(), &writeback())
        .unwrap();
    match role.as_str() {
        "consumer" => {
            assert_eq!(buf.is_vmm(), std::env::var("EXPECT_VMM").is_ok());
            mapping.write_at(0, &writeback()).unwrap();
            conn.release(buf, &[stream]).unwrap();
        }
        "hang" => {
            // Tell the parent everything is mapped, then wait to be killed.
            mapping.write_at(0, &[0x55]).unwrap();
            std::thread::sleep(Duration::from_secs(60));
            panic!("was not killed");
        }
        other => panic!("unknown role {other}"),
    }
}

// ---------------------------------------------------------------- the parent process

struct Producer {
    tb: TestBackend,
    backend: Arc<dyn Backend>,
    core: Arc<Mutex<DeviceCore>>,
    stream: StreamHandle,
}

impl Producer {
    fn new() -> Producer {
        Producer::with(AllocatorConfig::default())
    }

    fn with(config: AllocatorConfig) -> Producer {
        let (tb, backend) = test_backend();
        let core = DeviceCore::new(backend.clone(), dev(), config).unwrap();
        let stream = backend.stream_create(dev()).unwrap();
        Producer {
            tb,
            backend,
            core: Arc::new(Mutex::new(core)),
            stream,
        }
    }

    fn malloc(&self, len: usize) -> DevicePtr {
        self.core
            .lock()
            .unwrap()
            .malloc(len as u64, self.stream)
            .unwrap()
            .ptr
    }

    fn host_buffer(&self) -> gpualloc_ipc::SharedMapping {
        let m = shm::create(HOST_LEN as u64, Backing::Memfd, MapOptions::shared_rw()).unwrap();
        m.write_at(0, &pattern(HOST_LEN, 1)).unwrap();
        m
    }

    fn read_device(&self, ptr: DevicePtr, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.backend
            .copy_from_device(self.stream, &mut v, ptr)
            .unwrap();
        v
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_and_device_buffer_round_trip_async() {
    round_trip(false).await;
}

/// The same with `expandable_segments:True`: the buffer travels as physical-page fds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expandable_segment_buffer_round_trip_async() {
    round_trip(true).await;
}

async fn round_trip(expandable: bool) {
    let p = Producer::with(AllocatorConfig::default().with_expandable_segments(expandable));
    let path = sock_path(if expandable {
        "roundtrip-es"
    } else {
        "roundtrip"
    });
    let _ = std::fs::remove_file(&path);
    let listener = tokio::net::UnixListener::bind(&path).unwrap();
    let mut child = spawn("consumer", &path, expandable);
    let (sock, _) = listener.accept().await.unwrap();
    let mut conn = AsyncExportConn::new(sock, &PeerPolicy::default(), p.backend.clone())
        .await
        .unwrap();
    assert_eq!(conn.peer().pid, child.id());

    let host = p.host_buffer();
    conn.send_host(&host, 7).await.unwrap();

    let ptr = p.malloc(DEV_LEN);
    p.backend
        .copy_to_device(p.stream, ptr, &pattern(DEV_LEN, 2))
        .unwrap();
    let region = region(&p.core.lock().unwrap(), ptr);
    assert_eq!(region.len, DEV_LEN as u64);
    match &region.segment {
        SegmentMemory::Allocation { .. } => assert!(!expandable),
        SegmentMemory::Vmm { chunks } => {
            assert!(expandable);
            assert!(!chunks.is_empty());
        }
    }
    let guard = core_guard(p.core.clone(), ptr);
    let id = conn
        .send_device(&region, Some(p.stream), guard)
        .await
        .unwrap();

    // While the consumer holds it, the block stays allocated and is not handed out again.
    assert!(p.core.lock().unwrap().allocation(ptr).is_some());
    let other = p.malloc(DEV_LEN);
    assert_ne!(other, ptr);
    p.core.lock().unwrap().free(other).unwrap();

    assert_eq!(conn.wait_returned(id).await.unwrap(), Returned::Released);
    // The consumer's writes are visible, in host and device memory.
    assert_eq!(host.to_vec()[..BACK_LEN], writeback()[..]);
    assert_eq!(host.to_vec()[BACK_LEN..], pattern(HOST_LEN, 1)[BACK_LEN..]);
    let dev = p.read_device(ptr, DEV_LEN);
    assert_eq!(dev[..BACK_LEN], writeback()[..]);
    assert_eq!(dev[BACK_LEN..], pattern(DEV_LEN, 2)[BACK_LEN..]);
    // Only now is the block free, and the next request of its size reuses it.
    assert!(p.core.lock().unwrap().allocation(ptr).is_none());
    let again = p.malloc(DEV_LEN);
    assert_eq!(again, ptr);
    p.core.lock().unwrap().free(again).unwrap();

    let totals = conn.serve().await.unwrap();
    assert_eq!((totals.released, totals.reclaimed), (1, 0));
    assert!(child.wait().unwrap().success());
    let mut core = p.core.lock().unwrap();
    core.empty_cache().unwrap();
    assert_eq!(core.reserved_bytes(), 0);
    drop(core);
    p.backend.stream_destroy(p.stream).unwrap();
    p.tb.assert_nothing_leaked();
    let _ = std::fs::remove_file(&path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_importer_is_reclaimed_and_nothing_leaks() {
    let p = Producer::new();
    let reserved_before = p.core.lock().unwrap().reserved_bytes();
    let path = sock_path("killed");
    let _ = std::fs::remove_file(&path);
    let listener = tokio::net::UnixListener::bind(&path).unwrap();
    let mut child = spawn("hang", &path, false);
    let (sock, _) = listener.accept().await.unwrap();
    let mut conn = AsyncExportConn::new(sock, &PeerPolicy::default(), p.backend.clone())
        .await
        .unwrap();
    let host = p.host_buffer();
    conn.send_host(&host, 7).await.unwrap();
    let ptr = p.malloc(DEV_LEN);
    p.backend
        .copy_to_device(p.stream, ptr, &pattern(DEV_LEN, 2))
        .unwrap();
    let region = region(&p.core.lock().unwrap(), ptr);
    let guard = core_guard(p.core.clone(), ptr);
    conn.send_device(&region, Some(p.stream), guard)
        .await
        .unwrap();

    // Wait until the child has mapped both and written into the device buffer.
    let deadline = Instant::now() + Duration::from_secs(20);
    while host.to_vec()[0] != 0x55 {
        assert!(Instant::now() < deadline, "child never got ready");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(conn.outstanding(), 1);
    assert!(p.core.lock().unwrap().allocation(ptr).is_some());
    let child_pid = child.id();
    child.kill().unwrap();
    assert!(!child.wait().unwrap().success());

    let totals = tokio::time::timeout(Duration::from_secs(20), conn.serve())
        .await
        .unwrap()
        .unwrap();
    assert_eq!((totals.released, totals.reclaimed), (0, 1));
    // The child's write reached the block before it died.
    assert_eq!(p.read_device(ptr, BACK_LEN), writeback());
    let mut core = p.core.lock().unwrap();
    assert!(core.allocation(ptr).is_none());
    assert!(core.reserved_bytes() > reserved_before);
    core.empty_cache().unwrap();
    assert_eq!(core.reserved_bytes(), reserved_before);
    drop(core);
    p.tb.assert_nothing_leaked();
    drop(host);
    assert!(shm_names(std::process::id()).is_empty());
    assert!(shm_names(child_pid).is_empty());
    let _ = std::fs::remove_file(&path);
}

#[test]
fn vmm_buffer_round_trip_blocking() {
    let (tb, backend) = test_backend();
    let stream = backend.stream_create(dev()).unwrap();
    let gran = backend.vmm_granularity(dev()).unwrap();
    // An expandable-style segment: two physical chunks mapped back to back; the buffer
    // straddles the boundary between them.
    let base = backend.va_reserve(dev(), 2 * gran, gran).unwrap();
    let mut chunks = Vec::new();
    for i in 0..2 {
        let h = backend.phys_create(dev(), gran).unwrap();
        let at = DevicePtr(base.0 + i * gran);
        backend.map(at, gran, 0, h).unwrap();
        backend.set_access(dev(), at, gran).unwrap();
        chunks.push(VmmChunk {
            ptr: at,
            size: gran,
            handle: h,
            handle_offset: 0,
        });
    }
    let ptr = DevicePtr(base.0 + gran / 2);
    let len = gran as usize;
    backend
        .copy_to_device(stream, ptr, &pattern(len, 2))
        .unwrap();
    let region = DeviceRegion {
        device: dev(),
        ptr,
        len: len as u64,
        segment: SegmentMemory::Vmm {
            chunks: chunks.clone(),
        },
    };

    let path = sock_path("vmm");
    let _ = std::fs::remove_file(&path);
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let mut child = spawn("consumer", &path, true);
    let (sock, _) = listener.accept().unwrap();
    let mut conn = ExportConn::new(sock, &PeerPolicy::default(), backend.clone()).unwrap();
    let host = shm::create(HOST_LEN as u64, Backing::Memfd, MapOptions::shared_rw()).unwrap();
    host.write_at(0, &pattern(HOST_LEN, 1)).unwrap();
    conn.send_host(&host, 7).unwrap();
    let released = Arc::new(AtomicBool::new(false));
    let flag = released.clone();
    let id = conn
        .send_device(
            &region,
            Some(stream),
            Box::new(OnRelease::new(move || flag.store(true, Ordering::SeqCst))),
        )
        .unwrap();
    assert!(!released.load(Ordering::SeqCst));
    assert_eq!(conn.wait_returned(id).unwrap(), Returned::Released);
    assert!(released.load(Ordering::SeqCst));
    let mut got = vec![0u8; len];
    backend.copy_from_device(stream, &mut got, ptr).unwrap();
    assert_eq!(got[..BACK_LEN], writeback()[..]);
    assert_eq!(got[BACK_LEN..], pattern(len, 2)[BACK_LEN..]);
    assert_eq!(conn.serve().unwrap().released, 1);
    assert!(child.wait().unwrap().success());
    for c in chunks {
        backend.unmap(c.ptr, c.size).unwrap();
        backend.phys_release(c.handle).unwrap();
    }
    backend.va_free(dev(), base, 2 * gran).unwrap();
    tb.assert_nothing_leaked();
    let _ = std::fs::remove_file(&path);
}
