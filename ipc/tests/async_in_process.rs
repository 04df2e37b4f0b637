//! The async importer and the counter-as-truth path, in one process (the sim may open its
//! own IPC handles): an importer that just drops its buffer, without telling the exporter,
//! still lets the exporter's `collect` take the block back.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use gpualloc_ipc::{
    AsyncExportConn, AsyncImportConn, DeviceRegion, OnRelease, PeerPolicy, Received, Returned,
    SegmentMemory,
};
use gpualloc_runtime::{Backend, DeviceId};
use gpualloc_sim::{SimBackend, SimConfig};

const DEV: DeviceId = DeviceId(0);

/// Both ends of an async connection over a socket pair, on `backend`.
async fn connected(backend: &Arc<dyn Backend>) -> (AsyncExportConn, AsyncImportConn) {
    let (a, b) = tokio::net::UnixStream::pair().unwrap();
    let exp = AsyncExportConn::new(a, &PeerPolicy::default(), backend.clone())
        .await
        .unwrap();
    let imp = AsyncImportConn::new(b, &PeerPolicy::default(), backend.clone(), DEV)
        .await
        .unwrap();
    (exp, imp)
}

#[tokio::test]
async fn async_pair_release_message_and_silent_drop() {
    let sim = SimBackend::new(SimConfig::fast(1)).unwrap();
    let backend: Arc<dyn Backend> = sim.clone();
    let stream = backend.stream_create(DEV).unwrap();
    let seg = backend.malloc(DEV, 4 << 20).unwrap();
    let (mut exp, mut imp) = connected(&backend).await;
    let released = Arc::new(AtomicUsize::new(0));

    // Two buffers of one segment: at offset 1 MiB and 3 MiB.
    let mut ids = Vec::new();
    for off in [1u64 << 20, 3 << 20] {
        let ptr = seg.checked_add(off).unwrap();
        backend
            .copy_to_device(stream, ptr, &[off as u8 ^ 0x3c; 4096])
            .unwrap();
        let region = DeviceRegion {
            device: DEV,
            ptr,
            len: 4096,
            segment: SegmentMemory::Allocation { base: seg },
        };
        let r = released.clone();
        let guard = Box::new(OnRelease::new(move || {
            r.fetch_add(1, Ordering::SeqCst);
        }));
        ids.push(exp.send_device(&region, Some(stream), guard).await.unwrap());
    }
    assert_eq!(exp.outstanding(), 2);

    let mut bufs = Vec::new();
    for off in [1u64 << 20, 3 << 20] {
        let Received::Device(buf) = imp.recv().await.unwrap() else {
            panic!("expected a device buffer");
        };
        let mut got = [0u8; 4096];
        backend
            .copy_from_device(stream, &mut got, buf.ptr())
            .unwrap();
        assert_eq!(got, [off as u8 ^ 0x3c; 4096]);
        assert!(!buf.is_vmm());
        bufs.push(buf);
    }
    // The second is dropped silently: no message, only the shared counter changes.
    drop(bufs.pop());
    assert_eq!(exp.collect(), vec![ids[1]]);
    assert_eq!(released.load(Ordering::SeqCst), 1);
    // The first is released properly; the exporter hears about it.
    imp.release(bufs.pop().unwrap(), &[stream]).await.unwrap();
    assert_eq!(exp.wait_returned(ids[0]).await.unwrap(), Returned::Released);
    assert_eq!(released.load(Ordering::SeqCst), 2);
    assert_eq!(exp.outstanding(), 0);
    drop(imp);
    let totals = exp.serve().await.unwrap();
    assert_eq!((totals.released, totals.reclaimed), (2, 0));
    backend.free(DEV, seg).unwrap();
    assert_eq!(sim.live_allocations(), 0);
}

/// An async exporter connection dropped with an export out keeps it while the importer holds
/// it, and gives it back once the importer drops it (its connection still open).
#[tokio::test]
async fn a_dropped_async_exporter_keeps_the_export_until_the_importer_drops_it() {
    use gpualloc_ipc::keeper::COLLECT_EVERY;
    let sim = SimBackend::new(SimConfig::fast(1)).unwrap();
    let backend: Arc<dyn Backend> = sim.clone();
    let seg = backend.malloc(DEV, 2 << 20).unwrap();
    let (mut exp, mut imp) = connected(&backend).await;
    let released = Arc::new(AtomicUsize::new(0));
    let r = released.clone();
    let region = DeviceRegion {
        device: DEV,
        ptr: seg,
        len: 4096,
        segment: SegmentMemory::Allocation { base: seg },
    };
    exp.send_device(
        &region,
        None,
        Box::new(OnRelease::new(move || {
            r.fetch_add(1, Ordering::SeqCst);
        })),
    )
    .await
    .unwrap();
    let Received::Device(buf) = imp.recv().await.unwrap() else {
        panic!("expected a device buffer");
    };
    drop(exp);
    tokio::time::sleep(COLLECT_EVERY * 2).await;
    assert_eq!(
        released.load(Ordering::SeqCst),
        0,
        "freed under the importer"
    );
    drop(buf);
    let t = std::time::Instant::now();
    while released.load(Ordering::SeqCst) == 0 {
        assert!(
            t.elapsed() < COLLECT_EVERY * 10,
            "the release was not collected"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert_eq!(released.load(Ordering::SeqCst), 1);
    drop(imp);
    backend.free(DEV, seg).unwrap();
}
