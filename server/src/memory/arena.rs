//! The host arena: every cached byte lives in large, 64-byte-aligned slabs,
//! and the catalog's Arrow buffers point into them.
//!
//! Ingest copies each received record batch once into the arena: its IPC
//! body lands in one allocation ([`Arena::copy_body`]) and the batch is
//! decoded over it in place, kept as it came when [`Arena::holds`] says so.
//! Other batches (compressed, dictionary-encoded, nulls in fixed-width
//! columns, and those of restores and peers) are copied after decoding
//! ([`Arena::copy_batch`]): one bump allocation per batch, every buffer of
//! the batch 64-byte aligned inside it, and the batch rebuilt over slices of
//! that allocation (a column that is a small slice of larger buffers, as a
//! query's `LIMIT` leaves it, is copied as its rows alone). Either way the
//! cache stays plain Arrow. A slab is charged to the
//! [`Budget`] when it is allocated from the system, so the budget counts real
//! memory, and an allocation that needs a slab the budget cannot give fails
//! *before* anything is copied.
//!
//! A slab lives as long as any buffer in it. When the last one goes (its
//! dataset was dropped, spilled, or its attempt lost), the slab returns to a
//! small pool of idle slabs that later allocations reuse; beyond the pool, it
//! goes back to the system and to the budget.
//!
//! Slabs are page-locked through the CUDA driver when one is present
//! ([`HostMemory::Pinned`]: `cuMemHostAlloc` with the portable flag, not
//! write-combined, since `DoGet` reads the cache with the CPU), so host-to-
//! device copies run at full speed; without a driver they are anonymous
//! memory mapped from the kernel for the slab alone ([`HostMemory::Heap`]).
//!
//! This is the one module that hands out raw memory, hence the `unsafe` blocks
//! below, each with the invariant it relies on.
#![allow(unsafe_code)]

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use arrow::array::{ArrayData, MutableArrayData, RecordBatch, make_array};
use arrow::buffer::{BooleanBuffer, Buffer, NullBuffer};
use arrow::datatypes::DataType;

use super::Budget;
use super::device::CudaHost;
use crate::error::{Error, Result};
use crate::memory::Reservation;

/// Alignment of every allocation, and of every Arrow buffer inside one.
pub const ALIGN: usize = 64;
/// Slab size when the budget is large enough for it.
pub const DEFAULT_SLAB_BYTES: usize = 64 << 20;
/// Idle slabs kept for reuse after their data went away.
const MAX_IDLE_SLABS: usize = 2;

fn round_up(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

/// The slab size for a budget of `limit` bytes: the default, but no more
/// than a sixteenth of the limit (at least 64 KiB, at most the limit), so
/// small budgets still hold many allocations.
pub fn slab_bytes_for(limit: u64) -> usize {
    let limit = usize::try_from(limit).unwrap_or(usize::MAX);
    (limit / 16).clamp(64 << 10, DEFAULT_SLAB_BYTES).min(limit)
}

/// Where slabs come from.
#[derive(Debug, Clone)]
pub enum HostMemory {
    /// Anonymous memory mapped for each slab alone (on Linux; aligned heap
    /// memory elsewhere), and unmapped when the slab goes back to the
    /// system. Never from the process's allocator there: slabs mixed into
    /// malloc's heaps with the short-lived buffers of decoding would leave
    /// freed memory the allocator keeps, outside the budget (measured: up
    /// to 200 MiB above a 256 MiB limit with 32 writers).
    Heap,
    /// Page-locked memory from the CUDA driver (portable, not write-combined).
    Pinned(CudaHost),
}

/// One slab's memory: `cap` bytes at `ptr`, freed on drop.
struct SlabMem {
    ptr: NonNull<u8>,
    cap: usize,
    source: HostMemory,
}

// SAFETY: the memory is a plain allocation owned by this value; handing it to
// another thread is fine, and all access to its bytes goes through the
// arena's disjoint allocations.
unsafe impl Send for SlabMem {}
// SAFETY: as above; `&SlabMem` only exposes the pointer value.
unsafe impl Sync for SlabMem {}

impl SlabMem {
    fn allocate(cap: usize, source: &HostMemory) -> Result<Self> {
        let ptr = match source {
            HostMemory::Heap => os::map(cap)?,
            HostMemory::Pinned(host) => NonNull::new(host.alloc_pinned(cap)?),
        };
        let ptr = ptr.ok_or_else(|| {
            Error::ResourceExhausted(format!(
                "the system refused {cap} bytes of host memory for the cache; lower \
                 --memory-limit below what this machine can hold"
            ))
        })?;
        Ok(Self {
            ptr,
            cap,
            source: source.clone(),
        })
    }
}

/// Heap slabs of at least this size are aligned to it, so that an
/// allocation that fills one can be backed by huge pages
/// ([`Arena::copy_bytes`]).
const HUGE_PAGE: usize = 2 << 20;

/// The system's page size (4 KiB where it cannot be read).
pub(crate) fn page_size() -> usize {
    // SAFETY: `sysconf` only reads a system constant.
    usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
        .ok()
        .filter(|&size| size > 0)
        .unwrap_or(4096)
}

/// The alignment of a heap slab of `cap` bytes.
fn heap_align(cap: usize) -> usize {
    if cap >= HUGE_PAGE { HUGE_PAGE } else { ALIGN }
}

/// Heap slabs straight from the kernel: `mmap` for each, `munmap` when it
/// goes, so a freed slab is given back to the system at once.
#[cfg(target_os = "linux")]
mod os {
    use std::ptr::NonNull;

    use super::{heap_align, page_size as page};
    use crate::error::{Error, Result};

    /// Maps `cap` bytes (rounded up to whole pages) aligned to
    /// [`heap_align`]; `None` when the kernel refuses.
    pub(super) fn map(cap: usize) -> Result<Option<NonNull<u8>>> {
        let page = page();
        let len = cap.next_multiple_of(page);
        let align = heap_align(cap).max(page);
        let over = len
            .checked_add(align - page)
            .ok_or_else(|| Error::Internal(format!("a slab of {cap} bytes is too large")))?;
        // SAFETY: an anonymous private mapping at an address the kernel picks
        // touches no existing memory.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                over,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Ok(None);
        }
        let base = base as usize;
        let start = base.next_multiple_of(align);
        let (head, tail) = (start - base, base + over - (start + len));
        // SAFETY: both ranges are page-aligned parts of the mapping just made
        // that the slab does not use.
        unsafe {
            if head > 0 {
                libc::munmap(base as *mut libc::c_void, head);
            }
            if tail > 0 {
                libc::munmap((start + len) as *mut libc::c_void, tail);
            }
        }
        Ok(NonNull::new(start as *mut u8))
    }

    /// Unmaps a slab [`map`] returned for `cap` bytes.
    ///
    /// # Safety
    /// `ptr` came from `map(cap)` and nothing refers to its memory any more.
    pub(super) unsafe fn unmap(ptr: NonNull<u8>, cap: usize) {
        // SAFETY: the caller's contract; `map` mapped exactly these pages.
        unsafe { libc::munmap(ptr.as_ptr().cast(), cap.next_multiple_of(page())) };
    }
}

