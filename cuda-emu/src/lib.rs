//! **A test double of NVIDIA's CUDA driver, for CI only. It is never a substitute for a GPU:
//! nothing runs on a device, and no user should put it on their library path.**
//!
//! Built as `libgpualloc_cuda_emu.so` (a `cdylib`), it exports the driver API functions
//! gpualloc's CUDA backend and the parts of cudarc it uses reach, with the driver's C
//! signatures and `CUresult` codes. Linked as `libcuda.so` into a folder of its own and put
//! first on `LD_LIBRARY_PATH` (see [`emulator_dir`]), it is what cudarc's dynamic loading
//! opens, so the real CUDA backend runs, unchanged, without a GPU. It is never built under
//! the driver's name, so it cannot shadow a real driver by accident. Behind the symbols is
//! gpualloc's simulated GPU (`gpualloc_sim`): memfd-backed device memory, real
//! virtual-memory reservations and mappings, worker-thread streams.
//!
//! It is strict where the driver documents a rule, because strictness is what finds bugs:
//! every call before `cuInit` is `CUDA_ERROR_NOT_INITIALIZED`; calls that need a context on
//! a thread without a current one are `CUDA_ERROR_INVALID_CONTEXT`; a host function may not
//! call the driver (`CUDA_ERROR_NOT_PERMITTED`); unknown or freed pointers and handles are
//! errors; `cuEventQuery` is `CUDA_ERROR_NOT_READY` until the stream passes the event; the
//! legacy default (null) stream is ordered with blocking streams (created without
//! `CU_STREAM_NON_BLOCKING`) both ways, and not with non-blocking ones. A
//! function it does not implement returns `CUDA_ERROR_NOT_SUPPORTED` and logs its name once:
//! never a silent success. There are no kernels (`cuModuleLoad*`, `cuLaunchKernel`).
//!
//! # Fidelity: the driver's documented rules, and what the emulator does
//!
//! | driver rule (its docs) | emulator | test |
//! |---|---|---|
//! | `cuIpcOpenMemHandle` of a handle this context already opened: "the reference count on the handle is incremented by 1 and the existing device pointer is returned"; `cuIpcCloseMemHandle` decrements, unmaps at zero | counts per (context, handle), same pointer; the mapping goes with the last close | `tests/cuda_rules.rs` `an_ipc_handle_opened_twice_is_closed_twice` |
//! | `cuIpcGetMemHandle` takes "a pointer to the base of an existing device memory allocation" | a pointer inside one is `CUDA_ERROR_INVALID_VALUE` | `tests/strict.rs` `an_ipc_handle_cannot_be_opened_by_the_process_that_made_it`; the backend passes the base (`cuda_rules.rs`, `ipc-export`) |
//! | `cuIpcCloseMemHandle` in the context that opened the handle | another context is `CUDA_ERROR_INVALID_CONTEXT` | `cuda_rules.rs` `an_ipc_handle_is_closed_in_the_context_that_opened_it` |
//! | `cuMemMap`'s offset "currently must be zero", its flags too | `CUDA_ERROR_INVALID_VALUE` | `strict.rs` `vmm_sizes_unmaps_access_and_deferred_release_follow_the_driver` |
//! | a process cannot open its own IPC handle | `CUDA_ERROR_INVALID_CONTEXT` | `strict.rs` |
//! | a faulting kernel's error is sticky: "any further CUDA work will return the same error ... the process must be terminated and relaunched"; host functions never run | `gpualloc_emu_fault_stream_code` raises any of [`STICKY_CODES`] (700, 702, 710 `CUDA_ERROR_ASSERT`, 714-719, 214, 220, 226, 911); every later call in the context fails with it for the life of the process, releasing the primary context does not clear it | `cuda_rules.rs` `after_a_sticky_error_pending_futures_fail_and_the_device_is_lost`, `every_sticky_code_loses_the_device` |
//! | host functions of independent streams "may be serialized" (and are, on one callback thread) | every host function of every stream runs on one callback thread, one at a time; its stream waits until it has run, so a blocking host function stalls every stream's host functions | `runtime` conformance `stream_wait_event_uses_record_at_call_time` (its earlier form, watching stream b with a host function, failed here as on a driver) |
//! | `cuStreamDestroy` with work queued "will return immediately"; the work completes later | the stream is destroyed on a thread of the emulator's, the call returns at once | `strict.rs` `destroying_a_stream_with_pending_work_returns_at_once_and_lets_it_complete` |
//! | a copy from or to pageable host memory is staged synchronously by the driver, `cuMemcpyAsync` included | every copy's host side not page-locked for the copying context is counted (`gpualloc_emu_pageable_copies`) | `cuda_rules.rs` `registered_host_memory_is_pinned_for_every_device`, `a_unified_copy_records_its_host_side` |
//! | the driver reuses a destroyed object's pointer value | `CUstream` and `CUevent` values of destroyed objects are handed out again, the most recent first | `cuda_rules.rs` `a_stale_handle_does_not_name_a_newer_object` |
//! | a host wait on an event created without `CU_EVENT_BLOCKING_SYNC` spins a CPU core | counted (`gpualloc_emu_spinning_waits`) | `cuda_rules.rs` `host_waits_on_events_do_not_spin` |
//! | the driver's state does not survive a fork | a forked child's calls fail with `CUDA_ERROR_NOT_INITIALIZED`, counted (`gpualloc_emu_calls_in_forked_child`) | `cuda_rules.rs` `a_forked_child_drops_what_it_inherited_without_the_driver` |
//! | VMM memory is usable by a device only after `cuMemSetAccess` names it | work of another device is an illegal-address fault (below) | `cuda_rules.rs` `expandable_memory_is_usable_on_a_peer_once_peer_access_is_enabled` |
//! | work on freed or unmapped memory, or on a mapping without access for the device running it, faults the context: `CUDA_ERROR_ILLEGAL_ADDRESS`, sticky | the copy or memset returns 700 and the context of the stream's device keeps it for the life of the process (the driver may report it at a later call; the emulator at once) | `tests/device_faults.rs` `work_on_freed_memory_is_a_sticky_fault`, `work_on_an_unmapped_range_is_a_sticky_fault`, `work_on_a_mapping_without_access_is_a_sticky_fault` |
//! | context checks are per object: "cudaEventRecord() will fail if the input event and input stream are associated to different devices"; "a kernel launch will fail if it is issued to a stream that is not associated to the current device"; waits may cross devices | `cuEventRecord` across devices and `cuLaunchHostFunc` on another context's stream are `CUDA_ERROR_INVALID_HANDLE`; a call on a stream or event reports the sticky error of the object's own context, whichever is current | `device_faults.rs` `context_checks_are_per_object` |
//! | "the exporting process must not free the memory while an importing process is still using it" (undefined behaviour) | an exporter's `cuMemFree` of an allocation another process has open through its IPC handle prints why and aborts the process (the importer holds a shared `flock` on the memory while it has it open) | `device_faults.rs` `freeing_memory_another_process_has_open_aborts_the_exporter` |
//! | a context costs device memory (code, heap, local memory: a few hundred MiB on a data-center GPU) | a retained primary context takes [`CONTEXT_MIB`] (`GPUALLOC_EMU_CONTEXT_MIB`) from its device, from the first retain to the last release, visible in `cuMemGetInfo` and in what is left to allocate | `tests/capacity.rs`, `tests/backend_faults.rs` |
//! | stream capture (`cuStreamBeginCapture`, `cuThreadExchangeStreamCaptureMode`): "potentially unsafe" calls are prohibited by the thread's mode during a capture, synchronizing a capturing stream is not permitted, a capture ends on its origin stream with its forks joined, dependencies may not cross its boundary, a captured event may not be queried | the sim's captures (`gpualloc_sim`): allocation, freeing, mapping, synchronizing and querying are refused with 900 and invalidate the capture (901 at its end); 902–908 as documented; the legacy stream cannot be captured and may not depend on a capturing blocking stream (906); graphs replay their captured copies and memsets | `tests/capture.rs`; the conformance checks `graph_replays_captured_work`, `capture_refuses_conflicting_calls`, `capture_modes_across_threads`, `capture_keeps_its_boundaries` through the CUDA backend |
//!
//! Still more lenient than the driver, said plainly:
//! - a unified `cuMemcpyAsync` cannot tell a freed device pointer from pageable host memory:
//!   that side is refused per call (`CUDA_ERROR_INVALID_VALUE`), not faulted (memsets and
//!   the typed copies fault; the backend's `memcpy_async` is a unified copy);
//! - `cuStreamDestroy` and `cuEventDestroy` of an object whose context faulted succeed;
//! - `cuStreamWaitEvent` and `cuMemcpy*` on a stream of a context other than the current one
//!   are accepted (the driver documents both as allowed);
//! - a host function cannot be captured (`CUDA_ERROR_NOT_SUPPORTED`, the capture goes on),
//!   instantiation flags are refused, and `cuStreamGetCaptureInfo_v2` does not hand out the
//!   graph being built (`graphs.rs`);
//! - nothing runs kernels, so a fault only comes from the calls above or
//!   `gpualloc_emu_fault_stream_code`.
//!
//! Configuration (read at `cuInit`): `GPUALLOC_EMU_DEVICES` (default 1),
//! `GPUALLOC_EMU_MEMORY_MIB` per device (default 16384), `GPUALLOC_EMU_LATENCY=hardware` for
//! the sim's model of real call costs (`cuMemFree` synchronizes the device, a malloc costs
//! what it costs on a GPU; default: no delays), and `GPUALLOC_EMU_FAULTS` to fail chosen
//! calls of named functions (see `faults.rs`: `function:nth[+count]:code,...`), and
//! `GPUALLOC_EMU_EXCLUSIVE_PROCESS=DIR` for devices in `EXCLUSIVE_PROCESS` mode (one process's
//! context per device, among processes given the same folder), and
//! `GPUALLOC_EMU_FREE_NO_SYNC` for a `cuMemFree` that does not synchronize (the driver says it
//! *may*; work still queued on freed memory then fails with a sticky error), and
//! `GPUALLOC_EMU_CONTEXT_MIB` for what a primary context costs (default [`CONTEXT_MIB`]).
//!
//! Exported functions that are not the driver's, for tests (through `dlsym`):
//! `gpualloc_emu_pageable_copies` (copies the driver would have staged) and
//! `gpualloc_emu_fault_stream` / `gpualloc_emu_fault_stream_code` (a kernel that faults when
//! its stream reaches it: the context's sticky error, after which every call in it fails and
//! host functions never run).
//!
//! The device name, `gpualloc emulated device`, lets tests tell the emulator from a GPU.
//! With `GPUALLOC_FORBID_EMULATOR` set (as `scripts/gpu-check.sh` does on a real GPU),
//! `cuInit` fails with `CUDA_ERROR_NOT_PERMITTED`: the double cannot pass for the driver.

