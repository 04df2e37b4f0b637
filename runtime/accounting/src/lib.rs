//! The accounting backend: a [`Backend`] that hands out addresses and counts bytes, with no
//! memory behind them.
//!
//! It exists for two jobs the simulated GPU cannot do: replaying a recorded 60 GiB training
//! trace on a laptop (nothing is touched, so nothing is consumed), and driving the allocator
//! cores through exact event schedules in property tests ([`AccountingBackend::manual_events`]:
//! an event stays pending until the test completes it). Addresses are deterministic: each
//! device allocates from its own 64 TiB window, 2 MiB aligned, lowest free address first
//! (highest first with [`AccountingBackend::highest_address_first`]), unless [`AccountingBackend::place_next`] asks for a specific address (trace replays use it
//! to give a segment the address PyTorch gave it).
//!
//! Pinned host memory is accounted the same way: `host_alloc` hands out 4 KiB-aligned addresses
//! from a host window of its own (no memory behind them) and counts them against a host capacity
//! ([`AccountingBackend::with_host_capacity`]); `host_register` records page-aligned,
//! non-overlapping ranges (which count against the same capacity) and `host_unregister` removes
//! them. IPC is not modelled: those calls return `NotSupported`.

mod address_space;
mod backend;
mod host;

use std::collections::{BTreeMap, HashMap};
use std::os::fd::OwnedFd;

use self::address_space::AddressSpace;
use gpualloc_runtime::sync::{lock, Mutex};
use gpualloc_runtime::types::{
    DeviceId, DevicePtr, EventHandle, HostFn, HostRegisterFlags, IpcMemHandle, MemInfo, PhysHandle,
    StreamHandle,
};
use gpualloc_runtime::Backend;
use gpualloc_runtime::{BackendError, Result};

/// Alignment of every device allocation and reservation (real drivers give at least this for
/// large allocations; the allocator only relies on 512 B).
pub const ALIGNMENT: u64 = 2 << 20;
/// Address window of each device (64 TiB). Each expandable segment reserves 9/8 of the
/// device, as PyTorch's does, and a replay's device is 1 TiB unless told otherwise: 64 TiB
/// holds 56 such reservations (a job on 10 streams makes 20: a small and a large pool each;
/// 16 TiB held 14). Device 0's window, from 0x7000_0000_0000, holds the addresses CUDA gave
/// the shared traces (0x7f..), where a warm replay places segments.
const WINDOW: u64 = 1 << 46;
/// Address window of host allocations.
const HOST_WINDOW: u64 = 1 << 40;
const BASE: u64 = 0x7000_0000_0000;
/// Page size the host calls validate against.
pub const HOST_PAGE: u64 = 4096;
/// Start of the window `host_alloc` hands out addresses from (below every device window).
const HOST_BASE: u64 = 0x6000_0000_0000;

/// Counts of the calls that change device memory, for tests and replay reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AccountingCounts {
    /// `malloc` calls that succeeded.
    pub mallocs: u64,
    /// `free` calls that succeeded.
    pub frees: u64,
    /// `malloc` calls refused for lack of capacity.
    pub failed_mallocs: u64,
    /// `device_synchronize` calls (frees synchronize too but are not counted here).
    pub device_syncs: u64,
    /// `map` calls that succeeded.
    pub maps: u64,
    /// `unmap` calls that succeeded.
    pub unmaps: u64,
    /// `host_alloc` calls that succeeded.
    pub host_allocs: u64,
    /// `host_free` calls that succeeded.
    pub host_frees: u64,
    /// `host_register` calls that succeeded.
    pub host_registers: u64,
    /// `host_unregister` calls that succeeded.
    pub host_unregisters: u64,
}

struct HostState {
    /// Live `host_alloc` allocations: start → size (rounded to [`HOST_PAGE`]), in the host
    /// window.
    allocs: AddressSpace,
    /// Registered ranges: start → length.
    registered: BTreeMap<u64, u64>,
    /// Bytes of `allocs` plus `registered`.
    used: u64,
}

impl HostState {
    fn overlaps(map: &BTreeMap<u64, u64>, start: u64, len: u64) -> bool {
        map.range(..start.saturating_add(len))
            .next_back()
            .is_some_and(|(s, l)| s + l > start)
    }

    /// Lowest [`HOST_PAGE`]-aligned gap of `size` bytes in the host window.
    fn find_gap(&self, size: u64) -> Option<u64> {
        self.allocs.find(size, HOST_PAGE, false)
    }
}

