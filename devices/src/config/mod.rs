//! Allocator configuration: PyTorch's `PYTORCH_CUDA_ALLOC_CONF` syntax, and a typed builder.
//!
//! The string is a comma-separated list of `key:value` entries; a value may be a bracketed list
//! (`roundup_power2_divisions:[64:8,256:4,>:1]`). Keys:
//!
//! | key | meaning | default |
//! |---|---|---|
//! | `max_split_size_mb` | blocks of at least this size are never split (> 20) | unlimited |
//! | `max_non_split_rounding_mb` | largest waste when a large request reuses an unsplittable block | 20 |
//! | `roundup_power2_divisions` | `N` or `[MB:N,...,>:N]`, powers of two | none |
//! | `garbage_collection_threshold` | in (0, 1): reclaim old cached blocks above this fraction of the allowed memory (needs `per_process_memory_fraction`) | off |
//! | `expandable_segments` | `True`/`False` | `True` where the backend has virtual memory under the `gpualloc` policy (the facade and the replay resolve it: [`AllocatorConfig::resolved`]), else `False` |
//! | `large_segment_size_mb` | segment size for 1–10 MiB requests (even, ≥ 2) | 20 |
//! | `per_process_memory_fraction` | cap reserved memory at this fraction of the device, in (0, 1] | none |
//! | `release_lock_on_cudamalloc` | `True`/`False`: let the actor serve other requests during a driver malloc | `True` |
//! | `thread_cache` | `True`/`False`: each thread keeps a few blocks it freed and hands them straight back to a same-size request on the same stream, without the actor's gate (gpualloc's own key; see the facade's `actor::thread_cache`) | `True` |
//! | `debug_cross_stream_frees` | `True`/`False`: on each free, ask the backend whether another stream that was not `record_stream`ed still has queued work touching the block, and report it (gpualloc's own key; the sim can tell, a real driver cannot; every free then goes through the actor) | `False` |
//! | `policy` | `pytorch`/`gpualloc`: whose rules answer where the two differ (gpualloc's own key; see [`crate::config::policy`] and the deviations below) | `gpualloc` |
//! | `backend` | only `native` is supported | `native` |
//! | `pinned_*` | pinned-host allocator keys, validated by the host allocator | — |
//!
//! Choices where PyTorch is silent or odd, kept for fidelity and written down here:
//! - `>` in a division list fills from the last named band *inclusive* (PyTorch's `std::fill`
//!   starts at `last_index`), so `[64:8,256:4,1024:4,>:1]` leaves the 1 GiB band at 1.
//! - Bands between two named bands keep 0 (no power-of-two rounding), as in PyTorch.
//! - `per_process_memory_fraction` is a config key here (PyTorch only has an API call).
//! - Unknown keys and malformed values are errors that name the key and what was expected.
//!
//! Where the `gpualloc` policy (the default) departs from PyTorch's rules, `policy:pytorch`
//! follows PyTorch: the table of departures is [`crate::config::policy::DEVIATIONS`] (written there
//! once; the README shows it, and `devices/tests/departures.rs` keeps the two equal).

pub mod policy;
pub(crate) mod size_classes;
pub mod sizes;

use std::fmt;

use crate::config::policy::Policy;
use crate::config::size_classes::{roundup_band, LARGE_BUFFER, ROUNDUP_BANDS};

mod parse;
#[cfg(test)]
mod tests;

const MIB: u64 = 1 << 20;

/// Error from parsing or building a configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A key this allocator does not know.
    #[error("unknown allocator config key `{0}`")]
    UnknownKey(String),
    /// A value that does not fit its key.
    #[error("invalid value `{value}` for `{key}`: expected {expected}")]
    InvalidValue {
        /// The key.
        key: String,
        /// What was given.
        value: String,
        /// What the key takes.
        expected: &'static str,
    },
    /// The string is not `key:value[,key:value]...`.
    #[error(
        "malformed allocator config near `{0}`: expected key:value entries separated by commas"
    )]
    Syntax(String),
}

