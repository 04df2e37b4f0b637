//! `impl Backend for SimBackend`: each call is counted, may be failed by fault injection,
//! is validated, then performed on real memory and charged its modelled latency. The host
//! memory calls are made in `host.rs`, the legacy IPC calls in `ipc.rs`, the virtual memory
//! calls in `vmm.rs`.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use crate::memory::{Region, RegionKind};
use crate::os::{self, Mapping};
use crate::queue::{SimEvent, SimStream};
use crate::{latency, lock, Op, SimBackend};
use gpualloc_runtime::backend::Backend;
use gpualloc_runtime::capture::{CaptureMode, CaptureStatus, GraphExecHandle, GraphHandle};
use gpualloc_runtime::error::{BackendError, Result};
use gpualloc_runtime::release_hooks::{Release, ReleaseHooks};
use gpualloc_runtime::types::{
    DeviceId, DevicePtr, EventHandle, HostFn, HostRegisterFlags, IpcMemHandle, MemInfo, PhysHandle,
    StreamHandle,
};

impl Backend for SimBackend {
    fn name(&self) -> &'static str {
        self.counters.bump(Op::Name);
        "sim"
    }
    /// No device of this backend is ever lost (`device_lost` stays `None`).
    fn lost_watch(&self, _device: DeviceId) -> gpualloc_runtime::LostWatch {
        gpualloc_runtime::LostWatch::Never
    }

    fn device_count(&self) -> Result<u32> {
        self.enter(Op::DeviceCount)?;
        latency::pay(self.latency().query);
        Ok(self.config.devices)
    }

    /// The sim is this process's alone: everything in use on it is this process's.
    fn process_used(&self, device: DeviceId) -> Result<Option<u64>> {
        self.enter(Op::ProcessUsed)?;
        Ok(Some(self.used_on(device)?))
    }

    fn mem_info(&self, device: DeviceId) -> Result<MemInfo> {
        self.enter(Op::MemInfo)?;
        let used = self.used_on(device)?;
        latency::pay(self.latency().query);
        let total = self.config.capacity_per_device;
        Ok(MemInfo {
            free: total.saturating_sub(used),
            total,
        })
    }

    fn malloc(&self, device: DeviceId, size: u64) -> Result<DevicePtr> {
        self.enter(Op::Malloc)?;
        self.check_device(device)?;
        if size == 0 {
            return Err(BackendError::invalid("malloc of 0 bytes"));
        }
        let oom = || BackendError::OutOfMemory {
            requested: size,
            what: device.to_string(),
        };
        if size > self.config.capacity_per_device {
            return Err(oom());
        }
        let rounded = self.page_round(size).ok_or_else(oom)?;
        self.take_capacity(device, rounded).map_err(|_| oom())?;
        let made = os::memfd(rounded, &device.to_string())
            .and_then(|fd| Mapping::shared(&fd, rounded, &device.to_string()).map(|m| (fd, m)));
        let (fd, mapping) = match made {
            Ok(x) => x,
            Err(e) => {
                self.give_capacity(device, rounded);
                return Err(e);
            }
        };
        let addr = mapping.addr();
        let region = Region {
            len: rounded,
            kind: RegionKind::Device,
            device: Some(device),
            accessible: true,
            read_only: false,
            _mapping: Some(mapping),
            fd: Some(fd),
        };
        if let Err(e) = self.mem.insert(addr, region) {
            self.give_capacity(device, rounded);
            return Err(e);
        }
        latency::pay(self.latency().malloc);
        Ok(DevicePtr(addr))
    }

    fn free(&self, device: DeviceId, ptr: DevicePtr) -> Result<()> {
        self.enter(Op::Free)?;
        self.check_allocation_of(device, ptr)?;
        let release = Release::Free {
            device,
            addr: ptr.0,
        };
        // cuMemFree semantics: the device is synchronized first, before the release hooks,
        // so a hook's deregistration never runs under work still using the memory.
        self.drain_device(device);
        self.release_hooks
            .around(release, || self.free_region(device, ptr))
    }

    fn release_hooks(&self) -> Option<&ReleaseHooks> {
        Some(&self.release_hooks)
    }

    fn mem_address_range(&self, ptr: DevicePtr) -> Result<(DevicePtr, u64)> {
        self.enter(Op::MemAddressRange)?;
        self.mem
            .find_containing(ptr.0, |start, r| {
                matches!(r.kind, RegionKind::Device | RegionKind::IpcOpened)
                    .then_some((DevicePtr(start), r.len))
            })
            .flatten()
            .ok_or_else(|| BackendError::invalid(format!("{ptr} is not in a device allocation")))
    }

    fn device_synchronize(&self, device: DeviceId) -> Result<()> {
        self.enter(Op::DeviceSynchronize)?;
        self.check_device(device)?;
        let streams = self.device_streams(device);
        for s in &streams {
            s.drain();
        }
        match streams.iter().find_map(|s| s.peek_error()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn stream_create(&self, device: DeviceId) -> Result<StreamHandle> {
        self.enter(Op::StreamCreate)?;
        self.check_device(device)?;
        let raw = self.next_id();
        let stream = SimStream::spawn(device, raw, self.failures.clone())?;
        lock(&self.streams).insert(raw, stream);
        latency::pay(self.latency().stream);
        Ok(StreamHandle { device, raw })
    }

    fn stream_destroy(&self, stream: StreamHandle) -> Result<()> {
        self.enter(Op::StreamDestroy)?;
        let s = {
            let mut streams = lock(&self.streams);
            match streams.get(&stream.raw) {
                Some(s) if s.shared.device == stream.device => {}
                _ => return Err(self.unknown_handle(format!("unknown stream {stream:?}"))),
            }
            streams.remove(&stream.raw)
        };
        self.captures.stream_destroyed(stream.raw);
        // `cuStreamDestroy` returns at once: the work queued so far still runs, and
        // device-wide synchronizations wait for it.
        if let Some(s) = s {
            self.retire_stream(s);
        }
        latency::pay(self.latency().stream);
        Ok(())
    }

    fn stream_synchronize(&self, stream: StreamHandle) -> Result<()> {
        self.enter(Op::StreamSynchronize)?;
        let (shared, _tx) = self.stream(stream)?;
        drop(_tx);
        self.captures.check_stream_sync(shared.raw)?;
        shared.synchronize()
    }

    fn stream_query(&self, stream: StreamHandle) -> Result<bool> {
        self.enter(Op::StreamQuery)?;
        self.stream(stream)?;
        self.captures.check_stream_sync(stream.raw)?;
        self.stream_idle(stream)
    }

    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()> {
        self.enter(Op::StreamWaitEvent)?;
        let (shared, tx) = self.stream(stream)?;
        let ev = self.event(event)?;
        if let Some(captured) = self
            .captures
            .wait_event(shared.device, shared.raw, event.raw)
        {
            return captured;
        }
        let seq = ev.last();
        if let Some((other, task)) = ev.last_at() {
            if other != shared.raw {
                shared.wait_for(other, task);
            }
        }
        latency::pay(self.latency().event);
        if ev.reached(seq) {
            return Ok(());
        }
        shared.enqueue(
            &tx,
            Box::new(move || {
                ev.wait(seq);
                Ok(())
            }),
        )
    }

    fn unordered_users(
        &self,
        stream: StreamHandle,
        ptr: DevicePtr,
        len: u64,
    ) -> Result<Option<Vec<StreamHandle>>> {
        self.enter(Op::UnorderedUsers)?;
        let (shared, _tx) = self.stream(stream)?;
        let end = ptr.0.saturating_add(len);
        let others: Vec<Arc<crate::queue::StreamShared>> = self
            .device_streams(shared.device)
            .into_iter()
            .filter(|s| s.raw != shared.raw)
            .collect();
        let mut users: Vec<StreamHandle> = others
            .iter()
            .filter(|o| o.touches_pending(ptr.0, end, shared.waits_for(o.raw)))
            .map(|o| StreamHandle {
                device: o.device,
                raw: o.raw,
            })
            .collect();
        users.sort_by_key(|h| h.raw);
        Ok(Some(users))
    }

    fn launch_host_func(&self, stream: StreamHandle, f: HostFn) -> Result<()> {
        self.enter(Op::LaunchHostFunc)?;
        let (shared, tx) = self.stream(stream)?;
        if self.captures.status(shared.raw).is_capturing() {
            return Err(BackendError::NotSupported(
                "a host function on a capturing stream (the sim's host functions run once)".into(),
            ));
        }
        latency::pay(self.latency().launch);
        shared.enqueue(
            &tx,
            Box::new(move || {
                f(Ok(()));
                Ok(())
            }),
        )
    }

    unsafe fn memcpy_async(
        &self,
        stream: StreamHandle,
        dst: u64,
        src: u64,
        len: u64,
    ) -> Result<()> {
        SimBackend::memcpy_async(self, stream, dst, src, len)
    }

    fn memset_async(
        &self,
        stream: StreamHandle,
        dst: DevicePtr,
        value: u8,
        len: u64,
    ) -> Result<()> {
        self.enter(Op::MemsetAsync)?;
        let (shared, tx) = self.stream(stream)?;
        if len == 0 {
            return Ok(());
        }
        self.mem.validate_write(dst.0, len)?;
        let mem = self.mem.clone();
        latency::pay(self.latency().launch);
        let touches = [(dst.0, len)];
        self.enqueue_timed(&shared, &tx, len, &touches, move || {
            mem.fill(dst.0, len, value)
        })
    }

    fn copy_to_device(&self, stream: StreamHandle, dst: DevicePtr, src: &[u8]) -> Result<()> {
        self.enter(Op::CopyToDevice)?;
        let (shared, tx) = self.stream(stream)?;
        let len = src.len() as u64;
        if len == 0 {
            return Ok(());
        }
        self.mem.validate_write(dst.0, len)?;
        let data = src.to_vec();
        let mem = self.mem.clone();
        self.run_timed(&shared, tx, len, move || mem.write(dst.0, &data))
    }

    fn copy_from_device(&self, stream: StreamHandle, dst: &mut [u8], src: DevicePtr) -> Result<()> {
        self.enter(Op::CopyFromDevice)?;
        let (shared, tx) = self.stream(stream)?;
        let len = dst.len() as u64;
        if len == 0 {
            return Ok(());
        }
        self.mem.validate(src.0, len)?;
        let mem = self.mem.clone();
        let bytes = self.run_timed(&shared, tx, len, move || mem.read(src.0, len))?;
        dst.copy_from_slice(&bytes);
        Ok(())
    }

    fn event_create(&self, device: DeviceId) -> Result<EventHandle> {
        self.enter(Op::EventCreate)?;
        self.check_device(device)?;
        let raw = self.next_id();
        lock(&self.events).insert(raw, Arc::new(SimEvent::new(device)));
        latency::pay(self.latency().event);
        Ok(EventHandle { device, raw })
    }

    fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<()> {
        self.enter(Op::EventRecord)?;
        let ev = self.event(event)?;
        let (shared, tx) = self.stream(stream)?;
        if ev.device != shared.device {
            return Err(BackendError::invalid(format!(
                "event of {} recorded on a stream of {}",
                ev.device, shared.device
            )));
        }
        if let Some(captured) = self.captures.record_event(event.raw, shared.raw) {
            return captured;
        }
        let seq = ev.begin_record();
        let completer = ev.clone();
        latency::pay(self.latency().event);
        let queued = shared.enqueue_touching(
            &tx,
            Box::new(move || {
                completer.complete(seq);
                Ok(())
            }),
            &[],
        );
        match queued {
            Ok(task) => {
                ev.placed(seq, shared.raw, task);
                Ok(())
            }
            Err(e) => {
                ev.complete(seq);
                Err(e)
            }
        }
    }

    fn event_query(&self, event: EventHandle) -> Result<bool> {
        let ev = self.enter_event(Op::EventQuery, event)?;
        latency::pay(self.latency().event);
        Ok(ev.reached(ev.last()))
    }

    fn event_synchronize(&self, event: EventHandle) -> Result<()> {
        let ev = self.enter_event(Op::EventSynchronize, event)?;
        ev.wait(ev.last());
        Ok(())
    }

    fn event_destroy(&self, event: EventHandle) -> Result<()> {
        self.enter(Op::EventDestroy)?;
        let mut events = lock(&self.events);
        match events.get(&event.raw) {
            Some(e) if e.device == event.device => {}
            _ => return Err(self.unknown_handle(format!("unknown event {event:?}"))),
        }
        // Pending records keep their own reference and still complete.
        events.remove(&event.raw);
        drop(events);
        self.captures.event_destroyed(event.raw);
        latency::pay(self.latency().event);
        Ok(())
    }

    fn stream_begin_capture(&self, stream: StreamHandle, mode: CaptureMode) -> Result<()> {
        self.enter(Op::StreamBeginCapture)?;
        let (shared, _tx) = self.stream(stream)?;
        self.captures.begin(shared.device, shared.raw, mode)
    }

    fn stream_end_capture(&self, stream: StreamHandle) -> Result<GraphHandle> {
        self.enter(Op::StreamEndCapture)?;
        let (shared, _tx) = self.stream(stream)?;
        let raw = self.captures.end(shared.raw)?;
        Ok(GraphHandle {
            device: shared.device,
            raw,
        })
    }

    fn stream_capture_status(&self, stream: StreamHandle) -> Result<CaptureStatus> {
        self.enter(Op::StreamCaptureStatus)?;
        let (shared, _tx) = self.stream(stream)?;
        Ok(self.captures.status(shared.raw))
    }

    fn capture_may_be_underway(&self) -> bool {
        self.captures.any()
    }

    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode> {
        self.enter(Op::ExchangeCaptureMode)?;
        Ok(crate::capture::exchange_thread_mode(mode))
    }

    fn graph_instantiate(&self, graph: GraphHandle) -> Result<GraphExecHandle> {
        self.enter(Op::GraphInstantiate)?;
        self.check_device(graph.device)?;
        let raw = self.captures.instantiate(graph.device, graph.raw)?;
        Ok(GraphExecHandle {
            device: graph.device,
            raw,
        })
    }

    fn graph_launch(&self, exec: GraphExecHandle, stream: StreamHandle) -> Result<()> {
        self.enter(Op::GraphLaunch)?;
        let (shared, tx) = self.stream(stream)?;
        let graph = self.captures.exec(shared.device, exec.raw)?;
        latency::pay(self.latency().launch);
        let touches = graph.touches();
        self.submit(&shared, &tx, &touches, move || graph.run())
    }

    fn graph_destroy(&self, graph: GraphHandle) -> Result<()> {
        self.enter(Op::GraphDestroy)?;
        self.captures.destroy_graph(graph.device, graph.raw)
    }

    fn graph_exec_destroy(&self, exec: GraphExecHandle) -> Result<()> {
        self.enter(Op::GraphExecDestroy)?;
        self.captures.destroy_exec(exec.device, exec.raw)
    }

    fn host_alloc(&self, size: u64) -> Result<*mut u8> {
        self.pinned_alloc(size)
    }

    unsafe fn host_free(&self, ptr: *mut u8) -> Result<()> {
        SimBackend::host_free(self, ptr)
    }

    unsafe fn host_register(&self, ptr: *mut u8, len: u64, flags: HostRegisterFlags) -> Result<()> {
        self.register_range(ptr, len, flags)
    }

    unsafe fn host_unregister(&self, ptr: *mut u8) -> Result<()> {
        SimBackend::host_unregister(self, ptr)
    }

    fn vmm_granularity(&self, device: DeviceId) -> Result<u64> {
        self.enter(Op::VmmGranularity)?;
        self.check_device(device)?;
        Ok(self.config.granularity)
    }

    fn va_reserve(&self, device: DeviceId, size: u64, alignment: u64) -> Result<DevicePtr> {
        self.enter(Op::VaReserve)?;
        self.vmm_reserve(device, size, alignment)
    }

    fn va_free(&self, device: DeviceId, ptr: DevicePtr, size: u64) -> Result<()> {
        self.enter(Op::VaFree)?;
        self.vmm_va_free(device, ptr, size)
    }

    fn phys_create(&self, device: DeviceId, size: u64) -> Result<PhysHandle> {
        self.enter(Op::PhysCreate)?;
        self.vmm_phys_create(device, size)
    }

    fn phys_release(&self, handle: PhysHandle) -> Result<()> {
        self.enter(Op::PhysRelease)?;
        self.vmm_phys_release(handle)
    }

    fn map(&self, ptr: DevicePtr, size: u64, offset: u64, handle: PhysHandle) -> Result<()> {
        self.enter(Op::Map)?;
        self.vmm_map(ptr, size, offset, handle)
    }

    fn unmap(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        self.enter(Op::Unmap)?;
        let release = Release::Unmap { addr: ptr.0, size };
        self.release_hooks
            .around(release, || self.vmm_unmap(ptr, size))
    }

    fn set_access(&self, device: DeviceId, ptr: DevicePtr, size: u64) -> Result<()> {
        self.enter(Op::SetAccess)?;
        self.vmm_set_access(device, ptr, size)
    }

    fn phys_export_fd(&self, handle: PhysHandle) -> Result<OwnedFd> {
        self.enter(Op::PhysExportFd)?;
        self.vmm_export(handle)
    }

    fn phys_import_fd(&self, device: DeviceId, fd: OwnedFd) -> Result<PhysHandle> {
        self.enter(Op::PhysImportFd)?;
        self.vmm_import(device, fd)
    }

    fn ipc_get_mem_handle(&self, ptr: DevicePtr) -> Result<IpcMemHandle> {
        self.ipc_export(ptr)
    }

    fn ipc_open_mem_handle(&self, device: DeviceId, handle: &IpcMemHandle) -> Result<DevicePtr> {
        self.ipc_open(device, handle)
    }

    fn ipc_close_mem_handle(&self, ptr: DevicePtr) -> Result<()> {
        self.ipc_close(ptr)
    }
}