impl Default for HostState {
    fn default() -> Self {
        HostState {
            allocs: AddressSpace::new(HOST_BASE, HOST_BASE + HOST_WINDOW),
            registered: BTreeMap::new(),
            used: 0,
        }
    }
}

struct DeviceState {
    /// Live allocations and reservations: start → size, and the gaps of the device's window.
    ranges: AddressSpace,
    /// Which of `ranges` are reservations (va_reserve) rather than malloc'd memory.
    reservations: BTreeMap<u64, u64>,
    /// Mapped ranges inside reservations: start → (size, phys raw).
    mapped: BTreeMap<u64, (u64, u64)>,
    used: u64,
    place_next: Option<u64>,
}

impl DeviceState {
    /// Device `index`, with its own address window.
    fn new(index: u32) -> Self {
        let lo = BASE + u64::from(index) * WINDOW;
        DeviceState {
            ranges: AddressSpace::new(lo, lo + WINDOW),
            reservations: BTreeMap::new(),
            mapped: BTreeMap::new(),
            used: 0,
            place_next: None,
        }
    }
}

#[derive(Default)]
struct State {
    devices: Vec<DeviceState>,
    /// Event raw → (last record seq, completed seq).
    events: HashMap<u64, (u64, u64)>,
    /// Event raw → raw of the stream it was last recorded on.
    event_streams: HashMap<u64, u64>,
    streams: HashMap<u64, DeviceId>,
    phys: HashMap<u64, PhysHandle>,
    next_id: u64,
    counts: AccountingCounts,
    host: HostState,
}

/// A backend with addresses and byte counts only. See the module docs.
pub struct AccountingBackend {
    capacity: u64,
    host_capacity: u64,
    manual_events: bool,
    /// `free` completes every recorded event, as `cuMemFree` synchronizes the device.
    free_synchronizes: bool,
    /// New memory at the highest free address instead of the lowest.
    highest_first: bool,
    state: Mutex<State>,
}

impl AccountingBackend {
    /// `devices` devices of `capacity` bytes each; events complete as soon as recorded.
    pub fn new(devices: u32, capacity: u64) -> Self {
        let state = State {
            devices: (0..devices).map(DeviceState::new).collect(),
            next_id: 1,
            ..State::default()
        };
        AccountingBackend {
            capacity,
            host_capacity: HOST_WINDOW,
            manual_events: false,
            free_synchronizes: true,
            highest_first: false,
            state: Mutex::new(state),
        }
    }

    /// Sets how many bytes of pinned host memory (`host_alloc` plus `host_register`) may be
    /// held at once; the default is the whole 1 TiB host window.
    pub fn with_host_capacity(mut self, bytes: u64) -> Self {
        self.host_capacity = bytes;
        self
    }

    /// Bytes of pinned host memory held (allocated plus registered).
    pub fn host_used(&self) -> u64 {
        lock(&self.state).host.used
    }

    /// Like [`AccountingBackend::new`], but recorded events stay pending until
    /// [`AccountingBackend::complete_event`] or [`AccountingBackend::complete_all_events`]
    /// (or a synchronize call) completes them.
    pub fn manual_events(devices: u32, capacity: u64) -> Self {
        let mut b = Self::new(devices, capacity);
        b.manual_events = true;
        b
    }

    /// `free` leaves recorded events as they are (by default it completes them all, as
    /// `cuMemFree` synchronizes the device). For a replay whose frees complete where the
    /// history says they did (`gpualloc replay`): an owner that releases segments off its
    /// core records their `segment_free` before the driver call, and a request it serves
    /// in between still sees frees on other segments pending.
    pub fn free_does_not_synchronize(mut self) -> Self {
        self.free_synchronizes = false;
        self
    }

    /// Hands out device memory and reservations from the top of each device's window down
    /// (highest free address first) instead of from the bottom up. CUDA's driver gave most
    /// `cudaMalloc` segments of the shared PyTorch traces at addresses below the previous one
    /// (qwen2-7b-layerwise-calib: 270 of 419 steps down), and best fit breaks ties between
    /// equal free blocks by address, so the order decides which of two equal blocks a request
    /// takes: a cold replay of that trace peaks at PyTorch's recorded 5.40 GiB top-down, at
    /// 5.79 GiB bottom-up.
    pub fn highest_address_first(mut self) -> Self {
        self.highest_first = true;
        self
    }

    /// Completes the last record of `event`.
    pub fn complete_event(&self, event: EventHandle) {
        if let Some((rec, done)) = lock(&self.state).events.get_mut(&event.raw) {
            *done = *rec;
        }
    }

