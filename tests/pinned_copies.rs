//! Copies between pinned and device memory cannot race safe code: the
//! copy takes the pinned buffer and hands it back once the stream has passed it. Also: size 0
//! is an empty buffer for pinned memory too, and the `unsafe` escape hatch.

use std::sync::Arc;
use std::time::Duration;

use gpualloc::runtime::sim::{Op, SimBackend, SimConfig};
use gpualloc::{Allocator, DeviceId};

const KIB: u64 = 1 << 10;

fn sim() -> Arc<SimBackend> {
    SimBackend::new(SimConfig::fast(1)).expect("sim")
}

fn build(sim: &Arc<SimBackend>) -> Allocator {
    Allocator::builder()
        .backend_instance(sim.clone())
        .reaper_interval(Duration::from_millis(1))
        .build()
        .expect("build")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_to_host_copy_hands_the_buffer_back_only_when_written() {
    let sim = sim();
    let alloc = build(&sim);
    let host = alloc.host();
    let stream = alloc.new_stream(DeviceId(0)).unwrap();
    let dev = alloc.malloc(64 * KIB, &stream).await.unwrap();
    let (ptr, len) = (dev.ptr(), dev.len());
    // The device bytes become 0xab only after 100 ms of work on the stream.
    sim.launch_kernel(stream.handle(), Duration::from_millis(100), move |m| {
        m.fill(ptr, len, 0xab)
    })
    .unwrap();
    let mut dst = host.malloc(64 * KIB).await.unwrap();
    dst.fill(0);
    let copy = host.copy_d2h(&dev, dst, &stream).unwrap();
    // `dst` moved into the copy: safe code cannot read it while the copy may write it.
    assert!(!copy.is_done().unwrap(), "the stream is still busy");
    let dst = copy.finish().await.unwrap();
    assert!(
        dst.iter().all(|&b| b == 0xab),
        "handed back after the copy wrote it"
    );
    drop((dst, dev));
    alloc.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finish_blocking_and_dropping_a_copy_unawaited() {
    let sim = sim();
    let alloc = build(&sim);
    let host = alloc.host();
    let stream = alloc.new_stream(DeviceId(0)).unwrap();
    let dev = alloc.malloc(8 * KIB, &stream).await.unwrap();
    let mut src = host.malloc(8 * KIB).await.unwrap();
    src.fill(3);
    let h2d = host.copy_h2d(src, &dev, &stream).unwrap();
    let src = tokio::task::spawn_blocking(move || h2d.finish_blocking().unwrap())
        .await
        .unwrap();
    assert!(src.iter().all(|&b| b == 3));
    // Dropped unawaited behind slow work: the block is cached only after the stream passed it.
    let (p, l) = (dev.ptr(), dev.len());
    sim.launch_kernel(stream.handle(), Duration::from_millis(30), move |m| {
        m.fill(p, l, 1)
    })
    .unwrap();
    drop(host.copy_h2d(src, &dev, &stream).unwrap());
    assert_eq!(
        host.stats().await.unwrap().allocation.current,
        1,
        "still in use"
    );
    let mut waited = 0;
    while host.stats().await.unwrap().allocation.current != 0 {
        assert!(waited < 5000, "the dropped copy's buffer never came back");
        tokio::time::sleep(Duration::from_millis(1)).await;
        waited += 1;
    }
    assert_eq!(host.stats().await.unwrap().cached_bytes, 8 * KIB);
    drop(dev);
    alloc.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn size_zero_is_an_empty_buffer_for_pinned_memory_too() {
    let sim = sim();
    let alloc = build(&sim);
    let host = alloc.host();
    let stream = alloc.new_stream(DeviceId(0)).unwrap();
    let empty = host.malloc(0).await.unwrap();
    let dev_empty = alloc.malloc(0, &stream).await.unwrap();
    assert!(empty.is_empty() && dev_empty.is_empty());
    assert_eq!((empty.ptr().0, empty.len(), empty[..].len()), (0, 0, 0));
    empty.record_stream(&stream).unwrap();
    sim.reset_counts();
    let copy = host.copy_h2d(empty, &dev_empty, &stream).unwrap();
    assert!(copy.is_done().unwrap());
    let empty = copy.finish().await.unwrap();
    let empty = host
        .copy_d2h(&dev_empty, empty, &stream)
        .unwrap()
        .finish()
        .await
        .unwrap();
    assert_eq!(sim.counts().get(Op::MemcpyAsync), 0, "nothing to copy");
    drop((empty, dev_empty));
    let st = host.stats().await.unwrap();
    assert_eq!((st.allocation.allocated, st.segment.current), (0, 0));
    alloc.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_unchecked_copies_borrow() {
    let sim = sim();
    let alloc = build(&sim);
    let host = alloc.host();
    let stream = alloc.new_stream(DeviceId(0)).unwrap();
    let dev = alloc.malloc(4 * KIB, &stream).await.unwrap();
    let mut src = host.malloc(4 * KIB).await.unwrap();
    src.fill(7);
    let mut dst = host.malloc(4 * KIB).await.unwrap();
    // SAFETY: neither buffer is touched until the stream is synchronized below.
    unsafe {
        assert!(host.copy_h2d_unchecked(&src, &dev, &stream).unwrap());
        assert!(host.copy_d2h_unchecked(&dev, &mut dst, &stream).unwrap());
    }
    stream.synchronize().unwrap();
    assert!(dst.iter().all(|&b| b == 7));
    drop((src, dst, dev));
    alloc.shutdown().await.unwrap();
}