/// Heap slabs from the global allocator where `mmap` is not at hand.
#[cfg(not(target_os = "linux"))]
mod os {
    use std::ptr::NonNull;

    use super::heap_align;
    use crate::error::{Error, Result};

    fn layout(cap: usize) -> Result<Layout> {
        Layout::from_size_align(cap, heap_align(cap))
            .map_err(|e| Error::Internal(format!("slab layout of {cap} bytes: {e}")))
    }

    pub(super) fn map(cap: usize) -> Result<Option<NonNull<u8>>> {
        // SAFETY: `cap` is non-zero (callers round up to at least ALIGN).
        Ok(NonNull::new(unsafe { std::alloc::alloc(layout(cap)?) }))
    }

    /// # Safety
    /// `ptr` came from `map(cap)` and nothing refers to its memory any more.
    pub(super) unsafe fn unmap(ptr: NonNull<u8>, cap: usize) {
        if let Ok(layout) = layout(cap) {
            // SAFETY: the caller's contract.
            unsafe { std::alloc::dealloc(ptr.as_ptr(), layout) };
        }
    }
}

impl Drop for SlabMem {
    fn drop(&mut self) {
        match &self.source {
            // SAFETY: mapped in `allocate` with this very size, and no
            // buffer points here any more (slabs are dropped only when the
            // last allocation in them is gone).
            HostMemory::Heap => unsafe { os::unmap(self.ptr, self.cap) },
            HostMemory::Pinned(host) => host.free_pinned(self.ptr.as_ptr()),
        }
    }
}

/// What the arena and its slabs share: the pool of idle slabs and counters.
struct Pool {
    budget: Arc<Budget>,
    source: HostMemory,
    slab_bytes: usize,
    idle: Mutex<Vec<SlabMem>>,
    /// Bytes of live allocations.
    live: AtomicU64,
    /// Bytes of slabs held (live and idle), as charged to the budget.
    held: AtomicU64,
}

impl std::panic::RefUnwindSafe for Pool {}

impl Pool {
    fn idle(&self) -> MutexGuard<'_, Vec<SlabMem>> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A slab of `cap` bytes: an idle one of that size, or a new one charged
    /// to the budget.
    fn take(
        &self,
        cap: usize,
        share: usize,
        reservation: Option<&mut Reservation>,
        what: &dyn Fn() -> String,
    ) -> Result<SlabMem> {
        if cap == self.slab_bytes
            && let Some(mem) = self.idle().pop()
        {
            self.budget.settle(share as u64, reservation);
            return Ok(mem);
        }
        self.budget
            .take_reserved(cap as u64, share as u64, reservation, what)?;
        match SlabMem::allocate(cap, &self.source) {
            Ok(mem) => {
                self.held.fetch_add(cap as u64, Ordering::AcqRel);
                Ok(mem)
            }
            Err(e) => {
                self.budget.release(cap as u64);
                Err(e)
            }
        }
    }

    /// Takes back a slab nothing points into any more.
    fn give_back(&self, mem: SlabMem) {
        let cap = mem.cap;
        if cap == self.slab_bytes {
            let mut idle = self.idle();
            if idle.len() < MAX_IDLE_SLABS {
                idle.push(mem);
                return;
            }
        }
        drop(mem);
        self.held.fetch_sub(cap as u64, Ordering::AcqRel);
        self.budget.release(cap as u64);
    }
}

/// A slab in use; returns its memory to the pool when the last allocation in
/// it (and the arena's own handle, for the current slab) is gone.
struct Slab {
    mem: Option<SlabMem>,
    pool: Arc<Pool>,
}

impl Slab {
    fn base(&self) -> *mut u8 {
        self.mem
            .as_ref()
            .map_or(std::ptr::null_mut(), |m| m.ptr.as_ptr())
    }

