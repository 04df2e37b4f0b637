//! Driver functions the emulator does not implement: each returns
//! `CUDA_ERROR_NOT_SUPPORTED` and logs its name once, so nothing that reaches one passes
//! silently. (cudarc resolves symbols by name and panics on a missing one; these make such a
//! call a typed error instead.)
//!
//! The stubs take no parameters: under the C calling convention on x86-64 and aarch64 the
//! caller passes arguments in registers and on its own stack frame, so a callee that ignores
//! them is called correctly whatever the real signature.

use std::collections::HashSet;
use std::sync::{Mutex, OnceLock};

use crate::abi::{CUresult, CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_NOT_SUPPORTED};

/// Logs `name` the first time it is reached.
pub(crate) fn once(name: &'static str) {
    static SEEN: OnceLock<Mutex<HashSet<&'static str>>> = OnceLock::new();
    let seen = SEEN.get_or_init(Default::default);
    if crate::state::lock(seen).insert(name) {
        tracing::warn!(function = name, "emulated CUDA driver: not supported");
        eprintln!("gpualloc emulated CUDA driver: {name} is not supported");
    }
}

fn unsupported(name: &'static str) -> CUresult {
    if !crate::state::initialized() {
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    once(name);
    CUDA_ERROR_NOT_SUPPORTED
}

macro_rules! stubs {
    ($($name:ident),* $(,)?) => {
        $(
            #[doc = concat!("`", stringify!($name), "`: not supported (no kernels, no stream-ordered pools, no extra contexts).")]
            #[no_mangle]
            pub extern "C" fn $name() -> CUresult {
                unsupported(stringify!($name))
            }
        )*
    };
}

stubs!(
    cuModuleLoad,
    cuModuleLoadData,
    cuModuleLoadDataEx,
    cuModuleUnload,
    cuModuleGetFunction,
    cuModuleGetGlobal_v2,
    cuLaunchKernel,
    cuLaunchCooperativeKernel,
    cuFuncGetAttribute,
    cuFuncSetAttribute,
    cuOccupancyMaxActiveBlocksPerMultiprocessor,
    cuMemAllocAsync,
    cuMemFreeAsync,
    cuMemAllocFromPoolAsync,
    cuMemAllocManaged,
    cuMemPoolCreate,
    cuMemPoolDestroy,
    cuMemPoolTrimTo,
    cuMemPoolSetAttribute,
    cuMemPoolGetAttribute,
    cuDeviceGetDefaultMemPool,
    cuDeviceGetMemPool,
    cuDeviceSetMemPool,
    cuMemPrefetchAsync_v2,
    cuMemAdvise_v2,
    cuCtxCreate_v3,
    cuCtxCreate_v4,
    cuCtxDestroy_v2,
    cuCtxPushCurrent_v2,
    cuCtxPopCurrent_v2,
    cuCtxGetLimit,
    cuCtxSetLimit,
    cuCtxGetCacheConfig,
    cuCtxSetCacheConfig,
    cuCtxSetFlags,
    cuCtxGetStreamPriorityRange,
    cuDeviceGetUuid,
    cuDeviceGetUuid_v2,
    cuEventElapsedTime,
    cuEventElapsedTime_v2,
    cuMemcpyHtoD_v2,
    cuMemcpyDtoH_v2,
    cuMemcpyDtoD_v2,
    cuMemsetD8_v2,
    cuMemcpyPeerAsync,
    cuGraphUpload,
    cuImportExternalMemory,
    cuDestroyExternalMemory,
    cuExternalMemoryGetMappedBuffer,
);
