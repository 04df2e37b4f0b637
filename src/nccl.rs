//! NCCL user-buffer registration of a pool (feature `nccl`).
//!
//! NCCL moves data fastest (zero-copy, NVLS, CollNet) between buffers registered with a
//! communicator (`ncclCommRegister`). A registration must be dropped before its memory is
//! unmapped, or NCCL keeps a handle on memory that is gone. [`Pool::register_with_nccl`]
//! registers every segment of a pool as the allocator maps it and deregisters each just
//! before it is unmapped or freed, on every path (trim, `empty_cache`, sleep, shutdown): the
//! rules of [`crate::SegmentRegistrar`], with [`NcclRegistrar`] as the registrar.
//!
//! ```ignore
//! let comm = NcclComm::init_rank(&alloc, DeviceId(0), rank, world_size, id)?;
//! let kv = alloc.pool("kv_cache", PoolOptions::default()).await?;
//! let reg = kv.register_with_nccl(DeviceId(0), comm.clone()).await?;
//! let buf = kv.malloc(64 << 20, &stream).await?;
//! {
//!     let c = comm.lock(); // one NCCL call at a time on a communicator
//!     unsafe { cudarc::nccl::result::all_reduce(/* buf ..., */ c.raw(), /* stream */) }?;
//! }
//! ```
//!
//! - NCCL is loaded at run time, like the driver: the crate builds without it, and a machine
//!   without `libnccl` gets a panic from cudarc's loader on the first NCCL call (check
//!   [`nccl_available`] first).
//! - A communicator must be used by one thread at a time (NCCL's rule). [`NcclComm::lock`]
//!   serializes the registrar's calls with yours; make your collectives through it too.
//! - A registration is made shortly after its range is mapped (on a tokio task): a buffer
//!   used before then still works, unregistered. An unmap of part of a registered range drops
//!   the whole registration and registers the rest again once the unmap has returned.
//! - With `expandable_segments`, a segment is registered per mapped stretch; an unsplit pool
//!   (`PoolOptions::unsplit`) gives one range per buffer, which NVLS registration needs.

use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::CudaContext;
use cudarc::nccl::{result::NcclError, sys};
use gpualloc_runtime::{BackendError, DeviceId};

use crate::{Allocator, Error, Pool, SegmentRegistrar, SegmentRegistration};

/// True if NCCL's library can be loaded on this machine.
pub fn nccl_available() -> bool {
    // SAFETY: only tries to open the library by its names; no symbol is called.
    unsafe { sys::is_culib_present() }
}

fn nccl_error(call: &str, e: NcclError) -> Error {
    BackendError::Driver {
        code: e.0 as i32,
        name: format!("{call}: {:?}", e.0),
    }
    .into()
}

/// A raw communicator, usable from any thread one call at a time.
struct RawComm(sys::ncclComm_t);

// SAFETY: an NCCL communicator is an opaque handle that NCCL lets any thread use, as long as
// calls on it do not overlap; `NcclComm` keeps it behind a mutex, so they never do.
unsafe impl Send for RawComm {}

/// An NCCL communicator of one device, shared by your collectives and a registration.
pub struct NcclComm {
    raw: Mutex<RawComm>,
    ctx: Arc<CudaContext>,
    device: DeviceId,
    owned: bool,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("device", &self.device)
            .field("owned", &self.owned)
            .finish()
    }
}

/// [`NcclComm::lock`]: the communicator, for one NCCL call at a time.
pub struct NcclCommGuard<'a> {
    raw: MutexGuard<'a, RawComm>,
}

impl NcclCommGuard<'_> {
    /// The raw communicator, for cudarc's `nccl::result` functions.
    pub fn raw(&self) -> sys::ncclComm_t {
        self.raw.0
    }
}

impl NcclComm {
    /// One communicator per device in `devices`, all ranks in this process
    /// (`ncclCommInitAll`); rank `i` is `devices[i]`.
    pub fn init_all(alloc: &Allocator, devices: &[DeviceId]) -> Result<Vec<Arc<NcclComm>>, Error> {
        let ctxs = devices
            .iter()
            .map(|d| alloc.cudarc_context(*d))
            .collect::<Result<Vec<_>, Error>>()?;
        let ordinals: Vec<i32> = devices.iter().map(|d| d.0 as i32).collect();
        let mut raws = vec![std::ptr::null_mut(); devices.len()];
        // SAFETY: `raws` has room for one communicator per ordinal, and both vectors live
        // across the call; NCCL fills `raws` or returns an error.
        unsafe {
            cudarc::nccl::result::comm_init_all(
                raws.as_mut_ptr(),
                ordinals.len() as i32,
                ordinals.as_ptr(),
            )
        }
        .map_err(|e| nccl_error("ncclCommInitAll", e))?;
        Ok(raws
            .into_iter()
            .zip(ctxs)
            .zip(devices)
            .map(|((raw, ctx), device)| {
                Arc::new(NcclComm {
                    raw: Mutex::new(RawComm(raw)),
                    ctx,
                    device: *device,
                    owned: true,
                })
            })
            .collect())
    }

