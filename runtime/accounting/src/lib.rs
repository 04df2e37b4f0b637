//! The accounting backend: a [`Backend`] that hands out addresses and counts bytes, with no
//! memory behind them.
//!
//! It exists for two jobs the simulated GPU cannot do: replaying a recorded 60 GiB training
//! trace on a laptop (nothing is touched, so nothing is consumed), and driving the allocator
//! cores through exact event schedules in property tests ([`AccountingBackend::manual_events`]:
//! an event stays pending until the test completes it). Addresses are deterministic: each
//! device allocates from its own 16 TiB window, 2 MiB aligned, lowest free address first
//! (highest first with [`AccountingBackend::highest_address_first`]), unless [`AccountingBackend::place_next`] asks for a specific address (trace replays use it
//! to give a segment the address PyTorch gave it).
//!
//! Pinned host memory is accounted the same way: `host_alloc` hands out 4 KiB-aligned addresses
//! from a host window of its own (no memory behind them) and counts them against a host capacity
//! ([`AccountingBackend::with_host_capacity`]); `host_register` records page-aligned,
//! non-overlapping ranges (which count against the same capacity) and `host_unregister` removes
//! them. IPC is not modelled: those calls return `NotSupported`.

mod address_space;

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
/// Address window of each device (16 TiB: room for expandable-segment reservations of
/// 9/8 of a large capacity).
const WINDOW: u64 = 1 << 44;
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

