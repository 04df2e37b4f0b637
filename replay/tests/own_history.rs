//! The allocator's own history replays to itself (issue 23): a workload run through the public
//! API on the sim while recording (cross-stream frees, frees that wait, an out-of-memory
//! request, `empty_cache`), dumped with `snapshot_pickle`, read back and replayed warm with the
//! same config, puts every allocation at the address the live allocator gave it, with
//! ordinary segments and with expandable ones.

use gpualloc::{Allocator, DeviceId, HistoryOptions};
use gpualloc_replay::input::from_bytes;
use gpualloc_replay::{replay, ReplayOptions};

const MIB: u64 = 1 << 20;

async fn recorded(conf: &str) -> Vec<u8> {
    let sim = gpualloc::runtime::sim::SimBackend::new(gpualloc::runtime::sim::SimConfig {
        capacity_per_device: 1 << 30,
        ..gpualloc::runtime::sim::SimConfig::fast(1)
    })
    .unwrap();
    let alloc = Allocator::builder()
        .config_str(conf)
        .backend_instance(sim)
        // No reaper pass during the run: cross-stream frees complete when the workload's own
        // mallocs and frees process events, in its order (a pass landing while a miss maps
        // pages off the gate is the race described below).
        .reaper_interval(std::time::Duration::from_secs(3600))
        .build()
        .unwrap();
    alloc
        .record_history(HistoryOptions::default())
        .await
        .unwrap();
    let s1 = alloc.new_stream(DeviceId(0)).unwrap();
    let s2 = alloc.new_stream(DeviceId(0)).unwrap();
    let mut live = Vec::new();
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    for i in 0..400u64 {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let size = match rng % 4 {
            0 => rng % 4096 + 1,
            1 => rng % MIB + 1,
            2 => rng % (12 * MIB) + 1,
            _ => rng % (40 * MIB) + 1,
        };
        let s = if i % 3 == 0 { &s2 } else { &s1 };
        // The streams' events complete before the malloc, so the malloc's own first step
        // records the frees they release: an event that completed while a miss maps pages off
        // the gate would be recorded before that miss's `alloc`, and a sequential replay
        // takes the freed block instead of growing (see the README).
        s1.synchronize().unwrap();
        s2.synchronize().unwrap();
        if let Ok(b) = alloc.malloc(size, s).await {
            if i % 7 == 0 {
                b.record_stream(if i % 2 == 0 { &s1 } else { &s2 }).unwrap();
            }
            live.push(b);
        }
        if live.len() > 12 || rng % 5 == 0 {
            let k = (rng as usize / 5) % live.len().max(1);
            if k < live.len() {
                live.swap_remove(k);
            }
        }
        if i == 200 {
            s1.synchronize().unwrap();
            s2.synchronize().unwrap();
            alloc.empty_cache().await.unwrap();
        }
    }
    assert!(alloc.malloc(4 << 30, &s1).await.is_err());
    let bytes = alloc.snapshot_pickle().await.unwrap();
    drop(live);
    alloc.shutdown().await.unwrap();
    bytes
}

#[test]
fn a_recorded_history_replays_warm_at_the_same_addresses() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // The replay places a new ordinary segment at its recorded `segment_alloc` address, and a
    // new expandable segment's reservation at its first `segment_map` (which maps from the
    // reservation's base); the device's capacity is the live one's, as an expandable
    // segment reserves 9/8 of it.
    for conf in [
        "",
        "thread_cache:False",
        "garbage_collection_threshold:0.6",
        "max_split_size_mb:40",
        "expandable_segments:True",
        "expandable_segments:True,thread_cache:False",
        "expandable_segments:True,max_split_size_mb:40",
    ] {
        let bytes = rt.block_on(recorded(conf));
        let traces = from_bytes("own.pickle", &bytes).unwrap();
        assert_eq!(traces.len(), 1);
        let options = ReplayOptions {
            warm: true,
            config: gpualloc::AllocatorConfig::parse(conf).unwrap(),
            capacity: Some(1 << 30),
            ..ReplayOptions::default()
        };
        let report = replay(&traces[0], &options).unwrap();
        let (matched, compared) = report.address_match.unwrap();
        if matched != compared {
            std::fs::write("/tmp/own_fail.pickle", &bytes).unwrap();
        }
        println!("[{conf}] {matched} of {compared} allocations at the live allocator's address");
        assert!(compared > 300, "[{conf}] {compared}");
        assert_eq!(
            matched, compared,
            "[{conf}] first mismatch: {:?}",
            report.first_mismatch
        );
    }
}