    fn cap(&self) -> usize {
        self.mem.as_ref().map_or(0, |m| m.cap)
    }
}

impl Drop for Slab {
    fn drop(&mut self) {
        if let Some(mem) = self.mem.take() {
            self.pool.give_back(mem);
        }
    }
}

/// The owner of one allocation: keeps its slab alive and counts live bytes.
struct Chunk {
    _slab: Arc<Slab>,
    len: usize,
    pool: Arc<Pool>,
}

impl std::panic::RefUnwindSafe for Chunk {}

impl Drop for Chunk {
    fn drop(&mut self) {
        self.pool.live.fetch_sub(self.len as u64, Ordering::AcqRel);
    }
}

/// An allocation not yet shared: writable, then frozen (`ChunkMut::freeze`) into an
/// Arrow [`Buffer`].
pub struct ChunkMut {
    ptr: NonNull<u8>,
    len: usize,
    owner: Arc<Chunk>,
}

impl ChunkMut {
    /// Copies `bytes` into the allocation at `offset`. (No `&mut [u8]` of
    /// the allocation is ever handed out: its memory starts uninitialised,
    /// and every byte is written through here or [`ChunkMut::zero`] before
    /// the allocation is frozen.)
    fn write_at(&mut self, offset: usize, bytes: &[u8]) {
        assert!(
            offset + bytes.len() <= self.len,
            "write past the allocation"
        );
        // SAFETY: `[ptr, ptr + len)` belongs to this allocation alone (the
        // arena hands out disjoint ranges under its lock) and is checked above.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.ptr.as_ptr().add(offset),
                bytes.len(),
            );
        }
    }

    /// Fills `[offset, offset + len)` with zeros (padding between buffers).
    fn zero(&mut self, offset: usize, len: usize) {
        assert!(offset + len <= self.len, "write past the allocation");
        // SAFETY: as in `write_at`.
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr().add(offset), 0, len) };
    }

    /// Asks the kernel to back the allocation's whole huge pages with
    /// transparent huge pages (a hint, ignored where they are off; the
    /// pages are not touched yet when the slab is new).
    fn huge_pages(&self) {
        #[cfg(target_os = "linux")]
        if self.len >= HUGE_PAGE {
            let start = (self.ptr.as_ptr() as usize).next_multiple_of(HUGE_PAGE);
            let end = (self.ptr.as_ptr() as usize + self.len) / HUGE_PAGE * HUGE_PAGE;
            if end > start {
                // SAFETY: `[start, end)` lies inside this allocation, which
                // belongs to it alone; `madvise` changes only how it is
                // backed, never its contents.
                let _ = unsafe {
                    libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE)
                };
            }
        }
    }

    /// `bytes` (at most the allocation's length) written at its start, the
    /// rest zeroed, frozen: the buffer of exactly `bytes`, and the bytes the
    /// allocation takes.
    fn fill(mut self, bytes: &[u8]) -> (Buffer, u64) {
        self.write_at(0, bytes);
        let padding = self.len - bytes.len();
        self.zero(bytes.len(), padding);
        let taken = self.len as u64;
        (self.freeze().slice_with_length(0, bytes.len()), taken)
    }

    /// The allocation as an immutable Arrow buffer that keeps its slab alive.
    fn freeze(self) -> Buffer {
        // SAFETY: the range is valid, fully initialised by the caller, and
        // stays allocated while `owner` (which holds the slab) lives; nothing
        // writes to it after this point.
        unsafe { Buffer::from_custom_allocation(self.ptr, self.len, self.owner) }
    }
}

/// What the arena holds, for `stats`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ArenaStats {
    /// Bytes of slabs held from the system (charged to the budget).
    pub held_bytes: u64,
    /// Bytes of live allocations in them.
    pub live_bytes: u64,
    /// Bytes of idle slabs kept for reuse.
    pub idle_bytes: u64,
    /// Size of a regular slab.
    pub slab_bytes: u64,
    /// Whether slabs are page-locked.
    pub pinned: bool,
}

/// The host arena. Cheap to share behind an `Arc`.
pub struct Arena {
    pool: Arc<Pool>,
    /// The slab being filled and the first free byte in it.
    current: Mutex<Option<(Arc<Slab>, usize)>>,
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena")
            .field("stats", &self.stats())
            .finish()
    }
}

impl Arena {
    /// An empty arena of `slab_bytes` slabs from `source`, charged to `budget`.
    pub fn new(budget: Arc<Budget>, slab_bytes: usize, source: HostMemory) -> Self {
        Self {
            pool: Arc::new(Pool {
                budget,
                source,
                slab_bytes: round_up(slab_bytes.max(ALIGN)),
                idle: Mutex::new(Vec::new()),
                live: AtomicU64::new(0),
                held: AtomicU64::new(0),
            }),
            current: Mutex::new(None),
        }
    }

    /// The budget slabs are charged to.
    pub fn budget(&self) -> &Arc<Budget> {
        &self.pool.budget
    }

    /// Current figures.
    pub fn stats(&self) -> ArenaStats {
        let idle = self.pool.idle().iter().map(|m| m.cap as u64).sum();
        ArenaStats {
            held_bytes: self.pool.held.load(Ordering::Acquire),
            live_bytes: self.pool.live.load(Ordering::Acquire),
            idle_bytes: idle,
            slab_bytes: self.pool.slab_bytes as u64,
            pinned: matches!(self.pool.source, HostMemory::Pinned(_)),
        }
    }