    /// Completes every recorded event.
    pub fn complete_all_events(&self) {
        for (rec, done) in lock(&self.state).events.values_mut() {
            *done = *rec;
        }
    }

    /// Completes every event last recorded on `stream` (the stream reached the end of its work).
    pub fn complete_stream(&self, stream: StreamHandle) {
        let mut state = lock(&self.state);
        let state = &mut *state;
        for (raw, on) in &state.event_streams {
            if *on == stream.raw {
                if let Some((rec, done)) = state.events.get_mut(raw) {
                    *done = *rec;
                }
            }
        }
    }

    /// Registers a stream with a caller-chosen raw handle (a trace's stream id, so a replay
    /// orders blocks by the same stream values the recording did).
    pub fn register_stream(&self, device: DeviceId, raw: u64) -> Result<StreamHandle> {
        let mut state = lock(&self.state);
        Self::device(&mut state, device)?;
        match state.streams.get(&raw) {
            Some(d) if *d != device => Err(BackendError::invalid(format!(
                "stream {raw:#x} already belongs to {d}"
            ))),
            _ => {
                state.streams.insert(raw, device);
                Ok(StreamHandle { device, raw })
            }
        }
    }

    /// Forgets a pending [`AccountingBackend::place_next`].
    pub fn clear_placement(&self, device: DeviceId) {
        if let Some(d) = lock(&self.state).devices.get_mut(device.0 as usize) {
            d.place_next = None;
        }
    }

    /// Number of events whose last record is still pending.
    pub fn pending_events(&self) -> usize {
        lock(&self.state)
            .events
            .values()
            .filter(|(rec, done)| done < rec)
            .count()
    }

    /// The next `malloc` on `device` returns `addr` if that range is free (else the usual
    /// lowest free address).
    pub fn place_next(&self, device: DeviceId, addr: u64) {
        if let Some(d) = lock(&self.state).devices.get_mut(device.0 as usize) {
            d.place_next = Some(addr);
        }
    }

    /// Call counts so far.
    pub fn counts(&self) -> AccountingCounts {
        lock(&self.state).counts
    }

    /// The base of the address reservation (`va_reserve`) on `device` that holds `addr`, if
    /// any.
    pub fn reservation_holding(&self, device: DeviceId, addr: u64) -> Option<u64> {
        let state = lock(&self.state);
        let dev = state.devices.get(device.0 as usize)?;
        let (&base, &len) = dev.reservations.range(..=addr).next_back()?;
        (addr < base + len).then_some(base)
    }

    /// Bytes in use on `device` (allocations plus physical memory for mappings).
    pub fn used(&self, device: DeviceId) -> u64 {
        lock(&self.state)
            .devices
            .get(device.0 as usize)
            .map_or(0, |d| d.used)
    }

    fn device(state: &mut State, device: DeviceId) -> Result<&mut DeviceState> {
        state
            .devices
            .get_mut(device.0 as usize)
            .ok_or(BackendError::InvalidDevice(device.0))
    }

    fn check_size(size: u64) -> Result<u64> {
        if size == 0 {
            return Err(BackendError::invalid("size 0"));
        }
        let rounded = size
            .checked_next_multiple_of(ALIGNMENT)
            .ok_or_else(|| BackendError::invalid(format!("size {size} overflows")))?;
        if rounded > WINDOW {
            return Err(BackendError::OutOfMemory {
                requested: size,
                what: "device".into(),
            });
        }
        Ok(rounded)
    }

    /// Lowest `align`-aligned gap of `size` bytes in the device's window (the highest one
    /// when `highest_first`), or `want` if free.
    fn find_gap(
        dev: &DeviceState,
        size: u64,
        want: Option<u64>,
        align: u64,
        highest_first: bool,
    ) -> Option<u64> {
        if let Some(addr) = want {
            if addr % 512 == 0 && addr.checked_add(size).is_some() && dev.ranges.is_free(addr, size)
            {
                return Some(addr);
            }
        }
        dev.ranges.find(size, align, highest_first)
    }

    fn new_id(state: &mut State) -> u64 {
        // Ids start at 2^62 so they never meet raws chosen by `register_stream` (trace stream
        // ids are small integers or user-space addresses) and still fit an i64 (snapshots).
        state.next_id += 1;
        (1 << 62) + state.next_id
    }

    fn stream_device(state: &State, stream: StreamHandle) -> Result<DeviceId> {
        state
            .streams
            .get(&stream.raw)
            .copied()
            .ok_or_else(|| BackendError::InvalidHandle(format!("stream {stream:?}")))
    }
}

#[cfg(all(test, not(loom)))]
mod tests;
