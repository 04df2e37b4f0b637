//! PyTorch's `PYTORCH_CUDA_ALLOC_CONF` string, key by key, into an [`AllocatorConfig`]: the
//! syntax (entries, bracketed lists) and each key's value rules. The typed fields and
//! [`AllocatorConfig::validate`], which holds them to the same rules, are in `mod.rs`.

use super::{invalid, AllocatorConfig, ConfigError, MIB};
use crate::config::policy::Policy;
use crate::config::size_classes::{LARGE_BUFFER, ROUNDUP_BANDS};

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
