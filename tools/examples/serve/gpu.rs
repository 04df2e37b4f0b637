//! What runs the requests' kernels: the simulated GPU's kernels, or memsets and host-side
//! checks on a driver; and the parts of a buffer they write and check.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use gpualloc::runtime::sim::{KernelMemory, SimBackend, SimConfig};
use gpualloc::runtime::{Backend, BackendError};
use gpualloc::{DeviceBuffer, DeviceId, DevicePtr, Error, Stream};

use crate::request::Counters;
use crate::{KIB, MIB};

/// Simulated devices.
pub(crate) const SIM_DEVICES: u32 = 2;
/// A simulated device's memory: small on purpose, requests sometimes wait for memory.
pub(crate) const SIM_CAPACITY: u64 = 320 * MIB;

/// The parts of a buffer the kernels write and check: all of a small buffer, the first and
/// last 64 KiB of a large one (a reused block starts at a block boundary, so a head always
/// overlaps; this keeps the simulated kernels' CPU work, which competes with the allocator
/// for this machine's cores, small).
pub(crate) fn regions(ptr: DevicePtr, len: u64) -> Vec<(DevicePtr, u64)> {
    const EDGE: u64 = 64 * KIB;
    if len <= 4 * EDGE {
        vec![(ptr, len)]
    } else {
        vec![(ptr, EDGE), (DevicePtr(ptr.0 + len - EDGE), EDGE)]
    }
}

pub(crate) fn fill_regions(
    m: &mut KernelMemory,
    ptr: DevicePtr,
    len: u64,
    byte: u8,
) -> Result<(), BackendError> {
    for (p, l) in regions(ptr, len) {
        m.fill(p, l, byte)?;
    }
    Ok(())
}