impl Backend for AccountingBackend {
    fn name(&self) -> &'static str {
        "accounting"
    }

    fn device_count(&self) -> Result<u32> {
        Ok(lock(&self.state).devices.len() as u32)
    }

    fn process_used(&self, device: DeviceId) -> Result<Option<u64>> {
        Ok(Some(self.used(device)))
    }

    fn mem_info(&self, device: DeviceId) -> Result<MemInfo> {
        let mut state = lock(&self.state);
        let used = Self::device(&mut state, device)?.used;
        Ok(MemInfo {
            free: self.capacity.saturating_sub(used),
            total: self.capacity,
        })
    }

    fn malloc(&self, device: DeviceId, size: u64) -> Result<DevicePtr> {
        let rounded = Self::check_size(size)?;
        let mut state = lock(&self.state);
        let capacity = self.capacity;
        let dev = Self::device(&mut state, device)?;
        let want = dev.place_next.take();
        if dev.used + rounded > capacity {
            state.counts.failed_mallocs += 1;
            return Err(BackendError::OutOfMemory {
                requested: size,
                what: device.to_string(),
            });
        }
        let addr =
            Self::find_gap(dev, size, want, ALIGNMENT, self.highest_first).ok_or_else(|| {
                BackendError::OutOfMemory {
                    requested: size,
                    what: device.to_string(),
                }
            })?;
        dev.ranges.insert(addr, size);
        dev.used += rounded;
        state.counts.mallocs += 1;
        Ok(DevicePtr(addr))
    }

    fn free(&self, device: DeviceId, ptr: DevicePtr) -> Result<()> {
        let mut state = lock(&self.state);
        let dev = Self::device(&mut state, device)?;
        if dev.reservations.contains_key(&ptr.0) {
            return Err(BackendError::invalid(format!(
                "{ptr} is a reservation, not an allocation"
            )));
        }
        let size = dev
            .ranges
            .remove(ptr.0)
            .ok_or_else(|| BackendError::invalid(format!("free of unknown pointer {ptr}")))?;
        dev.used -= Self::check_size(size)?;
        state.counts.frees += 1;
        // cuMemFree synchronizes the device: every recorded event is complete afterwards.
        if self.free_synchronizes {
            for (rec, done) in state.events.values_mut() {
                *done = *rec;
            }
        }
        Ok(())
    }

    fn device_synchronize(&self, device: DeviceId) -> Result<()> {
        let mut state = lock(&self.state);
        Self::device(&mut state, device)?;
        state.counts.device_syncs += 1;
        for (rec, done) in state.events.values_mut() {
            *done = *rec;
        }
        Ok(())
    }

    fn stream_create(&self, device: DeviceId) -> Result<StreamHandle> {
        let mut state = lock(&self.state);
        Self::device(&mut state, device)?;
        let raw = Self::new_id(&mut state);
        state.streams.insert(raw, device);
        Ok(StreamHandle { device, raw })
    }

    fn stream_destroy(&self, stream: StreamHandle) -> Result<()> {
        lock(&self.state)
            .streams
            .remove(&stream.raw)
            .map(|_| ())
            .ok_or_else(|| BackendError::InvalidHandle(format!("stream {stream:?}")))
    }

    fn stream_synchronize(&self, stream: StreamHandle) -> Result<()> {
        Self::stream_device(&lock(&self.state), stream).map(|_| ())
    }

    fn stream_wait_event(&self, stream: StreamHandle, _event: EventHandle) -> Result<()> {
        Self::stream_device(&lock(&self.state), stream).map(|_| ())
    }

    fn launch_host_func(&self, stream: StreamHandle, f: HostFn) -> Result<()> {
        Self::stream_device(&lock(&self.state), stream)?;
        f(Ok(()));
        Ok(())
    }

    unsafe fn memcpy_async(&self, _: StreamHandle, _: u64, _: u64, _: u64) -> Result<()> {
        Err(BackendError::NotSupported(
            "the accounting backend has no memory".into(),
        ))
    }

    fn memset_async(&self, _: StreamHandle, _: DevicePtr, _: u8, _: u64) -> Result<()> {
        Err(BackendError::NotSupported(
            "the accounting backend has no memory".into(),
        ))
    }

    fn copy_to_device(&self, _: StreamHandle, _: DevicePtr, _: &[u8]) -> Result<()> {
        Err(BackendError::NotSupported(
            "the accounting backend has no memory".into(),
        ))
    }

    fn copy_from_device(&self, _: StreamHandle, _: &mut [u8], _: DevicePtr) -> Result<()> {
        Err(BackendError::NotSupported(
            "the accounting backend has no memory".into(),
        ))
    }

    fn event_create(&self, device: DeviceId) -> Result<EventHandle> {
        let mut state = lock(&self.state);
        Self::device(&mut state, device)?;
        let raw = Self::new_id(&mut state);
        state.events.insert(raw, (0, 0));
        Ok(EventHandle { device, raw })
    }

    fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<()> {
        let mut state = lock(&self.state);
        let device = Self::stream_device(&state, stream)?;
        if device != event.device {
            return Err(BackendError::invalid(format!(
                "event of {} recorded on a stream of {device}",
                event.device
            )));
        }
        let manual = self.manual_events;
        let (rec, done) = state
            .events
            .get_mut(&event.raw)
            .ok_or_else(|| BackendError::InvalidHandle(format!("event {event:?}")))?;
        *rec += 1;
        if !manual {
            *done = *rec;
        }
        state.event_streams.insert(event.raw, stream.raw);
        Ok(())
    }

    fn event_query(&self, event: EventHandle) -> Result<bool> {
        lock(&self.state)
            .events
            .get(&event.raw)
            .map(|(rec, done)| done >= rec)
            .ok_or_else(|| BackendError::InvalidHandle(format!("event {event:?}")))
    }

    fn event_synchronize(&self, event: EventHandle) -> Result<()> {
        let mut state = lock(&self.state);
        let (rec, done) = state
            .events
            .get_mut(&event.raw)
            .ok_or_else(|| BackendError::InvalidHandle(format!("event {event:?}")))?;
        *done = *rec;
        Ok(())
    }

    fn event_destroy(&self, event: EventHandle) -> Result<()> {
        lock(&self.state)
            .events
            .remove(&event.raw)
            .map(|_| ())
            .ok_or_else(|| BackendError::InvalidHandle(format!("event {event:?}")))
    }

    fn host_alloc(&self, size: u64) -> Result<*mut u8> {
        if size == 0 {
            return Err(BackendError::invalid("host_alloc of size 0"));
        }
        let rounded = size
            .checked_next_multiple_of(HOST_PAGE)
            .filter(|s| *s <= HOST_WINDOW)
            .ok_or_else(|| BackendError::invalid(format!("host size {size} is too large")))?;
        let mut state = lock(&self.state);
        let oom = || BackendError::OutOfMemory {
            requested: size,
            what: "pinned host".into(),
        };
        if state.host.used + rounded > self.host_capacity {
            return Err(oom());
        }
        let addr = state.host.find_gap(rounded).ok_or_else(oom)?;
        state.host.allocs.insert(addr, rounded);
        state.host.used += rounded;
        state.counts.host_allocs += 1;
        Ok(addr as *mut u8)
    }

    unsafe fn host_free(&self, ptr: *mut u8) -> Result<()> {
        AccountingBackend::host_free(self, ptr)
    }

    unsafe fn host_register(&self, ptr: *mut u8, len: u64, flags: HostRegisterFlags) -> Result<()> {
        AccountingBackend::host_register(self, ptr, len, flags)
    }

    unsafe fn host_unregister(&self, ptr: *mut u8) -> Result<()> {
        AccountingBackend::host_unregister(self, ptr)
    }

    fn vmm_granularity(&self, device: DeviceId) -> Result<u64> {
        Self::device(&mut lock(&self.state), device)?;
        Ok(ALIGNMENT)
    }

    fn va_reserve(&self, device: DeviceId, size: u64, alignment: u64) -> Result<DevicePtr> {
        let rounded = Self::check_size(size)?;
        if alignment != 0 && !alignment.is_power_of_two() {
            return Err(BackendError::invalid(format!("alignment {alignment}")));
        }
        let mut state = lock(&self.state);
        let dev = Self::device(&mut state, device)?;
        let want = dev.place_next.take();
        let addr = Self::find_gap(
            dev,
            rounded,
            want,
            alignment.max(ALIGNMENT),
            self.highest_first,
        )
        .ok_or_else(|| {
            BackendError::invalid(format!(
                "address space exhausted: {rounded} bytes aligned to {alignment}, want {want:?}"
            ))
        })?;
        dev.ranges.insert(addr, rounded);
        dev.reservations.insert(addr, rounded);
        Ok(DevicePtr(addr))
    }

    fn va_free(&self, device: DeviceId, ptr: DevicePtr, size: u64) -> Result<()> {
        let mut state = lock(&self.state);
        let dev = Self::device(&mut state, device)?;
        match dev.reservations.get(&ptr.0) {
            Some(&len) if len == Self::check_size(size)? => {}
            _ => {
                return Err(BackendError::invalid(format!(
                    "no reservation of {size} at {ptr}"
                )))
            }
        }
        if dev.mapped.range(ptr.0..ptr.0 + size).next().is_some() {
            return Err(BackendError::invalid(format!(
                "reservation at {ptr} is still mapped"
            )));
        }
        dev.reservations.remove(&ptr.0);
        dev.ranges.remove(ptr.0);
        Ok(())
    }

    fn phys_create(&self, device: DeviceId, size: u64) -> Result<PhysHandle> {
        if size == 0 || size % ALIGNMENT != 0 {
            return Err(BackendError::invalid(format!(
                "physical size {size} not a granule multiple"
            )));
        }
        let mut state = lock(&self.state);
        let capacity = self.capacity;
        let dev = Self::device(&mut state, device)?;
        if dev.used + size > capacity {
            state.counts.failed_mallocs += 1;
            return Err(BackendError::OutOfMemory {
                requested: size,
                what: device.to_string(),
            });
        }
        dev.used += size;
        let raw = Self::new_id(&mut state);
        let handle = PhysHandle { device, raw, size };
        state.phys.insert(raw, handle);
        Ok(handle)
    }

    fn phys_release(&self, handle: PhysHandle) -> Result<()> {
        let mut state = lock(&self.state);
        let h = state
            .phys
            .remove(&handle.raw)
            .ok_or_else(|| BackendError::InvalidHandle(format!("{handle:?}")))?;
        Self::device(&mut state, h.device)?.used -= h.size;
        Ok(())
    }

    fn map(&self, ptr: DevicePtr, size: u64, offset: u64, handle: PhysHandle) -> Result<()> {
        let mut state = lock(&self.state);
        if !state.phys.contains_key(&handle.raw) {
            return Err(BackendError::InvalidHandle(format!("{handle:?}")));
        }
        if size == 0
            || ptr.0 % ALIGNMENT != 0
            || size % ALIGNMENT != 0
            || offset + size > handle.size
        {
            return Err(BackendError::invalid(format!(
                "map of {size} at {ptr} offset {offset}"
            )));
        }
        let dev = Self::device(&mut state, handle.device)?;
        let inside = dev
            .reservations
            .range(..=ptr.0)
            .next_back()
            .is_some_and(|(s, len)| ptr.0 + size <= s + len);
        let overlaps = dev
            .mapped
            .range(..ptr.0 + size)
            .next_back()
            .is_some_and(|(s, (len, _))| s + len > ptr.0);
        if !inside || overlaps {
            return Err(BackendError::invalid(format!(
                "map of {size} at {ptr}: not a free reserved range"
            )));
        }
        dev.mapped.insert(ptr.0, (size, handle.raw));
        state.counts.maps += 1;
        Ok(())
    }

    fn unmap(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        let mut state = lock(&self.state);
        let end = ptr
            .checked_add(size)
            .ok_or_else(|| BackendError::invalid("range overflows"))?;
        let device = state
            .devices
            .iter()
            .position(|d| d.mapped.contains_key(&ptr.0))
            .ok_or_else(|| BackendError::invalid(format!("{ptr} is not mapped")))?;
        let dev = &mut state.devices[device];
        // The range must be exactly a run of whole mappings.
        let run: Vec<u64> = dev.mapped.range(ptr.0..end.0).map(|(s, _)| *s).collect();
        let mut cursor = ptr.0;
        for s in &run {
            let (len, _) = dev.mapped[s];
            if *s != cursor {
                return Err(BackendError::invalid(format!(
                    "hole in unmap range at {cursor:#x}"
                )));
            }
            cursor += len;
        }
        if cursor != end.0 {
            return Err(BackendError::invalid(format!(
                "unmap of {size} at {ptr} splits a mapping"
            )));
        }
        let n = run.len() as u64;
        for s in run {
            dev.mapped.remove(&s);
        }
        state.counts.unmaps += n;
        Ok(())
    }

    fn set_access(&self, device: DeviceId, _ptr: DevicePtr, _size: u64) -> Result<()> {
        Self::device(&mut lock(&self.state), device).map(|_| ())
    }

    fn phys_export_fd(&self, _: PhysHandle) -> Result<OwnedFd> {
        Err(BackendError::NotSupported(
            "the accounting backend has no memory to share".into(),
        ))
    }

    fn phys_import_fd(&self, _: DeviceId, _: OwnedFd) -> Result<PhysHandle> {
        Err(BackendError::NotSupported(
            "the accounting backend has no memory to share".into(),
        ))
    }

    fn ipc_get_mem_handle(&self, _: DevicePtr) -> Result<IpcMemHandle> {
        Err(BackendError::NotSupported(
            "the accounting backend has no memory to share".into(),
        ))
    }

    fn ipc_open_mem_handle(&self, _: DeviceId, _: &IpcMemHandle) -> Result<DevicePtr> {
        Err(BackendError::NotSupported(
            "the accounting backend has no memory to share".into(),
        ))
    }

    fn ipc_close_mem_handle(&self, _: DevicePtr) -> Result<()> {
        Err(BackendError::NotSupported(
            "the accounting backend has no memory to share".into(),
        ))
    }
}

