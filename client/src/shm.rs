//! Record batches through the server's shared memory, for a client on the
//! server's own machine.
//!
//! A `DoGet` that carries the [`REQUEST_HEADER`] header may be answered as
//! usual except that the server writes each record batch into a ring in a
//! shared-memory file, and the stream carries, in its place, a small
//! metadata-only message saying where it lies (the server's
//! `service/shm.rs` describes the protocol; the Python client's `_shm`
//! reads it the same way). [`through_ring`] maps the ring the server
//! announces, copies each batch out into a 64-byte aligned buffer (so that
//! the ring can be used again however long the batch is kept), tells the
//! server how far it has read, and hands the stream on as the `FlightData`
//! the socket would have carried. A stream the server answers without a
//! ring (a server without shared memory, or none to spare, or a caller it
//! does not see as local) passes through as it comes.

#![allow(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};

use arrow::buffer::MutableBuffer;
use arrow_flight::FlightData;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use tonic::Status;

/// The request header that asks for shared memory (any value).
pub const REQUEST_HEADER: &str = "x-flightdeck-shm";
/// `app_metadata` of the message announcing the ring.
pub const ANNOUNCE_TAG: &[u8; 8] = b"FDSHM:A1";
/// `app_metadata` prefix of a batch's descriptor.
pub const BATCH_TAG: &[u8; 8] = b"FDSHM:B1";
/// A ring file's first word, which the reader checks.
pub const MAGIC: &[u8; 8] = b"FDSHM\x001\x00";
/// The header's word the reader sets to 1 once it has mapped the file.
pub const ATTACHED_WORD: usize = 1;
/// The header's word the reader sets to the ring position it has consumed
/// up to.
pub const CONSUMED_WORD: usize = 2;
/// The header's word a reader that keeps batches in the ring (handing out
/// views of it rather than copies, [`FEATURES_WORD`] permitting) sets to 1
/// while it waits for the stream's next message and back to 0 once it has
/// it. A server whose next batch finds the ring full while the reader
/// waits sends the batch over the socket instead: the reader is holding
/// what it was lent and will not make room.
pub const WAITING_WORD: usize = 3;
/// The header's word where the server says what it does beyond the
/// protocol's first version: [`LENDS`], or 0.
pub const FEATURES_WORD: usize = 4;
/// [`FEATURES_WORD`]'s bit saying that the server honours [`WAITING_WORD`],
/// so that a reader may hold batches in the ring without copying them out.
pub const LENDS: u64 = 1;

/// Maps the first `len` bytes of `file` shared, for reading and writing
/// (the server's side and the reader's map a ring alike).
pub fn map_shared(file: &File, len: usize) -> std::io::Result<*mut u8> {
    // SAFETY: a fresh shared mapping of an open file, the kernel choosing
    // the address; the result is checked. (Touching bytes past the file's
    // end would fault: callers map no more than the file holds.)
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if map == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(map.cast())
}

/// Why a stream asked with [`REQUEST_HEADER`] could not be read through the
/// ring.
#[derive(Debug)]
pub enum Attach {
    /// The announced ring cannot be mapped here (another machine's, user's
    /// or container's file): read the ticket again without the header.
    Cannot(String),
    /// The stream failed before its ring (its status, as over the socket).
    Failed(Status),
}

/// `messages`, a `DoGet` stream asked for with [`REQUEST_HEADER`], with its
/// record batches taken out of the ring the server announces after the
/// schema: the same `FlightData` the socket would have carried, each body
/// 64-byte aligned. A stream without an announcement passes through.
pub async fn through_ring(
    mut messages: BoxStream<'static, Result<FlightData, Status>>,
) -> Result<BoxStream<'static, Result<FlightData, Status>>, Attach> {
    let schema = match messages.next().await {
        Some(Ok(schema)) => schema,
        Some(Err(status)) => return Err(Attach::Failed(status)),
        None => return Ok(messages),
    };
    let schema = futures::stream::once(std::future::ready(Ok(schema)));
    // The announcement comes right after the schema, if at all.
    match messages.next().await {
        Some(Ok(m)) if is_announce(&m) => {
            let ring = Ring::attach(&m.app_metadata[ANNOUNCE_TAG.len()..])?;
            let batches = messages.and_then(move |m| {
                let taken = match is_batch(&m) {
                    true => ring.take(&m.app_metadata[BATCH_TAG.len()..]),
                    false => Ok(m),
                };
                std::future::ready(taken)
            });
            Ok(schema.chain(batches).boxed())
        }
        second => Ok(schema
            .chain(futures::stream::iter(second))
            .chain(messages)
            .boxed()),
    }
}

/// Whether `m` is a metadata-only message beginning with `tag`.
fn tagged(m: &FlightData, tag: &[u8; 8]) -> bool {
    m.data_header.is_empty() && m.data_body.is_empty() && m.app_metadata.starts_with(tag)
}

fn is_announce(m: &FlightData) -> bool {
    tagged(m, ANNOUNCE_TAG)
}

fn is_batch(m: &FlightData) -> bool {
    tagged(m, BATCH_TAG)
}

/// Little-endian u64s at the front of `bytes`.
fn words<const N: usize>(bytes: &[u8]) -> Option<[u64; N]> {
    let mut out = [0u64; N];
    for (i, word) in out.iter_mut().enumerate() {
        let at = bytes.get(i * 8..i * 8 + 8)?;
        *word = u64::from_le_bytes(at.try_into().ok()?);
    }
    Some(out)
}

/// A stream's ring, mapped in this process.
#[derive(Debug)]
struct Ring {
    map: *mut u8,
    len: usize,
}

