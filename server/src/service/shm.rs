//! A local reader's record batches through shared memory instead of the
//! socket.
//!
//! A reader on the server's own machine (loopback or the Unix socket) that
//! asks for it with the [`REQUEST_HEADER`] header gets its `DoGet` stream as
//! usual — the schema first, every message in order, the status at the end
//! — except that record batches are written into a ring in a file of the
//! server's shared-memory folder (`--shm-dir`, `/dev/shm` by default), and
//! the stream carries, in their place, metadata-only messages saying where
//! each one lies. Neither side's network stack touches those bytes: the
//! server copies a gathered batch into the ring once, the reader copies it
//! out once (so that the ring can be used again however long the reader
//! keeps the batch) or reads it in place, and nothing else is copied.
//!
//! The stream first announces the ring ([`announce`]: its file, size and
//! where its data starts); the reader maps the file and says it did by
//! setting the header's `attached` word, after which the server unlinks
//! the file (the mapping lives on in both processes, and nothing is left
//! behind whichever of them ends first). Each batch's descriptor
//! ([`descriptor`]) names its place in the file and the ring position its
//! end reaches; the reader sets the header's `consumed` word to that
//! position once it has copied the batch out, and the server writes a
//! batch only where the reader has consumed what was there ([`place`],
//! [`fits`]). A reader that never attaches or stops consuming takes nothing
//! from the stream, so the stream idle timeout ends it as it ends any other
//! stalled reader.
//!
//! The header's features word says the server lets a reader *hold* batches
//! in the ring: hand them out as views and move `consumed` past one only
//! once nothing refers to it (the Python reader's training loop does, and
//! copies nothing). Such a reader sets the `waiting` word while it waits
//! for the next message; a batch that finds the ring full while the reader
//! waits goes through the socket instead, and so do the ones after it
//! until the reader consumes again ([`Holding`]), so a reader that keeps
//! its batches gets them all.
//!
//! The file is created with mode 0600 under an unguessable name: only the
//! server's own user can open it, and a reader that cannot (another user,
//! another container's `/dev/shm`) falls back to reading the same ticket
//! over the socket. Its memory is reserved before anything is written into
//! it (`posix_fallocate`), so a full shared-memory folder sends the stream
//! over the socket rather than failing a write into the mapping later; on
//! the ring's first pass each message's pages are mapped in one call
//! (`MADV_POPULATE_WRITE`) before it is written rather than a fault a page.
//! Rings together take at most half the read-ahead allowance ([`Budget`]);
//! a stream that finds none left is sent over the socket. A ring no reader
//! mapped is removed with its stream, the ones left at shutdown then, and
//! those a server that died left (its process gone) by the next server
//! that starts on the folder.

#![allow(unsafe_code)]

use std::collections::HashSet;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};

use super::ipc::IpcMessage;
use crate::memory::arena::page_size;

pub use flightdeck_client::shm::{ANNOUNCE_TAG, BATCH_TAG, REQUEST_HEADER};
use flightdeck_client::shm::{
    ATTACHED_WORD, CONSUMED_WORD, FEATURES_WORD, LENDS, WAITING_WORD, map_shared,
};
/// Most bytes of a ring's data part, after its header page.
pub const RING_BYTES: u64 = 16 << 20;
/// Fewest bytes of a ring's data part.
pub const MIN_RING_BYTES: u64 = 1 << 20;
/// Record batches below this many bytes go through the socket: a stream
/// of small batches (a short read) never waits for the reader to map a
/// ring, nor makes its reader map one.
pub const SMALL_BATCH: u64 = 64 << 10;
/// Bytes of the file before the ring's data: the header page.
pub const DATA_OFFSET: u64 = 4096;
/// Every batch starts a multiple of this many bytes into the ring (its
/// Arrow buffers then as aligned as Arrow's own allocations).
pub const ALIGNMENT: u64 = 64;
/// The header's first word, which the reader checks.
const MAGIC: u64 = u64::from_le_bytes(*flightdeck_client::shm::MAGIC);

/// Where a message of `len` bytes goes when the ring's writer is at
/// position `pos` (bytes written since the ring began, padding included):
/// `(start, end)` positions, `start` aligned to [`ALIGNMENT`], the message
/// lying whole within the ring (`start % cap + len <= cap`: one that would
/// cross the ring's end starts again at its beginning). `None` when the
/// message is larger than the ring.
pub fn place(pos: u64, len: u64, cap: u64) -> Option<(u64, u64)> {
    if len > cap || cap == 0 || !cap.is_multiple_of(ALIGNMENT) {
        return None;
    }
    let start = pos.div_ceil(ALIGNMENT) * ALIGNMENT;
    let start = if start % cap + len > cap {
        start.div_ceil(cap) * cap
    } else {
        start
    };
    Some((start, start + len))
}