    /// Gives idle slabs back to the system and the budget.
    pub fn trim(&self) {
        let idle: Vec<SlabMem> = std::mem::take(&mut *self.pool.idle());
        for mem in idle {
            let cap = mem.cap as u64;
            drop(mem);
            self.pool.held.fetch_sub(cap, Ordering::AcqRel);
            self.pool.budget.release(cap);
        }
    }

    /// `len` bytes (rounded up to [`ALIGN`]), or `ResourceExhausted` naming
    /// `what` when the budget has no room for the slab it needs, even after
    /// idle slabs (and an empty current slab) went back.
    pub fn alloc(&self, len: usize, what: &dyn Fn() -> String) -> Result<ChunkMut> {
        self.alloc_in(len, false, None, what)
    }

    /// [`Arena::alloc`]; `own` puts the allocation in a slab of its own
    /// whatever its size, charged to `reservation` first.
    fn alloc_in(
        &self,
        len: usize,
        own: bool,
        mut reservation: Option<&mut Reservation>,
        what: &dyn Fn() -> String,
    ) -> Result<ChunkMut> {
        match self.try_alloc(len, own, reservation.as_deref_mut(), what) {
            Err(Error::ResourceExhausted(_)) => {
                self.trim();
                {
                    let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
                    if current
                        .as_ref()
                        .is_some_and(|(slab, _)| Arc::strong_count(slab) == 1)
                    {
                        *current = None;
                    }
                }
                self.trim();
                self.try_alloc(len, own, reservation, what)
            }
            other => other,
        }
    }

    fn try_alloc(
        &self,
        len: usize,
        own: bool,
        reservation: Option<&mut Reservation>,
        what: &dyn Fn() -> String,
    ) -> Result<ChunkMut> {
        let need = round_up(len.max(1));
        let slab_bytes = self.pool.slab_bytes;
        let (slab, offset) = if own || need > slab_bytes / 2 {
            // Large: a slab of its own, so the regular slab is not wasted.
            let mem = self.pool.take(need, need, reservation, what)?;
            let slab = Arc::new(Slab {
                mem: Some(mem),
                pool: self.pool.clone(),
            });
            (slab, 0)
        } else {
            let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((slab, cursor)) = current.as_mut() {
                // Only the arena holds it: every allocation in it is gone.
                if Arc::strong_count(slab) == 1 {
                    *cursor = 0;
                }
            }
            match current.as_mut() {
                Some((slab, cursor)) if *cursor + need <= slab.cap() => {
                    let at = *cursor;
                    *cursor += need;
                    self.pool.budget.settle(need as u64, reservation);
                    (slab.clone(), at)
                }
                _ => {
                    let mem = self.pool.take(slab_bytes, need, reservation, what)?;
                    let slab = Arc::new(Slab {
                        mem: Some(mem),
                        pool: self.pool.clone(),
                    });
                    *current = Some((slab.clone(), need));
                    (slab, 0)
                }
            }
        };
        // SAFETY: `offset + need <= cap`, so the pointer stays inside the slab.
        let ptr = unsafe { slab.base().add(offset) };
        let ptr = NonNull::new(ptr)
            .ok_or_else(|| Error::Internal("arena slab without memory".to_string()))?;
        self.pool.live.fetch_add(need as u64, Ordering::AcqRel);
        Ok(ChunkMut {
            ptr,
            len: need,
            owner: Arc::new(Chunk {
                _slab: slab,
                len: need,
                pool: self.pool.clone(),
            }),
        })
    }

    /// A copy of `bytes` in one arena allocation, for data read at random
    /// (packed rows, a filter's selection), drawn on `reservation` first:
    /// where it is large, its memory is asked to be backed
    /// by transparent huge pages, since with 4 KiB pages nearly every row
    /// read at random is a TLB miss. Fails before copying anything when the
    /// budget has no room.
    pub fn copy_bytes(
        &self,
        bytes: &[u8],
        reservation: Option<&mut Reservation>,
        what: &dyn Fn() -> String,
    ) -> Result<Buffer> {
        // A slab of its own starts on a huge page (see `heap_align`); drawn
        // on a reservation, one takes just the bytes set aside (a new
        // regular slab would take more).
        let own = bytes.len() >= HUGE_PAGE || reservation.is_some();
        let chunk = self.alloc_in(bytes.len(), own, reservation, what)?;
        chunk.huge_pages();
        Ok(chunk.fill(bytes).0)
    }

    /// A copy of a received IPC message body in one arena allocation (drawn
    /// on `reservation` first), and the bytes that allocation takes. A
    /// record batch decoded over it lives in the cache as it was received,
    /// with no copy in between, when [`Arena::holds`] says so. Fails before
    /// copying anything when the budget has no room.
    pub fn copy_body(
        &self,
        bytes: &[u8],
        reservation: Option<&mut Reservation>,
        what: &dyn Fn() -> String,
    ) -> Result<(Buffer, u64)> {
        Ok(self
            .alloc_in(bytes.len(), false, reservation, what)?
            .fill(bytes))
    }

