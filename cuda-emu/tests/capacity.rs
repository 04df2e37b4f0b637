//! `cuMemGetInfo` and out-of-memory agree across `cuMemAlloc` and `cuMemCreate`, and a
//! retained primary context costs device memory (a process of its own, so no other test
//! allocates meanwhile; 1 GiB device, 128 MiB per context).

use gpualloc_cuda_emu::*;

const MIB: usize = 1 << 20;

#[test]
fn capacity_is_shared_by_mem_alloc_and_mem_create() {
    // SAFETY: set before anything reads the environment in this process.
    unsafe {
        std::env::set_var("GPUALLOC_EMU_MEMORY_MIB", "1024");
        std::env::set_var("GPUALLOC_EMU_CONTEXT_MIB", "128");
    }
    assert_eq!(cuInit(0), CUDA_SUCCESS);
    let mut ctx: CUcontext = std::ptr::null_mut();
    let prop = CUmemAllocationProp {
        type_: 1,
        requested_handle_types: 1,
        location: CUmemLocation { type_: 1, id: 0 },
        win32_handle_meta_data: std::ptr::null_mut(),
        alloc_flags: [0; 8],
    };
    // SAFETY: valid pointers for every call.
    unsafe {
        assert_eq!(cuDevicePrimaryCtxRetain(&mut ctx, 0), CUDA_SUCCESS);
        assert_eq!(cuCtxSetCurrent(ctx), CUDA_SUCCESS);
        let (mut free, mut total) = (0usize, 0usize);
        assert_eq!(cuMemGetInfo_v2(&mut free, &mut total), CUDA_SUCCESS);
        assert_eq!(
            (free, total),
            (896 * MIB, 1024 * MIB),
            "the context takes its 128 MiB"
        );
        let mut p = 0u64;
        assert_eq!(cuMemAlloc_v2(&mut p, 512 * MIB), CUDA_SUCCESS);
        let mut h = 0u64;
        assert_eq!(cuMemCreate(&mut h, 256 * MIB, &prop, 0), CUDA_SUCCESS);
        assert_eq!(cuMemGetInfo_v2(&mut free, &mut total), CUDA_SUCCESS);
        assert_eq!(free, 128 * MIB, "both count");
        let mut q = 0u64;
        assert_eq!(
            cuMemAlloc_v2(&mut q, 128 * MIB + 1),
            CUDA_ERROR_OUT_OF_MEMORY
        );
        let mut h2 = 0u64;
        assert_eq!(
            cuMemCreate(&mut h2, 130 * MIB, &prop, 0),
            CUDA_ERROR_OUT_OF_MEMORY
        );
        assert_eq!(cuMemCreate(&mut h2, 128 * MIB, &prop, 0), CUDA_SUCCESS);
        assert_eq!(cuMemAlloc_v2(&mut q, 4096), CUDA_ERROR_OUT_OF_MEMORY);
        assert_eq!(cuMemRelease(h), CUDA_SUCCESS);
        assert_eq!(cuMemRelease(h2), CUDA_SUCCESS);
        assert_eq!(cuMemFree_v2(p), CUDA_SUCCESS);
        assert_eq!(cuMemGetInfo_v2(&mut free, &mut total), CUDA_SUCCESS);
        assert_eq!(free, 896 * MIB);
        // Released and retained again: the context's memory went back and is taken once more
        // (not twice).
        assert_eq!(cuCtxSetCurrent(std::ptr::null_mut()), CUDA_SUCCESS);
        assert_eq!(cuDevicePrimaryCtxRelease_v2(0), CUDA_SUCCESS);
        assert_eq!(cuDevicePrimaryCtxRetain(&mut ctx, 0), CUDA_SUCCESS);
        assert_eq!(cuDevicePrimaryCtxRetain(&mut ctx, 0), CUDA_SUCCESS);
        assert_eq!(cuCtxSetCurrent(ctx), CUDA_SUCCESS);
        assert_eq!(cuMemGetInfo_v2(&mut free, &mut total), CUDA_SUCCESS);
        assert_eq!(free, 896 * MIB, "a second retain costs nothing more");
    }
}
