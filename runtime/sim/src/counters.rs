//! Counters of every backend call the sim receives ([`Op`], [`CallCounts`]).

use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! ops {
    ($($variant:ident => $name:literal),* $(,)?) => {
        /// One backend operation: a variant per [`Backend`](gpualloc_runtime::Backend) method, plus the
        /// sim-only kernel launch.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum Op {
            $(
                #[doc = concat!("`", $name, "`")]
                $variant,
            )*
        }

        impl Op {
            /// Every operation, in declaration order.
            pub const ALL: &'static [Op] = &[$(Op::$variant),*];

            /// The method's name, e.g. `"malloc"`.
            pub fn name(self) -> &'static str {
                match self {
                    $(Op::$variant => $name,)*
                }
            }
        }
    };
}

ops! {
    Name => "name",
    DeviceCount => "device_count",
    MemInfo => "mem_info",
    ProcessUsed => "process_used",
    Malloc => "malloc",
    Free => "free",
    MemAddressRange => "mem_address_range",
    DeviceSynchronize => "device_synchronize",
    StreamCreate => "stream_create",
    StreamDestroy => "stream_destroy",
    StreamSynchronize => "stream_synchronize",
    StreamQuery => "stream_query",
    StreamWaitEvent => "stream_wait_event",
    UnorderedUsers => "unordered_users",
    LaunchHostFunc => "launch_host_func",
    MemcpyAsync => "memcpy_async",
    MemsetAsync => "memset_async",
    CopyToDevice => "copy_to_device",
    CopyFromDevice => "copy_from_device",
    EventCreate => "event_create",
    EventRecord => "event_record",
    EventQuery => "event_query",
    EventSynchronize => "event_synchronize",
    EventDestroy => "event_destroy",
    HostAlloc => "host_alloc",
    HostFree => "host_free",
    HostRegister => "host_register",
    HostUnregister => "host_unregister",
    VmmGranularity => "vmm_granularity",
    VaReserve => "va_reserve",
    VaFree => "va_free",
    PhysCreate => "phys_create",
    PhysRelease => "phys_release",
    Map => "map",
    Unmap => "unmap",
    SetAccess => "set_access",
    PhysExportFd => "phys_export_fd",
    PhysImportFd => "phys_import_fd",
    IpcGetMemHandle => "ipc_get_mem_handle",
    IpcOpenMemHandle => "ipc_open_mem_handle",
    IpcCloseMemHandle => "ipc_close_mem_handle",
    LaunchKernel => "launch_kernel",
    StreamBeginCapture => "stream_begin_capture",
    StreamEndCapture => "stream_end_capture",
    StreamCaptureStatus => "stream_capture_status",
    ExchangeCaptureMode => "exchange_capture_mode",
    GraphInstantiate => "graph_instantiate",
    GraphLaunch => "graph_launch",
    GraphDestroy => "graph_destroy",
    GraphExecDestroy => "graph_exec_destroy",
}

impl Op {
    /// True for a call the driver counts as potentially unsafe during a stream capture
    /// (allocating, freeing or mapping memory, synchronizing, querying completion, and
    /// synchronous copies): refused while the calling thread's capture mode guards against a
    /// capture under way (`capture.rs`).
    pub fn is_capture_unsafe(self) -> bool {
        matches!(
            self,
            Op::Malloc
                | Op::Free
                | Op::DeviceSynchronize
                | Op::StreamSynchronize
                | Op::StreamQuery
                | Op::EventQuery
                | Op::EventSynchronize
                | Op::CopyToDevice
                | Op::CopyFromDevice
                | Op::HostAlloc
                | Op::HostFree
                | Op::HostRegister
                | Op::HostUnregister
                | Op::VaReserve
                | Op::VaFree
                | Op::PhysCreate
                | Op::PhysRelease
                | Op::Map
                | Op::Unmap
                | Op::SetAccess
                | Op::IpcOpenMemHandle
                | Op::IpcCloseMemHandle
        )
    }
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A snapshot of the call counters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallCounts {
    counts: Vec<u64>,
}

impl CallCounts {
    /// Calls of `op` (successful or not) since creation or the last reset.
    pub fn get(&self, op: Op) -> u64 {
        self.counts.get(op as usize).copied().unwrap_or(0)
    }

    /// Calls of all operations together.
    pub fn total(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// The operations called since `earlier` (a snapshot of the same counters taken before),
    /// with how many times: what a stretch of work cost.
    pub fn since(&self, earlier: &CallCounts) -> Vec<(Op, u64)> {
        Op::ALL
            .iter()
            .map(|op| (*op, self.get(*op).saturating_sub(earlier.get(*op))))
            .filter(|(_, n)| *n > 0)
            .collect()
    }

    /// The operations called at least once, with their counts.
    pub fn nonzero(&self) -> Vec<(Op, u64)> {
        Op::ALL
            .iter()
            .map(|op| (*op, self.get(*op)))
            .filter(|(_, n)| *n > 0)
            .collect()
    }
}

/// The live counters.
#[derive(Debug)]
pub(crate) struct Counters {
    counts: Vec<AtomicU64>,
}

impl Default for Counters {
    fn default() -> Self {
        Counters {
            counts: Op::ALL.iter().map(|_| AtomicU64::new(0)).collect(),
        }
    }
}

impl Counters {
    pub(crate) fn bump(&self, op: Op) {
        if let Some(c) = self.counts.get(op as usize) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(crate) fn snapshot(&self) -> CallCounts {
        CallCounts {
            counts: self
                .counts
                .iter()
                .map(|c| c.load(Ordering::Relaxed))
                .collect(),
        }
    }

    pub(crate) fn reset(&self) {
        for c in &self.counts {
            c.store(0, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ops_index_their_counters() {
        let c = Counters::default();
        c.bump(Op::Malloc);
        c.bump(Op::Malloc);
        c.bump(Op::LaunchKernel);
        let s = c.snapshot();
        assert_eq!(s.get(Op::Malloc), 2);
        assert_eq!(s.get(Op::LaunchKernel), 1);
        assert_eq!(s.get(Op::Free), 0);
        assert_eq!(s.total(), 3);
        assert_eq!(s.nonzero(), vec![(Op::Malloc, 2), (Op::LaunchKernel, 1)]);
        assert_eq!(Op::ALL.len(), 50);
        assert_eq!(Op::IpcCloseMemHandle.name(), "ipc_close_mem_handle");
        c.reset();
        assert_eq!(c.snapshot().total(), 0);
    }
}
