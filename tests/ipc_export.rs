//! Exporting a `DeviceBuffer` of an `Allocator` to another process: this test binary spawns
//! itself as the consumer (an env var says so), which maps the buffer, verifies the
//! producer's pattern, writes back and releases (or is killed). The producer's block stays
//! allocated and unused until then: a malloc of the same size gets another address before the
//! release and the same block after it. Both processes run on the sim, or on the CUDA backend
//! with `GPUALLOC_BACKEND=cuda` (the IPC crate's test helper, shared).

#[path = "../ipc/tests/common/mod.rs"]
mod backend_choice;

use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use backend_choice::{dev, TestBackend};
use gpualloc::ipc::{
    AsyncExportConn, ImportConn, PeerPolicy, Received, Returned, SegmentMemory, ServeEnd,
};
use gpualloc::{Allocator, AllocatorConfig, DeviceBuffer, Error, Stream};

const ROLE: &str = "GPUALLOC_EXPORT_TEST_ROLE";
const SOCK: &str = "GPUALLOC_EXPORT_TEST_SOCK";
const EXPECT_VMM: &str = "GPUALLOC_EXPORT_TEST_VMM";
const LEN: u64 = 3 << 20;
const BACK: usize = 64 << 10;

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u64 * 7 + 2) as u8 % 251).collect()
}

fn writeback() -> Vec<u8> {
    (0..BACK).map(|i| (i % 253) as u8 ^ 0xA5).collect()
}

fn sock_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "gpualloc-export-{}-{name}.sock",
        std::process::id()
    ))
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
        cmd.env(EXPECT_VMM, "1");
    }
    cmd.spawn().unwrap()
}

// ---------------------------------------------------------------- the child process

/// The consumer, when this binary runs as the child; a no-op in the normal test run.
#[test]
fn consumer_entry() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let tb = TestBackend::from_env(dev());
    let backend = tb.backend.clone();
    let stream = backend.stream_create(dev()).unwrap();
    let sock = UnixStream::connect(std::env::var(SOCK).unwrap()).unwrap();
    let mut conn = ImportConn::new(sock, &PeerPolicy::default(), backend.clone(), dev()).unwrap();
    let Received::Device(buf) = conn.recv().unwrap() else {
        panic!("expected a device buffer");
    };
    assert_eq!(buf.len(), LEN);
    assert_eq!(buf.is_vmm(), std::env::var(EXPECT_VMM).is_ok());
    let mut got = vec![0u8; LEN as usize];
    backend
        .copy_from_device(stream, &mut got, buf.ptr())
        .unwrap();
    assert_eq!(got, pattern(LEN as usize));
    backend
        .copy_to_device(stream, buf.ptr(), &writeback())
        .unwrap();
    match role.as_str() {
        "consumer" => conn.release(buf, &[stream]).unwrap(),
        "hang" => {
            // Signal "mapped and written" by closing nothing: the parent polls the device
            // memory for the write-back, then kills us.
            std::thread::sleep(Duration::from_secs(60));
            panic!("was not killed");
        }
        other => panic!("unknown role {other}"),
    }
}

// ---------------------------------------------------------------- the parent process

struct Producer {
    tb: TestBackend,
    alloc: Allocator,
    stream: Stream,
}

impl Producer {
    /// On the backend `GPUALLOC_BACKEND` names.
    fn new(expandable: bool) -> Producer {
        Producer::on(TestBackend::from_env(dev()), expandable)
    }

    fn on(tb: TestBackend, expandable: bool) -> Producer {
        let alloc = Allocator::builder()
            .config(AllocatorConfig::default().with_expandable_segments(expandable))
            .backend_instance(tb.backend.clone())
            .build()
            .unwrap();
        let stream = alloc.new_stream(dev()).unwrap();
        Producer { tb, alloc, stream }
    }

    async fn filled(&self) -> DeviceBuffer {
        let buf = self.alloc.malloc(LEN, &self.stream).await.unwrap();
        self.alloc
            .backend()
            .copy_to_device(self.stream.handle(), buf.ptr(), &pattern(LEN as usize))
            .unwrap();
        buf
    }

    fn read(&self, buf: &DeviceBuffer, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.alloc
            .backend()
            .copy_from_device(self.stream.handle(), &mut v, buf.ptr())
            .unwrap();
        v
    }

