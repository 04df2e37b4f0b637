//! The NCCL adapter on a GPU (feature `nccl`): a pool's segments are registered with a
//! one-rank communicator, an all-reduce runs on a registered buffer, and a sleep, a wake and
//! a pool's release deregister every range before it is unmapped, without an NCCL error.
//! Skips (printing why) without a GPU, unless `GPUALLOC_REQUIRE_GPU=1` (scripts/gpu-check.sh);
//! skips without `libnccl` even then (NCCL is not part of the driver).
#![cfg(feature = "nccl")]

use std::time::Duration;

use gpualloc::nccl::{nccl_available, NcclComm};
use gpualloc::{Allocator, BackendKind, DeviceId, PoolOptions, SegmentRegistration, SleepMode};

const D0: DeviceId = DeviceId(0);
const MIB: u64 = 1 << 20;

async fn until(
    reg: &SegmentRegistration,
    what: &str,
    ok: impl Fn(&gpualloc::RegistrationStats) -> bool,
) {
    for _ in 0..1000 {
        if ok(&reg.stats()) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("{what}: {:?}", reg.stats());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_registered_with_nccl_all_reduces_sleeps_and_wakes() {
    let required = std::env::var("GPUALLOC_REQUIRE_GPU").is_ok_and(|v| v == "1");
    let alloc = match Allocator::builder()
        .backend(BackendKind::Cuda)
        .config_str("expandable_segments:True")
        .build()
    {
        Ok(a) => a,
        Err(e) if required => panic!("GPUALLOC_REQUIRE_GPU=1 but CUDA is unavailable: {e}"),
        Err(e) => {
            println!("skipped: no GPU ({e})");
            return;
        }
    };
    if !nccl_available() {
        println!("skipped: libnccl is not installed on this machine");
        return;
    }
    let comm = NcclComm::init_all(&alloc, &[D0]).unwrap().remove(0);
    let pool = alloc.pool("comm", PoolOptions::default()).await.unwrap();
    let stream = alloc.new_stream(D0).unwrap();
    let reg = pool.register_with_nccl(D0, comm.clone()).await.unwrap();
    let n = 4 * MIB as usize / 4;
    let buf = pool.malloc(4 * MIB, &stream).await.unwrap();
    let more = pool.malloc(40 * MIB, &stream).await.unwrap();
    let reserved = pool.usage(D0).await.unwrap().reserved.all().current;
    until(&reg, "the pool's ranges registered", |s| {
        s.live_bytes == reserved
    })
    .await;
    assert_eq!(reg.stats().failures, 0, "{:?}", reg.stats());

    // An in-place all-reduce over one rank leaves the data as it was.
    let data: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
    let bytes: Vec<u8> = data.iter().flat_map(|f| f.to_le_bytes()).collect();
    let backend = alloc.backend();
    backend
        .copy_to_device(stream.handle(), buf.ptr(), &bytes)
        .unwrap();
    let cu = alloc.to_cudarc_stream(&stream).unwrap();
    {
        let c = comm.lock();
        // SAFETY: `buf` holds `n` f32 on device 0 and lives until the stream is synchronized
        // below; the communicator is locked for the call; the stream is the buffer's own.
        unsafe {
            cudarc::nccl::result::all_reduce(
                buf.ptr().0 as *const _,
                buf.ptr().0 as *mut _,
                n,
                cudarc::nccl::sys::ncclDataType_t::ncclFloat32,
                cudarc::nccl::sys::ncclRedOp_t::ncclSum,
                c.raw(),
                cu.cu_stream() as _,
            )
        }
        .unwrap();
    }
    backend.stream_synchronize(stream.handle()).unwrap();
    let mut back = vec![0u8; bytes.len()];
    backend
        .copy_from_device(stream.handle(), &mut back, buf.ptr())
        .unwrap();
    assert_eq!(back, bytes);

    // Sleep: every registration goes before its unmap; wake: registered again.
    let live = reg.stats().live as u64;
    pool.sleep(SleepMode::Offload).await.unwrap();
    let st = reg.stats();
    assert_eq!(
        (st.live, st.deregistered, st.failures),
        (0, live, 0),
        "{st:?}"
    );
    pool.wake().await.unwrap();
    until(&reg, "registered again after the wake", |s| {
        s.live_bytes == reserved
    })
    .await;
    let mut again = vec![0u8; bytes.len()];
    backend
        .copy_from_device(stream.handle(), &mut again, buf.ptr())
        .unwrap();
    assert_eq!(again, bytes, "the data survived the sleep");
    drop((buf, more, pool));
    alloc.empty_cache().await.unwrap();
    let st = reg.close();
    assert_eq!((st.live, st.failures), (0, 0), "{st:?}");
    assert_eq!(st.registered, st.deregistered);
    alloc.shutdown().await.unwrap();
    println!("nccl registration on the GPU: {st:?}");
}
