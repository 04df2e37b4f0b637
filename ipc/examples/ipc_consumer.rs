//! The consumer half of the ipc demo (start `ipc_producer` first, see its docs).
//!
//! It connects to the producer's socket (first argument, default `gpualloc-ipc-demo.sock`
//! in the temp directory), maps the shared host buffer and opens the device buffer in its
//! own simulated GPU, checks the pattern, writes a reply into both, and releases the device
//! buffer so the producer may reuse its block.

use std::error::Error;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;

use gpualloc_ipc::{ImportConn, PeerPolicy, Received};
use gpualloc_runtime::{Backend, DeviceId};
use gpualloc_sim::{SimBackend, SimConfig};

const DEV: DeviceId = DeviceId(0);

fn socket_path() -> PathBuf {
    std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("gpualloc-ipc-demo.sock"))
}

fn main() -> Result<(), Box<dyn Error>> {
    let sim = SimBackend::new(SimConfig::fast(1))?;
    let backend: Arc<dyn Backend> = sim;
    let stream = backend.stream_create(DEV)?;
    let sock = UnixStream::connect(socket_path())?;
    let mut conn = ImportConn::new(sock, &PeerPolicy::default(), backend.clone(), DEV)?;
    println!(
        "consumer {}: connected to producer {}",
        std::process::id(),
        conn.peer().pid
    );
    let reply = format!("hello back from consumer {}\0", std::process::id());

    let mut host = None;
    let mut device = None;
    while host.is_none() || device.is_none() {
        match conn.recv()? {
            Received::Host { mapping, .. } => {
                let bytes = mapping.to_vec();
                let end = bytes.iter().position(|b| *b == 0).unwrap_or(0);
                println!(
                    "host buffer ({} bytes) says: {:?}",
                    mapping.len(),
                    String::from_utf8_lossy(&bytes[..end])
                );
                mapping.write_at(0, reply.as_bytes())?;
                host = Some(mapping);
            }
            Received::Device(buf) => {
                let mut data = vec![0u8; buf.len() as usize];
                backend.copy_from_device(stream, &mut data, buf.ptr())?;
                let ok = data.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8);
                println!(
                    "device buffer at {} ({} bytes): pattern {}",
                    buf.ptr(),
                    buf.len(),
                    if ok { "ok" } else { "WRONG" }
                );
                backend.copy_to_device(stream, buf.ptr(), reply.as_bytes())?;
                device = Some(buf);
            }
        }
    }
    if let Some(buf) = device {
        conn.release(buf, &[stream])?;
        println!("released the device buffer");
    }
    Ok(())
}