/// The calls the [`Backend`] trait marks `unsafe` because a GPU reads and writes host memory
/// by address: the accounting backend never touches memory (addresses are numbers to it), so
/// it offers them safe.
impl AccountingBackend {
    /// [`Backend::host_free`], safe here (no memory is touched).
    pub fn host_free(&self, ptr: *mut u8) -> Result<()> {
        let mut state = lock(&self.state);
        let size = state.host.allocs.remove(ptr as u64).ok_or_else(|| {
            BackendError::invalid(format!("host_free of unknown pointer {ptr:?}"))
        })?;
        state.host.used -= size;
        state.counts.host_frees += 1;
        Ok(())
    }

    /// [`Backend::host_register`], safe here (no memory is touched).
    pub fn host_register(&self, ptr: *mut u8, len: u64, _flags: HostRegisterFlags) -> Result<()> {
        let start = ptr as u64;
        if start == 0 || len == 0 || start % HOST_PAGE != 0 || len % HOST_PAGE != 0 {
            return Err(BackendError::invalid(format!(
                "host_register of {len} bytes at {ptr:?}: not a non-empty page-aligned range"
            )));
        }
        if start.checked_add(len).is_none() {
            return Err(BackendError::invalid("host_register range overflows"));
        }
        let mut state = lock(&self.state);
        if HostState::overlaps(&state.host.registered, start, len)
            || HostState::overlaps(state.host.allocs.ranges(), start, len)
        {
            return Err(BackendError::invalid(format!(
                "host_register of {len} bytes at {ptr:?} overlaps pinned memory"
            )));
        }
        if state.host.used + len > self.host_capacity {
            return Err(BackendError::OutOfMemory {
                requested: len,
                what: "pinned host".into(),
            });
        }
        state.host.registered.insert(start, len);
        state.host.used += len;
        state.counts.host_registers += 1;
        Ok(())
    }

