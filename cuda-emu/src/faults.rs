//! Fault injection: `GPUALLOC_EMU_FAULTS` fails chosen calls of named driver functions, so a
//! caller's rollback paths run (a `cuMemMap` failing half-way through a growth, a
//! `cuMemAlloc` out of memory, a failing `cuEventRecord`).
//!
//! The value is a comma-separated list of `function:nth[+count]:code`: the `nth` call of
//! `function` (1-based, counted from `cuInit`) and the `count - 1` calls after it (default 1)
//! return `code` (a number, or a name such as `CUDA_ERROR_OUT_OF_MEMORY`) without doing
//! anything. Example: `GPUALLOC_EMU_FAULTS=cuMemMap:2:CUDA_ERROR_OUT_OF_MEMORY`. A malformed
//! entry is reported on stderr and makes `cuInit` fail with `CUDA_ERROR_INVALID_VALUE`: a
//! test that meant to inject a fault must not run without it.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::abi::*;

/// One rule: calls `first..first + count` of a function fail with `code`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Rule {
    first: u64,
    count: u64,
    code: CUresult,
}

/// The rules and how often each function has been called.
#[derive(Debug, Default)]
pub(crate) struct Faults {
    rules: HashMap<String, Vec<Rule>>,
    calls: Mutex<HashMap<&'static str, u64>>,
    /// Faults injected so far, per function (read by `gpualloc_emu_faults_injected`).
    hits: Mutex<HashMap<&'static str, u64>>,
}

fn code_of(text: &str) -> Option<CUresult> {
    text.parse().ok().or_else(|| {
        (0..=999).find(|c| {
            describe(*c).is_some_and(|(name, _)| &name[..name.len() - 1] == text.as_bytes())
        })
    })
}

impl Faults {
    /// Parses `spec` (see the module docs).
    pub(crate) fn parse(spec: &str) -> Result<Faults, String> {
        let mut rules: HashMap<String, Vec<Rule>> = HashMap::new();
        for entry in spec.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let mut parts = entry.split(':');
            let (Some(name), Some(when), Some(code), None) =
                (parts.next(), parts.next(), parts.next(), parts.next())
            else {
                return Err(format!("`{entry}`: expected function:nth[+count]:code"));
            };
            let (first, count) = match when.split_once('+') {
                Some((n, c)) => (n.parse::<u64>(), c.parse::<u64>()),
                None => (when.parse::<u64>(), Ok(1)),
            };
            let (Ok(first), Ok(count)) = (first, count) else {
                return Err(format!("`{entry}`: `{when}` is not nth or nth+count"));
            };
            if first == 0 || count == 0 {
                return Err(format!(
                    "`{entry}`: calls count from 1, and count is at least 1"
                ));
            }
            let code = code_of(code)
                .filter(|c| *c != CUDA_SUCCESS)
                .ok_or_else(|| format!("`{entry}`: `{code}` is not a CUDA error code"))?;
            rules
                .entry(name.to_string())
                .or_default()
                .push(Rule { first, count, code });
        }
        Ok(Faults {
            rules,
            calls: Mutex::default(),
            hits: Mutex::default(),
        })
    }

    /// Counts a call of `name`; `Err(code)` when a rule fails it.
    pub(crate) fn check(&self, name: &'static str) -> Result<(), CUresult> {
        let Some(rules) = self.rules.get(name) else {
            return Ok(());
        };
        let n = {
            let mut calls = crate::state::lock(&self.calls);
            let n = calls.entry(name).or_insert(0);
            *n += 1;
            *n
        };
        match rules.iter().find(|r| n >= r.first && n - r.first < r.count) {
            Some(r) => {
                tracing::info!(function = name, call = n, code = r.code, "injected fault");
                *crate::state::lock(&self.hits).entry(name).or_insert(0) += 1;
                Err(r.code)
            }
            None => Ok(()),
        }
    }

    /// Faults injected so far into calls of `name`.
    pub(crate) fn injected(&self, name: &str) -> u64 {
        crate::state::lock(&self.hits)
            .get(name)
            .copied()
            .unwrap_or(0)
    }
}

/// Not a driver function: how many faults `GPUALLOC_EMU_FAULTS` has injected so far into
/// calls of the function named by the NUL-terminated `name` (0 before `cuInit`). Tests reach
/// it through `dlsym`.
///
/// # Safety
/// `name` must be null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn gpualloc_emu_faults_injected(name: *const std::ffi::c_char) -> u64 {
    if name.is_null() {
        return 0;
    }
    // SAFETY: non-null and NUL-terminated (the caller's contract).
    let name = unsafe { std::ffi::CStr::from_ptr(name) };
    match (crate::state::emu(), name.to_str()) {
        (Some(emu), Ok(name)) => emu.faults.injected(name),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_fail_the_chosen_calls_only() {
        let f =
            Faults::parse("cuMemMap:2:CUDA_ERROR_OUT_OF_MEMORY, cuEventRecord:1+2:999").unwrap();
        let map: Vec<_> = (0..4).map(|_| f.check("cuMemMap")).collect();
        assert_eq!(
            map,
            vec![Ok(()), Err(CUDA_ERROR_OUT_OF_MEMORY), Ok(()), Ok(())]
        );
        let rec: Vec<_> = (0..3).map(|_| f.check("cuEventRecord")).collect();
        assert_eq!(rec, vec![Err(999), Err(999), Ok(())]);
        assert_eq!(f.check("cuMemAlloc_v2"), Ok(()));
        assert_eq!(
            (
                f.injected("cuMemMap"),
                f.injected("cuEventRecord"),
                f.injected("x")
            ),
            (1, 2, 0)
        );
        for bad in [
            "cuMemMap",
            "cuMemMap:0:2",
            "cuMemMap:1:0",
            "cuMemMap:x:2",
            "cuMemMap:1:NOPE",
            "a:1:2:3",
        ] {
            assert!(Faults::parse(bad).is_err(), "{bad}");
        }
        assert!(Faults::parse("").unwrap().rules.is_empty());
    }
}
