//! The spill (the `gpualloc` policy: a small request past the most the small pool ever held,
//! of a size seen short-lived, takes free memory of the large pool's expandable segment), used
//! as a user would: the public API only, on the sim, every buffer's bytes checked while the
//! spilled workspaces sit beside the large activation.

mod common;

use common::{build, fill_mib, is_pytorch, read_mib, sim, MIB, POLICY_CONFIGS};
use gpualloc::runtime::sim::SimBackend;
use gpualloc::{Allocator, DeviceBuffer, DeviceId, Stream};

/// Fills every buffer with its own byte, then reads each back.
fn fill_and_check(sim: &SimBackend, stream: &Stream, bufs: &[&DeviceBuffer]) {
    for (i, b) in bufs.iter().enumerate() {
        fill_mib(sim, stream, b.ptr(), 0x10 + i as u8);
    }
    for (i, b) in bufs.iter().enumerate() {
        let bytes = read_mib(sim, stream, b.ptr());
        assert!(bytes.iter().all(|&x| x == 0x10 + i as u8), "buffer {i}");
    }
}

/// A CNN-like step: a 12 MiB activation with `workspaces` 1 MiB workspaces beside it, all
/// checked, the workspaces dropped, then a 16 MiB peak with one workspace. Returns the bytes
/// the small pool and the whole device hold at the end.
async fn step(
    alloc: &Allocator,
    sim: &SimBackend,
    stream: &Stream,
    workspaces: usize,
) -> (u64, u64) {
    let act = alloc.malloc(12 * MIB, stream).await.unwrap();
    let mut ws = Vec::new();
    for _ in 0..workspaces {
        ws.push(alloc.malloc(MIB, stream).await.unwrap());
    }
    let mut all: Vec<&DeviceBuffer> = ws.iter().collect();
    all.push(&act);
    fill_and_check(sim, stream, &all);
    drop(ws);
    drop(act);
    let peak = alloc.malloc(16 * MIB, stream).await.unwrap();
    let w = alloc.malloc(MIB, stream).await.unwrap();
    fill_and_check(sim, stream, &[&peak, &w]);
    drop((peak, w));
    let st = alloc.stats(DeviceId(0)).await.unwrap();
    (st.reserved_bytes[1].current, st.reserved_bytes[0].current)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spilled_workspaces_keep_their_bytes_and_the_small_pool_its_one_page() {
    for conf in POLICY_CONFIGS {
        // PyTorch's policy grows the small pool for the third workspace.
        let small_pool = if is_pytorch(conf) { 4 * MIB } else { 2 * MIB };
        let sim = sim(4 << 30);
        let alloc = build(sim.clone(), conf);
        let stream = alloc.new_stream(DeviceId(0)).unwrap();
        step(&alloc, &sim, &stream, 1).await;
        step(&alloc, &sim, &stream, 3).await;
        let warm = step(&alloc, &sim, &stream, 3).await;
        for _ in 0..3 {
            assert_eq!(step(&alloc, &sim, &stream, 3).await, warm, "[{conf}]");
        }
        assert_eq!(warm.0, small_pool, "[{conf}]");
        alloc.shutdown().await.unwrap();
    }
}

/// A small job as a user runs it: small weights loaded and kept (the small pool grows for
/// them: nothing small freed yet), then steps whose first workspaces are of a size never freed
/// before (the weights' 1 MiB), past the small pool's pages while the large pool is small:
/// they go to the large pool's mapped end, and later steps keep the small pool where the
/// first left it. Every
/// buffer's bytes checked, in four configs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_steps_new_small_sizes_go_to_the_large_pools_end() {
    for conf in POLICY_CONFIGS {
        let spills = !is_pytorch(conf);
        let sim = sim(4 << 30);
        let alloc = build(sim.clone(), conf);
        let stream = alloc.new_stream(DeviceId(0)).unwrap();
        // Small weights, kept: two pages, the second half full.
        let mut weights = Vec::new();
        for _ in 0..3 {
            weights.push(alloc.malloc(MIB, &stream).await.unwrap());
        }
        let small = |st: &gpualloc::devices::stats::DeviceStats| st.reserved_bytes[1].current;
        let st = alloc.stats(DeviceId(0)).await.unwrap();
        assert_eq!(small(&st), 4 * MIB, "[{conf}] the weights' pages");
        // A step: a 12 MiB activation, a 4 MiB scratch and a small input freed at once, then
        // two new workspaces. The frees are of buffers used on another stream too, so they go
        // to the core: one dropped on its own stream parks in the thread cache, and the core
        // learns of it only when the cache gives it back (`gpualloc_devices::spill`).
        let act = alloc.malloc(12 * MIB, &stream).await.unwrap();
        let other = alloc.new_stream(DeviceId(0)).unwrap();
        let scratch = alloc.malloc(4 * MIB, &stream).await.unwrap();
        let input = alloc.malloc(4 << 10, &stream).await.unwrap();
        for b in [scratch, input] {
            b.record_stream(&other).unwrap();
            drop(b);
        }
        other.synchronize().unwrap();
        let ws = [
            alloc.malloc(MIB, &stream).await.unwrap(),
            alloc.malloc(MIB, &stream).await.unwrap(),
        ];
        let mut all: Vec<&DeviceBuffer> = weights.iter().chain(ws.iter()).collect();
        all.push(&act);
        fill_and_check(&sim, &stream, &all);
        let st = alloc.stats(DeviceId(0)).await.unwrap();
        let grew = small(&st) > 4 * MIB;
        assert_eq!(
            !grew,
            spills,
            "[{conf}] small pool {} MiB",
            small(&st) >> 20
        );
        drop(ws);
        drop(act);
        // The next steps: the same sizes again, no new small page either way.
        let before = small(&alloc.stats(DeviceId(0)).await.unwrap());
        for _ in 0..3 {
            let act = alloc.malloc(12 * MIB, &stream).await.unwrap();
            let ws = [
                alloc.malloc(MIB, &stream).await.unwrap(),
                alloc.malloc(MIB, &stream).await.unwrap(),
            ];
            let mut all: Vec<&DeviceBuffer> = ws.iter().collect();
            all.push(&act);
            fill_and_check(&sim, &stream, &all);
        }
        let st = alloc.stats(DeviceId(0)).await.unwrap();
        assert_eq!(small(&st), before, "[{conf}]");
        drop(weights);
        alloc.shutdown().await.unwrap();
    }
}
