//! The wire format: a 16-byte header (magic `GPAI`, version, fd count, body length, zero)
//! and a JSON body (a [`Message`]). Fds travel as SCM_RIGHTS with the header's bytes.
//! [`FrameReader`] assembles one frame from any number of reads; every malformed input
//! (wrong magic or version, a body too long, bad JSON, the wrong number of fds, EOF in the
//! middle) is a typed [`IpcError`], never a panic.

use std::os::fd::OwnedFd;

use crate::error::{IpcError, Result};
use crate::message::Message;

/// First four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"GPAI";
/// Protocol version this crate speaks (2: VMM chunks name their physical handle).
pub const VERSION: u16 = 2;
/// Header bytes.
pub const HEADER_LEN: usize = 16;
/// Largest body accepted.
pub const MAX_BODY: usize = 64 * 1024;
/// Most fds one frame may carry.
pub const MAX_FDS: usize = 16;

/// Encodes `msg` (header and body).
pub fn encode(msg: &Message) -> Result<Vec<u8>> {
    let body = serde_json::to_vec(msg).map_err(|e| IpcError::Malformed(e.to_string()))?;
    let nfds = msg.fd_count();
    if nfds > MAX_FDS {
        return Err(IpcError::TooManyFds(nfds));
    }
    if body.len() > MAX_BODY {
        return Err(IpcError::Malformed(format!("body of {} bytes", body.len())));
    }
    let mut out = Vec::with_capacity(HEADER_LEN + body.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(nfds as u16).to_le_bytes());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// A decoded header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Header {
    nfds: usize,
    body_len: usize,
}

fn decode_header(h: &[u8; HEADER_LEN]) -> Result<Header> {
    if h[0..4] != MAGIC {
        return Err(IpcError::Malformed(format!("bad magic {:02x?}", &h[0..4])));
    }
    let version = u16::from_le_bytes([h[4], h[5]]);
    if version != VERSION {
        return Err(IpcError::Version {
            got: version,
            expected: VERSION,
        });
    }
    let nfds = u16::from_le_bytes([h[6], h[7]]) as usize;
    let body_len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]) as usize;
    if h[12..16] != [0; 4] {
        return Err(IpcError::Malformed(
            "reserved header bytes are not zero".into(),
        ));
    }
    if nfds > MAX_FDS {
        return Err(IpcError::TooManyFds(nfds));
    }
    if body_len == 0 || body_len > MAX_BODY {
        return Err(IpcError::Malformed(format!("body length {body_len}")));
    }
    Ok(Header { nfds, body_len })
}

/// A received frame: the message and the fds that came with it (now owned by this process).
#[derive(Debug)]
pub struct Frame {
    /// The message.
    pub message: Message,
    /// Its fds, in order.
    pub fds: Vec<OwnedFd>,
}

/// Assembles one frame from reads. Call [`FrameReader::buffer`] for where the next read
/// goes, hand the fds of that read to [`FrameReader::push_fds`], then
/// [`FrameReader::advance`] by the bytes read.
#[derive(Debug, Default)]
pub struct FrameReader {
    header: [u8; HEADER_LEN],
    got: usize,
    parsed: Option<Header>,
    body: Vec<u8>,
    fds: Vec<OwnedFd>,
    fd_overflow: bool,
}

impl FrameReader {
    /// A reader at the start of a frame.
    pub fn new() -> Self {
        FrameReader::default()
    }

    /// Where the next bytes go (never empty until a frame is complete).
    pub fn buffer(&mut self) -> &mut [u8] {
        match self.parsed {
            None => &mut self.header[self.got..],
            Some(h) => {
                let at = self.got - HEADER_LEN;
                &mut self.body[at..h.body_len]
            }
        }
    }

    /// Fds that arrived with the last read. `truncated` is the kernel's `MSG_CTRUNC`.
    pub fn push_fds(&mut self, fds: impl IntoIterator<Item = OwnedFd>, truncated: bool) {
        self.fds.extend(fds);
        self.fd_overflow |= truncated;
    }

