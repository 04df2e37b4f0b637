//! The size classes of PyTorch's device allocator: the constants of `round_size`,
//! `get_pool` and `get_allocation_size`, and the power-of-two bands that
//! `roundup_power2_divisions` configures. No config here: the config's parser and the
//! rounding in `sizes.rs` both build on these.

/// Smallest block, and the unit every size is rounded to.
pub const MIN_BLOCK_SIZE: u64 = 512;
/// Largest request served by the small pool.
pub const SMALL_SIZE: u64 = 1 << 20;
/// Segment size of the small pool.
pub const SMALL_BUFFER: u64 = 2 << 20;
/// Requests from here on get a segment of their own size (rounded to [`ROUND_LARGE`]).
pub const MIN_LARGE_ALLOC: u64 = 10 << 20;
/// Rounding of large segments.
pub const ROUND_LARGE: u64 = 2 << 20;
/// Default segment size for large-pool requests under [`MIN_LARGE_ALLOC`].
pub const LARGE_BUFFER: u64 = 20 << 20;
/// Number of power-of-two bands `roundup_power2_divisions` configures (1 MiB .. 64 GiB).
pub const ROUNDUP_BANDS: usize = 16;
/// Band of sizes below 2 MiB (log2 of 1 MiB).
const ROUNDUP_FIRST_LOG2: u32 = 20;

/// Index of the `roundup_power2_divisions` band of `size`.
pub fn roundup_band(size: u64) -> usize {
    let log = 63 - size.max(1).leading_zeros();
    (log.saturating_sub(ROUNDUP_FIRST_LOG2) as usize).min(ROUNDUP_BANDS - 1)
}

/// True when a (rounded) request is served by the small pool.
pub fn is_small(rounded: u64) -> bool {
    rounded <= SMALL_SIZE
}
