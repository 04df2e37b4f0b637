//! Input checks done before any driver call, so bad input gets a typed error and the
//! driver never sees it. Pure functions, unit tested without a driver.

use cudarc::driver::sys;

use gpualloc_runtime::error::{BackendError, Result};
use gpualloc_runtime::types::HostRegisterFlags;

/// A size the caller allocates or maps: non-zero and representable as `usize`.
pub(crate) fn alloc_size(op: &'static str, size: u64) -> Result<usize> {
    if size == 0 {
        return Err(BackendError::invalid(format!("{op}: size is zero")));
    }
    usize::try_from(size)
        .map_err(|_| BackendError::invalid(format!("{op}: size {size} does not fit in usize")))
}

/// A non-null address.
pub(crate) fn non_null(op: &'static str, addr: u64) -> Result<u64> {
    if addr == 0 {
        Err(BackendError::invalid(format!("{op}: null address")))
    } else {
        Ok(addr)
    }
}

/// The range `[addr, addr + len)`, non-null and not wrapping around; returns `len` as `usize`.
/// `len` may be zero (callers treat empty copies as no-ops before calling this).
pub(crate) fn range(op: &'static str, addr: u64, len: u64) -> Result<usize> {
    non_null(op, addr)?;
    if addr.checked_add(len).is_none() {
        return Err(BackendError::invalid(format!(
            "{op}: range {addr:#x} + {len} overflows"
        )));
    }
    usize::try_from(len)
        .map_err(|_| BackendError::invalid(format!("{op}: length {len} does not fit in usize")))
}

/// `value` is a multiple of `align` (`align` > 0).
pub(crate) fn aligned(op: &'static str, what: &str, value: u64, align: u64) -> Result<()> {
    if align == 0 || value % align != 0 {
        Err(BackendError::invalid(format!(
            "{op}: {what} {value:#x} is not a multiple of {align:#x}"
        )))
    } else {
        Ok(())
    }
}

/// A VA reservation alignment: zero (the driver's default) or a power of two.
pub(crate) fn va_alignment(op: &'static str, alignment: u64) -> Result<usize> {
    if alignment != 0 && !alignment.is_power_of_two() {
        return Err(BackendError::invalid(format!(
            "{op}: alignment {alignment:#x} is not a power of two"
        )));
    }
    usize::try_from(alignment)
        .map_err(|_| BackendError::invalid(format!("{op}: alignment {alignment} too large")))
}

/// `[offset, offset + size)` lies inside a physical allocation of `phys_size` bytes
/// (`phys_size == 0`: unknown, as for an imported handle; the driver checks it).
pub(crate) fn inside_phys(op: &'static str, offset: u64, size: u64, phys_size: u64) -> Result<()> {
    let end = offset.checked_add(size).ok_or_else(|| {
        BackendError::invalid(format!("{op}: offset {offset} + size {size} overflows"))
    })?;
    if phys_size != 0 && end > phys_size {
        return Err(BackendError::invalid(format!(
            "{op}: [{offset:#x}, {end:#x}) exceeds the physical allocation of {phys_size:#x} bytes"
        )));
    }
    Ok(())
}

/// The driver's flag word for [`HostRegisterFlags`].
/// The driver's flags for `flags`, always with `PORTABLE`: without it the range counts as
/// pinned only in the context current at registration, and copies on other devices' streams
/// are staged synchronously (as `host_alloc` already allocates portable).
pub(crate) fn host_register_flags(flags: HostRegisterFlags) -> u32 {
    let mut bits = sys::CU_MEMHOSTREGISTER_PORTABLE;
    if flags.device_map {
        bits |= sys::CU_MEMHOSTREGISTER_DEVICEMAP;
    }
    if flags.read_only {
        bits |= sys::CU_MEMHOSTREGISTER_READ_ONLY;
    }
    bits
}

/// A non-null, non-empty, non-wrapping host range: what `cuMemHostRegister` accepts. The
/// driver page-locks the pages the range touches and asks for no alignment (CUDA 4.0 did; its
/// docs have not since), so neither do we: a user registers a `Vec` as it lies.
pub(crate) fn host_range(op: &'static str, ptr: *mut u8, len: u64) -> Result<usize> {
    let addr = ptr as usize as u64;
    let len_usize = alloc_size(op, len)?;
    non_null(op, addr)?;
    range(op, addr, len)?;
    Ok(len_usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert!(matches!(
            alloc_size("m", 0),
            Err(BackendError::InvalidValue(_))
        ));
        assert_eq!(alloc_size("m", 1 << 20), Ok(1 << 20));
    }

    #[test]
    fn ranges() {
        assert!(non_null("f", 0).is_err());
        assert!(range("c", 0, 16).is_err());
        assert!(range("c", u64::MAX - 7, 16).is_err());
        assert_eq!(range("c", u64::MAX - 16, 16), Ok(16));
        assert_eq!(range("c", 0x1000, 0), Ok(0));
    }

    #[test]
    fn alignment() {
        let g = 2 << 20;
        assert!(aligned("map", "size", g * 3, g).is_ok());
        assert!(aligned("map", "size", g + 4096, g).is_err());
        assert!(aligned("map", "size", 0, 0).is_err());
        assert_eq!(va_alignment("r", 0), Ok(0));
        assert_eq!(va_alignment("r", g), Ok(2 << 20));
        assert!(va_alignment("r", 3 << 20).is_err());
    }

    #[test]
    fn physical_bounds() {
        let g = 2 << 20;
        assert!(inside_phys("map", 0, 2 * g, 2 * g).is_ok());
        assert!(inside_phys("map", g, 2 * g, 2 * g).is_err());
        assert!(inside_phys("map", u64::MAX, 2, 0).is_err());
        // Unknown size (imported handle): only overflow is checked here.
        assert!(inside_phys("map", g, 8 * g, 0).is_ok());
    }

    #[test]
    fn register_flags() {
        // Always portable (see `host_register_flags`).
        assert_eq!(host_register_flags(HostRegisterFlags::default()), 1);
        let all = HostRegisterFlags {
            portable: true,
            device_map: true,
            read_only: true,
        };
        assert_eq!(host_register_flags(all), 1 | 2 | 8);
        let dm = HostRegisterFlags {
            device_map: true,
            ..Default::default()
        };
        assert_eq!(host_register_flags(dm), 1 | 2);
    }

    #[test]
    fn host_ranges() {
        assert!(host_range("r", std::ptr::null_mut(), 4096).is_err());
        assert!(host_range("r", 0x10000 as *mut u8, 0).is_err());
        assert!(host_range("r", (u64::MAX - 7) as usize as *mut u8, 16).is_err());
        // Any byte range: the driver asks for no alignment.
        assert_eq!(host_range("r", 0x10001 as *mut u8, 4096), Ok(4096));
        assert_eq!(host_range("r", 0x10000 as *mut u8, 4097), Ok(4097));
    }
}
