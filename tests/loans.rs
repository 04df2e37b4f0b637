//! Loans between streams, used as a user would: the public API only, every config, streams
//! and buffers dropped at awkward moments. A buffer freed on one stream serves another
//! stream's request (ordered after the first stream's work) instead of new memory, and its
//! memory goes back to the first stream after the second stream's work.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

mod common;

use common::{build, fill_mib, read_mib, sim, MIB};
use gpualloc::runtime::sim::Op;
use gpualloc::DeviceId;

const CONFIGS: [&str; 4] = [
    "expandable_segments:True",
    "expandable_segments:False",
    "garbage_collection_threshold:0.6,per_process_memory_fraction:0.9",
    "thread_cache:False",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffer_freed_on_one_stream_serves_another_after_its_work() {
    for conf in CONFIGS {
        let sim = sim(1 << 30);
        let alloc = build(sim.clone(), conf);
        let (s1, s2) = (
            alloc.new_stream(DeviceId(0)).unwrap(),
            alloc.new_stream(DeviceId(0)).unwrap(),
        );
        let a = alloc.malloc(64 * MIB, &s1).await.unwrap();
        let ptr = a.ptr();
        // The first stream's kernel is still running when its buffer is dropped and lent.
        sim.launch_kernel(s1.handle(), Duration::from_millis(100), move |m| {
            m.fill(ptr, MIB, 0x11)
        })
        .unwrap();
        drop(a);
        let mallocs = sim.counts().get(Op::Malloc) + sim.counts().get(Op::Map);
        let b = alloc.malloc(64 * MIB, &s2).await.unwrap();
        assert_eq!(b.ptr(), ptr, "{conf}: lent, not new memory");
        assert_eq!(b.stream().handle(), s2.handle(), "{conf}");
        assert_eq!(
            sim.counts().get(Op::Malloc) + sim.counts().get(Op::Map),
            mallocs,
            "{conf}"
        );
        fill_mib(&sim, &s2, ptr, 0x22);
        // The lender's work is done, and its stream handle goes while its block is lent.
        s1.synchronize().unwrap();
        drop(s1);
        assert!(
            read_mib(&sim, &s2, ptr).iter().all(|&x| x == 0x22),
            "{conf}: the borrower's kernel ran before the lender's"
        );
        let stats = alloc.stats(DeviceId(0)).await.unwrap();
        assert_eq!(stats.reserved_bytes[0].current, 64 * MIB, "{conf}");
        // The borrower drops its buffer, then its stream; a third stream is served from the
        // same memory once the borrower's work is done (the actor's reaper sees its event
        // complete: until then the lent block counts as active, as a `record_stream` free).
        drop(b);
        drop(s2);
        let mut back = false;
        for _ in 0..1000 {
            let stats = alloc.stats(DeviceId(0)).await.unwrap();
            if stats.active_bytes[0].current == 0 {
                back = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert!(back, "{conf}: the lent block never came back");
        let s3 = alloc.new_stream(DeviceId(0)).unwrap();
        // Lent again, or (expandable segments) remapped: the dropped lender's free pages are
        // unmapped once its work is done (`orphans.rs`), whichever comes first. Never both.
        let c = alloc.malloc(64 * MIB, &s3).await.unwrap();
        let stats = alloc.stats(DeviceId(0)).await.unwrap();
        let expandable = !conf.contains("expandable_segments:False");
        assert!(expandable || c.ptr() == ptr, "{conf}");
        assert_eq!(stats.reserved_bytes[0].peak, 64 * MIB, "{conf}");
        drop(c);
        alloc.empty_cache().await.unwrap();
        alloc.shutdown().await.unwrap();
        assert_eq!(sim.used_bytes(DeviceId(0)).unwrap(), 0, "{conf}");
    }
}

/// PyTorch's policy keeps each stream's blocks to itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pytorchs_policy_lends_nothing() {
    let sim = sim(1 << 30);
    let alloc = build(sim.clone(), "policy:pytorch");
    let (s1, s2) = (
        alloc.new_stream(DeviceId(0)).unwrap(),
        alloc.new_stream(DeviceId(0)).unwrap(),
    );
    let a = alloc.malloc(64 * MIB, &s1).await.unwrap();
    let ptr = a.ptr();
    drop(a);
    let b = alloc.malloc(64 * MIB, &s2).await.unwrap();
    assert_ne!(b.ptr(), ptr);
    drop(b);
    alloc.shutdown().await.unwrap();
}

/// Six tasks on streams of their own write a tag into each buffer with a slow kernel, check it
/// with a kernel right after, and drop the buffer while both are still queued: the next
/// request of another stream may be lent it at once. Were a loan not ordered after the
/// lender's work, one stream's write would land between another's write and check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_lending_to_each_other_never_see_each_others_writes() {
    const TASKS: u64 = 6;
    const ROUNDS: u64 = 30;
    for conf in CONFIGS {
        let sim = sim(1 << 30);
        let alloc = build(sim.clone(), conf);
        let bad = Arc::new(AtomicU64::new(0));
        let tasks: Vec<_> = (0..TASKS)
            .map(|t| {
                let (alloc, sim, bad) = (alloc.clone(), sim.clone(), bad.clone());
                tokio::spawn(async move {
                    let s = alloc.new_stream(DeviceId(0)).unwrap();
                    for i in 0..ROUNDS {
                        let len = [MIB, 2 * MIB, 3 * MIB][((t + i) % 3) as usize];
                        let buf = alloc.malloc(len, &s).await.unwrap();
                        let (ptr, tag) = (buf.ptr(), (t * ROUNDS + i) as u8);
                        let slow = Duration::from_micros(500 + 300 * ((t + i) % 4));
                        sim.launch_kernel(s.handle(), slow, move |m| m.fill(ptr, len, tag))
                            .unwrap();
                        let bad = bad.clone();
                        sim.launch_kernel(s.handle(), Duration::ZERO, move |m| {
                            if m.read(ptr, len)?.iter().any(|&x| x != tag) {
                                bad.fetch_add(1, Ordering::Relaxed);
                            }
                            Ok(())
                        })
                        .unwrap();
                        drop(buf);
                        if i % 5 == 0 {
                            tokio::task::yield_now().await;
                        }
                    }
                    s.synchronize().unwrap();
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(
            bad.load(Ordering::Relaxed),
            0,
            "{conf}: a write landed out of order"
        );
        assert_eq!(sim.kernel_failures(), 0, "{conf}");
        // Loans were made (each orders its borrower by a wait), so the check had something
        // to catch.
        assert!(sim.counts().get(Op::StreamWaitEvent) > 0, "{conf}: no loan");
        alloc.shutdown().await.unwrap();
    }
}
