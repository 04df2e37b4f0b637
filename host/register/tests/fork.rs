//! A real `fork()`: registrations do not survive into the child. The child sees a typed
//! [`RegisterError::Forked`] from every operation, `query` answers `None`, and after
//! `reset_after_fork` with a backend of its own it registers again; the parent is unaffected.
//!
//! This file holds one test, so the process forks with as few threads as possible.

use std::sync::Arc;

use gpualloc_host::mapping::{page_size, PageMapping};
use gpualloc_host_register::{HostRegistry, RegisterError};
use gpualloc_runtime::{Backend, HostRegisterFlags};
use gpualloc_sim::{Op, SimBackend, SimConfig};

const RW: HostRegisterFlags = HostRegisterFlags {
    portable: false,
    device_map: false,
    read_only: false,
};

/// Runs in the child; returns 0 on success, else the number of the failed check. No panics:
/// the child must leave through `_exit`.
fn child_checks(reg: &mut HostRegistry, mem: &PageMapping, parent: u32) -> i32 {
    let p = page_size() as u64;
    let child = std::process::id();
    if !reg.is_forked() || child == parent {
        return 1;
    }
    // SAFETY: this test's own mapped memory, which outlives the registration; no copy is queued on
    // it.
    match unsafe { reg.register(mem.as_ptr(), p, RW) } {
        Err(RegisterError::Forked {
            parent: pp,
            child: cc,
        }) if pp == parent && cc == child => {}
        _ => return 2,
    }
    let Some(first) = reg
        .cache()
        .backend_ranges()
        .first()
        .and_then(|r| r.users.first().copied())
    else {
        return 3;
    };
    if !matches!(reg.release(first), Err(RegisterError::Forked { .. })) {
        return 4;
    }
    if reg.query(mem.as_ptr()).is_some() {
        return 5;
    }
    let Ok(child_sim) = SimBackend::new(SimConfig::fast(1)) else {
        return 6;
    };
    let backend: Arc<dyn Backend> = child_sim.clone();
    let forgotten = reg.reset_after_fork(backend);
    if forgotten.len() != 1 || forgotten[0].user_range != (mem.addr()..mem.addr() + 4 * p) {
        return 7;
    }
    // SAFETY: this test's own mapped memory, which outlives the registration; no copy is queued on
    // it.
    let Ok(id) = (unsafe { reg.register(mem.as_ptr(), 4 * p, RW) }) else {
        return 8;
    };
    if child_sim.counts().get(Op::HostRegister) != 1
        || reg.query(mem.as_ptr()).map(|i| i.id) != Some(id)
    {
        return 9;
    }
    if reg.release(id).is_err() || child_sim.counts().get(Op::HostUnregister) != 1 {
        return 10;
    }
    0
}

#[test]
fn registrations_do_not_survive_fork() {
    let sim = SimBackend::new(SimConfig::fast(1)).unwrap();
    let backend: Arc<dyn Backend> = sim.clone();
    let p = page_size() as u64;
    let mem = PageMapping::new(4 * p as usize).unwrap();
    let mut reg = HostRegistry::new(backend);
    // SAFETY: this test's own mapped memory, which outlives the registration; no copy is queued on
    // it.
    let id = unsafe { reg.register(mem.as_ptr(), 4 * p, RW) }.unwrap();
    let parent = std::process::id();

    // SAFETY: the child only runs `child_checks` (plain Rust on memory it owns a copy of, no
    // locks held by other threads are needed: the sim used here spawns no threads and the
    // allocator is fork-safe) and leaves with `_exit`, never returning into the test harness.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let code = child_checks(&mut reg, &mem, parent);
        // SAFETY: ends the child at once, without running the parent's destructors or atexit
        // handlers (which belong to the parent's process).
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: waits for our own child; `status` is a valid out-pointer.
    let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(waited, pid);
    assert!(
        libc::WIFEXITED(status),
        "child did not exit normally: {status:#x}"
    );
    assert_eq!(libc::WEXITSTATUS(status), 0, "child check failed");

    // The parent is unaffected: its registration is intact, one backend call in all.
    assert!(!reg.is_forked());
    assert_eq!(reg.query(mem.as_ptr()).map(|i| i.id), Some(id));
    assert_eq!(sim.counts().get(Op::HostRegister), 1);
    reg.release(id).unwrap();
    assert_eq!(sim.counts().get(Op::HostUnregister), 1);
}