/// Whether a message placed at positions `start..end` may be written when
/// the writer is at `pos` and the reader has consumed up to `consumed`:
/// the bytes the reader has yet to copy out, positions `consumed..pos`, do
/// not lie where the message goes (a lap of `cap` before it). The gap a
/// message skips to start again at the ring's beginning holds nothing.
pub fn fits(start: u64, end: u64, pos: u64, consumed: u64, cap: u64) -> bool {
    consumed >= pos || end <= consumed + cap || start >= pos + cap
}

/// The data size of a ring whose first batch takes `len` bytes: room for
/// four such (the reader copies one out while the server writes the next),
/// a power of two between [`MIN_RING_BYTES`] and [`RING_BYTES`]; `None` for
/// a batch larger than any ring.
pub fn ring_for(len: u64) -> Option<u64> {
    (len <= RING_BYTES).then(|| {
        len.saturating_mul(4)
            .next_power_of_two()
            .clamp(MIN_RING_BYTES, RING_BYTES)
    })
}

/// Whether a stream's batches go through the socket because its reader
/// holds the ring. A reader may keep the batches it read in the ring
/// rather than copy them out (it hands out views, and says it is done with
/// a batch only when nothing refers to it any more), so a reader that
/// keeps every batch (`list(dataset)`) fills the ring and makes no room:
/// waiting for it would stall the stream until its idle timeout. When a
/// batch finds the ring full and the reader has said it waits for the next
/// message (the header's `waiting` word) at every look for [`Holding::PATIENCE`],
/// the batch goes through the socket, and so do the ones after it until
/// the reader consumes something. One look is not enough: a reader also
/// says it waits in the moment between asking for a message already on its
/// way and getting it.
#[derive(Debug, Default)]
pub struct Holding {
    /// Since when every look found the ring full and the reader waiting.
    waiting_since: Option<Instant>,
    /// Where the reader had consumed up to when its batches went to the
    /// socket (`None`: they go through the ring).
    held_at: Option<u64>,
}

impl Holding {
    /// How long the reader must have waited on a full ring.
    pub const PATIENCE: Duration = Duration::from_millis(1);

    /// Whether the next batch goes through the socket before the ring is
    /// tried, the reader having consumed up to `consumed`: while it has
    /// consumed nothing since its batches went there.
    pub fn socket_first(&mut self, consumed: u64) -> bool {
        match self.held_at {
            Some(at) if at == consumed => true,
            _ => {
                self.held_at = None;
                false
            }
        }
    }

    /// Whether a batch that found the ring full at `now` goes through the
    /// socket, the reader saying whether it is `waiting` and having consumed
    /// up to `consumed`.
    pub fn full(&mut self, waiting: bool, consumed: u64, now: Instant) -> bool {
        let since = match (waiting, self.waiting_since) {
            (false, _) => None,
            (true, since) => Some(since.unwrap_or(now)),
        };
        let held = since.is_some_and(|t| now.duration_since(t) >= Self::PATIENCE);
        self.waiting_since = since.filter(|_| !held);
        if held {
            self.held_at = Some(consumed);
        }
        held
    }

    /// The ring took a batch.
    pub fn written(&mut self) {
        self.waiting_since = None;
    }
}

/// The announcement of a ring: [`ANNOUNCE_TAG`], the size of the file's
/// data part to map and its offset in the file (little-endian u64s), then
/// the file's path.
pub fn announce(path: &Path, cap: u64) -> Bytes {
    let path = path.as_os_str().as_encoded_bytes();
    let mut out = BytesMut::with_capacity(24 + path.len());
    out.put_slice(ANNOUNCE_TAG);
    out.put_u64_le(cap);
    out.put_u64_le(DATA_OFFSET);
    out.put_slice(path);
    out.freeze()
}

/// A batch's descriptor: [`BATCH_TAG`], then (little-endian u64s) its
/// offset in the file, its length, and the ring position its end reaches
/// (what the reader sets `consumed` to once it has copied it out).
pub fn descriptor(offset: u64, len: u64, end: u64) -> Bytes {
    let mut out = BytesMut::with_capacity(32);
    out.put_slice(BATCH_TAG);
    out.put_u64_le(offset);
    out.put_u64_le(len);
    out.put_u64_le(end);
    out.freeze()
}

/// Bytes a message takes in the ring, as an encapsulated Arrow IPC message
/// (see [`Ring::try_write`]).
fn encapsulated_len(m: &IpcMessage) -> (u64, usize) {
    let padded = padded_header(m.header.len());
    ((8 + padded + m.body_len) as u64, padded)
}

/// The flatbuffer header's length padded so that the body starts
/// [`ALIGNMENT`]-aligned after the 8 bytes of marker and length.
fn padded_header(header: usize) -> usize {
    let align = ALIGNMENT as usize;
    (8 + header).div_ceil(align) * align - 8
}