// SAFETY: the mapping is this ring's alone (no other value holds its
// pointer), so moving it to another thread moves its only user here.
unsafe impl Send for Ring {}

impl Ring {
    /// Maps the ring an announcement names (after its tag: the size of the
    /// data part, its offset in the file, then the file's path) and says so
    /// in its header.
    fn attach(announce: &[u8]) -> Result<Self, Attach> {
        let malformed = || {
            Attach::Failed(Status::internal(
                "the server announced a shared-memory ring in a form this client does not read",
            ))
        };
        let [cap, offset] = words::<2>(announce).ok_or_else(malformed)?;
        let path = std::str::from_utf8(&announce[16..]).map_err(|_| malformed())?;
        let len = cap
            .checked_add(offset)
            .and_then(|l| usize::try_from(l).ok())
            .filter(|&l| l >= 4096 && offset >= 24)
            .ok_or_else(malformed)?;
        let cannot = |e: &dyn std::fmt::Display| {
            Attach::Cannot(format!(
                "cannot map the server's shared-memory ring {path}: {e}"
            ))
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| cannot(&e))?;
        if file.metadata().map_err(|e| cannot(&e))?.len() < len as u64 {
            return Err(cannot(&"the file is shorter than announced"));
        }
        let map = map_shared(&file, len).map_err(|e| cannot(&e))?;
        let ring = Self { map, len };
        // SAFETY: the mapping is at least a page long.
        let magic = unsafe { std::slice::from_raw_parts(ring.map, MAGIC.len()) };
        if magic != MAGIC {
            return Err(Attach::Cannot(format!(
                "{path} is not a flightdeck shared-memory ring"
            )));
        }
        ring.word(ATTACHED_WORD).store(1, Ordering::Release);
        Ok(ring)
    }

    /// One of the header's words, which both processes access atomically.
    fn word(&self, index: usize) -> &AtomicU64 {
        // SAFETY: the mapping is page-aligned and at least a page long, so
        // the first words are aligned u64s within it, accessed only
        // atomically (here and by the server).
        unsafe { AtomicU64::from_ptr(self.map.cast::<u64>().add(index)) }
    }

    /// The batch a descriptor names (after its tag: its offset in the file,
    /// its length and the ring position its end reaches), copied out, as
    /// the `FlightData` that would have carried it over the socket.
    fn take(&self, descriptor: &[u8]) -> Result<FlightData, Status> {
        let malformed = |what: &str| {
            Status::internal(format!(
                "the server described a shared-memory batch {what}; read without shared memory \
                 (FLIGHTDECK_SHM=0) and report it"
            ))
        };
        let [offset, len, end] = words::<3>(descriptor)
            .ok_or_else(|| malformed("in a form this client does not read"))?;
        let (Ok(offset), Ok(len)) = (usize::try_from(offset), usize::try_from(len)) else {
            return Err(malformed("outside its ring"));
        };
        if offset < 24 || offset.checked_add(len).is_none_or(|e| e > self.len) || len < 8 {
            return Err(malformed("outside its ring"));
        }
        let mut out = MutableBuffer::with_capacity(len);
        // SAFETY: `offset + len` lies within the mapping (checked above),
        // and the server does not write there until `consumed` passes
        // `end`, which is set after the copy.
        out.extend_from_slice(unsafe { std::slice::from_raw_parts(self.map.add(offset), len) });
        // The copy is done: the server may write there again.
        self.word(CONSUMED_WORD).store(end, Ordering::Release);
        // An encapsulated IPC message: the continuation marker, the
        // header's padded length, the header, then the body.
        let header_len = u32::from_le_bytes([out[4], out[5], out[6], out[7]]) as usize;
        if out[..4] != [0xFF; 4] || 8 + header_len > len {
            return Err(malformed("that is not an Arrow IPC message"));
        }
        let bytes = crate::receive::aligned_bytes(out);
        Ok(FlightData {
            data_header: bytes.slice(8..8 + header_len),
            data_body: bytes.slice(8 + header_len..),
            ..Default::default()
        })
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // SAFETY: `map` and `len` are what `mmap` returned and was given;
        // nothing refers to the mapping after the ring (batches are copies).
        unsafe { libc::munmap(self.map.cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    #[test]
    fn words_read_little_endian_and_refuse_short_input() {
        let mut bytes = 7u64.to_le_bytes().to_vec();
        bytes.extend(9u64.to_le_bytes());
        assert_eq!(words::<2>(&bytes), Some([7, 9]));
        assert_eq!(words::<3>(&bytes), None);
    }

    #[test]
    fn only_metadata_only_messages_with_the_tag_are_the_protocol_s() {
        let meta = |m: &[u8]| FlightData {
            app_metadata: Bytes::copy_from_slice(m),
            ..Default::default()
        };
        assert!(is_announce(&meta(b"FDSHM:A1rest")));
        assert!(is_batch(&meta(b"FDSHM:B1rest")));
        assert!(!is_batch(&meta(b"FDSHM:A1")));
        let mut with_header = meta(b"FDSHM:B1");
        with_header.data_header = Bytes::from_static(b"h");
        assert!(!is_batch(&with_header), "a batch with metadata is a batch");
    }

    #[test]
    fn a_ring_that_is_not_there_cannot_be_attached() {
        let mut announce = (1u64 << 20).to_le_bytes().to_vec();
        announce.extend(4096u64.to_le_bytes());
        announce.extend(b"/nonexistent/flightdeck-0-0");
        assert!(matches!(Ring::attach(&announce), Err(Attach::Cannot(_))));
        assert!(matches!(
            Ring::attach(&announce[..10]),
            Err(Attach::Failed(_))
        ));
    }
}
