//! The release before a growth (the `gpualloc` policy: after the user's `empty_cache`, a
//! growth past the most ever held releases the cache first), used as a user would: the public
//! API only, on the sim, a live buffer's bytes checked across the release.

mod common;

use common::{build, fill_mib, read_mib, sim, MIB};
use gpualloc::runtime::sim::SimBackend;
use gpualloc::{Allocator, DeviceId, Stream};

/// 100 MiB and 100 MiB, the first dropped, then 150 MiB: reserved memory at that point, with
/// the second buffer's bytes as written before the release.
async fn step(alloc: &Allocator, sim: &SimBackend, stream: &Stream) -> u64 {
    let a = alloc.malloc(100 * MIB, stream).await.unwrap();
    let b = alloc.malloc(100 * MIB, stream).await.unwrap();
    fill_mib(sim, stream, b.ptr(), 0x5a);
    drop(a);
    let c = alloc.malloc(150 * MIB, stream).await.unwrap();
    fill_mib(sim, stream, c.ptr(), 0x33);
    assert!(read_mib(sim, stream, b.ptr()).iter().all(|&x| x == 0x5a));
    assert!(read_mib(sim, stream, c.ptr()).iter().all(|&x| x == 0x33));
    let st = alloc.stats(DeviceId(0)).await.unwrap();
    st.reserved_bytes[0].current
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_empty_cache_the_hole_goes_back_before_the_growth() {
    for (conf, reserved) in [
        ("expandable_segments:True", 250 * MIB),
        ("expandable_segments:True,thread_cache:False", 250 * MIB),
        ("policy:pytorch,expandable_segments:True", 360 * MIB),
    ] {
        let sim = sim(4 << 30);
        let alloc = build(sim.clone(), conf);
        let stream = alloc.new_stream(DeviceId(0)).unwrap();
        let a = alloc.malloc(100 * MIB, &stream).await.unwrap();
        let b = alloc.malloc(100 * MIB, &stream).await.unwrap();
        drop((a, b));
        alloc.empty_cache().await.unwrap();
        assert_eq!(step(&alloc, &sim, &stream).await, reserved, "[{conf}]");
        alloc.shutdown().await.unwrap();
    }
}
