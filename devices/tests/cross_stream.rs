//! The `debug_cross_stream_frees` check on the simulated GPU: a free is reported when another
//! stream still has queued work on the block that was neither `record_stream`ed nor waited for.

use std::sync::Arc;

use gpualloc_accounting::AccountingBackend;
use gpualloc_devices::{AllocatorConfig, CrossStreamFree, DeviceCore, CROSS_STREAM_LOG};
use gpualloc_runtime::{Backend, DeviceId, StreamHandle};
use gpualloc_sim::{Op, SimBackend, SimConfig};

mod common;
use common::hold;

const MIB: u64 = 1 << 20;
const D0: DeviceId = DeviceId(0);

struct Rig {
    sim: Arc<SimBackend>,
    core: DeviceCore,
    s0: StreamHandle,
    s1: StreamHandle,
}

fn rig(conf: &str) -> Rig {
    let sim = SimBackend::new(SimConfig::fast(1)).unwrap();
    let dynb: Arc<dyn Backend> = sim.clone();
    let s0 = dynb.stream_create(D0).unwrap();
    let s1 = dynb.stream_create(D0).unwrap();
    let core = DeviceCore::new(dynb, D0, AllocatorConfig::parse(conf).unwrap()).unwrap();
    Rig { sim, core, s0, s1 }
}

const CONFIGS: [&str; 2] = [
    "debug_cross_stream_frees:True",
    "debug_cross_stream_frees:True,expandable_segments:True",
];

#[test]
fn a_free_under_another_streams_pending_memset_is_reported() {
    for conf in CONFIGS {
        let mut r = rig(conf);
        let a = r.core.malloc(3 * MIB, r.s0).unwrap();
        let open = hold(&r.sim, r.s1);
        r.sim.memset_async(r.s1, a.ptr, 0xab, 4096).unwrap();
        r.core.free(a.ptr).unwrap();
        let reports = r.core.cross_stream_frees();
        assert_eq!(
            reports,
            vec![CrossStreamFree {
                ptr: a.ptr,
                size: a.block_size,
                stream: r.s0,
                others: vec![r.s1],
            }],
            "{conf}"
        );
        assert_eq!(r.core.stats().num_cross_stream_frees, 1, "{conf}");
        drop(open);
        r.sim.stream_synchronize(r.s1).unwrap();
        // The same block, freed again after s1 finished: nothing new.
        let b = r.core.malloc(3 * MIB, r.s0).unwrap();
        assert_eq!(b.ptr, a.ptr, "{conf}");
        r.core.free(b.ptr).unwrap();
        assert_eq!(r.core.stats().num_cross_stream_frees, 1, "{conf}");
        r.core.reset_accumulated_stats();
        assert_eq!(r.core.stats().num_cross_stream_frees, 0, "{conf}");
        r.core.shutdown().unwrap();
    }
}

#[test]
fn recorded_waited_for_own_stream_and_unrelated_work_is_not_reported() {
    let mut r = rig(CONFIGS[0]);
    let open = hold(&r.sim, r.s1);
    // Recorded: the core's events guard the reuse.
    let a = r.core.malloc(MIB, r.s0).unwrap();
    r.sim.memset_async(r.s1, a.ptr, 1, 64).unwrap();
    r.core.record_stream(a.ptr, r.s1).unwrap();
    r.core.free(a.ptr).unwrap();
    // Waited for: s0 waits on an event recorded on s1 after the memset.
    let b = r.core.malloc(MIB, r.s0).unwrap();
    r.sim.memset_async(r.s1, b.ptr, 2, 64).unwrap();
    let e = r.sim.event_create(D0).unwrap();
    r.sim.event_record(e, r.s1).unwrap();
    r.sim.stream_wait_event(r.s0, e).unwrap();
    r.core.free(b.ptr).unwrap();
    // Pending work on the allocation stream itself is stream-ordered.
    let open0 = hold(&r.sim, r.s0);
    let c = r.core.malloc(MIB, r.s0).unwrap();
    r.sim.memset_async(r.s0, c.ptr, 3, 64).unwrap();
    r.core.free(c.ptr).unwrap();
    // Work on s1 touching other memory.
    let d = r.core.malloc(2 * MIB, r.s0).unwrap();
    let other = r.core.malloc(2 * MIB, r.s0).unwrap();
    r.sim.memset_async(r.s1, other.ptr, 4, 2 * MIB).unwrap();
    r.core.free(d.ptr).unwrap();
    assert_eq!(r.core.cross_stream_frees(), vec![]);
    assert_eq!(r.core.stats().num_cross_stream_frees, 0);
    assert_eq!(r.sim.counts().get(Op::UnorderedUsers), 4);
    // And the buffer s1 still writes is reported when freed.
    r.core.free(other.ptr).unwrap();
    assert_eq!(r.core.stats().num_cross_stream_frees, 1);
    drop((open, open0));
    r.sim.stream_synchronize(r.s1).unwrap();
    r.sim.event_destroy(e).unwrap();
    r.core.shutdown().unwrap();
}

#[test]
fn off_by_default_and_silent_where_the_backend_cannot_tell() {
    let mut r = rig("");
    let a = r.core.malloc(MIB, r.s0).unwrap();
    let open = hold(&r.sim, r.s1);
    r.sim.memset_async(r.s1, a.ptr, 1, 64).unwrap();
    r.core.free(a.ptr).unwrap();
    assert_eq!(r.core.cross_stream_frees(), vec![]);
    assert_eq!(r.core.stats().num_cross_stream_frees, 0);
    assert_eq!(
        r.sim.counts().get(Op::UnorderedUsers),
        0,
        "no check with the key off"
    );
    drop(open);
    r.core.shutdown().unwrap();

    let acc: Arc<dyn Backend> = Arc::new(AccountingBackend::new(1, 64 * MIB));
    let s = acc.stream_create(D0).unwrap();
    let conf = AllocatorConfig::parse(CONFIGS[0]).unwrap();
    let mut core = DeviceCore::new(acc, D0, conf).unwrap();
    for _ in 0..3 {
        let a = core.malloc(MIB, s).unwrap();
        core.free(a.ptr).unwrap();
    }
    assert_eq!(core.stats().num_cross_stream_frees, 0);
}

#[test]
fn the_log_keeps_the_last_reports_and_the_count_keeps_all() {
    let mut r = rig(CONFIGS[0]);
    let open = hold(&r.sim, r.s1);
    let n = CROSS_STREAM_LOG + 6;
    let mut ptrs = Vec::new();
    for _ in 0..n {
        let a = r.core.malloc(4096, r.s0).unwrap();
        r.sim.memset_async(r.s1, a.ptr, 9, 16).unwrap();
        ptrs.push(a.ptr);
    }
    for p in &ptrs {
        r.core.free(*p).unwrap();
    }
    let reports = r.core.cross_stream_frees();
    assert_eq!(reports.len(), CROSS_STREAM_LOG);
    assert_eq!(reports[0].ptr, ptrs[6], "oldest kept");
    assert_eq!(reports.last().unwrap().ptr, ptrs[n - 1]);
    assert_eq!(r.core.stats().num_cross_stream_frees, n as u64);
    drop(open);
    r.core.shutdown().unwrap();
}
