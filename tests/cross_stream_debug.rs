//! The `debug_cross_stream_frees` config key, used as a user would: a buffer dropped while a
//! kernel on another stream still uses it is reported (and would really be reused under that
//! kernel); the documented patterns (record_stream, an event wait) are not reported.

mod common;

use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::Arc;
use std::time::Duration;

use common::{build, sim, MIB};
use gpualloc::runtime::sim::SimBackend;
use gpualloc::{Backend, DeviceId, Stream};

const D0: DeviceId = DeviceId(0);

const CONFIGS: [&str; 4] = [
    "debug_cross_stream_frees:True",
    "debug_cross_stream_frees:True,expandable_segments:True",
    "debug_cross_stream_frees:True,thread_cache:False",
    "debug_cross_stream_frees:True,garbage_collection_threshold:0.6,\
     per_process_memory_fraction:0.9",
];

/// Holds `stream` until the returned sender is dropped.
fn hold(sim: &SimBackend, stream: &Stream) -> SyncSender<()> {
    let (open, gate) = sync_channel::<()>(0);
    sim.launch_kernel(stream.handle(), Duration::ZERO, move |_| {
        let _ = gate.recv();
        Ok(())
    })
    .unwrap();
    open
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffer_dropped_under_another_streams_kernel_is_reported() {
    for conf in CONFIGS {
        let sim = sim(256 * MIB);
        let alloc = build(sim.clone() as Arc<dyn Backend>, conf);
        let producer = alloc.new_stream(D0).unwrap();
        let consumer = alloc.new_stream(D0).unwrap();
        let buf = alloc.malloc(2 * MIB, &producer).await.unwrap();
        let (ptr, len) = (buf.ptr(), buf.len());
        let open = hold(&sim, &consumer);
        // The consumer's kernel reads the buffer later; no record_stream, no event wait.
        sim.launch_kernel_touching(consumer.handle(), Duration::ZERO, &[(ptr, len)], |_| Ok(()))
            .unwrap();
        drop(buf);
        let reports = alloc.cross_stream_frees(D0).await.unwrap();
        assert_eq!(reports.len(), 1, "{conf}");
        assert_eq!(reports[0].ptr, ptr, "{conf}");
        assert_eq!(reports[0].stream, producer.handle(), "{conf}");
        assert_eq!(reports[0].others, vec![consumer.handle()], "{conf}");
        assert!(reports[0].size >= len, "{conf}");
        let stats = alloc.stats(D0).await.unwrap();
        assert_eq!(stats.num_cross_stream_frees, 1, "{conf}");
        // What the report warns of: the next request on the producer gets the same memory
        // while the consumer's kernel is still queued on it.
        let next = alloc.malloc(2 * MIB, &producer).await.unwrap();
        assert_eq!(next.ptr(), ptr, "{conf}: reused under the pending kernel");
        drop(open);
        consumer.synchronize().unwrap();
        drop(next);
        assert_eq!(alloc.stats(D0).await.unwrap().num_cross_stream_frees, 1);
        alloc.reset_accumulated_stats(D0).await.unwrap();
        assert_eq!(alloc.stats(D0).await.unwrap().num_cross_stream_frees, 0);
        drop((producer, consumer));
        alloc.shutdown().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn record_stream_or_an_event_wait_is_not_reported() {
    for conf in CONFIGS {
        let sim = sim(256 * MIB);
        let alloc = build(sim.clone() as Arc<dyn Backend>, conf);
        let producer = alloc.new_stream(D0).unwrap();
        let consumer = alloc.new_stream(D0).unwrap();
        let open = hold(&sim, &consumer);

        // Finished before the drop (before the wait below holds the producer too).
        let finished = alloc.malloc(MIB, &producer).await.unwrap();
        let f = (finished.ptr(), finished.len());
        sim.launch_kernel_touching(producer.handle(), Duration::ZERO, &[f], |_| Ok(()))
            .unwrap();
        producer.synchronize().unwrap();
        drop(finished);

        let recorded = alloc.malloc(MIB, &producer).await.unwrap();
        let r = (recorded.ptr(), recorded.len());
        sim.launch_kernel_touching(consumer.handle(), Duration::ZERO, &[r], |_| Ok(()))
            .unwrap();
        recorded.record_stream(&consumer).unwrap();
        drop(recorded);

        let waited = alloc.malloc(MIB, &producer).await.unwrap();
        let w = (waited.ptr(), waited.len());
        sim.launch_kernel_touching(consumer.handle(), Duration::ZERO, &[w], |_| Ok(()))
            .unwrap();
        let done = consumer.record_event().unwrap();
        producer.wait_event(&done).unwrap();
        drop(waited);

        assert_eq!(
            alloc.cross_stream_frees(D0).await.unwrap(),
            vec![],
            "{conf}"
        );
        assert_eq!(alloc.stats(D0).await.unwrap().num_cross_stream_frees, 0);
        drop(open);
        consumer.synchronize().unwrap();
        drop((producer, consumer, done));
        alloc.shutdown().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn off_by_default() {
    let sim = sim(256 * MIB);
    let alloc = build(sim.clone() as Arc<dyn Backend>, "");
    let producer = alloc.new_stream(D0).unwrap();
    let consumer = alloc.new_stream(D0).unwrap();
    let buf = alloc.malloc(MIB, &producer).await.unwrap();
    let open = hold(&sim, &consumer);
    sim.launch_kernel_touching(
        consumer.handle(),
        Duration::ZERO,
        &[(buf.ptr(), buf.len())],
        |_| Ok(()),
    )
    .unwrap();
    drop(buf);
    assert_eq!(alloc.cross_stream_frees(D0).await.unwrap(), vec![]);
    assert_eq!(
        sim.counts().get(gpualloc::runtime::sim::Op::UnorderedUsers),
        0
    );
    drop(open);
    consumer.synchronize().unwrap();
    drop((producer, consumer));
    alloc.shutdown().await.unwrap();
}