    /// Whether `batch`, decoded over `body` (from [`Arena::copy_body`]),
    /// can be kept as it is: every buffer lies inside `body` (none was
    /// decompressed, realigned or taken from a dictionary elsewhere), they
    /// use most of it (no large unused body held), and no fixed-width
    /// column has nulls (the arena's copy zeroes the values under them, see
    /// `copy_into`, and a kept batch must read the same).
    pub fn holds(body: &Buffer, batch: &RecordBatch) -> bool {
        let range = body.as_ptr() as usize..body.as_ptr() as usize + body.len();
        let mut inside = true;
        let mut used = 0usize;
        let mut nulls_under_values = false;
        for column in batch.columns() {
            let data = column.to_data();
            visit_buffers(&data, &mut |bytes| {
                let (start, end) = (
                    bytes.as_ptr() as usize,
                    bytes.as_ptr() as usize + bytes.len(),
                );
                inside &= bytes.is_empty() || (range.contains(&start) && end <= range.end);
                used += bytes.len();
            });
            visit_arrays(&data, &mut |d| {
                nulls_under_values |=
                    d.data_type().is_primitive() && d.nulls().is_some_and(|n| n.null_count() > 0);
            });
        }
        inside && !nulls_under_values && used >= body.len() / 2
    }

    /// A copy of `batch` whose buffers all live in one arena allocation, and
    /// the bytes that allocation takes. Fails before copying anything when
    /// the budget has no room.
    pub fn copy_batch(
        &self,
        batch: &RecordBatch,
        what: &dyn Fn() -> String,
    ) -> Result<(RecordBatch, u64)> {
        self.copy_batch_in(batch, None, what)
    }

    /// [`Arena::copy_batch`] for a writer holding `reservation`: the copy's
    /// bytes are drawn from it first (see [`Reservation`]).
    pub fn copy_batch_in(
        &self,
        batch: &RecordBatch,
        reservation: Option<&mut Reservation>,
        what: &dyn Fn() -> String,
    ) -> Result<(RecordBatch, u64)> {
        let data: Vec<ArrayData> = batch
            .columns()
            .iter()
            .map(|c| own_rows(c.to_data()))
            .collect();
        let mut total = 0usize;
        for d in &data {
            visit_buffers(d, &mut |bytes| total += round_up(bytes.len()));
        }
        if total == 0 {
            return Ok((batch.clone(), 0));
        }
        let mut chunk = self.alloc_in(total, false, reservation, what)?;
        let mut at = 0usize;
        for d in &data {
            copy_into(d, &mut chunk, &mut at);
        }
        let allocated = chunk.len as u64;
        let whole = chunk.freeze();
        let mut at = 0usize;
        let mut next = |len: usize| {
            let b = whole.slice_with_length(at, len);
            at += round_up(len);
            b
        };
        let columns = data
            .iter()
            .map(|d| make_array(rebuild(d, &mut next)))
            .collect();
        let options =
            arrow::array::RecordBatchOptions::new().with_row_count(Some(batch.num_rows()));
        let copied = RecordBatch::try_new_with_options(batch.schema(), columns, &options)
            .map_err(|e| Error::Internal(format!("rebuilding a batch in the arena: {e}")))?;
        Ok((copied, allocated))
    }
}

/// Bytes a column's buffers may hold beyond twice what its rows take before
/// [`own_rows`] copies its rows out.
const SLACK_BYTES: usize = 16 << 10;

/// `data`, or a copy of its rows alone where its buffers hold far more than
/// its rows take: a query's `LIMIT … OFFSET …` slices a stored batch, and a
/// slice of strings or lists keeps every value of the batch (a `derive` of
/// 10 rows of id, string and `array<float>` held 409 KB). The arena then
/// holds, and the budget counts, what the rows take.
fn own_rows(data: ArrayData) -> ArrayData {
    let mut held = 0usize;
    visit_buffers(&data, &mut |bytes| held += bytes.len());
    match own_bytes(&data) {
        Some(own) if held > own.saturating_mul(2).saturating_add(SLACK_BYTES) => {
            let mut copy = MutableArrayData::new(vec![&data], false, data.len());
            // Offsets that would overflow: copied whole, as before.
            let copied = copy.try_extend(0, 0, data.len()).is_ok();
            let copy = copy.freeze();
            if copied { copy } else { data }
        }
        _ => data,
    }
}

/// The bytes `data`'s rows take in buffers of their own (validity, offsets
/// from the first row's, the values they point at); `None` where not worked
/// out (nested types other than lists, views, dictionaries): such columns
/// are copied as they are.
fn own_bytes(data: &ArrayData) -> Option<usize> {
    let len = data.len();
    let nulls = data.nulls().map_or(0, |_| len.div_ceil(8));
    let child = |start: usize, n: usize| {
        let child = data.child_data().first()?;
        (start.checked_add(n)? <= child.len()).then(|| own_bytes(&child.slice(start, n)))?
    };
    let (offset_bytes, (first, n)) = match data.data_type() {
        DataType::Utf8 | DataType::Binary | DataType::List(_) => {
            (4, offset_span(data.buffer::<i32>(0), len)?)
        }
        DataType::LargeUtf8 | DataType::LargeBinary | DataType::LargeList(_) => {
            (8, offset_span(data.buffer::<i64>(0), len)?)
        }
        DataType::FixedSizeList(_, size) => {
            let size = usize::try_from(*size).ok()?;
            let values = child(data.offset().checked_mul(size)?, len.checked_mul(size)?)?;
            return Some(nulls + values);
        }
        t if t.is_primitive() || matches!(t, DataType::Boolean | DataType::Null) => {
            return data.get_slice_memory_size().ok();
        }
        _ => return None,
    };
    let values = match data.data_type() {
        DataType::List(_) | DataType::LargeList(_) => child(first, n)?,
        _ => n,
    };
    Some(nulls + (len + 1) * offset_bytes + values)
}

