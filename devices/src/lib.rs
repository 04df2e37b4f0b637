//! The device caching allocator of gpualloc: one [`DeviceCore`] per GPU.
//!
//! This crate is a synchronous state machine with PyTorch's `CUDACachingAllocator` semantics
//! (rounding, small and large pools, best fit by (stream, size, address), split and merge,
//! `max_split_size`, stream-ordered reuse through events, the OOM retry chain, private pools,
//! statistics, trace history and snapshots). It has no tokio, no channels and no clock: every
//! call runs to completion on the caller's thread, talks to the GPU only through a
//! [`gpualloc_runtime::Backend`], and takes time stamps from the caller. It calls the backend
//! itself for what never blocks (event queries, reserving address space) and for the calls
//! of its in-place entry points (`malloc`, `empty_cache`); its miss chain is sans-IO: each
//! driver call comes back to the caller to make ([`Miss`]). Async, waiting and concurrency
//! live in the actor that owns a core (facade crate).

mod blocks;
mod budget;
pub mod config;
mod core;
pub mod error;
mod expandable;
mod free;
mod ledger;
mod malloc;
mod miss;
mod pools;
mod recorded;
mod streams;

// The public modules, at the paths they had before the core's folders.
pub use config::{policy, sizes};
pub use ledger::{snapshot, snapshot_pickle, stats, trace};
pub use malloc::{map_ahead, placement, spill};
pub use streams::orphans;

#[cfg(feature = "rule-knobs")]
pub use crate::core::RuleKnobs;
pub use crate::core::{Allocation, DeviceCore, FreeMemoryCallback, MemPoolId};
pub use config::{AllocatorConfig, ConfigError};
pub use error::{format_size, AllocError, OomReport};
pub use expandable::growth::{map_growth, release_reservation, Growth, GrowthPlan, Refused};
pub use expandable::pages::AllocationMemory;
pub use expandable::segment::MappedPages;
pub use expandable::shrink::{release_pages, PageRelease};
pub use free::detached::{free_detached, DetachedSegment};
pub use ledger::cross_stream::{CrossStreamFree, CROSS_STREAM_LOG};
pub use ledger::history::TraceClock;
pub use ledger::observer::{
    HeldRanges, HeldRangesError, SegmentAction, SegmentEvent, SegmentRange, SegmentSink,
};
pub use ledger::round_trips::RoundTrips;
pub use ledger::snapshot::{BlockInfo, BlockStateName, DeviceSnapshot, PoolInfo, SegmentInfo};
pub use ledger::stats::{DeviceStats, Stat, StatArray, StatType};
pub use ledger::summary::memory_summary;
pub use ledger::trace::{Frame, Frames, TraceAction, TraceEntry};
pub use malloc::segment_request::SegmentRequest;
pub use malloc::CachedOutcome;
pub use miss::{IoDone, Leftover, Miss, MissIo, MissStep};
pub use policy::Policy;
pub use pools::pool_records::{PoolOptions, PoolUsage};
pub use pools::pool_state::PoolState;
pub use pools::sleep::{
    map_wake, release_slept_pages, wait_for_pool_streams, Leftovers, SleepMode, SleepPlan,
    WakePlan, WokenPages,
};
pub use recorded::restore::{RestorePool, RestoredBlock};
pub use recorded::RecordedHandles;
