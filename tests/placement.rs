//! The `gpualloc` policy's placement rule through the allocator (`gpualloc_devices::placement`):
//! a request that passed over a block with a dead remainder, on a device too full for its
//! segment to grow, is served from that block, without an out-of-memory error and without
//! releasing the cache (the facade grows segments off the gate, so this is its own path).

mod common;

use common::{build, sim, MIB};
use gpualloc::DeviceId;

const KIB: u64 = 1 << 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_device_serves_a_passed_over_block_without_releasing_the_cache() {
    for conf in [
        "expandable_segments:True",
        "expandable_segments:True,thread_cache:False",
    ] {
        let alloc = build(sim(20 * MIB), conf);
        let stream = alloc.new_stream(DeviceId(0)).unwrap();
        let a = alloc.malloc(1536 * KIB, &stream).await.unwrap();
        let b = alloc
            .malloc(20 * MIB - 1536 * KIB - 512 * KIB, &stream)
            .await
            .unwrap();
        let hole = a.ptr();
        drop(a);
        let c = alloc.malloc(1152 * KIB, &stream).await.unwrap();
        assert_eq!(c.ptr(), hole, "{conf}");
        let st = alloc.stats(DeviceId(0)).await.unwrap();
        assert_eq!(
            (st.num_ooms, st.num_alloc_retries, st.num_device_free),
            (0, 0, 0),
            "{conf}"
        );
        assert_eq!(st.reserved_bytes[0].current, 20 * MIB, "{conf}");
        drop((b, c));
        alloc.shutdown().await.unwrap();
    }
}