/// The first of `len` rows' `offsets` and how many values the rows span.
fn offset_span<O: Copy + TryInto<usize>>(offsets: &[O], len: usize) -> Option<(usize, usize)> {
    let first: usize = (*offsets.first()?).try_into().ok()?;
    let last: usize = (*offsets.get(len)?).try_into().ok()?;
    Some((first, last.checked_sub(first)?))
}

/// Calls `f` with the bytes of every buffer of `data`, children included, in
/// the order [`rebuild`] consumes them.
fn visit_buffers(data: &ArrayData, f: &mut dyn FnMut(&[u8])) {
    for b in data.buffers() {
        f(b.as_slice());
    }
    if let Some(nulls) = data.nulls() {
        f(nulls.inner().inner().as_slice());
    }
    for child in data.child_data() {
        visit_buffers(child, f);
    }
}

/// Calls `f` with `data` and each of its descendants.
fn visit_arrays(data: &ArrayData, f: &mut dyn FnMut(&ArrayData)) {
    f(data);
    for child in data.child_data() {
        visit_arrays(child, f);
    }
}

/// Copies the buffers of `data` (children included, [`visit_buffers`]
/// order) into `chunk` from `*at`, each padded to [`ALIGN`] with zeros.
/// Values under null slots of fixed-width primitive arrays are zeroed: Arrow
/// leaves them undefined, and zeroing makes the cache a function of the data
/// alone (a spilled dataset read back from Parquet serves the same bytes).
fn copy_into(data: &ArrayData, chunk: &mut ChunkMut, at: &mut usize) {
    let width = match data.data_type() {
        dt if dt.is_primitive() => Some(dt.primitive_width().unwrap_or(0)),
        _ => None,
    };
    for (i, b) in data.buffers().iter().enumerate() {
        let bytes = b.as_slice();
        chunk.write_at(*at, bytes);
        let padded = round_up(bytes.len());
        chunk.zero(*at + bytes.len(), padded - bytes.len());
        if let (0, Some(w), Some(nulls)) = (i, width, data.nulls())
            && w > 0
            && nulls.null_count() > 0
        {
            for slot in nulls
                .iter()
                .enumerate()
                .filter_map(|(j, valid)| (!valid).then_some(j))
            {
                let start = (data.offset() + slot) * w;
                if start + w <= bytes.len() {
                    chunk.zero(*at + start, w);
                }
            }
        }
        *at += padded;
    }
    if let Some(nulls) = data.nulls() {
        let bytes = nulls.inner().inner().as_slice();
        chunk.write_at(*at, bytes);
        let padded = round_up(bytes.len());
        chunk.zero(*at + bytes.len(), padded - bytes.len());
        *at += padded;
    }
    for child in data.child_data() {
        copy_into(child, chunk, at);
    }
}

