//! [`HostConfig`]: the `pinned_*` settings of the pinned-host allocator, typed, with
//! PyTorch's defaults, and [`HostConfig::apply`] for the facade's config-string parser.
//!
//! Keys and values follow `PYTORCH_CUDA_ALLOC_CONF`: booleans are `True`/`False` (lowercase
//! accepted too), sizes are whole MiB. Two keys are ours, not PyTorch's:
//! `pinned_max_round_threshold_mb` and `pinned_max_cached_size_mb` (see the fields).

/// Largest `pinned_num_register_threads` PyTorch accepts.
pub const MAX_REGISTER_THREADS: usize = 128;

const MIB: u64 = 1 << 20;

/// What [`HostConfig::apply`] and [`HostConfig::validate`] reject.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The key is not a pinned-host allocator setting.
    #[error("unknown pinned-host allocator config key `{key}`")]
    UnknownKey {
        /// The key as given.
        key: String,
    },
    /// The value does not parse or is out of range for `key`.
    #[error("invalid value `{value}` for `{key}`: {reason}")]
    InvalidValue {
        /// The key whose value was rejected.
        key: String,
        /// The value as given.
        value: String,
        /// What a valid value looks like.
        reason: &'static str,
    },
}

/// Settings of the pinned-host caching allocator. `Default` is PyTorch's behaviour except
/// for `pinned_max_round_threshold_mb`, which fixes PyTorch's doubling of large buffers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostConfig {
    /// Allocate with the system allocator, prefault the pages, then `host_register` the range,
    /// instead of `host_alloc` (PyTorch `pinned_use_cuda_host_register`, default `false`).
    pub pinned_use_cuda_host_register: bool,
    /// Threads that fault the pages in on the register path; a power of two in `1..=128`
    /// (PyTorch `pinned_num_register_threads`, default 1).
    pub pinned_num_register_threads: usize,
    /// Requests larger than this many MiB are rounded up to a multiple of
    /// [`FINE_GRANULARITY`](crate::size_class::FINE_GRANULARITY) (2 MiB) instead of the next
    /// power of two, so a 1.1 GiB request holds about 1.1 GiB, not 2 GiB (PyTorch issues
    /// #95823, #150517). Not a PyTorch key. Default `Some(64)`; `None` (config value `0`)
    /// rounds every size to a power of two as PyTorch does.
    pub pinned_max_round_threshold_mb: Option<u64>,
    /// Cap on the bytes of freed blocks kept cached for reuse: a block that becomes free
    /// beyond it releases the least recently cached blocks (possibly itself) to the backend.
    /// Blocks carved from the reserve segment are never released and do not count. Not a
    /// PyTorch key. Default `None` (unlimited, as PyTorch); `Some(0)` caches nothing.
    pub pinned_max_cached_size_mb: Option<u64>,
    /// Size of one pinned segment allocated on first use and carved (bump, 4 KiB aligned)
    /// before any fresh allocation; 0 disables it (PyTorch `pinned_reserve_segment_size_mb`,
    /// default 0).
    pub pinned_reserve_segment_size_mb: u64,
    /// Completed events are processed by a background reaper (the actor's timer) rather than
    /// at the start of every `malloc` (PyTorch `pinned_use_background_threads`, default
    /// `false`). The core never starts threads itself; this only changes when `malloc`
    /// processes events (always on a cache miss, before allocating fresh memory).
    pub pinned_use_background_threads: bool,
}

impl Default for HostConfig {
    fn default() -> Self {
        HostConfig {
            pinned_use_cuda_host_register: false,
            pinned_num_register_threads: 1,
            pinned_max_round_threshold_mb: Some(64),
            pinned_max_cached_size_mb: None,
            pinned_reserve_segment_size_mb: 0,
            pinned_use_background_threads: false,
        }
    }
}

