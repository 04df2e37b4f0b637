//! A hostile importer in a real second process (this test binary re-executed in a role named
//! by an environment variable) attacks the exporter through what the protocol hands it. The
//! exporter must survive with its memory intact. The two-process test runs on the sim, or on
//! the CUDA backend with `GPUALLOC_BACKEND=cuda` (see common/).

mod common;

use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;

use common::{dev, TestBackend};
use gpualloc_ipc::fdpass::recv_step;
use gpualloc_ipc::frame::{Frame, FrameReader};
use gpualloc_ipc::message::Message;
use gpualloc_ipc::{
    shm, Backing, DeviceRegion, ExportConn, MapOptions, OnRelease, PeerPolicy, SegmentMemory,
};
use gpualloc_runtime::Backend;
use gpualloc_sim::{SimBackend, SimConfig};

const ROLE: &str = "GPUALLOC_IPC_HOSTILE_ROLE";
const SOCK: &str = "GPUALLOC_IPC_HOSTILE_SOCK";
const HOST_LEN: u64 = 1 << 20;

fn sock_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "gpualloc-hostile-{}-{name}.sock",
        std::process::id()
    ))
}

fn recv_frame(sock: &UnixStream, reader: &mut FrameReader) -> Frame {
    loop {
        let n = recv_step(sock.as_fd(), reader).unwrap();
        assert!(n > 0, "exporter closed early");
        if let Some(f) = reader.advance(n).unwrap() {
            return f;
        }
    }
}

/// Exit-code bits the hostile child reports: what it managed to do.
const TRUNCATED_REFS: i32 = 1;
const TRUNCATED_HOST: i32 = 2;

/// The hostile importer, when this binary runs as the child; a no-op in the normal run.
#[test]
fn hostile_entry() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    assert_eq!(role, "truncate");
    let sock = UnixStream::connect(std::env::var(SOCK).unwrap()).unwrap();
    let mut reader = FrameReader::new();
    let mut code = 0;
    // The hello carries the reference-count file; the next frame a host buffer.
    let hello = recv_frame(&sock, &mut reader);
    assert!(matches!(hello.message, Message::Hello { .. }));
    if rustix::fs::ftruncate(&hello.fds[0], 0).is_ok() {
        code |= TRUNCATED_REFS;
    }
    let host = recv_frame(&sock, &mut reader);
    assert!(matches!(host.message, Message::Host { .. }));
    if rustix::fs::ftruncate(&host.fds[0], 0).is_ok() {
        code |= TRUNCATED_HOST;
    }
    std::process::exit(code);
}

#[test]
fn an_importer_cannot_truncate_what_it_was_sent() {
    let path = sock_path("truncate");
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "hostile_entry",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, "truncate")
        .env(SOCK, &path)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let (sock, _) = listener.accept().unwrap();
    let tb = TestBackend::from_env(dev());
    let backend = tb.backend.clone();
    let mut conn = ExportConn::new(sock, &PeerPolicy::default(), backend.clone()).unwrap();
    let host = shm::create(HOST_LEN, Backing::Memfd, MapOptions::shared_rw()).unwrap();
    host.write_at(0, &[0x5a; 4096]).unwrap();
    conn.send_host(&host, 1).unwrap();
    let status = child.wait().unwrap();
    let _ = std::fs::remove_file(&path);
    assert_eq!(
        status.code(),
        Some(0),
        "the importer truncated (1: refcounts, 2: host buffer)"
    );
    // The exporter's own accesses: counters (an export and collect) and its host mapping.
    // Had either been truncated, each would be a SIGBUS here.
    let ptr = backend.malloc(dev(), 1 << 20).unwrap();
    let region = DeviceRegion {
        device: dev(),
        ptr,
        len: 4096,
        segment: SegmentMemory::Allocation { base: ptr },
    };
    let sent = conn.send_device(&region, None, Box::new(OnRelease::new(|| {})));
    assert!(sent.is_err(), "the importer is gone");
    assert!(conn.collect().is_empty());
    assert_eq!(host.to_vec()[..4096], [0x5a; 4096]);
    assert_eq!(host.len(), HOST_LEN);
    drop(conn);
    backend.free(dev(), ptr).unwrap();
    tb.assert_nothing_leaked();
}

#[test]
fn objects_that_cannot_be_sealed_are_not_sent() {
    let (a, _b) = UnixStream::pair().unwrap();
    let backend: Arc<dyn Backend> = SimBackend::new(SimConfig::fast(dev().0 + 1)).unwrap();
    let mut conn = ExportConn::new(a, &PeerPolicy::default(), backend).unwrap();
    let posix = shm::create(4096, Backing::PosixShm, MapOptions::shared_rw()).unwrap();
    assert!(matches!(
        conn.send_host(&posix, 0),
        Err(gpualloc_ipc::IpcError::Unsealable(_))
    ));
    let dir = std::env::temp_dir().join(format!("gpualloc-unsealable-{}", std::process::id()));
    let file = shm::open_file(&dir, Some(4096), MapOptions::shared_rw()).unwrap();
    let _ = std::fs::remove_file(&dir);
    assert!(matches!(
        conn.send_host(&file, 0),
        Err(gpualloc_ipc::IpcError::Unsealable(_))
    ));
}
