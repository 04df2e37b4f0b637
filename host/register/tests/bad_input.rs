//! Bad input to the registries: typed errors, no panic, no backend state left behind.

use std::sync::Arc;

use gpualloc_host::mapping::{page_size, PageMapping};
use gpualloc_host_register::{AsyncRegistry, HostRegistry, RegisterError, RegistrationId};
use gpualloc_runtime::{Backend, HostRegisterFlags};
use gpualloc_sim::{Op, SimBackend, SimConfig};

const RW: HostRegisterFlags = HostRegisterFlags {
    portable: false,
    device_map: false,
    read_only: false,
};

#[test]
fn bad_input_gets_typed_errors() {
    let sim = SimBackend::new(SimConfig::fast(1)).unwrap();
    let backend: Arc<dyn Backend> = sim.clone();
    let p = page_size() as u64;
    let mut reg = HostRegistry::new(backend);
    // SAFETY: bad input or this test's own memory; no copy is ever queued on it.

    assert_eq!(
        unsafe { reg.register(std::ptr::null(), p, RW) },
        Err(RegisterError::NullPointer)
    );
    let mem = PageMapping::new(4 * p as usize).unwrap();
    // SAFETY: bad input or this test's own memory; no copy is ever queued on it.
    assert_eq!(
        unsafe { reg.register(mem.as_ptr(), 0, RW) },
        Err(RegisterError::ZeroLength { ptr: mem.addr() })
    );
    // wraps the address space, and wraps only once rounded up to a page
    let top = (u64::MAX - 10) as *const u8;
    // SAFETY: bad input or this test's own memory; no copy is ever queued on it.
    assert!(matches!(
        unsafe { reg.register(top, 11, RW) },
        Err(RegisterError::Wraps { .. })
    ));
    // SAFETY: bad input or this test's own memory; no copy is ever queued on it.
    assert!(matches!(
        unsafe { reg.register(top, u64::MAX, RW) },
        Err(RegisterError::Wraps { .. })
    ));
    // SAFETY: bad input or this test's own memory; no copy is ever queued on it.
    assert!(matches!(
        unsafe { reg.register(top, 5, RW) },
        Err(RegisterError::Wraps { .. })
    ));
    assert_eq!(
        sim.counts().get(Op::HostRegister),
        0,
        "refused before the backend"
    );

    // unmapped: page 1 (below mmap_min_addr) and the top of the address space
    // SAFETY: bad input or this test's own memory; no copy is ever queued on it.
    let err = unsafe { reg.register(p as *const u8, p, RW) }.unwrap_err();
    assert_eq!(
        err,
        RegisterError::Unmapped {
            range: p..2 * p,
            hole: p
        }
    );
    let high = u64::MAX - 2 * p + 1;
    // SAFETY: bad input or this test's own memory; no copy is ever queued on it.
    let err = unsafe { reg.register(high as *const u8, p, RW) }.unwrap_err();
    assert!(matches!(err, RegisterError::Unmapped { .. }), "{err:?}");
    // partly inaccessible: the middle page of a live mapping made PROT_NONE
    let guarded = PageMapping::new(3 * p as usize).unwrap();
    // SAFETY: the page belongs to `guarded`, which nothing reads or writes before it is
    // dropped (munmap does not care about protections).
    unsafe {
        rustix::mm::mprotect(
            guarded.as_ptr().add(p as usize).cast(),
            p as usize,
            rustix::mm::MprotectFlags::empty(),
        )
    }
    .unwrap();
    // SAFETY: bad input or this test's own memory; no copy is ever queued on it.
    assert_eq!(
        unsafe { reg.register(guarded.as_ptr(), 3 * p, RW) },
        Err(RegisterError::Unmapped {
            range: guarded.addr()..guarded.addr() + 3 * p,
            hole: guarded.addr() + p
        })
    );
    assert!(reg.is_empty() && reg.backend_ranges().is_empty());

    // releasing twice, and a handle never issued
    // SAFETY: bad input or this test's own memory; no copy is ever queued on it.
    let id = unsafe { reg.register(mem.as_ptr(), 4 * p, RW) }.unwrap();
    reg.release(id).unwrap();
    assert_eq!(reg.release(id), Err(RegisterError::UnknownRegistration(id)));
    let never = RegistrationId(999_999);
    assert_eq!(
        reg.release(never),
        Err(RegisterError::UnknownRegistration(never))
    );
    assert!(reg.info(never).is_none());

    // a flag conflict: read-only range, then a writable request over it
    let ro = HostRegisterFlags {
        read_only: true,
        ..RW
    };
    // SAFETY: bad input or this test's own memory; no copy is ever queued on it.
    let r = unsafe { reg.register(mem.as_ptr(), 2 * p, ro) }.unwrap();
    // SAFETY: bad input or this test's own memory; no copy is ever queued on it.
    let err = unsafe { reg.register(mem.as_ptr(), 4 * p, RW) }.unwrap_err();
    assert!(matches!(err, RegisterError::FlagConflict { .. }), "{err:?}");
    assert_eq!(reg.backend_ranges().len(), 1);
    reg.release(r).unwrap();
    assert_eq!(
        sim.counts().get(Op::HostRegister),
        sim.counts().get(Op::HostUnregister) + 3,
        "the three unmapped attempts reached the backend once each, and nothing else leaked"
    );
}

#[test]
fn async_registry_needs_a_runtime_and_refuses_bad_input() {
    let sim = SimBackend::new(SimConfig::fast(1)).unwrap();
    let backend: Arc<dyn Backend> = sim.clone();
    assert!(matches!(
        AsyncRegistry::new(backend.clone()),
        Err(RegisterError::NoRuntime)
    ));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    rt.block_on(async {
        let reg = AsyncRegistry::new(backend).unwrap();
        let p = page_size() as u64;
        // SAFETY: bad input or this test's own memory; no copy is ever queued on it.
        assert_eq!(
            unsafe { reg.register(std::ptr::null(), p, RW) }.map(|f| f.id()),
            Err(RegisterError::NullPointer)
        );
        // SAFETY: bad input or this test's own memory; no copy is ever queued on it.
        assert!(matches!(
            unsafe { reg.register(p as *const u8, 0, RW) },
            Err(RegisterError::ZeroLength { .. })
        ));
        // SAFETY: bad input or this test's own memory; no copy is ever queued on it.
        assert!(matches!(
            unsafe { reg.register((u64::MAX - 1) as *const u8, 2, RW) },
            Err(RegisterError::Wraps { .. })
        ));
        // SAFETY: bad input or this test's own memory; no copy is ever queued on it.
        let err = unsafe { reg.register(p as *const u8, p, RW) }
            .unwrap()
            .await
            .unwrap_err();
        assert!(matches!(err, RegisterError::Unmapped { .. }), "{err:?}");
        assert!(reg.backend_ranges().is_empty());
        let mem = PageMapping::new(p as usize).unwrap();
        // SAFETY: bad input or this test's own memory; no copy is ever queued on it.
        let id = unsafe { reg.register(mem.as_ptr(), p, RW) }
            .unwrap()
            .await
            .unwrap();
        reg.release(id).unwrap().await.unwrap();
        assert!(matches!(
            reg.release(id),
            Err(RegisterError::UnknownRegistration(_))
        ));
    });
}