impl HostConfig {
    /// Every key [`HostConfig::apply`] accepts.
    pub const KEYS: &'static [&'static str] = &[
        "pinned_use_cuda_host_register",
        "pinned_use_hip_host_register",
        "pinned_num_register_threads",
        "pinned_max_round_threshold_mb",
        "pinned_max_cached_size_mb",
        "pinned_reserve_segment_size_mb",
        "pinned_use_background_threads",
    ];

    /// Sets one `key:value` pair of a config string. `pinned_use_hip_host_register` is an
    /// alias of `pinned_use_cuda_host_register`, as in PyTorch's ROCm build. On error the
    /// config is unchanged.
    pub fn apply(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
        let key = key.trim();
        let value = value.trim();
        let bad = |reason| ConfigError::InvalidValue {
            key: key.to_string(),
            value: value.to_string(),
            reason,
        };
        match key {
            "pinned_use_cuda_host_register" | "pinned_use_hip_host_register" => {
                self.pinned_use_cuda_host_register = parse_bool(value).ok_or_else(|| bad(BOOL))?;
            }
            "pinned_use_background_threads" => {
                self.pinned_use_background_threads = parse_bool(value).ok_or_else(|| bad(BOOL))?;
            }
            "pinned_num_register_threads" => {
                let n: usize = value.parse().map_err(|_| bad(THREADS))?;
                if !valid_threads(n) {
                    return Err(bad(THREADS));
                }
                self.pinned_num_register_threads = n;
            }
            "pinned_max_round_threshold_mb" => {
                let mb = parse_mb(value).ok_or_else(|| bad(MB))?;
                self.pinned_max_round_threshold_mb = (mb > 0).then_some(mb);
            }
            "pinned_max_cached_size_mb" => {
                self.pinned_max_cached_size_mb = Some(parse_mb(value).ok_or_else(|| bad(MB))?);
            }
            "pinned_reserve_segment_size_mb" => {
                self.pinned_reserve_segment_size_mb = parse_mb(value).ok_or_else(|| bad(MB))?;
            }
            _ => {
                return Err(ConfigError::UnknownKey {
                    key: key.to_string(),
                })
            }
        }
        Ok(())
    }

    /// Checks a config built field by field (the typed builder path); [`HostConfig::apply`]
    /// never produces an invalid one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |key: &str, value: String, reason| ConfigError::InvalidValue {
            key: key.to_string(),
            value,
            reason,
        };
        if !valid_threads(self.pinned_num_register_threads) {
            return Err(bad(
                "pinned_num_register_threads",
                self.pinned_num_register_threads.to_string(),
                THREADS,
            ));
        }
        for (key, mb) in [
            (
                "pinned_max_round_threshold_mb",
                self.pinned_max_round_threshold_mb.unwrap_or(0),
            ),
            (
                "pinned_max_cached_size_mb",
                self.pinned_max_cached_size_mb.unwrap_or(0),
            ),
            (
                "pinned_reserve_segment_size_mb",
                self.pinned_reserve_segment_size_mb,
            ),
        ] {
            if mb_to_bytes(mb).is_none() {
                return Err(bad(key, mb.to_string(), MB));
            }
        }
        Ok(())
    }

    /// The rounding threshold in bytes, if fine rounding is on.
    pub fn round_threshold_bytes(&self) -> Option<u64> {
        self.pinned_max_round_threshold_mb.and_then(mb_to_bytes)
    }

    /// The cache cap in bytes, if any.
    pub fn max_cached_bytes(&self) -> Option<u64> {
        self.pinned_max_cached_size_mb.and_then(mb_to_bytes)
    }

    /// The reserve segment's size in bytes (0: none).
    pub fn reserve_segment_bytes(&self) -> u64 {
        mb_to_bytes(self.pinned_reserve_segment_size_mb).unwrap_or(0)
    }
}

const BOOL: &str = "expected True or False";
const THREADS: &str = "expected a power of two from 1 to 128";
const MB: &str = "expected a whole number of MiB below 2^44";

fn parse_bool(value: &str) -> Option<bool> {
    match value {
        "True" | "true" => Some(true),
        "False" | "false" => Some(false),
        _ => None,
    }
}