    /// Live allocations of the device, once the count settles at `want` (frees posted by a
    /// released guard run on the actor; give them a moment).
    async fn wait_allocations(&self, want: u64) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let now = self.alloc.stats(dev()).await.unwrap().allocation[0].current;
            if now == want || Instant::now() > deadline {
                assert_eq!(now, want, "live allocations");
                return;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    async fn accept(&self, path: &PathBuf, role: &str, vmm: bool) -> (Child, AsyncExportConn) {
        let _ = std::fs::remove_file(path);
        let listener = tokio::net::UnixListener::bind(path).unwrap();
        let child = spawn(role, path, vmm);
        let (sock, _) = listener.accept().await.unwrap();
        let conn = AsyncExportConn::new(sock, &PeerPolicy::default(), self.alloc.backend().clone())
            .await
            .unwrap();
        assert_eq!(conn.peer().pid, child.id());
        (child, conn)
    }

    async fn finish(self) {
        self.alloc.empty_cache().await.unwrap();
        let st = self.alloc.stats(dev()).await.unwrap();
        assert_eq!(st.reserved_bytes[0].current, 0);
        drop(self.stream);
        self.alloc.shutdown().await.unwrap();
        self.tb.assert_nothing_leaked();
    }
}

async fn round_trip(expandable: bool) {
    let p = Producer::new(expandable);
    let path = sock_path(if expandable { "es" } else { "plain" });
    let (mut child, mut conn) = p.accept(&path, "consumer", expandable).await;

    let buf = p.filled().await;
    let ptr = buf.ptr();
    let region = p.alloc.export_region(&buf).await.unwrap();
    assert_eq!((region.ptr, region.len, region.device), (ptr, LEN, dev()));
    match &region.segment {
        SegmentMemory::Allocation { base } => {
            assert!(!expandable);
            assert!(base.0 <= ptr.0);
        }
        SegmentMemory::Vmm { chunks } => {
            assert!(expandable);
            assert!(!chunks.is_empty());
        }
    }
    let id = p.alloc.export(&mut conn, buf).await.unwrap();

    // While the consumer holds it, the block stays allocated and is not handed out again.
    p.wait_allocations(1).await;
    let other = p.alloc.malloc(LEN, &p.stream).await.unwrap();
    assert_ne!(other.ptr(), ptr, "an exported block is not reused");

    assert_eq!(conn.wait_returned(id).await.unwrap(), Returned::Released);
    p.wait_allocations(1).await;
    // Released: the next request of its size gets that very block, with the consumer's
    // write-back in front of the producer's pattern.
    let again = p.alloc.malloc(LEN, &p.stream).await.unwrap();
    assert_eq!(again.ptr(), ptr, "the released block is reused");
    let got = p.read(&again, LEN as usize);
    assert_eq!(got[..BACK], writeback()[..]);
    assert_eq!(got[BACK..], pattern(LEN as usize)[BACK..]);

    let totals: ServeEnd = conn.serve().await.unwrap();
    assert_eq!((totals.released, totals.reclaimed), (1, 0));
    assert!(child.wait().unwrap().success());
    drop((other, again));
    p.finish().await;
    let _ = std::fs::remove_file(&path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exported_buffer_round_trip_and_reuse_only_after_release() {
    round_trip(false).await;
}

/// The same with `expandable_segments:True`: the buffer travels as physical-page fds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exported_expandable_buffer_round_trip() {
    round_trip(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_consumer_gives_the_block_back() {
    let p = Producer::new(false);
    let path = sock_path("killed");
    let (mut child, mut conn) = p.accept(&path, "hang", false).await;
    let buf = p.filled().await;
    let ptr = buf.ptr();
    p.alloc.export(&mut conn, buf).await.unwrap();

    // Wait until the child wrote into the device memory (a probe buffer is not possible
    // while the block is exported, so read through the backend at the address).
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut v = vec![0u8; BACK];
        p.alloc
            .backend()
            .copy_from_device(p.stream.handle(), &mut v, ptr)
            .unwrap();
        if v == writeback() {
            break;
        }
        assert!(Instant::now() < deadline, "child never wrote");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let other = p.alloc.malloc(LEN, &p.stream).await.unwrap();
    assert_ne!(other.ptr(), ptr);
    child.kill().unwrap();
    assert!(!child.wait().unwrap().success());
    let totals = tokio::time::timeout(Duration::from_secs(20), conn.serve())
        .await
        .unwrap()
        .unwrap();
    assert_eq!((totals.released, totals.reclaimed), (0, 1));
    p.wait_allocations(1).await;
    let again = p.alloc.malloc(LEN, &p.stream).await.unwrap();
    assert_eq!(again.ptr(), ptr, "the reclaimed block is reused");
    drop((other, again));
    p.finish().await;
    let _ = std::fs::remove_file(&path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_region_rejects_empty_and_foreign_buffers() {
    let p = Producer::new(false);
    let empty = p.alloc.malloc(0, &p.stream).await.unwrap();
    assert!(matches!(
        p.alloc.export_region(&empty).await,
        Err(Error::Export(m)) if m.contains("empty")
    ));
    // The other allocator is on a sim of its own.
    let q = Producer::on(TestBackend::sim(dev()), false);
    let theirs = q.alloc.malloc(4096, &q.stream).await.unwrap();
    assert!(matches!(
        p.alloc.export_region(&theirs).await,
        Err(Error::Export(m)) if m.contains("another allocator")
    ));
    drop((empty, theirs));
    q.finish().await;
    p.finish().await;
}

/// A buffer of a pool of unsplit blocks exposes its own 2 MiB range to an importer; a buffer of
/// the default pools exposes the physical handle it shares with its neighbour
/// (`DeviceRegion::exposed`, what the ipc crate's export docs describe).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffer_of_an_unsplit_pool_exposes_only_its_own_range() {
    use gpualloc::PoolOptions;
    const MIB: u64 = 1 << 20;
    let p = Producer::new(true);
    let pool = p
        .alloc
        .pool(
            "export",
            PoolOptions {
                unsplit: Some(2 * MIB),
                ..PoolOptions::default()
            },
        )
        .await
        .unwrap();
    let alone = pool.malloc(MIB, &p.stream).await.unwrap();
    let (shared, neighbour) = (
        p.alloc.malloc(MIB, &p.stream).await.unwrap(),
        p.alloc.malloc(MIB, &p.stream).await.unwrap(),
    );
    let backend = p.alloc.backend().clone();
    let exposed = |r: gpualloc::ipc::DeviceRegion| r.exposed(&*backend).unwrap();
    let region = p.alloc.export_region(&alone).await.unwrap();
    assert_eq!(exposed(region), (alone.ptr(), 2 * MIB));
    let (start, len) = exposed(p.alloc.export_region(&shared).await.unwrap());
    assert!(len >= 2 * MIB);
    assert!(start.0 <= neighbour.ptr().0 && neighbour.ptr().0 < start.0 + len);
    drop((alone, shared, neighbour));
    drop(pool);
    p.finish().await;
}
