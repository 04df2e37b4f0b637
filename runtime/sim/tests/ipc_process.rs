//! Legacy IPC across real processes: the parent allocates device memory on its sim and
//! sends the 64-byte handle to a child process (this test binary, re-run), which opens it
//! on its own sim, checks the parent's bytes and writes an answer the parent then reads.
#![cfg(not(loom))] // the sim runs real threads; loom builds run only the loom models

use std::process::Command;

use gpualloc_runtime::{Backend, DeviceId, DevicePtr, IpcMemHandle};
use gpualloc_sim::{SimBackend, SimConfig};

const D0: DeviceId = DeviceId(0);
const ENV: &str = "GPUALLOC_SIM_IPC_CHILD_HANDLE";

fn to_hex(h: &IpcMemHandle) -> String {
    h.0.iter().map(|b| format!("{b:02x}")).collect()
}

fn from_hex(s: &str) -> IpcMemHandle {
    let mut out = [0u8; 64];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap();
    }
    IpcMemHandle(out)
}

#[test]
fn ipc_handle_opens_in_another_process() {
    let sim = SimBackend::new(SimConfig::fast(1)).unwrap();
    let s = sim.stream_create(D0).unwrap();
    let p = sim.malloc(D0, 1 << 20).unwrap();
    sim.copy_to_device(s, DevicePtr(p.0 + 4096), b"from the parent")
        .unwrap();
    let handle = sim.ipc_get_mem_handle(p).unwrap();
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_side", "--nocapture", "--include-ignored"])
        .env(ENV, to_hex(&handle))
        .output()
        .unwrap();
    let log =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "child failed:\n{log}");
    assert!(log.contains("1 passed"), "child did not run:\n{log}");
    let mut answer = [0u8; 14];
    sim.copy_from_device(s, &mut answer, DevicePtr(p.0 + 8192))
        .unwrap();
    assert_eq!(&answer, b"from the child");
    sim.free(D0, p).unwrap();
    sim.stream_destroy(s).unwrap();
}

/// The child half; does nothing unless started by the test above.
#[test]
#[ignore = "run as a child process by ipc_handle_opens_in_another_process"]
fn child_side() {
    let Ok(hex) = std::env::var(ENV) else { return };
    let sim = SimBackend::new(SimConfig::fast(1)).unwrap();
    let s = sim.stream_create(D0).unwrap();
    let base = sim.ipc_open_mem_handle(D0, &from_hex(&hex)).unwrap();
    let mut got = [0u8; 15];
    sim.copy_from_device(s, &mut got, DevicePtr(base.0 + 4096))
        .unwrap();
    assert_eq!(&got, b"from the parent");
    sim.copy_to_device(s, DevicePtr(base.0 + 8192), b"from the child")
        .unwrap();
    sim.ipc_close_mem_handle(base).unwrap();
    sim.stream_destroy(s).unwrap();
}