/// `data` rebuilt over buffers taken from `next(len)`, in [`visit_buffers`]
/// order.
fn rebuild(data: &ArrayData, next: &mut dyn FnMut(usize) -> Buffer) -> ArrayData {
    let buffers: Vec<Buffer> = data.buffers().iter().map(|b| next(b.len())).collect();
    let nulls = data.nulls().map(|n| {
        let bits = n.inner();
        let buf = next(bits.inner().len());
        // SAFETY: same bits, offset and length as a valid null buffer, so the
        // same null count.
        unsafe {
            NullBuffer::new_unchecked(
                BooleanBuffer::new(buf, bits.offset(), bits.len()),
                n.null_count(),
            )
        }
    });
    let children: Vec<ArrayData> = data.child_data().iter().map(|c| rebuild(c, next)).collect();
    let builder = ArrayData::builder(data.data_type().clone())
        .len(data.len())
        .offset(data.offset())
        .buffers(buffers)
        .child_data(children)
        .nulls(nulls);
    // SAFETY: a byte-for-byte copy of valid array data with the same type,
    // length, offset and layout is valid.
    unsafe { builder.build_unchecked() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{
        Array, ArrayRef, FixedSizeListArray, Float32Array, Int64Array, ListArray, StringArray,
        new_null_array,
    };
    use arrow::buffer::OffsetBuffer;
    use arrow::datatypes::{DataType, Field, Float32Type, Schema};

    fn batch(rows: i64) -> RecordBatch {
        let values = Float32Array::from_iter_values((0..rows * 4).map(|v| v as f32));
        let list = FixedSizeListArray::new(
            Arc::new(Field::new("item", DataType::Float32, false)),
            4,
            Arc::new(values),
            None,
        );
        let ids = Int64Array::from_iter((0..rows).map(|v| (v % 3 != 0).then_some(v)));
        let names = StringArray::from_iter_values((0..rows).map(|v| format!("row{v}")));
        let schema = Schema::new(vec![
            Field::new("x", list.data_type().clone(), false),
            Field::new("id", DataType::Int64, true),
            Field::new("name", DataType::Utf8, false),
            Field::new("none", DataType::Float64, true),
        ]);
        RecordBatch::try_new(
            Arc::new(schema),
            vec![
                Arc::new(list),
                Arc::new(ids),
                Arc::new(names),
                new_null_array(&DataType::Float64, rows as usize),
            ],
        )
        .expect("valid batch")
    }

    fn arena(limit: u64, slab: usize) -> Arena {
        Arena::new(Budget::new(limit), slab, HostMemory::Heap)
    }

    #[test]
    fn copies_are_equal_aligned_and_live_in_the_arena() {
        let arena = arena(64 << 20, 1 << 20);
        let original = batch(1000);
        let (copy, bytes) = arena.copy_batch(&original, &|| "t".into()).expect("fits");
        assert_eq!(copy, original);
        copy.column(0).to_data().validate_full().expect("valid");
        copy.column(2).to_data().validate_full().expect("valid");
        let stats = arena.stats();
        assert_eq!(stats.live_bytes, bytes);
        assert_eq!(stats.held_bytes, 1 << 20);
        assert_eq!(arena.budget().used(), 1 << 20);
        for col in copy.columns() {
            for b in col.to_data().buffers() {
                assert_eq!(b.as_ptr() as usize % ALIGN, 0, "aligned");
            }
        }
        drop(copy);
        assert_eq!(arena.stats().live_bytes, 0);
    }

    /// `batch` as a writer sends it: one IPC record batch message, header
    /// and body.
    fn ipc_message(batch: &RecordBatch) -> (Vec<u8>, Vec<u8>) {
        use arrow::ipc::writer::{
            DictionaryTracker, IpcDataGenerator, IpcWriteContext, IpcWriteOptions,
        };
        let (_, encoded) = IpcDataGenerator::default()
            .encode(
                batch,
                &mut DictionaryTracker::new(false),
                &IpcWriteOptions::default(),
                &mut IpcWriteContext::default(),
            )
            .expect("encodes");
        (encoded.ipc_message, encoded.arrow_data)
    }

    /// The batch `header` describes, decoded over `body` without copying.
    fn decode_over(header: &[u8], body: &Buffer, schema: &Arc<Schema>) -> RecordBatch {
        let message = arrow::ipc::root_as_message(header).expect("a message");
        arrow::ipc::reader::read_record_batch(
            body,
            message.header_as_record_batch().expect("a record batch"),
            schema.clone(),
            &Default::default(),
            None,
            &message.version(),
        )
        .expect("decodes")
    }

    #[test]
    fn a_batch_decoded_over_its_landed_body_is_kept_as_it_came() {
        let arena = arena(64 << 20, 1 << 20);
        let values = Float32Array::from_iter_values((0..4000).map(|v| v as f32));
        let names = StringArray::from_iter_values((0..1000).map(|v| format!("row{v}")));
        let list = FixedSizeListArray::new(
            Arc::new(Field::new("item", DataType::Float32, false)),
            4,
            Arc::new(values),
            None,
        );
        let schema = Arc::new(Schema::new(vec![
            Field::new("x", list.data_type().clone(), false),
            Field::new("name", DataType::Utf8, false),
        ]));
        let plain = RecordBatch::try_new(schema.clone(), vec![Arc::new(list), Arc::new(names)])
            .expect("a batch");
        let (header, body) = ipc_message(&plain);
        let (landed, taken) = arena.copy_body(&body, None, &|| "t".into()).expect("fits");
        assert_eq!(taken, round_up(body.len()) as u64);
        assert_eq!(arena.stats().live_bytes, taken);
        let kept = decode_over(&header, &landed, &schema);
        assert_eq!(kept, plain);
        assert!(Arena::holds(&landed, &kept));
        // Not decoded over that body: the same values elsewhere.
        assert!(!Arena::holds(&landed, &plain));
        drop(landed);
        // Nulls in a fixed-width column: the arena's copy zeroes what lies
        // under them, so such a batch is copied, not kept.
        let with_nulls = batch(1000);
        let (header, body) = ipc_message(&with_nulls);
        let (landed, _) = arena.copy_body(&body, None, &|| "t".into()).expect("fits");
        let decoded = decode_over(&header, &landed, &with_nulls.schema());
        assert_eq!(decoded, with_nulls);
        assert!(!Arena::holds(&landed, &decoded));
        drop((decoded, landed));
        // What was kept holds its allocation alone, and frees it when it
        // goes, like a copy.
        assert_eq!(arena.stats().live_bytes, taken);
        drop(kept);
        assert_eq!(arena.stats().live_bytes, 0);
    }

    #[test]
    fn slabs_are_reused_and_returned_to_the_budget() {
        let arena = arena(8 << 20, 1 << 20);
        // Each batch is ~100 KiB; many batches fill several slabs.
        let original = batch(2500);
        let copies: Vec<_> = (0..30)
            .map(|_| arena.copy_batch(&original, &|| "t".into()).expect("fits").0)
            .collect();
        let held = arena.stats().held_bytes;
        assert!(held >= 3 << 20, "{held}");
        assert!(arena.budget().used() <= 8 << 20);
        drop(copies);
        let stats = arena.stats();
        assert_eq!(stats.live_bytes, 0);
        // The current slab and up to MAX_IDLE_SLABS idle ones are kept.
        assert!(
            stats.held_bytes <= (1 + MAX_IDLE_SLABS as u64) << 20,
            "{stats:?}"
        );
        assert_eq!(stats.held_bytes, arena.budget().used());
        arena.trim();
        assert!(arena.budget().used() <= 1 << 20);
        // Reuse: the same work again holds no more than before.
        let again: Vec<_> = (0..30)
            .map(|_| arena.copy_batch(&original, &|| "t".into()).expect("fits").0)
            .collect();
        assert_eq!(arena.stats().held_bytes, held);
        drop(again);
    }

    #[test]
    fn refuses_before_copying_when_the_budget_is_full() {
        let arena = arena(2 << 20, 1 << 20);
        let original = batch(2500);
        let mut kept = Vec::new();
        let err = loop {
            match arena.copy_batch(&original, &|| "partition 7 of 'd'".into()) {
                Ok((b, _)) => kept.push(b),
                Err(e) => break e,
            }
            assert!(kept.len() < 100, "never refused");
        };
        assert!(matches!(err, Error::ResourceExhausted(_)), "{err}");
        assert!(err.to_string().contains("partition 7 of 'd'"), "{err}");
        assert!(arena.budget().used() <= 2 << 20);
        // Large allocations take a slab of their own, also within the budget.
        let big = batch(30_000);
        assert!(arena.copy_batch(&big, &|| "big".into()).is_err());
        drop(kept);
        let (copy, _) = arena.copy_batch(&big, &|| "big".into()).expect("fits now");
        assert_eq!(copy, big);
        assert!(arena.budget().used() <= 2 << 20);
    }

    #[test]
    fn sliced_and_empty_batches_copy() {
        let arena = arena(16 << 20, 1 << 20);
        let original = batch(100).slice(10, 50);
        let (copy, _) = arena.copy_batch(&original, &|| "t".into()).expect("fits");
        assert_eq!(copy, original);
        let empty = batch(0);
        let (copy, _) = arena.copy_batch(&empty, &|| "t".into()).expect("fits");
        assert_eq!(copy.num_rows(), 0);
        assert!(copy.column(1).is_empty());
    }

    #[test]
    fn a_small_slice_of_a_large_batch_takes_what_its_rows_take() {
        let arena = arena(64 << 20, 1 << 20);
        // Strings, a fixed_size_list, nulls, and lists of floats (Spark's
        // array<float>) and of strings.
        let whole = batch(20_000);
        let lists = |rows: usize| {
            let floats = ListArray::from_iter_primitive::<Float32Type, _, _>(
                (0..rows).map(|r| Some((0..r % 5).map(|v| Some(v as f32)))),
            );
            let names = StringArray::from_iter_values((0..rows * 3).map(|v| format!("n{v}")));
            let strings = ListArray::new(
                Arc::new(Field::new("item", DataType::Utf8, false)),
                OffsetBuffer::from_lengths(std::iter::repeat_n(3, rows)),
                Arc::new(names),
                None,
            );
            (floats, strings)
        };
        let (floats, strings) = lists(20_000);
        let mut fields = whole.schema().fields().to_vec();
        fields.push(Arc::new(Field::new(
            "floats",
            floats.data_type().clone(),
            true,
        )));
        fields.push(Arc::new(Field::new(
            "strings",
            strings.data_type().clone(),
            true,
        )));
        let mut columns = whole.columns().to_vec();
        columns.extend([Arc::new(floats) as ArrayRef, Arc::new(strings)]);
        let whole = RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).expect("batch");
        let (_, all) = arena.copy_batch(&whole, &|| "t".into()).expect("fits");
        // Ten rows as a query's LIMIT 10 OFFSET 1500 cuts them.
        let part = whole.slice(1500, 10);
        let (copy, bytes) = arena.copy_batch(&part, &|| "t".into()).expect("fits");
        assert_eq!(copy, part);
        for column in copy.columns() {
            column.to_data().validate_full().expect("valid");
        }
        assert!(bytes < 8 << 10, "10 rows took {bytes} bytes of {all}");
        // A batch that is its rows is copied as it is, byte for byte.
        let (copy, again) = arena.copy_batch(&whole, &|| "t".into()).expect("fits");
        assert_eq!((copy, again), (whole.clone(), all));
        // A slice of most of a batch keeps its buffers (no second copy).
        let most = whole.slice(1000, 15_000);
        let (copy, _) = arena.copy_batch(&most, &|| "t".into()).expect("fits");
        assert_eq!(copy, most);
        let strings = copy.column(2).to_data();
        assert_eq!(
            strings.buffers()[1].len(),
            whole.column(2).to_data().buffers()[1].len()
        );
    }

    #[test]
    fn values_under_nulls_are_zeroed() {
        let arena = arena(16 << 20, 1 << 20);
        // A null slot over a non-zero value, as some writers leave them.
        let data = Int64Array::from(vec![7, 8, 9]).into_data();
        let nulls = NullBuffer::from(vec![true, false, true]);
        let with_garbage = Int64Array::from(
            data.into_builder()
                .nulls(Some(nulls))
                .build()
                .expect("valid"),
        );
        assert_eq!(with_garbage.values()[1], 8);
        let schema = Schema::new(vec![Field::new("v", DataType::Int64, true)]);
        let b =
            RecordBatch::try_new(Arc::new(schema), vec![Arc::new(with_garbage)]).expect("batch");
        let (copy, _) = arena.copy_batch(&b, &|| "t".into()).expect("fits");
        assert_eq!(copy, b, "logically equal");
        let v = copy
            .column(0)
            .as_any()
            .downcast_ref::<Int64Array>()
            .expect("i64");
        assert_eq!(v.values().to_vec(), vec![7, 0, 9]);
        // Sliced: the slot index is relative to the slice.
        let (copy, _) = arena
            .copy_batch(&b.slice(1, 2), &|| "t".into())
            .expect("fits");
        let v = copy
            .column(0)
            .as_any()
            .downcast_ref::<Int64Array>()
            .expect("i64");
        assert_eq!(v.values().to_vec(), vec![0, 9]);
    }

    #[test]
    fn slab_size_follows_small_budgets() {
        assert_eq!(slab_bytes_for(64 << 30), DEFAULT_SLAB_BYTES);
        assert_eq!(slab_bytes_for(64 << 20), 4 << 20);
        assert_eq!(slab_bytes_for(1 << 20), 64 << 10);
        assert_eq!(slab_bytes_for(32 << 10), 32 << 10);
    }
}
