//! A real `fork()` of a process using the allocator: in the child every call is a typed
//! `Error::Forked` (its actor threads and the GPU state did not survive the fork), dropping
//! a buffer inherited from the parent is harmless, and nothing hangs; the parent carries on.
//!
//! This file holds one test, so the process forks with as few threads as possible.

use gpualloc::runtime::accounting::AccountingBackend;
use gpualloc::{Allocator, AllocatorConfig, DeviceId, Error};
use std::sync::Arc;

/// Runs in the child; returns 0 on success, else the number of the failed check. No panics:
/// the child must leave through `_exit`.
fn child_checks(
    alloc: &Allocator,
    stream: &gpualloc::Stream,
    inherited: gpualloc::DeviceBuffer,
) -> i32 {
    let parent = std::os::unix::process::parent_id();
    let forked = |e: &Error| matches!(e, Error::Forked { parent: p, .. } if *p == parent);
    // A size the parent's thread cache holds a parked block of, and one it does not.
    for size in [4096, 1 << 20] {
        match futures::executor::block_on(alloc.malloc(size, stream)) {
            Err(e) if forked(&e) => {}
            _ => return 1,
        }
    }
    match futures::executor::block_on(alloc.stats(DeviceId(0))) {
        Err(e) if forked(&e) => {}
        _ => return 2,
    }
    match inherited.record_stream(stream) {
        Err(e) if forked(&e) => {}
        _ => return 3,
    }
    drop(inherited); // must neither free nor touch the parent's locks
    0
}

#[test]
fn a_forked_child_gets_typed_errors_and_the_parent_carries_on() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let acc = Arc::new(AccountingBackend::new(1, 1 << 30));
    let alloc = runtime.block_on(async {
        Allocator::builder()
            .config(AllocatorConfig::default())
            .backend_instance(acc.clone())
            .build()
            .unwrap()
    });
    let stream = alloc.new_stream(DeviceId(0)).unwrap();
    let inherited = runtime.block_on(async {
        let live = alloc.malloc(8192, &stream).await.unwrap();
        // Parked in this thread's slot of the thread cache: the child must not revive it.
        drop(alloc.malloc(4096, &stream).await.unwrap());
        live
    });

    // SAFETY: the child only runs `child_checks`, which fails every call at the fork check
    // before touching a lock or a thread of the parent's (the check reads one page that the
    // fork wiped), and leaves with `_exit`, never returning into the test harness.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let code = child_checks(&alloc, &stream, inherited);
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

    // The parent is unaffected: its parked block comes back from the thread cache, and the
    // buffer the child dropped is still live.
    runtime.block_on(async {
        let before = alloc
            .device_actor(DeviceId(0))
            .unwrap()
            .thread_cache_revivals();
        let again = alloc.malloc(4096, &stream).await.unwrap();
        let after = alloc
            .device_actor(DeviceId(0))
            .unwrap()
            .thread_cache_revivals();
        assert_eq!(after, before + 1);
        let st = alloc.stats(DeviceId(0)).await.unwrap();
        assert_eq!(st.allocation[0].current, 2);
        drop((again, inherited));
        alloc.shutdown().await.unwrap();
    });
    assert_eq!(acc.used(DeviceId(0)), 0);
}
