//! The backend the two-process tests run on: the sim by default, the CUDA backend when
//! `GPUALLOC_BACKEND=cuda` (CI runs them so against the emulated driver, a GPU machine against
//! NVIDIA's). The child process inherits the variable, so both sides use the same backend.
#![allow(dead_code)]

use std::sync::{Arc, Mutex, MutexGuard};

use gpualloc_runtime::{Backend, DeviceId};
use gpualloc_sim::{SimBackend, SimConfig};

/// A backend for one process of a test, with what is needed to check it leaked nothing.
pub struct TestBackend {
    pub backend: Arc<dyn Backend>,
    /// The sim, when the backend is the sim: its own live counts are the stricter check.
    pub sim: Option<Arc<SimBackend>>,
    device: DeviceId,
    free_at_start: u64,
    /// On CUDA, device memory is shared by the whole process: the tests of one binary hold
    /// this in turn, so one test's allocations do not move another's free-memory figures.
    _serial: Option<MutexGuard<'static, ()>>,
}

static CUDA_TESTS: Mutex<()> = Mutex::new(());

/// The device the tests run on: `GPUALLOC_TEST_DEVICE` (default 0). CI runs them on device 3 of
/// four emulated GPUs too, so nothing may assume device 0; the sims here then have
/// `device + 1` devices.
pub fn dev() -> DeviceId {
    DeviceId(std::env::var("GPUALLOC_TEST_DEVICE").map_or(0, |d| {
        d.parse()
            .unwrap_or_else(|_| panic!("GPUALLOC_TEST_DEVICE={d}: not a device ordinal"))
    }))
}

impl TestBackend {
    /// The backend `GPUALLOC_BACKEND` names (`cuda`, or the sim when unset or `sim`).
    pub fn from_env(device: DeviceId) -> TestBackend {
        match std::env::var("GPUALLOC_BACKEND").as_deref() {
            Ok("cuda") => {
                let serial = CUDA_TESTS.lock().unwrap_or_else(|e| e.into_inner());
                TestBackend::measured(cuda(), None, device, Some(serial))
            }
            Ok("sim") | Err(_) => TestBackend::sim(device),
            Ok(other) => panic!("GPUALLOC_BACKEND={other}: expected cuda or sim"),
        }
    }

    /// A sim with devices up to `device`, whatever the environment says.
    pub fn sim(device: DeviceId) -> TestBackend {
        let sim = SimBackend::new(SimConfig::fast(device.0 + 1)).unwrap();
        TestBackend::measured(sim.clone(), Some(sim), device, None)
    }

    fn measured(
        backend: Arc<dyn Backend>,
        sim: Option<Arc<SimBackend>>,
        device: DeviceId,
        serial: Option<MutexGuard<'static, ()>>,
    ) -> TestBackend {
        println!("two-process test on the {} backend", backend.name());
        let free_at_start = backend.mem_info(device).unwrap().free;
        TestBackend {
            backend,
            sim,
            device,
            free_at_start,
            _serial: serial,
        }
    }

    /// Nothing this process allocated on the device is left: the device's free memory is what
    /// it was at the start and, on the sim, no allocation or physical handle is alive.
    pub fn assert_nothing_leaked(&self) {
        let free = self.backend.mem_info(self.device).unwrap().free;
        assert_eq!(
            free,
            self.free_at_start,
            "{}: device memory still in use",
            self.backend.name()
        );
        if let Some(sim) = &self.sim {
            assert_eq!(sim.live_allocations(), 0);
            assert_eq!(sim.live_phys(), 0);
        }
    }
}

#[cfg(feature = "cuda")]
fn cuda() -> Arc<dyn Backend> {
    gpualloc_cuda::CudaBackend::new().unwrap_or_else(|e| {
        panic!("GPUALLOC_BACKEND=cuda but the CUDA backend is unavailable: {e}")
    })
}

#[cfg(not(feature = "cuda"))]
fn cuda() -> Arc<dyn Backend> {
    panic!("GPUALLOC_BACKEND=cuda but these tests were built without the `cuda` feature")
}

/// Live allocation `ptr` of `core` as a [`gpualloc_ipc::DeviceRegion`] (what the facade's
/// `export_region` does; the ipc crate does not know the core).
pub fn region(
    core: &gpualloc_devices::DeviceCore,
    ptr: gpualloc_runtime::DevicePtr,
) -> gpualloc_ipc::DeviceRegion {
    use gpualloc_devices::AllocationMemory;
    use gpualloc_ipc::SegmentMemory;
    let (len, memory) = core.allocation_memory(ptr).expect("a live allocation");
    let segment = match memory {
        AllocationMemory::Segment { base } => SegmentMemory::Allocation { base },
        AllocationMemory::Pages(pages) => SegmentMemory::from_pages(pages),
    };
    gpualloc_ipc::DeviceRegion {
        device: core.device(),
        ptr,
        len,
        segment,
    }
}

/// A guard that frees `ptr` in `core` when the export is released.
pub fn core_guard(
    core: Arc<Mutex<gpualloc_devices::DeviceCore>>,
    ptr: gpualloc_runtime::DevicePtr,
) -> Box<dyn gpualloc_ipc::ExportGuard> {
    Box::new(gpualloc_ipc::OnRelease::new(move || {
        let mut core = core.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = core.free(ptr) {
            eprintln!("freeing a released export failed: {e}");
        }
    }))
}
