//! The private pools of a device, as one component the core keeps: each pool's pair of block
//! pools and its records, the ids handed out (never reused), and the streams routed into a
//! pool (PyTorch's `beginAllocateToPool`). A leaf: the pools' behaviour (create, route,
//! release, quotas, sleep) is `impl DeviceCore` in `pools/mod.rs` and its neighbours.

use std::collections::{btree_map, BTreeMap, HashMap};

use crate::pools::pool_records::PoolUsage;

/// One private pool.
pub(crate) struct PrivatePool {
    /// Its small and large block pools (indexes of the core's `pools`).
    pub small: usize,
    pub large: usize,
    pub use_on_oom: bool,
    /// The user released the pool: its cached segments go back on `empty_cache`.
    pub released: bool,
    /// Name, quota and what it holds (`pools/`).
    pub usage: PoolUsage,
    /// Made by `create_named_pool` (not PyTorch's unnamed `create_pool`).
    pub named: bool,
    /// Bytes on their way to or from the device off the core: segments being allocated for it
    /// by misses whose segment malloc is in flight (an off-core miss's
    /// [`crate::MissIo::AllocSegment`]), and its segments and pages out of the books whose
    /// free or unmap has not returned. They count against its quota.
    pub claimed: u64,
    /// Granularity of its unsplit blocks, or why the one asked for cannot be (`unsplit.rs`).
    pub unsplit: Option<Result<u64, &'static str>>,
    /// Live graphs captured into it (`capture.rs`): their pointers are baked in.
    pub graphs: usize,
    /// Graphs of it dropped while their launches may still run (`capture.rs`).
    pub launches: usize,
}

/// The device's private pools (see the module docs).
pub(crate) struct PrivatePools {
    pools: BTreeMap<u64, PrivatePool>,
    next_id: u64,
    /// Streams (raw handles) whose allocations go to a pool, and its id.
    routes: HashMap<u64, u64>,
}

impl PrivatePools {
    pub(crate) fn new() -> Self {
        PrivatePools {
            pools: BTreeMap::new(),
            next_id: 1,
            routes: HashMap::new(),
        }
    }

    /// The id the next pool gets (ids start at 1 and are never reused); the caller then
    /// [`PrivatePools::insert`]s the pool under it.
    pub(crate) fn new_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    pub(crate) fn insert(&mut self, id: u64, pool: PrivatePool) {
        self.pools.insert(id, pool);
    }

    /// Forgets pool `id` (released by its user, no segment left).
    pub(crate) fn remove(&mut self, id: u64) {
        self.pools.remove(&id);
        self.unroute_pool(id);
    }

    pub(crate) fn get(&self, id: u64) -> Option<&PrivatePool> {
        self.pools.get(&id)
    }

    pub(crate) fn get_mut(&mut self, id: u64) -> Option<&mut PrivatePool> {
        self.pools.get_mut(&id)
    }

    /// Pool `id` if its user has not released it.
    pub(crate) fn live(&self, id: u64) -> Option<&PrivatePool> {
        self.get(id).filter(|p| !p.released)
    }

    /// True when pool `id` exists and is a named pool.
    pub(crate) fn is_named(&self, id: u64) -> bool {
        self.get(id).is_some_and(|p| p.named)
    }

    /// The pools by id, in id order.
    pub(crate) fn iter(&self) -> btree_map::Iter<'_, u64, PrivatePool> {
        self.pools.iter()
    }

    pub(crate) fn values(&self) -> btree_map::Values<'_, u64, PrivatePool> {
        self.pools.values()
    }

    /// Routes stream `stream`'s allocations to pool `id`.
    pub(crate) fn route(&mut self, stream: u64, id: u64) {
        self.routes.insert(stream, id);
    }

    /// Stops routing stream `stream`.
    pub(crate) fn unroute(&mut self, stream: u64) {
        self.routes.remove(&stream);
    }

    /// Stops routing every stream routed to pool `id`.
    pub(crate) fn unroute_pool(&mut self, id: u64) {
        self.routes.retain(|_, routed| *routed != id);
    }

    /// The pool stream `stream` is routed to, if any.
    pub(crate) fn routed(&self, stream: u64) -> Option<u64> {
        self.routes.get(&stream).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(small: usize) -> PrivatePool {
        PrivatePool {
            small,
            large: small + 1,
            use_on_oom: false,
            released: false,
            usage: PoolUsage::default(),
            named: false,
            claimed: 0,
            graphs: 0,
            launches: 0,
            unsplit: None,
        }
    }

    #[test]
    fn ids_are_never_reused_and_routes_go_with_their_pool() {
        let mut pools = PrivatePools::new();
        let (a, b) = (pools.new_id(), pools.new_id());
        assert_eq!((a, b), (1, 2));
        pools.insert(a, pool(2));
        pools.insert(b, pool(4));
        pools.route(7, a);
        pools.route(8, a);
        pools.route(9, b);
        assert_eq!(pools.routed(7), Some(a));
        pools.unroute(7);
        assert_eq!(pools.routed(7), None);
        pools.remove(a);
        assert!(pools.get(a).is_none());
        assert_eq!((pools.routed(8), pools.routed(9)), (None, Some(b)));
        assert_eq!(
            pools.new_id(),
            3,
            "a removed pool's id is not handed out again"
        );
        pools.get_mut(b).unwrap().released = true;
        assert!(pools.live(b).is_none() && pools.get(b).is_some());
        pools.get_mut(b).unwrap().named = true;
        assert!(pools.is_named(b) && !pools.is_named(a));
        assert_eq!(pools.values().count(), 1);
    }
}