/// The device allocator's configuration. `Default` is PyTorch's default.
#[derive(Clone, PartialEq)]
pub struct AllocatorConfig {
    /// Blocks at least this large are never split (`u64::MAX`: no limit).
    pub max_split_size: u64,
    /// A request of at least `max_split_size` may take a cached block at most this much larger.
    pub max_non_split_rounding: u64,
    /// Divisions per power-of-two band, band 0 = sizes below 2 MiB (0 or 1: no rounding).
    pub roundup_power2_divisions: [u64; ROUNDUP_BANDS],
    /// Garbage-collect cached blocks above this fraction of the allowed memory (0: off).
    pub garbage_collection_threshold: f64,
    /// Use expandable (virtual-memory) segments.
    pub expandable_segments: bool,
    /// Whether the config names `expandable_segments` (parsed, or set with
    /// [`AllocatorConfig::with_expandable_segments`]). Where it does not, the `gpualloc` policy
    /// uses expandable segments on a backend with virtual memory
    /// ([`AllocatorConfig::resolved`]).
    pub expandable_segments_named: bool,
    /// Segment size for large-pool requests under 10 MiB.
    pub large_segment_size: u64,
    /// Cap on reserved memory as a fraction of the device's memory.
    pub per_process_memory_fraction: Option<f64>,
    /// Let other requests be served while a driver allocation runs.
    pub release_lock_on_device_malloc: bool,
    /// Per-thread caches of just-freed blocks in front of the device actor (facade only;
    /// the core ignores it).
    pub thread_cache: bool,
    /// Check every free for other streams' pending work on the block (a debugging aid; see
    /// `DeviceCore::cross_stream_frees`).
    pub debug_cross_stream_frees: bool,
    /// Whose rules answer where gpualloc's and PyTorch's differ (see [`crate::config::policy`]).
    pub policy: Policy,
    /// Where the facade writes a snapshot pickle when a `malloc` runs out of memory
    /// (`oom_snapshot_path:/path/file.pickle`; the core ignores it). The path cannot hold a
    /// comma (the config's separator).
    pub oom_snapshot_path: Option<String>,
    /// `pinned_*` entries, passed unparsed to the pinned-host allocator.
    pub pinned: Vec<(String, String)>,
}

impl Default for AllocatorConfig {
    fn default() -> Self {
        AllocatorConfig {
            max_split_size: u64::MAX,
            max_non_split_rounding: LARGE_BUFFER,
            roundup_power2_divisions: [0; ROUNDUP_BANDS],
            garbage_collection_threshold: 0.0,
            expandable_segments: false,
            expandable_segments_named: false,
            large_segment_size: LARGE_BUFFER,
            per_process_memory_fraction: None,
            release_lock_on_device_malloc: true,
            thread_cache: true,
            debug_cross_stream_frees: false,
            policy: Policy::default(),
            oom_snapshot_path: None,
            pinned: Vec::new(),
        }
    }
}

impl fmt::Debug for AllocatorConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AllocatorConfig({self})")
    }
}

impl fmt::Display for AllocatorConfig {
    /// Writes the config back in PyTorch's syntax (only keys that differ from the default).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = AllocatorConfig::default();
        let mut parts: Vec<String> = Vec::new();
        if self.max_split_size != d.max_split_size {
            parts.push(format!("max_split_size_mb:{}", self.max_split_size / MIB));
        }
        if self.max_non_split_rounding != d.max_non_split_rounding {
            parts.push(format!(
                "max_non_split_rounding_mb:{}",
                self.max_non_split_rounding / MIB
            ));
        }
        if self.roundup_power2_divisions != d.roundup_power2_divisions {
            let bands: Vec<String> = self
                .roundup_power2_divisions
                .iter()
                .enumerate()
                .map(|(i, n)| format!("{}:{n}", 1u64 << i))
                .collect();
            parts.push(format!("roundup_power2_divisions:[{}]", bands.join(",")));
        }
        if self.garbage_collection_threshold != 0.0 {
            parts.push(format!(
                "garbage_collection_threshold:{}",
                self.garbage_collection_threshold
            ));
        }
        if self.expandable_segments {
            parts.push("expandable_segments:True".into());
        } else if self.expandable_segments_named {
            // Named: the `gpualloc` policy's default does not apply (`resolved`).
            parts.push("expandable_segments:False".into());
        }
        if self.large_segment_size != d.large_segment_size {
            parts.push(format!(
                "large_segment_size_mb:{}",
                self.large_segment_size / MIB
            ));
        }
        if let Some(fr) = self.per_process_memory_fraction {
            parts.push(format!("per_process_memory_fraction:{fr}"));
        }
        if !self.release_lock_on_device_malloc {
            parts.push("release_lock_on_cudamalloc:False".into());
        }
        if !self.thread_cache {
            parts.push("thread_cache:False".into());
        }
        if self.debug_cross_stream_frees {
            parts.push("debug_cross_stream_frees:True".into());
        }
        if self.policy != d.policy {
            parts.push(format!("policy:{}", self.policy));
        }
        if let Some(path) = &self.oom_snapshot_path {
            parts.push(format!("oom_snapshot_path:{path}"));
        }
        for (k, v) in &self.pinned {
            parts.push(format!("{k}:{v}"));
        }
        write!(f, "{}", parts.join(","))
    }
}

