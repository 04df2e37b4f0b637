//! Setup shared by the device-core tests.

// Not every test crate including this module uses every helper.
#![allow(dead_code)]

use std::sync::Arc;

use gpualloc_accounting::AccountingBackend;
use gpualloc_devices::{AllocatorConfig, DeviceCore, IoDone, Miss, MissIo, MissStep, PoolOptions};
use gpualloc_runtime::{Backend, BackendError, DeviceId, StreamHandle};

const MIB: u64 = 1 << 20;

/// A core on one accounting device of `capacity` bytes under config `conf`, its backend and a
/// stream of it. Not recording history.
pub fn rig(capacity: u64, conf: &str) -> (Arc<AccountingBackend>, DeviceCore, StreamHandle) {
    let backend = Arc::new(AccountingBackend::new(1, capacity));
    let dynb: Arc<dyn Backend> = backend.clone();
    let s = dynb.stream_create(DeviceId(0)).unwrap();
    let config = AllocatorConfig::parse(conf).unwrap();
    let core = DeviceCore::new(dynb, DeviceId(0), config).unwrap();
    (backend, core, s)
}

/// A named pool's options with a quota of `bytes` and nothing else.
pub fn quota(bytes: u64) -> PoolOptions {
    PoolOptions {
        quota: Some(bytes),
        ..PoolOptions::default()
    }
}

/// The error of a device without memory.
pub fn oom() -> BackendError {
    BackendError::OutOfMemory {
        requested: 0,
        what: "device 0".into(),
    }
}

/// The kind of a step, to compare sequences.
pub fn kind(step: &MissStep) -> String {
    match step {
        MissStep::Done(a) => format!("done {} MiB", a.block_size / MIB),
        MissStep::Failed(e) => format!("failed {}", if e.is_oom() { "oom" } else { "other" }),
        MissStep::Io(MissIo::AllocSegment { size, .. }) => format!("alloc {} MiB", size / MIB),
        MissStep::Io(MissIo::MapPages(p)) => format!("map {} MiB", p.bytes() / MIB),
        MissStep::Io(MissIo::FreeSegments { segments, .. }) => {
            let sizes: Vec<u64> = segments.iter().map(|s| s.size / MIB).collect();
            format!("free {sizes:?} MiB")
        }
        MissStep::Io(MissIo::SynchronizeEvents(e)) => format!("sync {} events", e.len()),
        MissStep::Io(MissIo::UnmapPages(r)) => {
            format!(
                "unmap {} MiB",
                r.iter().map(|r| r.bytes()).sum::<u64>() / MIB
            )
        }
        MissStep::Io(MissIo::GiveBack(_)) => "give back".into(),
    }
}

/// Advances `m` from `done` to its end, each driver call handed to `call` (which makes it,
/// refuses it, or first does what other requests would meanwhile). Returns the kinds of the
/// steps and the last step.
pub fn drive(
    core: &mut DeviceCore,
    m: &mut Miss,
    mut done: Option<IoDone>,
    mut call: impl FnMut(&mut DeviceCore, MissIo) -> IoDone,
) -> (Vec<String>, MissStep) {
    let mut steps = Vec::new();
    for _ in 0..64 {
        let step = core.advance_miss(m, done.take());
        steps.push(kind(&step));
        match step {
            MissStep::Io(io) => done = Some(call(core, io)),
            end => return (steps, end),
        }
    }
    panic!("no end after 64 steps: {steps:?}");
}

/// Drives `miss` (started on `core`) to its end, as an owner does: each driver call the chain
/// asks for is made, except those `refuse` picks, which fail as a device without memory
/// does (the owner tried it and found no room). Returns the last step.
pub fn drive_miss(
    core: &mut DeviceCore,
    mut miss: Miss,
    mut refuse: impl FnMut(&MissIo) -> bool,
) -> MissStep {
    let (_, end) = drive(core, &mut miss, None, |core, io| {
        if refuse(&io) {
            io.fail(oom())
        } else {
            let backend = core.backend().clone();
            io.perform(backend.as_ref())
        }
    });
    end
}

/// True for the chain's request of a new segment.
pub fn segment_malloc(io: &MissIo) -> bool {
    matches!(io, MissIo::AllocSegment { .. })
}

/// Holds `stream` of the sim busy until the returned sender is dropped.
pub fn hold(
    sim: &gpualloc_sim::SimBackend,
    stream: StreamHandle,
) -> std::sync::mpsc::SyncSender<()> {
    let (open, gate) = std::sync::mpsc::sync_channel::<()>(0);
    sim.launch_kernel(stream, std::time::Duration::ZERO, move |_| {
        let _ = gate.recv();
        Ok(())
    })
    .unwrap();
    open
}
