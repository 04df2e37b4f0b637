//! The producer half of the ipc demo: run it in one terminal, `ipc_consumer` in another.
//!
//! ```text
//! cargo run -p gpualloc-ipc --example ipc_producer   # terminal 1
//! cargo run -p gpualloc-ipc --example ipc_consumer   # terminal 2
//! ```
//!
//! It listens on a Unix socket (first argument, default `gpualloc-ipc-demo.sock` in the temp
//! directory), shares a 1 MiB shared-memory buffer holding a greeting and a 4 MiB device
//! buffer (simulated GPU) holding a pattern, waits until the consumer releases the device
//! buffer, and prints what the consumer wrote back into both.

use std::error::Error;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use gpualloc_devices::{AllocatorConfig, DeviceCore};
use gpualloc_ipc::{
    shm, AsyncExportConn, Backing, DeviceRegion, MapOptions, OnRelease, PeerPolicy, Returned,
};
use gpualloc_runtime::{Backend, DeviceId};
use gpualloc_sim::{SimBackend, SimConfig};

const DEV: DeviceId = DeviceId(0);
const DEV_LEN: usize = 4 << 20;

fn socket_path() -> PathBuf {
    std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("gpualloc-ipc-demo.sock"))
}

fn text(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|b| *b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let sim = SimBackend::new(SimConfig::fast(1))?;
    let backend: Arc<dyn Backend> = sim;
    let core = Arc::new(Mutex::new(DeviceCore::new(
        backend.clone(),
        DEV,
        AllocatorConfig::default(),
    )?));
    let stream = backend.stream_create(DEV)?;

    let path = socket_path();
    let _ = std::fs::remove_file(&path);
    let listener = tokio::net::UnixListener::bind(&path)?;
    println!(
        "producer {}: waiting on {}",
        std::process::id(),
        path.display()
    );
    let (sock, _) = listener.accept().await?;
    let mut conn = AsyncExportConn::new(sock, &PeerPolicy::default(), backend.clone()).await?;
    println!("consumer {} connected", conn.peer().pid);

    // A memfd, sealed at its size: the consumer cannot truncate it under this process.
    let host = shm::create(1 << 20, Backing::Memfd, MapOptions::shared_rw())?;
    host.write_at(
        0,
        format!("hello from producer {}\0", std::process::id()).as_bytes(),
    )?;
    conn.send_host(&host, 1).await?;

    let ptr = {
        let mut core = core.lock().map_err(|_| "poisoned")?;
        core.malloc(DEV_LEN as u64, stream)?.ptr
    };
    let data: Vec<u8> = (0..DEV_LEN).map(|i| (i % 251) as u8).collect();
    backend.copy_to_device(stream, ptr, &data)?;
    let region = region_of(&*core.lock().map_err(|_| "poisoned")?, ptr)?;
    // Released by the consumer (or its death): the block goes back to the core.
    let guard = {
        let core = core.clone();
        OnRelease::new(move || {
            if let Ok(mut core) = core.lock() {
                let _ = core.free(ptr);
            }
        })
    };
    let id = conn
        .send_device(&region, Some(stream), Box::new(guard))
        .await?;
    println!("shared device buffer {ptr} ({DEV_LEN} bytes) as export {id}");

    match conn.wait_returned(id).await? {
        Returned::Released => println!("consumer released the device buffer"),
        Returned::Reclaimed => println!("consumer went away; device buffer reclaimed"),
    }
    let mut back = vec![0u8; 64];
    backend.copy_from_device(stream, &mut back, ptr)?;
    println!("device buffer now starts with: {:?}", text(&back));
    println!(
        "host buffer now starts with:   {:?}",
        text(&host.to_vec()[..64])
    );
    let totals = conn.serve().await?;
    println!(
        "connection closed: {} released, {} reclaimed",
        totals.released, totals.reclaimed
    );
    let mut core = core.lock().map_err(|_| "poisoned")?;
    core.empty_cache()?;
    println!(
        "reserved after empty_cache: {} bytes",
        core.reserved_bytes()
    );
    let _ = std::fs::remove_file(&path);
    Ok(())
}

/// Live allocation `ptr` of `core` as a region to export (what the facade's `export_region`
/// does: the ipc crate does not know the core).
fn region_of(
    core: &gpualloc_devices::DeviceCore,
    ptr: gpualloc_runtime::DevicePtr,
) -> Result<DeviceRegion, Box<dyn std::error::Error>> {
    use gpualloc_devices::AllocationMemory;
    use gpualloc_ipc::SegmentMemory;
    let (len, memory) = core.allocation_memory(ptr)?;
    let segment = match memory {
        AllocationMemory::Segment { base } => SegmentMemory::Allocation { base },
        AllocationMemory::Pages(pages) => SegmentMemory::from_pages(pages),
    };
    Ok(DeviceRegion {
        device: core.device(),
        ptr,
        len,
        segment,
    })
}
