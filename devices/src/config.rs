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
//! | `policy` | `pytorch`/`gpualloc`: whose rules answer where the two differ (gpualloc's own key; see [`crate::policy`] and the deviations below) | `gpualloc` |
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
//! follows PyTorch: the table of departures is [`crate::policy::DEVIATIONS`] (written there
//! once; the README shows it, and `devices/tests/departures.rs` keeps the two equal).

use std::fmt;

use crate::policy::Policy;
use crate::size_classes::{roundup_band, LARGE_BUFFER, ROUNDUP_BANDS};

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
    /// Whose rules answer where gpualloc's and PyTorch's differ (see [`crate::policy`]).
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

fn invalid(key: &str, value: &str, expected: &'static str) -> ConfigError {
    ConfigError::InvalidValue {
        key: key.to_string(),
        value: value.to_string(),
        expected,
    }
}

fn parse_u64(key: &str, value: &str, expected: &'static str) -> Result<u64, ConfigError> {
    value
        .trim()
        .parse::<u64>()
        .map_err(|_| invalid(key, value, expected))
}

fn parse_bool(key: &str, value: &str) -> Result<bool, ConfigError> {
    match value.trim() {
        "True" | "true" | "1" => Ok(true),
        "False" | "false" | "0" => Ok(false),
        _ => Err(invalid(key, value, "True or False")),
    }
}

fn parse_mb(key: &str, value: &str, expected: &'static str) -> Result<u64, ConfigError> {
    parse_u64(key, value, expected)?
        .checked_mul(MIB)
        .ok_or_else(|| invalid(key, value, expected))
}

/// Splits `a:1,b:[x:1,y:2],c:3` into entries, keeping bracketed lists whole.
fn split_entries(s: &str) -> Result<Vec<&str>, ConfigError> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0i32, 0usize);
    for (i, c) in s.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => {
                depth -= 1;
                if depth < 0 {
                    return Err(ConfigError::Syntax(s[start..].to_string()));
                }
            }
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(ConfigError::Syntax(s[start..].to_string()));
    }
    out.push(&s[start..]);
    Ok(out
        .into_iter()
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .collect())
}

impl AllocatorConfig {
    /// Parses a config string in PyTorch's syntax. An empty string is the default config.
    pub fn parse(s: &str) -> Result<Self, ConfigError> {
        let mut config = AllocatorConfig::default();
        for entry in split_entries(s)? {
            let (key, value) = entry
                .split_once(':')
                .ok_or_else(|| ConfigError::Syntax(entry.to_string()))?;
            config.set(key.trim(), value.trim())?;
        }
        Ok(config)
    }

    /// Reads `GPUALLOC_CONF`, else `PYTORCH_CUDA_ALLOC_CONF`, else the default.
    pub fn from_env() -> Result<Self, ConfigError> {
        match std::env::var("GPUALLOC_CONF").or_else(|_| std::env::var("PYTORCH_CUDA_ALLOC_CONF")) {
            Ok(s) => Self::parse(&s),
            Err(_) => Ok(Self::default()),
        }
    }

    /// Sets one key from its string value (the builder behind [`AllocatorConfig::parse`]).
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
        match key {
            "max_split_size_mb" => {
                let v = parse_u64(key, value, "an integer number of MiB above 20")?;
                if v <= LARGE_BUFFER / MIB {
                    return Err(invalid(key, value, "an integer number of MiB above 20"));
                }
                self.max_split_size = v
                    .checked_mul(MIB)
                    .ok_or_else(|| invalid(key, value, "an integer number of MiB above 20"))?;
            }
            "max_non_split_rounding_mb" => {
                self.max_non_split_rounding = parse_mb(key, value, "an integer number of MiB")?;
            }
            "roundup_power2_divisions" => {
                self.roundup_power2_divisions = parse_divisions(key, value)?
            }
            "garbage_collection_threshold" => {
                let v: f64 = value
                    .parse()
                    .map_err(|_| invalid(key, value, "a number in (0.0, 1.0)"))?;
                if !(v > 0.0 && v < 1.0) {
                    return Err(invalid(key, value, "a number in (0.0, 1.0)"));
                }
                self.garbage_collection_threshold = v;
            }
            "expandable_segments" => {
                self.expandable_segments = parse_bool(key, value)?;
                self.expandable_segments_named = true;
            }
            "large_segment_size_mb" => {
                let v = parse_mb(key, value, "an even number of MiB, at least 2")?;
                if v < 2 * MIB || v % (2 * MIB) != 0 {
                    return Err(invalid(key, value, "an even number of MiB, at least 2"));
                }
                self.large_segment_size = v;
            }
            "per_process_memory_fraction" => {
                let v: f64 = value
                    .parse()
                    .map_err(|_| invalid(key, value, "a number in (0.0, 1.0]"))?;
                if !(v > 0.0 && v <= 1.0) {
                    return Err(invalid(key, value, "a number in (0.0, 1.0]"));
                }
                self.per_process_memory_fraction = Some(v);
            }
            "release_lock_on_cudamalloc" => {
                self.release_lock_on_device_malloc = parse_bool(key, value)?;
            }
            "thread_cache" => self.thread_cache = parse_bool(key, value)?,
            "debug_cross_stream_frees" => {
                self.debug_cross_stream_frees = parse_bool(key, value)?;
            }
            "oom_snapshot_path" => {
                if value.is_empty() {
                    return Err(invalid(key, value, "a file path"));
                }
                self.oom_snapshot_path = Some(value.to_string());
            }
            "policy" => {
                self.policy = Policy::from_name(value)
                    .ok_or_else(|| invalid(key, value, "pytorch or gpualloc"))?;
            }
            "backend" => {
                if value != "native" {
                    return Err(invalid(
                        key,
                        value,
                        "native (cudaMallocAsync is not supported)",
                    ));
                }
            }
            k if k.starts_with("pinned_") => {
                self.pinned.retain(|(old, _)| old != k);
                self.pinned.push((k.to_string(), value.to_string()));
            }
            _ => return Err(ConfigError::UnknownKey(key.to_string())),
        }
        Ok(())
    }

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