mod abi;
mod device;
mod errors;
mod faults;
mod graphs;
mod memory;
mod state;
mod streams;
mod unsupported;
mod vmm;

pub use abi::*;
pub use device::*;
pub use errors::*;
pub use faults::gpualloc_emu_faults_injected;
pub use graphs::*;
pub use memory::*;
pub use state::CONTEXT_MIB;
pub use streams::*;
pub use unsupported::*;
pub use vmm::*;

/// The name every emulated device reports (`cuDeviceGetName`).
pub const DEVICE_NAME: &str = "gpualloc emulated device";

/// Makes `<target>/cuda-emu/libcuda.so`, a link to the emulator built next to the running
/// test binary (`<target>/<profile>/deps/`), and returns the folder, to put first on
/// `LD_LIBRARY_PATH` of a child process. `None` when the emulator library is not there.
pub fn emulator_dir() -> Option<std::path::PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let deps = exe.parent()?;
    let lib = [deps.to_path_buf(), deps.parent()?.to_path_buf()]
        .into_iter()
        .map(|d| d.join("libgpualloc_cuda_emu.so"))
        .find(|p| p.exists())?;
    let dir = deps.parent()?.join("cuda-emu");
    std::fs::create_dir_all(&dir).ok()?;
    let link = dir.join("libcuda.so");
    if std::fs::read_link(&link).ok().as_deref() == Some(lib.as_path()) {
        return Some(dir);
    }
    // Several tests may ask at once: make the link under a name of our own, then rename it
    // over the old one (atomic).
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(".libcuda.so.{}.{n}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(&lib, &tmp).ok()?;
    std::fs::rename(&tmp, &link).ok()?;
    Some(dir)
}