/// The server-wide share of memory rings may take, and the ring files
/// still linked.
#[derive(Debug)]
pub struct Budget {
    limit: u64,
    used: AtomicU64,
    linked: Mutex<HashSet<PathBuf>>,
}

impl Budget {
    /// A budget of `limit` bytes of rings.
    pub fn new(limit: u64) -> Arc<Self> {
        Arc::new(Self {
            limit,
            used: AtomicU64::new(0),
            linked: Mutex::new(HashSet::new()),
        })
    }

    fn linked(&self) -> MutexGuard<'_, HashSet<PathBuf>> {
        self.linked.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Removes the ring file at `path` and forgets it.
    fn unlink(&self, path: &Path) -> io::Result<()> {
        self.linked().remove(path);
        std::fs::remove_file(path)
    }

    /// Removes the ring files still linked (no reader mapped them): at
    /// shutdown, when their streams may never be dropped.
    pub fn remove_linked(&self) {
        for path in std::mem::take(&mut *self.linked()) {
            let _ = std::fs::remove_file(path);
        }
    }

    /// `bytes` of the budget, if it has them now.
    fn take(self: &Arc<Self>, bytes: u64) -> Option<Slot> {
        self.reserve(bytes).then(|| Slot {
            budget: self.clone(),
            bytes,
        })
    }

    /// Counts `bytes` more as taken, if the budget has them.
    fn reserve(&self, bytes: u64) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                (used + bytes <= self.limit).then_some(used + bytes)
            })
            .is_ok()
    }
}

/// What became of a message offered to a ring.
#[derive(Debug, PartialEq, Eq)]
pub enum Written {
    /// Written; its descriptor.
    At(Bytes),
    /// The reader has yet to copy out what lies where it goes: offer it
    /// again later.
    NotYet,
    /// It can never go through this ring (larger than it, or the ring
    /// could not be sized): send it through the socket.
    Never,
    /// The reader holds the ring full and waits ([`Holding`]): send it
    /// through the socket.
    Held,
}

/// The rings of a server: where they are made, and their [`Budget`].
#[derive(Debug, Clone)]
pub struct Rings {
    /// The shared-memory folder.
    pub dir: PathBuf,
    /// What they may take, and which are linked.
    pub budget: Arc<Budget>,
}

impl Rings {
    /// Rings in `dir` (`None` where it is not a folder: every reader over
    /// the socket) taking at most `limit` bytes together; ring files that
    /// servers which are gone left there are removed.
    pub fn open(dir: Option<PathBuf>, limit: u64) -> Option<Self> {
        let dir = dir?;
        if !dir.is_dir() {
            tracing::info!(
                dir = %dir.display(),
                "local readers read over the socket: the shared-memory folder (--shm-dir) is not a \
                 folder"
            );
            return None;
        }
        let mut removed = 0;
        if let Ok(entries) = std::fs::read_dir(&dir) {
            for entry in entries.flatten() {
                let name = entry.file_name();
                if ring_owner(&name.to_string_lossy()).is_some_and(|pid| !alive(pid))
                    && std::fs::remove_file(entry.path()).is_ok()
                {
                    removed += 1;
                }
            }
        }
        if removed > 0 {
            tracing::info!(dir = %dir.display(), removed, "removed ring files that stopped servers left");
        }
        Some(Self {
            dir,
            budget: Budget::new(limit),
        })
    }
}

/// The process a ring file's name says made it (`flightdeck-PID-HEX16`).
fn ring_owner(name: &str) -> Option<u32> {
    let (pid, tail) = name.strip_prefix("flightdeck-")?.split_once('-')?;
    let hex = tail.len() == 16 && tail.bytes().all(|b| b.is_ascii_hexdigit());
    hex.then(|| pid.parse().ok()).flatten()
}

/// Whether process `pid` exists (a process another user runs counts).
fn alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid == 0 {
        return true;
    }
    // SAFETY: signal 0 sends nothing; the call only checks the process.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// One ring's share of the [`Budget`], given back when dropped.
#[derive(Debug)]
struct Slot {
    budget: Arc<Budget>,
    bytes: u64,
}