    /// [`Backend::host_unregister`], safe here (no memory is touched).
    pub fn host_unregister(&self, ptr: *mut u8) -> Result<()> {
        let mut state = lock(&self.state);
        let len = state.host.registered.remove(&(ptr as u64)).ok_or_else(|| {
            BackendError::invalid(format!(
                "host_unregister of {ptr:?}: not a registered range"
            ))
        })?;
        state.host.used -= len;
        state.counts.host_unregisters += 1;
        Ok(())
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_aligned_lowest_first_and_capacity_is_enforced() {
        let b = AccountingBackend::new(2, 10 << 20);
        let d0 = DeviceId(0);
        let a = b.malloc(d0, 1).unwrap();
        let c = b.malloc(d0, 3 << 20).unwrap();
        assert_eq!(a.0, BASE);
        assert_eq!(c.0, BASE + ALIGNMENT);
        assert_eq!(b.mem_info(d0).unwrap().free, (10 << 20) - (6 << 20));
        assert!(b.malloc(d0, 5 << 20).unwrap_err().is_oom());
        b.free(d0, a).unwrap();
        assert_eq!(b.malloc(d0, 100).unwrap().0, BASE, "lowest gap reused");
        assert_eq!(b.malloc(DeviceId(1), 1).unwrap().0, BASE + WINDOW);
        assert_eq!(b.counts().mallocs, 4);
        assert_eq!(b.counts().failed_mallocs, 1);
    }

    #[test]
    fn bad_input_is_typed() {
        let b = AccountingBackend::new(1, 1 << 30);
        assert!(matches!(
            b.malloc(DeviceId(0), 0),
            Err(BackendError::InvalidValue(_))
        ));
        assert!(matches!(
            b.malloc(DeviceId(0), u64::MAX - 100),
            Err(BackendError::InvalidValue(_))
        ));
        assert!(b.malloc(DeviceId(0), 1 << 62).unwrap_err().is_oom());
        assert!(matches!(
            b.malloc(DeviceId(3), 1),
            Err(BackendError::InvalidDevice(3))
        ));
        assert!(matches!(
            b.free(DeviceId(0), DevicePtr(12)),
            Err(BackendError::InvalidValue(_))
        ));
        assert!(matches!(
            b.unmap(DevicePtr(BASE), ALIGNMENT),
            Err(BackendError::InvalidValue(_))
        ));
    }

    #[test]
    fn manual_events_stay_pending_until_completed_or_synchronized() {
        let b = AccountingBackend::manual_events(1, 1 << 30);
        let s = b.stream_create(DeviceId(0)).unwrap();
        let e = b.event_create(DeviceId(0)).unwrap();
        assert!(b.event_query(e).unwrap(), "never recorded = complete");
        b.event_record(e, s).unwrap();
        assert!(!b.event_query(e).unwrap());
        assert_eq!(b.pending_events(), 1);
        b.complete_event(e);
        assert!(b.event_query(e).unwrap());
        b.event_record(e, s).unwrap();
        b.device_synchronize(DeviceId(0)).unwrap();
        assert!(b.event_query(e).unwrap());
    }

    #[test]
    fn a_free_completes_every_event_unless_told_not_to() {
        for synchronizes in [true, false] {
            let mut b = AccountingBackend::manual_events(1, 1 << 30);
            if !synchronizes {
                b = b.free_does_not_synchronize();
            }
            let s = b.stream_create(DeviceId(0)).unwrap();
            let e = b.event_create(DeviceId(0)).unwrap();
            b.event_record(e, s).unwrap();
            let p = b.malloc(DeviceId(0), 2 << 20).unwrap();
            b.free(DeviceId(0), p).unwrap();
            assert_eq!(b.event_query(e).unwrap(), synchronizes);
        }
    }

    #[test]
    fn host_memory_is_accounted_and_validated() {
        let b = AccountingBackend::new(1, 1 << 30).with_host_capacity(16 * HOST_PAGE);
        let a = b.host_alloc(1).unwrap();
        let c = b.host_alloc(HOST_PAGE + 1).unwrap();
        assert_eq!(a as u64, HOST_BASE);
        assert_eq!(
            c as u64,
            HOST_BASE + HOST_PAGE,
            "4 KiB aligned, lowest first"
        );
        assert_eq!(b.host_used(), 3 * HOST_PAGE);
        assert!(b.host_alloc(14 * HOST_PAGE).unwrap_err().is_oom());
        assert!(matches!(
            b.host_alloc(0),
            Err(BackendError::InvalidValue(_))
        ));
        assert!(matches!(
            b.host_alloc(u64::MAX - 100),
            Err(BackendError::InvalidValue(_))
        ));
        b.host_free(a).unwrap();
        assert!(
            matches!(b.host_free(a), Err(BackendError::InvalidValue(_))),
            "double free"
        );
        assert_eq!(b.host_alloc(10).unwrap(), a, "lowest gap reused");

        let r = 0x10_0000_0000u64 as *mut u8;
        let flags = HostRegisterFlags::default();
        assert!(
            b.host_register(r.wrapping_add(1), HOST_PAGE, flags)
                .is_err(),
            "unaligned ptr"
        );
        assert!(b.host_register(r, 100, flags).is_err(), "unaligned len");
        assert!(
            b.host_register(c, HOST_PAGE, flags).is_err(),
            "overlaps host_alloc"
        );
        b.host_register(r, 4 * HOST_PAGE, flags).unwrap();
        assert!(
            b.host_register(r.wrapping_add(4096), HOST_PAGE, flags)
                .is_err(),
            "overlap"
        );
        assert!(b
            .host_register(r.wrapping_add(4 * 4096), 20 * HOST_PAGE, flags)
            .unwrap_err()
            .is_oom());
        assert_eq!(b.host_used(), 7 * HOST_PAGE);
        assert!(
            b.host_unregister(r.wrapping_add(4096)).is_err(),
            "not a range start"
        );
        b.host_unregister(r).unwrap();
        assert!(b.host_unregister(r).is_err());
        let n = b.counts();
        assert_eq!(
            (
                n.host_allocs,
                n.host_frees,
                n.host_registers,
                n.host_unregisters
            ),
            (3, 1, 1, 1)
        );
    }

    #[test]
    fn place_next_and_vmm_accounting() {
        let b = AccountingBackend::new(1, 8 << 20);
        let d = DeviceId(0);
        b.place_next(d, BASE + 10 * ALIGNMENT);
        assert_eq!(b.malloc(d, 1 << 20).unwrap().0, BASE + 10 * ALIGNMENT);
        let va = b.va_reserve(d, 8 * ALIGNMENT, ALIGNMENT).unwrap();
        assert_eq!(b.reservation_holding(d, va.0), Some(va.0));
        assert_eq!(
            b.reservation_holding(d, va.0 + 8 * ALIGNMENT - 1),
            Some(va.0)
        );
        assert_eq!(b.reservation_holding(d, va.0 + 8 * ALIGNMENT), None);
        assert_eq!(
            b.reservation_holding(d, BASE + 10 * ALIGNMENT),
            None,
            "a malloc"
        );
        let h = b.phys_create(d, ALIGNMENT).unwrap();
        b.map(va, ALIGNMENT, 0, h).unwrap();
        assert!(b.va_free(d, va, 8 * ALIGNMENT).is_err(), "still mapped");
        assert!(b.unmap(va, 2 * ALIGNMENT).is_err(), "more than mapped");
        b.unmap(va, ALIGNMENT).unwrap();
        b.phys_release(h).unwrap();
        b.va_free(d, va, 8 * ALIGNMENT).unwrap();
        assert_eq!(b.reservation_holding(d, va.0), None);
        assert_eq!(b.used(d), 2 << 20);
    }
}