    /// Accounts for `n` bytes read into [`FrameReader::buffer`]. `n == 0` is EOF:
    /// [`IpcError::Closed`] between frames, [`IpcError::Truncated`] inside one. Returns the
    /// frame once complete (and resets for the next).
    pub fn advance(&mut self, n: usize) -> Result<Option<Frame>> {
        if n == 0 {
            return Err(if self.got == 0 && self.fds.is_empty() {
                IpcError::Closed
            } else {
                IpcError::Truncated {
                    got: self.got,
                    expected: HEADER_LEN + self.parsed.map_or(0, |h| h.body_len),
                }
            });
        }
        self.got += n;
        if self.parsed.is_none() && self.got == HEADER_LEN {
            let h = decode_header(&self.header)?;
            self.body = vec![0; h.body_len];
            self.parsed = Some(h);
            return Ok(None);
        }
        match self.parsed {
            Some(h) if self.got == HEADER_LEN + h.body_len => {
                let frame = self.finish(h);
                *self = FrameReader::default();
                frame.map(Some)
            }
            _ => Ok(None),
        }
    }

    fn finish(&mut self, h: Header) -> Result<Frame> {
        if self.fd_overflow {
            return Err(IpcError::TooManyFds(self.fds.len()));
        }
        if self.fds.len() != h.nfds {
            return Err(IpcError::FdCount {
                got: self.fds.len(),
                expected: h.nfds,
            });
        }
        let message: Message = serde_json::from_slice(&self.body)
            .map_err(|e| IpcError::Malformed(format!("bad body: {e}")))?;
        if message.fd_count() != h.nfds {
            return Err(IpcError::FdCount {
                got: h.nfds,
                expected: message.fd_count(),
            });
        }
        Ok(Frame {
            message,
            fds: std::mem::take(&mut self.fds),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(bytes: &[u8], chunk: usize) -> Result<Option<Frame>> {
        let mut r = FrameReader::new();
        let mut at = 0;
        loop {
            let buf = r.buffer();
            let n = buf.len().min(chunk).min(bytes.len() - at);
            buf[..n].copy_from_slice(&bytes[at..at + n]);
            at += n;
            if let Some(f) = r.advance(n)? {
                return Ok(Some(f));
            }
        }
    }

    #[test]
    fn round_trips_in_any_chunking() {
        let msg = Message::Released { id: 42 };
        let bytes = encode(&msg).unwrap();
        for chunk in [1, 3, 16, 1000] {
            let f = feed(&bytes, chunk).unwrap().unwrap();
            assert_eq!(f.message, msg);
        }
    }

    #[test]
    fn rejects_truncated_garbage_and_wrong_versions() {
        let bytes = encode(&Message::Released { id: 1 }).unwrap();
        match feed(&bytes[..bytes.len() - 2], 1000) {
            Err(IpcError::Truncated { got, expected }) => {
                assert_eq!((got, expected), (bytes.len() - 2, bytes.len()))
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(feed(&[], 10), Err(IpcError::Closed)));
        assert!(matches!(
            feed(b"GARBAGE-GARBAGE-GARBAGE", 100),
            Err(IpcError::Malformed(_))
        ));
        let mut v = bytes.clone();
        v[4] = 9;
        assert!(matches!(
            feed(&v, 100),
            Err(IpcError::Version {
                got: 9,
                expected: VERSION
            })
        ));
        let mut v = bytes.clone();
        v[HEADER_LEN] = b'#';
        assert!(matches!(feed(&v, 100), Err(IpcError::Malformed(_))));
        let mut v = bytes.clone();
        v[6] = 1; // announces an fd that never comes
        assert!(matches!(
            feed(&v, 100),
            Err(IpcError::FdCount {
                got: 0,
                expected: 1
            })
        ));
        let mut v = bytes;
        v[8..12].copy_from_slice(&(10u32 << 20).to_le_bytes());
        assert!(matches!(feed(&v, 100), Err(IpcError::Malformed(_))));
    }
}