/// The error for `value` of `key`, which takes `expected`.
pub(crate) fn invalid(key: &str, value: &str, expected: &'static str) -> ConfigError {
    ConfigError::InvalidValue {
        key: key.to_string(),
        value: value.to_string(),
        expected,
    }
}

impl AllocatorConfig {
    /// Checks every field against the rules the string parser applies, so a config built by
    /// setting the public fields directly is held to them too (the facade's `build()` and
    /// [`DeviceCore::new`](crate::DeviceCore::new) call it). The error names the string key
    /// and shows the field's value in the field's units (bytes for sizes).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bytes = |v: u64| format!("{v} bytes");
        if self.max_split_size != u64::MAX && self.max_split_size <= LARGE_BUFFER {
            return Err(invalid(
                "max_split_size_mb",
                &bytes(self.max_split_size),
                "above 20 MiB, or u64::MAX for no limit",
            ));
        }
        if let Some(&n) = self
            .roundup_power2_divisions
            .iter()
            .find(|&&n| n != 0 && !n.is_power_of_two())
        {
            return Err(invalid(
                "roundup_power2_divisions",
                &n.to_string(),
                "0 or a power of two in every band",
            ));
        }
        let gc = self.garbage_collection_threshold;
        if !(gc == 0.0 || (gc > 0.0 && gc < 1.0)) {
            return Err(invalid(
                "garbage_collection_threshold",
                &gc.to_string(),
                "0.0 (off) or a number in (0.0, 1.0)",
            ));
        }
        if self.large_segment_size < 2 * MIB || self.large_segment_size % (2 * MIB) != 0 {
            return Err(invalid(
                "large_segment_size_mb",
                &bytes(self.large_segment_size),
                "an even number of MiB, at least 2",
            ));
        }
        if let Some(f) = self.per_process_memory_fraction {
            if !(f > 0.0 && f <= 1.0) {
                return Err(invalid(
                    "per_process_memory_fraction",
                    &f.to_string(),
                    "a number in (0.0, 1.0]",
                ));
            }
        }
        for (key, _) in &self.pinned {
            if !key.starts_with("pinned_") {
                return Err(ConfigError::UnknownKey(key.clone()));
            }
        }
        Ok(())
    }

    /// Builder: `max_split_size_mb`.
    pub fn with_max_split_size_mb(mut self, mb: u64) -> Result<Self, ConfigError> {
        self.set("max_split_size_mb", &mb.to_string())?;
        Ok(self)
    }

    /// Builder: `expandable_segments`.
    pub fn with_expandable_segments(mut self, on: bool) -> Self {
        self.expandable_segments = on;
        self.expandable_segments_named = true;
        self
    }

    /// The config an allocator runs with on a backend that has virtual memory (`vmm`: the
    /// backend's `has_vmm` answers yes for every device) or not. Under the `gpualloc` policy a config that does not
    /// name `expandable_segments` gets them where there is virtual memory
    /// ([`Policy::expandable_by_default`]), and names the choice made either way, so it reads
    /// back (`Display`, a snapshot's settings) the same whatever backend reads it; otherwise
    /// the config as it is.
    pub fn resolved(&self, vmm: bool) -> AllocatorConfig {
        let mut config = self.clone();
        if config.policy.expandable_by_default() && !config.expandable_segments_named {
            config.expandable_segments = vmm;
            config.expandable_segments_named = true;
        }
        config
    }

    /// Builder: `garbage_collection_threshold` with the `per_process_memory_fraction` it needs.
    pub fn with_garbage_collection(
        mut self,
        threshold: f64,
        fraction: f64,
    ) -> Result<Self, ConfigError> {
        self.set("garbage_collection_threshold", &threshold.to_string())?;
        self.set("per_process_memory_fraction", &fraction.to_string())?;
        Ok(self)
    }

    /// Builder: `policy`.
    pub fn with_policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// Builder: `thread_cache`.
    pub fn with_thread_cache(mut self, on: bool) -> Self {
        self.thread_cache = on;
        self
    }

    /// Builder: `debug_cross_stream_frees`.
    pub fn with_debug_cross_stream_frees(mut self, on: bool) -> Self {
        self.debug_cross_stream_frees = on;
        self
    }

    /// Builder: `per_process_memory_fraction`.
    pub fn with_memory_fraction(mut self, fraction: f64) -> Result<Self, ConfigError> {
        self.set("per_process_memory_fraction", &fraction.to_string())?;
        Ok(self)
    }

    /// Divisions that apply to a request of `size` bytes.
    pub fn roundup_divisions_for(&self, size: u64) -> u64 {
        self.roundup_power2_divisions[roundup_band(size)]
    }
}