impl Slot {
    /// Takes `more` bytes of the budget into this share, if it has them.
    fn grow(&mut self, more: u64) -> bool {
        let grown = self.budget.reserve(more);
        if grown {
            self.bytes += more;
        }
        grown
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// A stream's ring: a file mapped shared, its header page then up to
/// [`RING_BYTES`] of data. The data part's memory is reserved when the
/// first batch that goes through the ring sizes it ([`ring_for`]): a
/// stream of small batches never takes any.
#[derive(Debug)]
pub struct Ring {
    file: File,
    map: *mut u8,
    map_len: usize,
    /// The ring's data size; 0 until sized.
    cap: u64,
    /// Sizing failed (the folder is full): every batch goes through the
    /// socket.
    unusable: bool,
    /// The writer's position (see [`place`]).
    pos: u64,
    /// Bytes of the ring's data, from its start, mapped so far (see
    /// [`Ring::populate`]).
    populated: u64,
    /// The file, until unlinked.
    path: Option<PathBuf>,
    slot: Slot,
    /// Whether batches go through the socket while the reader holds the
    /// ring full.
    holding: Holding,
}

// SAFETY: the mapping is owned by the ring alone (no other `Ring` shares
// its pointer), so moving it to another thread moves its only user.
unsafe impl Send for Ring {}

impl Ring {
    /// A ring of [`RING_BYTES`] in a new file of `dir`, its space reserved,
    /// if `budget` has room for it.
    pub fn create(dir: &Path, budget: &Arc<Budget>) -> io::Result<Self> {
        let cap = RING_BYTES;
        // The header page now, the data part's when the ring is sized.
        let slot = budget.take(DATA_OFFSET).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::OutOfMemory,
                "the shared-memory rings already take half the read-ahead allowance",
            )
        })?;
        let path = dir.join(format!(
            "flightdeck-{}-{:016x}",
            std::process::id(),
            unguessable()
        ));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)?;
        let map_len = usize::try_from(DATA_OFFSET + cap).map_err(io::Error::other)?;
        // The whole length (so that the reader can map it all), the header
        // page's memory reserved; the data's when the ring is sized.
        let made = file
            .set_len(DATA_OFFSET + cap)
            .and_then(|()| reserve(&file, 0, DATA_OFFSET))
            .and_then(|()| map_shared(&file, map_len));
        let map = match made {
            Ok(map) => map,
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                return Err(e);
            }
        };
        budget.linked().insert(path.clone());
        let ring = Self {
            file,
            map,
            map_len,
            cap: 0,
            unusable: false,
            pos: 0,
            populated: 0,
            path: Some(path),
            slot,
            holding: Holding::default(),
        };
        ring.word(FEATURES_WORD).store(LENDS, Ordering::Release);
        ring.word(0).store(MAGIC, Ordering::Release);
        Ok(ring)
    }

    /// The ring position the reader has consumed up to.
    fn consumed(&self) -> u64 {
        self.word(CONSUMED_WORD).load(Ordering::Acquire)
    }

    /// Whether the reader says it is waiting for the stream's next message
    /// (see [`Holding`]).
    fn reader_waiting(&self) -> bool {
        self.word(WAITING_WORD).load(Ordering::Acquire) != 0
    }

    /// The file, while it is linked.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The size of the file's data part, which the reader maps.
    pub fn mapped(&self) -> u64 {
        self.map_len as u64 - DATA_OFFSET
    }

    /// Sizes the ring for a first batch of `len` bytes and reserves its
    /// memory; `false` where it cannot be (the batch is larger than any
    /// ring, or the folder is full: then no batch goes through the ring).
    fn size_for(&mut self, len: u64) -> bool {
        if self.cap > 0 {
            return true;
        }
        let Some(cap) = ring_for(len).filter(|_| !self.unusable) else {
            return false;
        };
        if !self.slot.grow(cap) {
            // The rings' share of memory is taken: this stream's batches
            // go through the socket.
            self.unusable = true;
            return false;
        }
        match reserve(&self.file, DATA_OFFSET, cap) {
            Ok(()) => {
                self.cap = cap;
                true
            }
            Err(e) => {
                tracing::debug!(error = %e, "a read stream's ring could not be sized; its batches go through the socket");
                self.unusable = true;
                false
            }
        }
    }

    /// Maps the ring's data up to `end` (bytes from its start) writable, in
    /// one call for what is not mapped yet, before a message is written
    /// there: a page fault for each page at its first write costs more
    /// (writing a fresh 16 MiB ring in 2 MiB messages took 6.9–7.6 ms
    /// with a fault a page, 5.8–6.0 ms with a call before each message;
    /// `bench/RESULTS.md`). A hint: where the kernel lacks it (before
    /// Linux 5.14) the pages fault in as before. `false` when nothing was
    /// mapped by it.
    fn populate(&mut self, end: u64) -> bool {
        let end = end.min(self.cap);
        if end <= self.populated {
            return false;
        }
        let done = std::mem::replace(&mut self.populated, end);
        let (Ok(from), Ok(to)) = (
            usize::try_from(DATA_OFFSET + done),
            usize::try_from(DATA_OFFSET + end),
        ) else {
            return false;
        };
        // From the page that holds the first byte not mapped yet (the
        // mapping starts at a page).
        let page = page_size();
        let from = from / page * page;
        #[cfg(target_os = "linux")]
        {
            // SAFETY: `[from, to)` lies within the mapping (the ring's
            // data, its memory reserved) and starts at a page; populating
            // changes how it is backed, never its contents.
            let rc = unsafe {
                libc::madvise(
                    self.map.add(from).cast(),
                    to - from,
                    libc::MADV_POPULATE_WRITE,
                )
            };
            rc == 0
        }
        #[cfg(not(target_os = "linux"))]
        {
            let _ = (from, to);
            false
        }
    }

    /// Whether the reader has mapped the file (then it is unlinked: both
    /// mappings outlive the name, and an unlinked ring is an attached one).
    pub fn attached(&mut self) -> bool {
        if self.path.is_some() && self.word(ATTACHED_WORD).load(Ordering::Acquire) == 0 {
            return false;
        }
        self.unlink();
        true
    }

    fn unlink(&mut self) {
        if let Some(path) = self.path.take()
            && let Err(e) = self.slot.budget.unlink(&path)
        {
            tracing::warn!(path = %path.display(), error = %e, "could not remove a read stream's shared-memory file");
        }
    }

    /// One of the header's words, which the reader's process may write.
    fn word(&self, index: usize) -> &AtomicU64 {
        debug_assert!((index + 1) * 8 <= DATA_OFFSET as usize);
        // SAFETY: the header page is mapped for the ring's life, and the
        // map is page-aligned, so every word of it is an aligned u64 that
        // only ever is accessed atomically (here and, as aligned 8-byte
        // stores and loads, by the reader).
        unsafe { AtomicU64::from_ptr(self.map.cast::<u64>().add(index)) }
    }

    /// Writes `m` into the ring as an encapsulated Arrow IPC message (the
    /// continuation marker, the header's length, the header padded, the
    /// body) if the reader has consumed where it goes; [`Written::Held`]
    /// while the reader holds the ring full and waits ([`Holding`]).
    pub fn try_write(&mut self, m: &IpcMessage) -> Written {
        let (len, padded) = encapsulated_len(m);
        if !self.size_for(len) {
            return Written::Never;
        }
        let Some((start, end)) = place(self.pos, len, self.cap) else {
            return Written::Never;
        };
        let consumed = self.consumed();
        if self.holding.socket_first(consumed) {
            return Written::Held;
        }
        if !fits(start, end, self.pos, consumed, self.cap) {
            return match self
                .holding
                .full(self.reader_waiting(), consumed, Instant::now())
            {
                true => Written::Held,
                false => Written::NotYet,
            };
        }
        let offset = DATA_OFFSET + start % self.cap;
        let _ = self.populate(start % self.cap + len);
        let (Ok(mut at), Ok(padded32)) = (usize::try_from(offset), u32::try_from(padded)) else {
            return Written::Never;
        };
        let mut put = |bytes: &[u8]| {
            debug_assert!(at + bytes.len() <= self.map_len);
            // SAFETY: `place` keeps the message within the ring's data,
            // which lies within the mapping, and `fits` says the reader is
            // done with those bytes; the source is a separate allocation.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.map.add(at), bytes.len()) };
            at += bytes.len();
        };
        put(&u32::MAX.to_le_bytes());
        put(&padded32.to_le_bytes());
        put(&m.header);
        put(&[0u8; ALIGNMENT as usize][..padded - m.header.len()]);
        for piece in &m.body {
            put(piece);
        }
        self.pos = end;
        self.holding.written();
        Written::At(descriptor(offset, len, end))
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        let opened = self.word(ATTACHED_WORD).load(Ordering::Acquire) != 0;
        // SAFETY: `map` and `map_len` are what `mmap` returned and was
        // given; nothing refers to the mapping after the ring.
        unsafe { libc::munmap(self.map.cast(), self.map_len) };
        // A stream whose batches all went through the socket may end
        // before its reader opened the ring it announced: the file stays a
        // while, so that the reader finds it (and the stream over) rather
        // than take a missing file for another machine's.
        if self.path.is_some()
            && !opened
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            let mut unlinked = Unlinked {
                path: self.path.take(),
                budget: self.slot.budget.clone(),
            };
            runtime.spawn(async move {
                tokio::time::sleep(UNMAPPED_GRACE).await;
                unlinked.unlink();
            });
        }
        self.unlink();
    }
}

