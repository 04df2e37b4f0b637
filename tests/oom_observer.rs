//! Out-of-memory observers through the public API: `on_oom` callbacks run once per
//! failed `malloc` (of the allocator or a pool, at once or after a wait), never for other
//! errors or for a wait that ends in a buffer; they run off the gate (one frees a buffer it
//! kept and the next request fits); one that panics does not stop the others; and
//! `oom_snapshot_path` writes a snapshot the callbacks can read, with the `oom` entry in it.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{sim, MIB};
use gpualloc::{
    Allocator, DeviceBuffer, DeviceId, Error, HistoryOptions, MallocOptions, OomEvent, PoolOptions,
};

const D0: DeviceId = DeviceId(0);

type Seen = Arc<Mutex<Vec<OomEvent>>>;

fn recorder(seen: &Seen) -> impl Fn(&OomEvent) + Send + Sync + 'static {
    let seen = seen.clone();
    move |e: &OomEvent| seen.lock().unwrap().push(e.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observers_run_once_per_failed_malloc_and_may_free_memory() {
    for conf in ["", "expandable_segments:True", "thread_cache:False"] {
        let seen = Seen::default();
        let reserve: Arc<Mutex<Option<DeviceBuffer>>> = Arc::default();
        let reserve_in = reserve.clone();
        let alloc = Allocator::builder()
            .config_str(conf)
            .backend_instance(sim(256 * MIB))
            .on_oom(|_| panic!("an observer with a bug"))
            .on_oom(recorder(&seen))
            // Frees an emergency reserve: it runs off the gate, so dropping a buffer works.
            .on_oom(move |_| drop(reserve_in.lock().unwrap().take()))
            .build()
            .unwrap();
        let s = alloc.new_stream(D0).unwrap();
        *reserve.lock().unwrap() = Some(alloc.malloc(100 * MIB, &s).await.unwrap());
        let _held = alloc.malloc(120 * MIB, &s).await.unwrap();
        let e = alloc.malloc(100 * MIB, &s).await.unwrap_err();
        assert!(e.is_oom(), "[{conf}] {e}");
        {
            let seen = seen.lock().unwrap();
            assert_eq!(
                seen.len(),
                1,
                "[{conf}] the panicking observer did not stop the others"
            );
            assert_eq!((seen[0].device, seen[0].size), (D0, 100 * MIB));
            assert!(seen[0].error.is_oom());
            assert_eq!(seen[0].error.to_string(), e.to_string());
            assert_eq!(seen[0].snapshot, None);
        }
        assert!(
            reserve.lock().unwrap().is_none(),
            "[{conf}] the reserve was freed"
        );
        // The memory the observer freed serves the retry.
        let ok = alloc.malloc(100 * MIB, &s).await.unwrap();
        // Other errors are not out-of-memory: no call.
        let other = alloc.new_stream(D0).unwrap();
        drop(ok);
        let invalid = alloc.malloc(u64::MAX, &other).await.unwrap_err();
        assert!(!invalid.is_oom(), "[{conf}] {invalid}");
        assert_eq!(seen.lock().unwrap().len(), 1, "[{conf}]");
        alloc.shutdown().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waits_and_pools_call_observers_only_when_they_fail() {
    let seen = Seen::default();
    let alloc = Allocator::builder()
        .config_str("")
        .backend_instance(sim(256 * MIB))
        .on_oom(recorder(&seen))
        .build()
        .unwrap();
    let s = alloc.new_stream(D0).unwrap();
    let big = alloc.malloc(200 * MIB, &s).await.unwrap();
    // A wait that ends in a buffer: no call.
    let waiting = {
        let (alloc, s) = (alloc.clone(), s.clone());
        tokio::spawn(async move {
            alloc
                .malloc_with(
                    100 * MIB,
                    &s,
                    MallocOptions::wait_for(Duration::from_secs(10)),
                )
                .await
        })
    };
    common::until_waiting(&alloc, 1).await;
    drop(big);
    let got = waiting.await.unwrap().unwrap();
    assert!(seen.lock().unwrap().is_empty());
    // A wait that times out: one call, after the wait.
    let e = alloc
        .malloc_with(
            200 * MIB,
            &s,
            MallocOptions::wait_for(Duration::from_millis(50)),
        )
        .await
        .unwrap_err();
    assert!(e.is_oom());
    assert_eq!(seen.lock().unwrap().len(), 1);
    drop(got);
    // A pool at its quota.
    let kv = alloc
        .pool(
            "kv",
            PoolOptions {
                quota: Some(40 * MIB),
                ..PoolOptions::default()
            },
        )
        .await
        .unwrap();
    let _a = kv.malloc(30 * MIB, &s).await.unwrap();
    let e = kv.malloc(30 * MIB, &s).await.unwrap_err();
    assert!(e.is_oom(), "{e}");
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[1].size, 30 * MIB);
    assert!(
        seen[1].error.to_string().contains("kv"),
        "{}",
        seen[1].error
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oom_snapshot_path_writes_a_snapshot_with_the_oom_in_its_history() {
    let dir = std::env::temp_dir().join(format!("gpualloc-oom-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("oom.pickle");
    let seen = Seen::default();
    let alloc = Allocator::builder()
        .config_str(format!(
            "expandable_segments:True,oom_snapshot_path:{}",
            path.display()
        ))
        .backend_instance(sim(256 * MIB))
        .on_oom(recorder(&seen))
        .build()
        .unwrap();
    alloc
        .record_history(HistoryOptions::default())
        .await
        .unwrap();
    let s = alloc.new_stream(D0).unwrap();
    let _a = alloc.malloc(150 * MIB, &s).await.unwrap();
    let e: Error = alloc.malloc(150 * MIB, &s).await.unwrap_err();
    assert!(e.is_oom());
    assert_eq!(
        seen.lock().unwrap()[0].snapshot.as_deref(),
        Some(path.as_path())
    );
    let snap = gpualloc::trace::Snapshot::from_pickle(&std::fs::read(&path).unwrap()).unwrap();
    let trace = &snap.device_traces[0];
    let oom = trace
        .iter()
        .find(|t| t.action == gpualloc::trace::Action::Oom)
        .expect("an oom entry");
    assert_eq!(oom.size, 150 * MIB);
    assert_eq!(
        snap.segments.iter().map(|s| s.total_size).sum::<u64>(),
        alloc.stats(D0).await.unwrap().reserved_bytes.all().current
    );
    // Without a recording the snapshot is written too, with its segments only.
    alloc.stop_history().await.unwrap();
    std::fs::remove_file(&path).unwrap();
    assert!(alloc.malloc(150 * MIB, &s).await.is_err());
    let snap = gpualloc::trace::Snapshot::from_pickle(&std::fs::read(&path).unwrap()).unwrap();
    assert!(snap.device_traces[0].is_empty());
    assert_eq!(seen.lock().unwrap().len(), 2);
    std::fs::remove_file(&path).unwrap();
    let _ = std::fs::remove_dir(&dir);
    alloc.shutdown().await.unwrap();
}