pub(crate) fn check_regions(
    m: &mut KernelMemory,
    ptr: DevicePtr,
    len: u64,
    byte: u8,
) -> Result<bool, BackendError> {
    for (p, l) in regions(ptr, len) {
        if !m.check(p, l, byte)? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// What runs the requests' kernels (see the module docs).
#[derive(Clone)]
pub(crate) enum Gpu {
    /// The simulated GPU: its kernels write and check the bytes on the device.
    Sim(Arc<SimBackend>),
    /// A driver: memsets, and checks by a stream-ordered copy to the host (made only in a
    /// build with feature `cuda`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Driver(Arc<dyn Backend>),
}

impl Gpu {
    /// A driver when `GPUALLOC_BACKEND` says `cuda` (an error if there is none), or when it
    /// says nothing and a GPU is present; else the simulated GPU.
    pub(crate) fn choose() -> Result<Gpu, Error> {
        let sim = || -> Result<Gpu, Error> {
            Ok(Gpu::Sim(SimBackend::new(SimConfig {
                devices: SIM_DEVICES,
                capacity_per_device: SIM_CAPACITY,
                ..SimConfig::default()
            })?))
        };
        match gpualloc::BackendKind::from_env()? {
            gpualloc::BackendKind::Cuda => Gpu::driver(),
            gpualloc::BackendKind::Sim => sim(),
            _ => Gpu::driver().or_else(|_| sim()),
        }
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn driver() -> Result<Gpu, Error> {
        let backend: Arc<dyn Backend> = gpualloc::runtime::cuda::CudaBackend::new()?;
        Ok(Gpu::Driver(backend))
    }

    #[cfg(not(feature = "cuda"))]
    pub(crate) fn driver() -> Result<Gpu, Error> {
        Err(
            BackendError::Unavailable("this build has no CUDA backend (feature `cuda`)".into())
                .into(),
        )
    }

    pub(crate) fn backend(&self) -> Arc<dyn Backend> {
        match self {
            Gpu::Sim(sim) => sim.clone(),
            Gpu::Driver(b) => b.clone(),
        }
    }

    /// The devices the requests use.
    pub(crate) fn devices(&self) -> Result<u32, Error> {
        match self {
            Gpu::Sim(_) => Ok(SIM_DEVICES),
            Gpu::Driver(b) => Ok(b.device_count()?),
        }
    }

    /// The memory the requests may use on a device (the least free of any device, on a
    /// driver).
    pub(crate) fn capacity(&self) -> Result<u64, Error> {
        match self {
            Gpu::Sim(_) => Ok(SIM_CAPACITY),
            Gpu::Driver(b) => {
                let mut least = u64::MAX;
                for d in 0..b.device_count()? {
                    least = least.min(b.mem_info(DeviceId(d))?.free);
                }
                Ok(least)
            }
        }
    }

    /// What the process holds on the device side: live allocations on the sim, the driver's
    /// used bytes per device on a driver.
    pub(crate) fn held(&self) -> Result<Vec<u64>, Error> {
        match self {
            Gpu::Sim(sim) => Ok(vec![sim.live_allocations() as u64]),
            Gpu::Driver(b) => (0..b.device_count()?)
                .map(|d| {
                    let info = b.mem_info(DeviceId(d))?;
                    Ok(info.total - info.free)
                })
                .collect(),
        }
    }

    /// Kernels that failed (the sim's; a driver runs none of ours).
    pub(crate) fn kernel_failures(&self) -> u64 {
        match self {
            Gpu::Sim(sim) => sim.kernel_failures(),
            Gpu::Driver(_) => 0,
        }
    }

    /// Fills each of `fills` with its byte, after the work before it on `stream`.
    pub(crate) fn fill(
        &self,
        stream: &Stream,
        duration: Duration,
        fills: Vec<(DevicePtr, u64, u8)>,
    ) -> Result<(), BackendError> {
        match self {
            Gpu::Sim(sim) => sim.launch_kernel(stream.handle(), duration, move |m| {
                for (ptr, len, byte) in &fills {
                    fill_regions(m, *ptr, *len, *byte)?;
                }
                Ok(())
            }),
            Gpu::Driver(b) => {
                for (ptr, len, byte) in fills {
                    for (p, l) in regions(ptr, len) {
                        b.memset_async(stream.handle(), p, byte, l)?;
                    }
                }
                Ok(())
            }
        }
    }

    /// Fills every byte of `[ptr, ptr + len)` with `byte`, in stream order.
    pub(crate) fn fill_every_byte(
        &self,
        stream: &Stream,
        (ptr, len, byte): (DevicePtr, u64, u8),
    ) -> Result<(), BackendError> {
        match self {
            Gpu::Sim(sim) => sim.launch_kernel(stream.handle(), Duration::ZERO, move |m| {
                m.fill(ptr, len, byte)
            }),
            Gpu::Driver(b) => b.memset_async(stream.handle(), ptr, byte, len),
        }
    }

    /// True when all of `[ptr, ptr + len)` holds `byte` once the work before it on `stream`
    /// is done: a stream-ordered copy to the host (a driver only).
    pub(crate) fn holds_on_driver(
        b: &Arc<dyn Backend>,
        stream: &Stream,
        (ptr, len, byte): (DevicePtr, u64, u8),
        every_byte: bool,
    ) -> Result<bool, BackendError> {
        let parts = match every_byte {
            true => vec![(ptr, len)],
            false => regions(ptr, len),
        };
        for (p, l) in parts {
            let mut host = vec![0u8; l as usize];
            tokio::task::block_in_place(|| b.copy_from_device(stream.handle(), &mut host, p))?;
            if host.iter().any(|x| *x != byte) {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Checks that `check` holds its byte (counting a mismatch, and failing, if not) and then
    /// fills `next` (if any), in stream order.
    pub(crate) fn check_then_fill(
        &self,
        stream: &Stream,
        duration: Duration,
        check: (&DeviceBuffer, u8),
        next: Option<(&DeviceBuffer, u8)>,
        counters: &Arc<Counters>,
    ) -> Result<(), BackendError> {
        let (cptr, clen, cbyte) = (check.0.ptr(), check.0.len(), check.1);
        let next = next.map(|(b, v)| (b.ptr(), b.len(), v));
        let mismatch = |counters: &Counters| {
            counters.mismatches.fetch_add(1, Ordering::Relaxed);
            BackendError::invalid("data mismatch: memory reused while in use")
        };
        match self {
            Gpu::Sim(sim) => {
                let counters = counters.clone();
                sim.launch_kernel(stream.handle(), duration, move |m| {
                    if !check_regions(m, cptr, clen, cbyte)? {
                        return Err(mismatch(&counters));
                    }
                    if let Some((ptr, len, byte)) = next {
                        fill_regions(m, ptr, len, byte)?;
                    }
                    Ok(())
                })
            }
            Gpu::Driver(b) => {
                if !Gpu::holds_on_driver(b, stream, (cptr, clen, cbyte), false)? {
                    return Err(mismatch(counters));
                }
                match next {
                    Some(fill) => self.fill(stream, duration, vec![fill]),
                    None => Ok(()),
                }
            }
        }
    }

    /// Adds to `bad` when `[ptr, ptr + len)` does not hold `byte` once `stream` has run the
    /// work before (every byte).
    pub(crate) fn count_if_changed(
        &self,
        stream: &Stream,
        (ptr, len, byte): (DevicePtr, u64, u8),
        bad: &Arc<AtomicU64>,
    ) -> Result<(), BackendError> {
        match self {
            Gpu::Sim(sim) => {
                let bad = bad.clone();
                sim.launch_kernel(stream.handle(), Duration::ZERO, move |m| {
                    if !m.check(ptr, len, byte)? {
                        bad.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(())
                })
            }
            Gpu::Driver(b) => {
                if !Gpu::holds_on_driver(b, stream, (ptr, len, byte), true)? {
                    bad.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            }
        }
    }
}