fn parse_divisions(key: &str, value: &str) -> Result<[u64; ROUNDUP_BANDS], ConfigError> {
    const EXPECTED: &str = "a power of two, or [MB:N,...,>:N] with powers of two";
    let pow2 = |v: &str| -> Result<u64, ConfigError> {
        let n = parse_u64(key, v, EXPECTED)?;
        if n.is_power_of_two() {
            Ok(n)
        } else {
            Err(invalid(key, v, EXPECTED))
        }
    };
    let mut bands = [0u64; ROUNDUP_BANDS];
    let Some(list) = value.strip_prefix('[') else {
        bands.fill(pow2(value)?);
        return Ok(bands);
    };
    let list = list
        .strip_suffix(']')
        .ok_or_else(|| invalid(key, value, EXPECTED))?;
    let (mut last_index, mut first) = (0usize, true);
    for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (band, n) = item
            .split_once(':')
            .ok_or_else(|| invalid(key, item, EXPECTED))?;
        let n = pow2(n.trim())?;
        if band.trim() == ">" {
            bands[last_index..].fill(n);
        } else {
            let mb = pow2(band.trim())?;
            let index = (63 - mb.leading_zeros() as usize).min(ROUNDUP_BANDS - 1);
            if first {
                bands[..index].fill(n);
                first = false;
            }
            bands[index] = n;
            last_index = index;
        }
    }
    Ok(bands)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oom_snapshot_path_is_a_path_and_round_trips() {
        let c =
            AllocatorConfig::parse("expandable_segments:True, oom_snapshot_path:/tmp/o o.pickle")
                .unwrap();
        assert_eq!(c.oom_snapshot_path.as_deref(), Some("/tmp/o o.pickle"));
        assert_eq!(
            c.to_string(),
            "expandable_segments:True,oom_snapshot_path:/tmp/o o.pickle"
        );
        assert_eq!(AllocatorConfig::parse(&c.to_string()).unwrap(), c);
        assert_eq!(AllocatorConfig::default().oom_snapshot_path, None);
        match AllocatorConfig::parse("oom_snapshot_path:") {
            Err(ConfigError::InvalidValue { key, expected, .. }) => {
                assert_eq!(
                    (key.as_str(), expected),
                    ("oom_snapshot_path", "a file path")
                )
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn parses_pytorch_strings() {
        let c = AllocatorConfig::parse(
            "max_split_size_mb:512, max_non_split_rounding_mb:200,expandable_segments:True,\
             garbage_collection_threshold:0.6,per_process_memory_fraction:0.5,pinned_use_cuda_host_register:True",
        )
        .unwrap();
        assert_eq!(c.max_split_size, 512 << 20);
        assert_eq!(c.max_non_split_rounding, 200 << 20);
        assert!(c.expandable_segments);
        assert_eq!(c.garbage_collection_threshold, 0.6);
        assert_eq!(c.per_process_memory_fraction, Some(0.5));
        assert_eq!(
            c.pinned,
            vec![("pinned_use_cuda_host_register".into(), "True".into())]
        );
        assert_eq!(
            AllocatorConfig::parse("").unwrap(),
            AllocatorConfig::default()
        );
    }

    #[test]
    fn division_lists_follow_pytorch() {
        let c = AllocatorConfig::parse("roundup_power2_divisions:[64:8,256:4,1024:4,>:1]").unwrap();
        assert_eq!(&c.roundup_power2_divisions[..7], &[8, 8, 8, 8, 8, 8, 8]);
        assert_eq!(c.roundup_power2_divisions[7], 0);
        assert_eq!(c.roundup_power2_divisions[8], 4);
        assert_eq!(c.roundup_power2_divisions[9], 0);
        assert_eq!(&c.roundup_power2_divisions[10..], &[1; 6]);
    }

    #[test]
    fn bad_strings_name_the_key() {
        let err = |s: &str| AllocatorConfig::parse(s).unwrap_err();
        assert_eq!(
            err("max_split_size:512"),
            ConfigError::UnknownKey("max_split_size".into())
        );
        assert!(
            matches!(err("max_split_size_mb:abc"), ConfigError::InvalidValue { key, .. } if key == "max_split_size_mb")
        );
        assert!(matches!(
            err("max_split_size_mb:20"),
            ConfigError::InvalidValue { .. }
        ));
        assert!(matches!(
            err("max_split_size_mb:99999999999999999"),
            ConfigError::InvalidValue { .. }
        ));
        assert!(matches!(
            err("roundup_power2_divisions:3"),
            ConfigError::InvalidValue { .. }
        ));
        assert!(matches!(
            err("roundup_power2_divisions:[64:8,100:4]"),
            ConfigError::InvalidValue { .. }
        ));
        assert!(matches!(
            err("roundup_power2_divisions:[64:8"),
            ConfigError::Syntax(_)
        ));
        assert!(matches!(
            err("garbage_collection_threshold:1.5"),
            ConfigError::InvalidValue { .. }
        ));
        assert!(matches!(
            err("expandable_segments:yes"),
            ConfigError::InvalidValue { .. }
        ));
        assert!(matches!(
            err("backend:cudaMallocAsync"),
            ConfigError::InvalidValue { .. }
        ));
        assert!(matches!(err("expandable_segments"), ConfigError::Syntax(_)));
        assert!(matches!(
            err("large_segment_size_mb:3"),
            ConfigError::InvalidValue { .. }
        ));
        assert!(matches!(
            err("thread_cache:maybe"),
            ConfigError::InvalidValue { .. }
        ));
    }

    #[test]
    fn thread_cache_key() {
        assert!(AllocatorConfig::default().thread_cache);
        let off = AllocatorConfig::parse("thread_cache:False").unwrap();
        assert!(!off.thread_cache);
        assert_eq!(off, AllocatorConfig::default().with_thread_cache(false));
        assert_eq!(off.to_string(), "thread_cache:False");
        assert_eq!(AllocatorConfig::parse(&off.to_string()).unwrap(), off);
    }

    #[test]
    fn expandable_segments_by_default_under_the_gpualloc_policy() {
        let plain = AllocatorConfig::parse("").unwrap();
        assert!(!plain.expandable_segments, "the core runs what it is given");
        assert!(plain.resolved(true).expandable_segments);
        assert!(
            !plain.resolved(false).expandable_segments,
            "no virtual memory"
        );
        // The choice is named, so it reads back the same on any backend.
        assert_eq!(
            plain.resolved(false).to_string(),
            "expandable_segments:False"
        );
        let back = AllocatorConfig::parse(&plain.resolved(false).to_string()).unwrap();
        assert!(!back.resolved(true).expandable_segments);
        let off = AllocatorConfig::parse("expandable_segments:False").unwrap();
        assert!(off.expandable_segments_named);
        assert!(!off.resolved(true).expandable_segments, "named: kept");
        assert_eq!(off.to_string(), "expandable_segments:False");
        assert_eq!(AllocatorConfig::parse(&off.to_string()).unwrap(), off);
        assert!(
            !AllocatorConfig::default()
                .with_expandable_segments(false)
                .resolved(true)
                .expandable_segments
        );
        let on = AllocatorConfig::parse("expandable_segments:True").unwrap();
        assert_eq!(
            on.resolved(false),
            on,
            "asked for: kept, as the backend will refuse"
        );
        let torch = AllocatorConfig::parse("policy:pytorch").unwrap();
        assert!(
            !torch.resolved(true).expandable_segments,
            "PyTorch's default"
        );
        assert_eq!(plain.resolved(true).to_string(), "expandable_segments:True");
    }

    #[test]
    fn policy_key() {
        assert_eq!(AllocatorConfig::default().policy, Policy::Gpualloc);
        let torch = AllocatorConfig::parse("policy:pytorch").unwrap();
        assert_eq!(torch.policy, Policy::Pytorch);
        assert_eq!(
            torch,
            AllocatorConfig::default().with_policy(Policy::Pytorch)
        );
        assert_eq!(torch.to_string(), "policy:pytorch");
        assert_eq!(AllocatorConfig::parse(&torch.to_string()).unwrap(), torch);
        // The default policy is not written back, like every default.
        assert_eq!(
            AllocatorConfig::parse("policy:gpualloc")
                .unwrap()
                .to_string(),
            ""
        );
        match AllocatorConfig::parse("policy:tensorflow") {
            Err(ConfigError::InvalidValue { key, expected, .. }) => {
                assert_eq!(key, "policy");
                assert_eq!(expected, "pytorch or gpualloc");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn debug_cross_stream_frees_key() {
        assert!(!AllocatorConfig::default().debug_cross_stream_frees);
        let on = AllocatorConfig::parse("debug_cross_stream_frees:True").unwrap();
        assert!(on.debug_cross_stream_frees);
        assert_eq!(
            on,
            AllocatorConfig::default().with_debug_cross_stream_frees(true)
        );
        assert_eq!(on.to_string(), "debug_cross_stream_frees:True");
        assert_eq!(AllocatorConfig::parse(&on.to_string()).unwrap(), on);
        assert!(matches!(
            AllocatorConfig::parse("debug_cross_stream_frees:yes"),
            Err(ConfigError::InvalidValue { .. })
        ));
    }

    #[test]
    fn display_round_trips() {
        let c = AllocatorConfig::parse(
            "max_split_size_mb:512,expandable_segments:True,roundup_power2_divisions:[64:8,>:2]",
        )
        .unwrap();
        assert_eq!(AllocatorConfig::parse(&c.to_string()).unwrap(), c);
    }

    #[test]
    fn validate_holds_typed_fields_to_the_parsers_rules() {
        let ok = |c: AllocatorConfig| c.validate().is_ok();
        let d = AllocatorConfig::default;
        assert!(ok(d()));
        let parsed = AllocatorConfig::parse(
            "max_split_size_mb:21,large_segment_size_mb:4,garbage_collection_threshold:0.5,\
             per_process_memory_fraction:1.0,roundup_power2_divisions:[64:8,>:1],pinned_num_register_threads:2",
        )
        .unwrap();
        assert!(ok(parsed), "whatever the parser accepts validates");
        // max_split_size: unlimited, or above 20 MiB.
        assert!(!ok(AllocatorConfig {
            max_split_size: 20 * MIB,
            ..d()
        }));
        assert!(ok(AllocatorConfig {
            max_split_size: 20 * MIB + 1,
            ..d()
        }));
        assert!(!ok(AllocatorConfig {
            max_split_size: 0,
            ..d()
        }));
        // Divisions: 0 or powers of two.
        let mut div = [0; ROUNDUP_BANDS];
        div[3] = 4;
        div[5] = 1;
        assert!(ok(AllocatorConfig {
            roundup_power2_divisions: div,
            ..d()
        }));
        div[4] = 3;
        assert!(!ok(AllocatorConfig {
            roundup_power2_divisions: div,
            ..d()
        }));
        // Garbage collection: 0 (off) or in (0, 1).
        for (t, good) in [
            (0.0, true),
            (1e-9, true),
            (0.5, true),
            (0.999, true),
            (1.0, false),
            (-0.1, false),
            (f64::NAN, false),
        ] {
            assert_eq!(
                ok(AllocatorConfig {
                    garbage_collection_threshold: t,
                    ..d()
                }),
                good,
                "{t}"
            );
        }
        // Large segments: an even number of MiB, at least 2.
        for (size, good) in [
            (2 * MIB, true),
            (4 * MIB, true),
            (MIB, false),
            (3 * MIB, false),
            (2 * MIB + 1, false),
            (0, false),
        ] {
            assert_eq!(
                ok(AllocatorConfig {
                    large_segment_size: size,
                    ..d()
                }),
                good,
                "{size}"
            );
        }
        // Fraction: in (0, 1].
        for (f, good) in [
            (1.0, true),
            (1e-9, true),
            (0.0, false),
            (1.0001, false),
            (-1.0, false),
            (f64::NAN, false),
        ] {
            assert_eq!(
                ok(AllocatorConfig {
                    per_process_memory_fraction: Some(f),
                    ..d()
                }),
                good,
                "{f}"
            );
        }
        let foreign = AllocatorConfig {
            pinned: vec![("other".into(), "1".into())],
            ..d()
        };
        assert_eq!(
            foreign.validate(),
            Err(ConfigError::UnknownKey("other".into()))
        );
        let err = AllocatorConfig {
            large_segment_size: 3,
            ..d()
        }
        .validate()
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid value `3 bytes` for `large_segment_size_mb`: expected an even number of MiB, at least 2"
        );
    }
}
