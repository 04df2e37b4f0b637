//! fd passing over Unix domain sockets with SCM_RIGHTS: one `sendmsg`/`recvmsg` step at a
//! time, so the same code serves blocking sockets and tokio's readiness loop. The sender
//! keeps its fds (the kernel installs new ones in the receiver, the seed's flow); received
//! fds are close-on-exec and owned by the receiver.

use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

use crate::frame::{FrameReader, MAX_FDS};

/// One `recvmsg` into `reader`'s buffer, handing it any fds that came along. Returns the
/// bytes read (0 at EOF); `WouldBlock` on a non-blocking socket with nothing to read.
pub fn recv_step(sock: BorrowedFd<'_>, reader: &mut FrameReader) -> io::Result<usize> {
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let (n, truncated) = {
        let buf = reader.buffer();
        let mut iov = [IoSliceMut::new(buf)];
        let msg = rustix::net::recvmsg(sock, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC)?;
        (msg.bytes, msg.flags.contains(ReturnFlags::CTRUNC))
    };
    let mut fds: Vec<OwnedFd> = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(it) = m {
            fds.extend(it);
        }
    }
    reader.push_fds(fds, truncated);
    Ok(n)
}

/// One `sendmsg` of `bytes[sent..]`, with `fds` attached when `sent == 0` (they ride on the
/// frame's first byte). Returns the bytes sent.
pub fn send_step(
    sock: BorrowedFd<'_>,
    bytes: &[u8],
    sent: usize,
    fds: &[BorrowedFd<'_>],
) -> io::Result<usize> {
    let rest = bytes.get(sent..).unwrap_or(&[]);
    let iov = [IoSlice::new(rest)];
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if sent == 0 && !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "too many fds for one message",
        ));
    }
    let n = rustix::net::sendmsg(sock, &iov, &mut control, SendFlags::NOSIGNAL)?;
    Ok(n)
}
