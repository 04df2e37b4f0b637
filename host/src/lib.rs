//! The pinned-host caching allocator of gpualloc: its pure core.
//!
//! [`HostCore`] is a synchronous, deterministic state machine over a
//! [`Backend`](gpualloc_runtime::Backend): no async runtime, no channels, no threads of its own
//! (the register path's prefault uses scoped threads that end before the call returns), and no
//! clock but the [`Clock`] its owner passes in. The `HostActor` and the facade wrap it; it is
//! tested directly, against a reference model.
//!
//! - [`config`]: [`HostConfig`], the `pinned_*` settings, and [`ConfigError`].
//! - [`size_class`]: power-of-two classes, and 2 MiB granularity above the rounding threshold.
//! - [`core`]: [`HostCore`] — malloc, free, record_stream, events, cache cap, empty_cache.
//! - [`free_list`], [`reserve`]: the cached blocks, and the reserve segment's bump allocator.
//! - [`mapping`], [`mod@prefault`]: the register path's OS memory and its parallel page faulting
//!   (the only `unsafe` code is in `mapping`).
//! - [`addr_map`]: the block table's cheap address hasher.
//! - [`stats`]: [`HostStats`] with PyTorch's host keys; [`clock`]: [`Clock`]; [`error`].
//!
//! Registering memory the user already has (`cuMemHostRegister` of a `Vec` or a mapped file)
//! is a concept of its own, in the crate `gpualloc-host-register`.

pub use gpualloc_runtime::addr_map;
pub mod clock;
pub mod config;
pub mod core;
pub mod error;
pub mod free_list;
pub mod mapping;
pub mod prefault;
pub mod reserve;
pub mod size_class;
pub mod stats;

pub use clock::{Clock, ManualClock, MonotonicClock};
pub use config::{ConfigError, HostConfig};
pub use core::HostCore;
pub use error::{HostError, Result};
pub use prefault::prefault;
pub use stats::{DurationStat, HostStats, Stat};

use std::fmt;

/// The address of a pinned host block: plain CPU memory, usable by the device for copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HostPtr(pub u64);

impl HostPtr {
    /// The address as a raw pointer (dereferencing it is the caller's business).
    pub fn as_mut_ptr(self) -> *mut u8 {
        self.0 as *mut u8
    }
}

impl fmt::Display for HostPtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// A block handed out by [`HostCore::malloc`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostBlock {
    /// Start of the block.
    pub ptr: HostPtr,
    /// Bytes the block holds (the request rounded to its size class).
    pub size: u64,
    /// Bytes the caller asked for.
    pub requested: u64,
}
