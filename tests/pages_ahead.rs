//! No pages ahead after a page move (the `gpualloc` policy: once free pages were moved before a
//! growth, the job is at its peak, where pages mapped ahead stay unused), used as a user
//! would: the public API only, on the sim, misses served off the gate by the device actor,
//! every buffer's bytes checked after the move.

mod common;

use common::{build, fill_mib, is_pytorch, read_mib, sim, MIB, POLICY_CONFIGS};
use gpualloc::{DeviceBuffer, DeviceId};

/// 200 MiB freed before a live 200 MiB, then 210 MiB: the growth past the most ever held first
/// gives back the freed pages (the page move) and maps only what it needs. The next growths,
/// 3 MiB and 7 MiB, map 4 and 6 more (no pages ahead); before the move, a growth of 210 MiB
/// maps ahead to the next 20 MiB boundary. PyTorch's policy moves nothing and maps 20 MiB
/// pages: 620 MiB throughout. Bytes checked in every buffer after each step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_page_move_growths_map_only_what_they_need() {
    for conf in POLICY_CONFIGS {
        let moved = !is_pytorch(conf);
        let sim = sim(4 << 30);
        let alloc = build(sim.clone(), conf);
        let stream = alloc.new_stream(DeviceId(0)).unwrap();
        let reserved =
            || async { alloc.stats(DeviceId(0)).await.unwrap().reserved_bytes[0].current / MIB };
        let check = |bufs: &[&DeviceBuffer]| {
            for (i, b) in bufs.iter().enumerate() {
                fill_mib(&sim, &stream, b.ptr(), 0x20 + i as u8);
            }
            for (i, b) in bufs.iter().enumerate() {
                let bytes = read_mib(&sim, &stream, b.ptr());
                assert!(bytes.iter().all(|&x| x == 0x20 + i as u8), "[{conf}] {i}");
            }
        };
        let a = alloc.malloc(200 * MIB, &stream).await.unwrap();
        let b = alloc.malloc(200 * MIB, &stream).await.unwrap();
        drop(a);
        let c = alloc.malloc(210 * MIB, &stream).await.unwrap();
        check(&[&b, &c]);
        let after_c = reserved().await;
        let d = alloc.malloc(3 * MIB, &stream).await.unwrap();
        let after_d = reserved().await;
        let e = alloc.malloc(7 * MIB, &stream).await.unwrap();
        let after_e = reserved().await;
        check(&[&b, &c, &d, &e]);
        if moved {
            assert_eq!([after_c, after_d, after_e], [410, 414, 420], "[{conf}]");
        } else {
            assert_eq!([after_c, after_d, after_e], [620, 620, 620], "[{conf}]");
        }
        drop((b, c, d, e));
        alloc.shutdown().await.unwrap();
    }
}
