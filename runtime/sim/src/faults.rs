//! Fault injection: make chosen backend calls fail, deterministically.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::counters::Op;
use gpualloc_runtime::error::{BackendError, Result};

/// How calls of one [`Op`] fail.
#[derive(Debug, Clone, PartialEq)]
pub enum Fault {
    /// Let `skip` calls through, then fail the next `count` calls with `error`, then stop.
    /// "OOM on the 3rd malloc" is `FailNext { skip: 2, count: 1, error: OutOfMemory {..} }`.
    FailNext {
        /// Calls that succeed first.
        skip: u64,
        /// Calls that then fail.
        count: u64,
        /// What they fail with.
        error: BackendError,
    },
    /// Fail each call with `probability` (0..=1), drawn from a splitmix64 generator seeded
    /// with `seed`, so a run is reproducible.
    Random {
        /// Chance that one call fails.
        probability: f64,
        /// Generator seed.
        seed: u64,
        /// What a failing call fails with.
        error: BackendError,
    },
    /// Let `skip` calls through, then panic in the next one (once): a custom backend that
    /// panics, for tests that the allocator survives it.
    PanicNext {
        /// Calls that succeed first.
        skip: u64,
    },
}

#[derive(Debug)]
enum Active {
    Next {
        skip: u64,
        count: u64,
        error: BackendError,
    },
    Random {
        threshold: u64,
        state: u64,
        error: BackendError,
    },
    Panic {
        skip: u64,
    },
}

/// splitmix64: a tiny, good-enough deterministic generator.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The table of active faults, one per operation.
#[derive(Debug, Default)]
pub(crate) struct Faults {
    active: AtomicUsize,
    table: Mutex<HashMap<Op, Active>>,
}

impl Faults {
    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<Op, Active>> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Installs `fault` for `op`, replacing any previous one.
    pub(crate) fn inject(&self, op: Op, fault: Fault) {
        let active = match fault {
            Fault::FailNext { skip, count, error } => Active::Next { skip, count, error },
            Fault::PanicNext { skip } => Active::Panic { skip },
            Fault::Random {
                probability,
                seed,
                error,
            } => {
                let p = if probability.is_nan() {
                    0.0
                } else {
                    probability.clamp(0.0, 1.0)
                };
                // p == 1.0 must always fail: saturate the threshold.
                let threshold = if p >= 1.0 {
                    u64::MAX
                } else {
                    (p * (u64::MAX as f64)) as u64
                };
                Active::Random {
                    threshold,
                    state: seed,
                    error,
                }
            }
        };
        let mut table = self.table();
        table.insert(op, active);
        self.active.store(table.len(), Ordering::Release);
    }

    /// Removes every fault.
    pub(crate) fn clear(&self) {
        let mut table = self.table();
        table.clear();
        self.active.store(0, Ordering::Release);
    }

    /// Decides whether this call of `op` fails.
    pub(crate) fn check(&self, op: Op) -> Result<()> {
        if self.active.load(Ordering::Acquire) == 0 {
            return Ok(());
        }
        let mut table = self.table();
        let Some(active) = table.get_mut(&op) else {
            return Ok(());
        };
        let (result, done) = match active {
            Active::Next { skip, count, error } => {
                if *skip > 0 {
                    *skip -= 1;
                    (Ok(()), false)
                } else if *count > 0 {
                    *count -= 1;
                    (Err(error.clone()), *count == 0)
                } else {
                    (Ok(()), true)
                }
            }
            Active::Random {
                threshold,
                state,
                error,
            } => {
                let draw = splitmix64(state);
                let fail = *threshold == u64::MAX || draw < *threshold;
                (if fail { Err(error.clone()) } else { Ok(()) }, false)
            }
            Active::Panic { skip } => {
                if *skip > 0 {
                    *skip -= 1;
                    (Ok(()), false)
                } else {
                    table.remove(&op);
                    self.active.store(table.len(), Ordering::Release);
                    drop(table);
                    panic!("injected panic in {op:?}");
                }
            }
        };
        if done {
            table.remove(&op);
            self.active.store(table.len(), Ordering::Release);
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panic_next_skips_then_panics_once() {
        let f = Faults::default();
        f.inject(Op::Malloc, Fault::PanicNext { skip: 1 });
        assert!(f.check(Op::Malloc).is_ok());
        let panicked = std::panic::catch_unwind(|| f.check(Op::Malloc));
        assert!(panicked.is_err());
        assert!(f.check(Op::Malloc).is_ok(), "once");
        assert!(f.check(Op::Free).is_ok());
    }

    #[test]
    fn fail_next_skips_then_fails_count_times() {
        let f = Faults::default();
        let err = BackendError::Injected("malloc");
        f.inject(
            Op::Malloc,
            Fault::FailNext {
                skip: 2,
                count: 2,
                error: err.clone(),
            },
        );
        let got: Vec<bool> = (0..6).map(|_| f.check(Op::Malloc).is_err()).collect();
        assert_eq!(got, vec![false, false, true, true, false, false]);
        assert!(f.check(Op::Free).is_ok());
    }

    #[test]
    fn random_is_deterministic_and_near_probability() {
        let run = |seed| {
            let f = Faults::default();
            let error = BackendError::Injected("free");
            f.inject(
                Op::Free,
                Fault::Random {
                    probability: 0.25,
                    seed,
                    error,
                },
            );
            (0..4000)
                .map(|_| f.check(Op::Free).is_err())
                .collect::<Vec<_>>()
        };
        let a = run(7);
        assert_eq!(a, run(7));
        assert_ne!(a, run(8));
        let fails = a.iter().filter(|x| **x).count();
        assert!((850..1150).contains(&fails), "{fails} failures of 4000");
    }

    #[test]
    fn certain_and_impossible_faults() {
        let f = Faults::default();
        let error = BackendError::Injected("map");
        f.inject(
            Op::Map,
            Fault::Random {
                probability: 1.0,
                seed: 1,
                error: error.clone(),
            },
        );
        assert!((0..100).all(|_| f.check(Op::Map).is_err()));
        f.inject(
            Op::Map,
            Fault::Random {
                probability: 0.0,
                seed: 1,
                error,
            },
        );
        assert!((0..100).all(|_| f.check(Op::Map).is_ok()));
        f.clear();
        assert!(f.check(Op::Map).is_ok());
    }
}