/// How long a ring file its reader never opened stays after its stream.
const UNMAPPED_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// A ring file kept after its ring (see `Ring::drop`).
struct Unlinked {
    path: Option<PathBuf>,
    budget: Arc<Budget>,
}

impl Unlinked {
    fn unlink(&mut self) {
        if let Some(path) = self.path.take() {
            let _ = self.budget.unlink(&path);
        }
    }
}

/// Reserves the memory of `len` bytes of `file` from `from`: a write
/// there can then not fail for want of room (which, into a mapping, would
/// be a SIGBUS).
fn reserve(file: &File, from: u64, len: u64) -> io::Result<()> {
    let off = |v: u64| libc::off_t::try_from(v).map_err(io::Error::other);
    // SAFETY: the descriptor is an open file of ours; the call only reads
    // its arguments.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), off(from)?, off(len)?) };
    match rc {
        0 => Ok(()),
        rc => Err(io::Error::from_raw_os_error(rc)),
    }
}

/// 64 bits no other process can predict: the kernel's random bytes, else
/// the clock and a counter mixed.
fn unguessable() -> u64 {
    let mut buf = [0u8; 8];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| io::Read::read_exact(&mut f, &mut buf))
        .is_ok()
    {
        return u64::from_le_bytes(buf);
    }
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    nanos ^ COUNT.fetch_add(1, Ordering::Relaxed).rotate_left(40)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Messages placed one after another, each written only once the
        /// reader has consumed what its bytes held, never overwrite a
        /// message the reader has yet to copy out, and each lies whole
        /// and aligned within the ring.
        #[test]
        fn placed_messages_never_overwrite_unconsumed_ones(
            lens in proptest::collection::vec(1u64..5000, 1..200),
            cap_lines in 80u64..200,
            lag in 0usize..6,
        ) {
            let cap = cap_lines * ALIGNMENT;
            let mut pos = 0;
            // Messages written, as (start, end) positions; the reader is
            // `lag` messages behind at most.
            let mut written: Vec<(u64, u64)> = Vec::new();
            let mut consumed_upto = 0usize;
            for len in lens {
                let (start, end) = place(pos, len, cap).expect("smaller than the ring");
                prop_assert_eq!(start % ALIGNMENT, 0);
                prop_assert!(start >= pos);
                prop_assert!(start % cap + len <= cap, "crosses the ring's end");
                // The reader consumes until the message fits or it is
                // `lag` behind.
                let consumed = |upto: usize| if upto == 0 { 0 } else { written[upto - 1].1 };
                while !fits(start, end, pos, consumed(consumed_upto), cap) {
                    prop_assert!(consumed_upto < written.len(), "fits once all is consumed");
                    consumed_upto += 1;
                }
                for &(s, e) in &written[consumed_upto..] {
                    // Unconsumed messages' bytes in the ring do not meet
                    // this one's.
                    let (a, b) = (s % cap, s % cap + (e - s));
                    let (c, d) = (start % cap, start % cap + len);
                    prop_assert!(b <= c || d <= a, "overlaps an unconsumed message");
                }
                written.push((start, end));
                pos = end;
                consumed_upto = consumed_upto.max(written.len().saturating_sub(lag + 1));
            }
        }
    }

    #[test]
    fn a_ring_holds_four_of_its_first_batch_within_its_bounds() {
        assert_eq!(ring_for(1), Some(MIN_RING_BYTES));
        assert_eq!(ring_for(1 << 20), Some(4 << 20));
        assert_eq!(ring_for((1 << 20) + 1), Some(8 << 20));
        assert_eq!(ring_for(RING_BYTES), Some(RING_BYTES));
        assert_eq!(ring_for(RING_BYTES + 1), None);
    }

    #[test]
    fn a_full_ring_sends_batches_through_the_socket_once_its_reader_waits_on_it() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut h = Holding::default();
        // A reader busy with what it has, or waiting only for a moment: the
        // batch waits for room.
        assert!(!h.full(false, 100, at(0)));
        assert!(!h.full(true, 100, at(1)), "one look is not enough");
        assert!(!h.full(false, 100, at(2)));
        assert!(!h.full(true, 100, at(3)), "nor two looks apart");
        h.written();
        assert!(
            !h.full(true, 100, at(4)),
            "the ring took one: the wait is timed anew"
        );
        assert!(!h.full(true, 100, at(4)), "nor looks in the same moment");
        assert!(!h.socket_first(100));
        // Waiting at every look for the patience: through the socket, then
        // the batches after it too while the reader consumes nothing...
        assert!(h.full(true, 100, at(5)));
        assert!(h.socket_first(100));
        assert!(h.socket_first(100));
        // ...and through the ring again once it did.
        assert!(!h.socket_first(160));
        assert!(!h.socket_first(100), "a new start, not a comparison");
        assert!(!h.full(true, 160, at(6)), "the wait is timed anew");
        assert!(h.full(true, 160, at(7)));
    }

    #[test]
    fn a_ring_tells_its_reader_that_it_may_hold_batches_and_hears_it_wait() {
        let dir = Scratch::new("lends");
        let budget = Budget::new(1 << 30);
        let ring = Ring::create(dir.path(), &budget).expect("a ring");
        assert_eq!(ring.word(FEATURES_WORD).load(Ordering::Acquire), LENDS);
        assert!(!ring.reader_waiting());
        ring.word(WAITING_WORD).store(1, Ordering::Release);
        assert!(ring.reader_waiting());
        ring.word(CONSUMED_WORD).store(64, Ordering::Release);
        assert_eq!(ring.consumed(), 64);
    }

    #[test]
    fn ring_files_of_servers_that_are_gone_are_removed_at_start() {
        let dir = Scratch::new("sweep");
        // No process has a pid this high (pid_max is at most 2^22).
        let gone = dir.path().join("flightdeck-99999999-00000000000000ab");
        let ours = dir.path().join(format!(
            "flightdeck-{}-00000000000000cd",
            std::process::id()
        ));
        let other = dir.path().join("flightdeck-99999999-not-a-ring");
        for f in [&gone, &ours, &other] {
            std::fs::write(f, b"x").expect("write");
        }
        let rings = Rings::open(Some(dir.path().to_path_buf()), 1 << 30).expect("a folder");
        assert!(!gone.exists());
        assert!(
            ours.exists() && other.exists(),
            "a live server's and others' files stay"
        );
        let ring = Ring::create(&rings.dir, &rings.budget).expect("ring");
        let path = ring.path().expect("linked").to_path_buf();
        // A stream never dropped (the process exits): removed at shutdown.
        std::mem::forget(ring);
        rings.budget.remove_linked();
        assert!(!path.exists());
        assert!(Rings::open(Some(dir.path().join("missing")), 1).is_none());
    }

    #[test]
    fn a_message_larger_than_the_ring_is_not_placed() {
        assert_eq!(place(0, 4097, 4096), None);
        assert_eq!(place(100, 4096, 4096), Some((4096, 8192)));
        assert_eq!(place(0, 10, 4096), Some((0, 10)));
    }

    #[test]
    fn the_budget_bounds_the_rings_and_a_closed_ring_gives_its_share_back() {
        let dir = Scratch::new("budget");
        let budget = Budget::new(3 * DATA_OFFSET + MIN_RING_BYTES);
        let small = IpcMessage {
            header: Bytes::from_static(b"h"),
            body: vec![Bytes::from(vec![1u8; 100])],
            body_len: 100,
            app_metadata: Bytes::new(),
        };
        let mut a = Ring::create(dir.path(), &budget).expect("first ring");
        let mut b = Ring::create(dir.path(), &budget).expect("second ring");
        let path = a.path().expect("linked").to_path_buf();
        // Unsized, a ring holds its header page's memory alone.
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(&path).expect("metadata");
        assert_eq!(meta.len(), DATA_OFFSET + RING_BYTES);
        assert!(
            meta.blocks() * 512 <= DATA_OFFSET,
            "{} blocks",
            meta.blocks()
        );
        // The first batch sizes the ring, from the budget; the second
        // ring finds none left and sends its batches through the socket.
        assert!(matches!(a.try_write(&small), Written::At(_)));
        assert_eq!(a.cap, MIN_RING_BYTES);
        let meta = std::fs::metadata(&path).expect("metadata");
        assert!(meta.blocks() * 512 >= DATA_OFFSET + MIN_RING_BYTES);
        assert_eq!(b.try_write(&small), Written::Never);
        assert_eq!(b.try_write(&small), Written::Never, "and keeps to that");
        let _c = Ring::create(dir.path(), &budget).expect("a header page left");
        let err = Ring::create(dir.path(), &budget).expect_err("no room for a fourth");
        assert_eq!(err.kind(), io::ErrorKind::OutOfMemory);
        drop(a);
        assert!(!path.exists(), "a dropped ring's file is removed");
        let mut d = Ring::create(dir.path(), &budget).expect("room again");
        assert!(matches!(d.try_write(&small), Written::At(_)));
    }

    #[test]
    fn a_written_message_reads_back_as_arrow_ipc_and_waits_for_the_reader() {
        use arrow::array::{Int64Array, RecordBatch};
        use arrow::datatypes::{DataType, Field, Schema};

        let dir = Scratch::new("write");
        let budget = Budget::new(1 << 30);
        let mut ring = Ring::create(dir.path(), &budget).expect("ring");
        let schema = Arc::new(Schema::new(vec![Field::new("x", DataType::Int64, false)]));
        let rows = (RING_BYTES / 8 / 3) as i64;
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![Arc::new(Int64Array::from_iter_values(0..rows))],
        )
        .expect("batch");
        let mut encoder = super::super::ipc::Messages::new(&schema).expect("encoder");
        let messages = encoder.batch(&batch).expect("encoded");
        let m = messages.last().expect("a record batch");
        // Two fit; the third waits until the reader consumed the first.
        let Written::At(first) = ring.try_write(m) else {
            panic!("room for the first");
        };
        assert!(
            matches!(ring.try_write(m), Written::At(_)),
            "and the second"
        );
        assert_eq!(ring.try_write(m), Written::NotYet);
        // A reader that waits on the full ring past the patience holds it:
        // the message goes through the socket, and the next too until the
        // reader consumes.
        ring.word(WAITING_WORD).store(1, Ordering::Release);
        assert_eq!(ring.try_write(m), Written::NotYet, "one look");
        std::thread::sleep(Holding::PATIENCE * 2);
        assert_eq!(ring.try_write(m), Written::Held);
        assert_eq!(ring.try_write(m), Written::Held, "until it consumes");
        ring.word(WAITING_WORD).store(0, Ordering::Release);
        let file = std::fs::read(ring.path().expect("linked")).expect("read the file");
        let offset = u64::from_le_bytes(first[8..16].try_into().expect("8 bytes")) as usize;
        let len = u64::from_le_bytes(first[16..24].try_into().expect("8 bytes")) as usize;
        let end = u64::from_le_bytes(first[24..32].try_into().expect("8 bytes"));
        let mut reader = arrow::ipc::reader::StreamReader::try_new(
            std::io::Cursor::new(
                [
                    encoder_schema_bytes(&schema),
                    file[offset..offset + len].to_vec(),
                ]
                .concat(),
            ),
            None,
        )
        .expect("a stream");
        let back = reader.next().expect("one batch").expect("decodes");
        assert_eq!(back, batch);
        ring.word(CONSUMED_WORD).store(end, Ordering::Release);
        assert!(matches!(ring.try_write(m), Written::At(_)));
        assert!(!ring.attached());
        ring.word(ATTACHED_WORD).store(1, Ordering::Release);
        assert!(ring.attached());
        assert!(ring.path().is_none(), "unlinked once attached");
        assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 0);
    }

    #[test]
    fn a_rings_first_pass_maps_each_messages_pages_before_writing_them() {
        let dir = Scratch::new("populate");
        let budget = Budget::new(1 << 30);
        let mut ring = Ring::create(dir.path(), &budget).expect("ring");
        let quarter = (RING_BYTES / 4 - 64) as usize;
        let message = IpcMessage {
            header: Bytes::from_static(b"h"),
            body: vec![Bytes::from(vec![7u8; quarter])],
            body_len: quarter,
            app_metadata: Bytes::new(),
        };
        assert!(matches!(ring.try_write(&message), Written::At(_)));
        assert_eq!(ring.cap, RING_BYTES);
        // The first message's pages are mapped, and no further.
        assert!((quarter as u64..RING_BYTES / 4 + page_size() as u64).contains(&ring.populated));
        let ahead = DATA_OFFSET + RING_BYTES / 2;
        let before = present(&ring, ahead);
        // Where the kernel populates mappings (Linux 5.14 on), the call
        // maps pages without a write (seen where the pagemap is).
        let populated = ring.populate(RING_BYTES * 3 / 4);
        if let Some(before) = before {
            assert!(!before, "a page nothing wrote yet is not mapped");
            assert_eq!(
                present(&ring, ahead),
                Some(populated),
                "populated pages are mapped"
            );
        }
        assert_eq!(ring.populated, RING_BYTES * 3 / 4);
        assert!(
            !ring.populate(RING_BYTES / 8),
            "what is mapped is not mapped again"
        );
        for _ in 0..3 {
            assert!(matches!(ring.try_write(&message), Written::At(_)));
        }
        assert_eq!(
            ring.populated, RING_BYTES,
            "the whole ring after its first pass"
        );
        let file = std::fs::read(ring.path().expect("linked")).expect("read the file");
        let fourth = (DATA_OFFSET + RING_BYTES * 3 / 4) as usize;
        assert!(
            file[fourth..fourth + 1024].contains(&7),
            "the fourth message is in the file"
        );
    }

    /// Whether the page at `offset` of `ring`'s file is mapped into this
    /// process (bit 63 of its `/proc/self/pagemap` entry); `None` where
    /// there is no pagemap to read.
    fn present(ring: &Ring, offset: u64) -> Option<bool> {
        use std::io::{Read, Seek, SeekFrom};
        let page = (ring.map as u64 + offset) / page_size() as u64;
        let mut pagemap = File::open("/proc/self/pagemap").ok()?;
        let mut entry = [0u8; 8];
        pagemap.seek(SeekFrom::Start(page * 8)).ok()?;
        pagemap.read_exact(&mut entry).ok()?;
        Some(u64::from_le_bytes(entry) >> 63 == 1)
    }

    /// A folder of its own for a test, removed after it.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(name: &str) -> Self {
            let dir =
                std::env::temp_dir().join(format!("flightdeck-shm-{name}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("scratch folder");
            Self(dir)
        }

        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// The schema as an encapsulated IPC message, as a stream begins.
    fn encoder_schema_bytes(schema: &arrow::datatypes::Schema) -> Vec<u8> {
        let mut out = Vec::new();
        let writer = arrow::ipc::writer::StreamWriter::try_new(&mut out, schema).expect("writer");
        drop(writer);
        // The writer wrote the schema; without `finish` no end marker.
        out
    }
}
