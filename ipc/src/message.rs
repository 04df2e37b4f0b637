//! The messages of the protocol (the body of a [`crate::frame`]), and how many fds each
//! carries. Exporter → importer: [`Message::Hello`] (once, with the reference-count file),
//! [`Message::Host`] (shared host memory), [`Message::Device`] (a device buffer).
//! Importer → exporter: [`Message::Released`] (a nudge; the shared counter is the truth).

use serde::{Deserialize, Serialize};

/// One protocol message. Fds travel beside it (SCM_RIGHTS), in the order documented per
/// variant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Message {
    /// First message of a connection. Fds: the reference-count file.
    Hello {
        /// Exporter's pid (for logs).
        pid: u32,
        /// Slots in the reference-count file.
        slots: u32,
    },
    /// Shared host memory. Fds: the memory object.
    Host {
        /// Bytes the importer should map (checked against fstat on arrival).
        len: u64,
        /// The exporter's label for it (free for applications).
        tag: u64,
    },
    /// A device buffer. Fds: none for legacy memory, one per chunk for VMM memory.
    Device(DeviceOffer),
    /// The importer released export `id` (its counter slot is already decremented).
    Released {
        /// The export.
        id: u64,
    },
}

impl Message {
    /// Number of fds that must travel with this message.
    pub fn fd_count(&self) -> usize {
        match self {
            Message::Hello { .. } | Message::Host { .. } => 1,
            Message::Device(offer) => match &offer.memory {
                OfferedMemory::Legacy { .. } => 0,
                OfferedMemory::Vmm { chunks, .. } => chunks.len(),
            },
            Message::Released { .. } => 0,
        }
    }

    /// Short name for errors.
    pub fn name(&self) -> &'static str {
        match self {
            Message::Hello { .. } => "hello",
            Message::Host { .. } => "host",
            Message::Device(_) => "device",
            Message::Released { .. } => "released",
        }
    }
}

/// A device buffer on offer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceOffer {
    /// The export's id on this connection.
    pub id: u64,
    /// Its slot in the reference-count file.
    pub slot: u32,
    /// Device ordinal the importer should open it on.
    pub device: u32,
    /// Bytes of the buffer.
    pub len: u64,
    /// What the importer must wait for before reading.
    pub ready: Readiness,
    /// Where the memory comes from.
    pub memory: OfferedMemory,
}

/// How the importer's work is ordered after the exporter's writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Readiness {
    /// The exporter synchronized its producing stream before sending: nothing to wait for.
    /// (The `Backend` trait has no inter-process event handles yet; when it gets them, an
    /// `Event` variant carrying one goes here and the importer's stream waits on it.)
    Synchronized,
}

/// The memory of an offered device buffer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum OfferedMemory {
    /// An ordinary segment: a legacy IPC handle of the whole segment plus the buffer's
    /// offset in it (as PyTorch does).
    Legacy {
        /// The 64-byte `IpcMemHandle`.
        handle: Vec<u8>,
        /// Buffer start minus segment start.
        offset: u64,
    },
    /// An expandable (VMM) segment: physical handles (one fd each) mapped at offsets of a
    /// fresh reservation of `span` bytes; the buffer starts `offset` bytes into it.
    Vmm {
        /// Bytes to reserve (the chunks' extent).
        span: u64,
        /// Buffer start inside the reservation.
        offset: u64,
        /// The chunks, in fd order.
        chunks: Vec<WireChunk>,
    },
}

/// One mapped piece of a VMM buffer, as it travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WireChunk {
    /// The exporter's name for the physical handle (its raw value): two offers naming the
    /// same handles in the same layout are mapped once by the importer, which counts their
    /// users. A lying exporter can only make the importer reuse a mapping of memory the
    /// exporter sent it before, with the sizes checked against that mapping.
    pub handle: u64,
    /// Where it is mapped, from the start of the reservation.
    pub va_offset: u64,
    /// Bytes mapped.
    pub size: u64,
    /// Offset into the physical handle.
    pub handle_offset: u64,
}
