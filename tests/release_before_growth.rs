//! The release before a growth (the `gpualloc` policy: after the user's `empty_cache`, a
//! growth past the most ever held releases the cache first; without one, it first moves the
//! large pool's free pages when they come to 3/4 of the request), used as a user would: the
//! public API only, on the sim, a live buffer's bytes checked across the release.

mod common;

use common::{build, fill_mib, read_mib, sim, MIB};
use gpualloc::runtime::sim::SimBackend;
use gpualloc::{Allocator, DeviceId, Stream};

/// 100 MiB and 100 MiB, the first dropped, then 150 MiB: reserved memory at that point, with
/// the second buffer's bytes as written before the release.
async fn step(alloc: &Allocator, sim: &SimBackend, stream: &Stream) -> u64 {
    step_then(alloc, sim, stream, 150 * MIB).await
}

/// [`step`] with a last request of `last` bytes.
async fn step_then(alloc: &Allocator, sim: &SimBackend, stream: &Stream, last: u64) -> u64 {
    let a = alloc.malloc(100 * MIB, stream).await.unwrap();
    let b = alloc.malloc(100 * MIB, stream).await.unwrap();
    fill_mib(sim, stream, b.ptr(), 0x5a);
    drop(a);
    let c = alloc.malloc(last, stream).await.unwrap();
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

/// Without an `empty_cache`: the 100 MiB hole's pages move to the 120 MiB request (at least
/// 3/4 of it), which maps only what it needs; the live buffer keeps its bytes, and the next
/// steps reserve the same. A second stream's free pages move too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_growth_past_the_most_ever_held_takes_the_free_pages_first() {
    for (conf, reserved) in [
        ("", 220 * MIB),
        ("expandable_segments:True,thread_cache:False", 220 * MIB),
        ("garbage_collection_threshold:0.8", 220 * MIB),
        ("policy:pytorch,expandable_segments:True", 320 * MIB),
    ] {
        let sim = sim(4 << 30);
        let alloc = build(sim.clone(), conf);
        let stream = alloc.new_stream(DeviceId(0)).unwrap();
        for _ in 0..3 {
            let got = step_then(&alloc, &sim, &stream, 120 * MIB).await;
            assert_eq!(got, reserved, "[{conf}]");
        }
        // Another stream's 100 MiB, freed, then 120 MiB on this one, more than a loan of it
        // could serve: its pages move here (PyTorch's policy maps 120 more).
        let other = alloc.new_stream(DeviceId(0)).unwrap();
        let held = alloc.malloc(220 * MIB, &stream).await.unwrap();
        fill_mib(&sim, &stream, held.ptr(), 0x11);
        let x = alloc.malloc(100 * MIB, &other).await.unwrap();
        drop(x);
        let y = alloc.malloc(120 * MIB, &stream).await.unwrap();
        fill_mib(&sim, &stream, y.ptr(), 0x77);
        assert!(read_mib(&sim, &stream, y.ptr()).iter().all(|&v| v == 0x77));
        assert!(read_mib(&sim, &stream, held.ptr())
            .iter()
            .all(|&v| v == 0x11));
        let st = alloc.stats(DeviceId(0)).await.unwrap();
        let two_streams = reserved + 120 * MIB;
        assert_eq!(st.reserved_bytes[0].current, two_streams, "[{conf}]");
        drop((held, y));
        alloc.shutdown().await.unwrap();
    }
}

/// With every rule on, a repeated step makes no backend call once warm, as a user sees it:
/// the two steps that would release or move at every turn without their bounds (the core's
/// tests in `devices/tests/release_before_growth.rs`), on the sim, in three configs. The calls
/// of the sim are counted, every kind, after seven turns of warm-up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_step_makes_no_backend_call_once_warm() {
    for conf in [
        "",
        "expandable_segments:True,thread_cache:False",
        "garbage_collection_threshold:0.8",
    ] {
        for (first, second, last, empty_first) in [(100, 20, 120, false), (60, 40, 150, true)] {
            let sim = sim(4 << 30);
            let alloc = build(sim.clone(), conf);
            let stream = alloc.new_stream(DeviceId(0)).unwrap();
            if empty_first {
                drop(alloc.malloc(100 * MIB, &stream).await.unwrap());
                alloc.empty_cache().await.unwrap();
            }
            let step = || async {
                let a = alloc.malloc(first * MIB, &stream).await.unwrap();
                let b = alloc.malloc(second * MIB, &stream).await.unwrap();
                drop(a);
                let c = alloc.malloc(last * MIB, &stream).await.unwrap();
                drop((b, c));
            };
            for _ in 0..7 {
                step().await;
            }
            let warm = sim.counts();
            for _ in 0..7 {
                step().await;
            }
            let calls = sim.counts().since(&warm);
            assert_eq!(calls, [], "[{conf}] {first}, {second}, {last}");
            alloc.shutdown().await.unwrap();
        }
    }
}
