//! The device caching allocator of gpualloc: one [`DeviceCore`] per GPU.
//!
//! This crate is a sans-IO state machine with PyTorch's `CUDACachingAllocator` semantics
//! (rounding, small and large pools, best fit by (stream, size, address), split and merge,
//! `max_split_size`, stream-ordered reuse through events, the OOM retry chain, private pools,
//! statistics, trace history and snapshots). It has no tokio, no channels and no clock: every
//! call runs to completion on the caller's thread, talks to the GPU only through a
//! [`gpualloc_runtime::Backend`], and takes time stamps from the caller. Async, waiting and
//! concurrency live in the actor that owns a core (facade crate).

mod beside;
mod block;
mod budget;
pub mod config;
mod core;
mod cross_stream;
mod detached;
pub mod error;
mod events;
mod expandable;
mod expandable_core;
mod free;
mod growth;
mod history;
mod inspect;
mod ledger;
mod malloc;
pub mod map_ahead;
mod mem_pools;
mod miss;
mod observer;
mod observer_hooks;
mod oom;
pub mod orphans;
mod pages;
mod pending;
pub mod placement;
pub mod policy;
mod pool;
mod pool_id;
mod pool_records;
mod pool_state;
mod recorded;
mod release;
mod restore;
mod round_trips;
mod segment_request;
mod shrink;
mod size_classes;
pub mod sizes;
mod sleep;
pub mod snapshot;
pub mod snapshot_pickle;
pub mod stats;
mod streams;
mod summary;
pub mod trace;
mod unsplit;

#[cfg(feature = "rule-knobs")]
pub use crate::core::RuleKnobs;
pub use crate::core::{Allocation, DeviceCore, FreeMemoryCallback, MemPoolId};
pub use crate::history::TraceClock;
pub use crate::malloc::CachedOutcome;
pub use crate::segment_request::SegmentRequest;
pub use config::{AllocatorConfig, ConfigError};
pub use cross_stream::{CrossStreamFree, CROSS_STREAM_LOG};
pub use detached::{free_detached, DetachedSegment};
pub use error::{format_size, AllocError, OomReport};
pub use expandable::MappedPages;
pub use growth::{map_growth, release_reservation, Growth, GrowthPlan, Refused};
pub use miss::{IoDone, Leftover, Miss, MissIo, MissStep};
pub use observer::{
    HeldRanges, HeldRangesError, SegmentAction, SegmentEvent, SegmentRange, SegmentSink,
};
pub use pages::AllocationMemory;
pub use policy::Policy;
pub use pool_records::{PoolOptions, PoolUsage};
pub use pool_state::PoolState;
pub use restore::{RestorePool, RestoredBlock};
pub use round_trips::RoundTrips;
pub use shrink::{release_pages, PageRelease};
pub use sleep::{
    map_wake, release_slept_pages, wait_for_pool_streams, Leftovers, SleepMode, SleepPlan,
    WakePlan, WokenPages,
};
pub use snapshot::{BlockInfo, BlockStateName, DeviceSnapshot, PoolInfo, SegmentInfo};
pub use stats::{DeviceStats, Stat, StatArray, StatType};
pub use summary::memory_summary;
pub use trace::{Frame, Frames, TraceAction, TraceEntry};
