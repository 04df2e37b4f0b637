//! A stream that is dropped does not strand its cached blocks: once its
//! work is done its free segments serve any other stream of the device (ordinary segments) or go
//! back to the device (expandable ones, whose pages are unmapped after that stream alone is
//! synchronized), never with a device-wide synchronize. The vllm#52951 pattern: a server that
//! makes a fresh stream per weight sync stranded 2 GiB per sync.

mod common;

use common::{build, sim, MIB};
use gpualloc::runtime::sim::Op;
use gpualloc::DeviceId;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_rounds_of_new_stream_malloc_free_drop_stay_within_one_round() {
    for conf in [
        "",
        "thread_cache:False",
        "expandable_segments:True",
        "expandable_segments:True,thread_cache:False",
    ] {
        let sim = sim(16 << 30);
        let alloc = build(sim.clone(), conf);
        let mut one_round = 0;
        for round in 0..100 {
            let stream = alloc.new_stream(DeviceId(0)).unwrap();
            let buf = alloc.malloc(64 * MIB, &stream).await.unwrap();
            drop(buf);
            drop(stream);
            let reserved = alloc.stats(DeviceId(0)).await.unwrap().reserved_bytes[0].current;
            if round == 0 {
                one_round = reserved;
            }
            assert!(
                reserved <= one_round,
                "[{conf}] round {round}: {} MiB reserved, one round holds {} MiB",
                reserved / MIB,
                one_round / MIB
            );
        }
        let counts = sim.counts();
        assert_eq!(counts.get(Op::DeviceSynchronize), 0, "[{conf}]");
        assert_eq!(
            counts.get(Op::Free),
            0,
            "[{conf}]: no cudaFree (it synchronizes)"
        );
        alloc.shutdown().await.unwrap();
    }
}