fn valid_threads(n: usize) -> bool {
    n.is_power_of_two() && n <= MAX_REGISTER_THREADS
}

fn parse_mb(value: &str) -> Option<u64> {
    value
        .parse::<u64>()
        .ok()
        .filter(|mb| mb_to_bytes(*mb).is_some())
}

/// MiB to bytes; sizes of 2^64 bytes or more (2^44 MiB) are rejected.
fn mb_to_bytes(mb: u64) -> Option<u64> {
    mb.checked_mul(MIB)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_pytorch_where_it_has_them() {
        let c = HostConfig::default();
        assert!(!c.pinned_use_cuda_host_register);
        assert_eq!(c.pinned_num_register_threads, 1);
        assert_eq!(c.pinned_reserve_segment_size_mb, 0);
        assert!(!c.pinned_use_background_threads);
        assert_eq!(c.pinned_max_cached_size_mb, None);
        assert_eq!(c.round_threshold_bytes(), Some(64 << 20));
        assert!(c.validate().is_ok());
    }

    #[test]
    fn apply_sets_every_key() {
        let mut c = HostConfig::default();
        c.apply("pinned_use_cuda_host_register", "True").unwrap();
        c.apply("pinned_num_register_threads", "8").unwrap();
        c.apply("pinned_max_round_threshold_mb", "0").unwrap();
        c.apply("pinned_max_cached_size_mb", "512").unwrap();
        c.apply("pinned_reserve_segment_size_mb", "16").unwrap();
        c.apply(" pinned_use_background_threads ", "true").unwrap();
        assert_eq!(
            c,
            HostConfig {
                pinned_use_cuda_host_register: true,
                pinned_num_register_threads: 8,
                pinned_max_round_threshold_mb: None,
                pinned_max_cached_size_mb: Some(512),
                pinned_reserve_segment_size_mb: 16,
                pinned_use_background_threads: true,
            }
        );
        assert_eq!(c.max_cached_bytes(), Some(512 << 20));
        assert_eq!(c.reserve_segment_bytes(), 16 << 20);
        c.apply("pinned_use_hip_host_register", "False").unwrap();
        assert!(!c.pinned_use_cuda_host_register);
    }

    #[test]
    fn bad_keys_and_values_are_typed_and_name_the_key() {
        let mut c = HostConfig::default();
        let before = c.clone();
        assert_eq!(
            c.apply("pinned_bogus", "1"),
            Err(ConfigError::UnknownKey {
                key: "pinned_bogus".into()
            })
        );
        for (k, v) in [
            ("pinned_use_cuda_host_register", "yes"),
            ("pinned_num_register_threads", "3"),
            ("pinned_num_register_threads", "256"),
            ("pinned_num_register_threads", "0"),
            ("pinned_num_register_threads", "-2"),
            ("pinned_max_cached_size_mb", "1.5"),
            ("pinned_reserve_segment_size_mb", "18446744073709551615"),
            ("pinned_max_round_threshold_mb", ""),
        ] {
            match c.apply(k, v) {
                Err(ConfigError::InvalidValue { key, value, .. }) => {
                    assert_eq!((key.as_str(), value.as_str()), (k, v));
                }
                other => panic!("{k}:{v} gave {other:?}"),
            }
        }
        assert_eq!(c, before, "failed applies change nothing");
        let e = c.apply("pinned_num_register_threads", "3").unwrap_err();
        assert!(e.to_string().contains("pinned_num_register_threads"));
    }

    #[test]
    fn validate_catches_typed_misconfiguration() {
        let c = HostConfig {
            pinned_num_register_threads: 6,
            ..HostConfig::default()
        };
        assert!(matches!(
            c.validate(),
            Err(ConfigError::InvalidValue { .. })
        ));
        let c = HostConfig {
            pinned_reserve_segment_size_mb: u64::MAX,
            ..HostConfig::default()
        };
        assert!(c.validate().is_err());
    }
}
