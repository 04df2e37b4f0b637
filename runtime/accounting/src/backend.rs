//! The [`Backend`] trait on the accounting backend: addresses and byte counts, no memory.

use super::*;

impl Backend for AccountingBackend {
    fn name(&self) -> &'static str {
        "accounting"
    }
    /// No device of this backend is ever lost (`device_lost` stays `None`).
    fn lost_watch(&self, _device: DeviceId) -> gpualloc_runtime::LostWatch {
        gpualloc_runtime::LostWatch::Never
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