    /// This process's `rank` of a communicator of `world_size` ranks (`ncclCommInitRank`),
    /// on `device`; `id` is rank 0's `cudarc::nccl::Id::new()`, sent to every rank.
    pub fn init_rank(
        alloc: &Allocator,
        device: DeviceId,
        rank: usize,
        world_size: usize,
        id: cudarc::nccl::Id,
    ) -> Result<Arc<NcclComm>, Error> {
        let (Ok(rank32), Ok(world32)) = (i32::try_from(rank), i32::try_from(world_size)) else {
            return Err(BackendError::invalid("rank or world size out of range").into());
        };
        if rank >= world_size {
            return Err(BackendError::invalid(format!(
                "rank {rank} is not below the world size {world_size}"
            ))
            .into());
        }
        let ctx = alloc.cudarc_context(device)?;
        ctx.bind_to_thread()
            .map_err(|e| BackendError::invalid(format!("binding the context: {e:?}")))?;
        let mut raw = std::ptr::null_mut();
        let unique = sys::ncclUniqueId {
            internal: *id.internal(),
        };
        // SAFETY: `raw` is a valid out-pointer; the id is passed by value; NCCL initializes
        // the communicator on the device current on this thread (bound just above).
        unsafe { cudarc::nccl::result::comm_init_rank(&mut raw, world32, unique, rank32) }
            .map_err(|e| nccl_error("ncclCommInitRank", e))?;
        Ok(Arc::new(NcclComm {
            raw: Mutex::new(RawComm(raw)),
            ctx,
            device,
            owned: true,
        }))
    }

    /// Wraps a communicator made elsewhere; it is not destroyed when this is dropped.
    ///
    /// # Safety
    /// `raw` is a live NCCL communicator of `device`'s primary context; it outlives the
    /// returned value, and no NCCL call on it overlaps one made through [`NcclComm::lock`].
    pub unsafe fn from_raw(
        alloc: &Allocator,
        device: DeviceId,
        raw: sys::ncclComm_t,
    ) -> Result<Arc<NcclComm>, Error> {
        Ok(Arc::new(NcclComm {
            raw: Mutex::new(RawComm(raw)),
            ctx: alloc.cudarc_context(device)?,
            device,
            owned: false,
        }))
    }

    /// The device.
    pub fn device(&self) -> DeviceId {
        self.device
    }

    /// The communicator, for one NCCL call (the registrar's wait meanwhile).
    pub fn lock(&self) -> NcclCommGuard<'_> {
        NcclCommGuard {
            raw: self.raw.lock().unwrap_or_else(|p| p.into_inner()),
        }
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let raw = self.lock().raw();
        if let Err(e) = self.ctx.bind_to_thread() {
            tracing::warn!(error = ?e, "binding the context to destroy an NCCL communicator");
        }
        // SAFETY: the communicator was created by this value (`owned`), is live, and no
        // other reference to it remains (this is its drop); destroy waits for its work.
        if let Err(e) = unsafe { cudarc::nccl::result::comm_destroy(raw) } {
            tracing::warn!(error = ?e, "ncclCommDestroy failed");
        }
    }
}

/// NCCL's registration handle.
pub struct NcclHandle(*mut c_void);

// SAFETY: an opaque token NCCL returns and takes back; it is only passed to
// `ncclCommDeregister` of the same communicator, under its lock.
unsafe impl Send for NcclHandle {}

/// A [`SegmentRegistrar`] that registers ranges with an NCCL communicator.
#[derive(Debug, Clone)]
pub struct NcclRegistrar {
    comm: Arc<NcclComm>,
}

impl NcclRegistrar {
    /// Registers with `comm`.
    pub fn new(comm: Arc<NcclComm>) -> Self {
        NcclRegistrar { comm }
    }
}

impl SegmentRegistrar for NcclRegistrar {
    type Handle = NcclHandle;

    fn register(&mut self, addr: u64, size: u64) -> Result<NcclHandle, String> {
        let size = usize::try_from(size).map_err(|_| format!("size {size} too large"))?;
        let comm = self.comm.lock();
        self.comm
            .ctx
            .bind_to_thread()
            .map_err(|e| format!("binding the context: {e:?}"))?;
        let mut handle = std::ptr::null_mut();
        // SAFETY: the communicator is live (owned by the `NcclComm` this registrar holds) and
        // locked for this call; `[addr, addr + size)` is device memory mapped now (the
        // registration's rule: it is deregistered before it is unmapped); `handle` is a
        // valid out-pointer.
        unsafe { sys::ncclCommRegister(comm.raw(), addr as *mut c_void, size, &mut handle) }
            .result()
            .map_err(|e| format!("ncclCommRegister: {:?}", e.0))?;
        Ok(NcclHandle(handle))
    }

    fn deregister(&mut self, _addr: u64, _size: u64, handle: NcclHandle) -> Result<(), String> {
        let comm = self.comm.lock();
        self.comm
            .ctx
            .bind_to_thread()
            .map_err(|e| format!("binding the context: {e:?}"))?;
        // SAFETY: `handle` came from `ncclCommRegister` on this same live communicator and is
        // deregistered once (the registration table owns it); the communicator is locked.
        unsafe { sys::ncclCommDeregister(comm.raw(), handle.0) }
            .result()
            .map_err(|e| format!("ncclCommDeregister: {:?}", e.0))?;
        Ok(())
    }
}

impl Pool {
    /// Registers every segment of this pool on `device` with `comm` while the returned
    /// registration lives (see the module docs).
    pub async fn register_with_nccl(
        &self,
        device: DeviceId,
        comm: Arc<NcclComm>,
    ) -> Result<SegmentRegistration, Error> {
        if comm.device() != device {
            return Err(BackendError::invalid(format!(
                "the communicator is on device {}, the registration on {device}",
                comm.device()
            ))
            .into());
        }
        self.allocator()
            .register_segments(device, Some(self), NcclRegistrar::new(comm))
            .await
    }
}
