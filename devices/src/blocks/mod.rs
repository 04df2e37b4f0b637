//! Blocks and the pools that hold them: the arena of blocks (`block.rs`), the free trees of a
//! block pool (`pool.rs`), and a private pool's id (`pool_id.rs`). Leaf types the core keeps.

pub(crate) mod block;
pub(crate) mod live;
pub(crate) mod pool;
pub(crate) mod pool_id;
pub(crate) mod segment_table;
