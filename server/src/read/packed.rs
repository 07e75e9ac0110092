//! Packed rows: a row-major copy of a sealed dataset's fixed-width columns,
//! so that a read of scattered rows fetches one contiguous record per row
//! instead of one cache line per column. Rows are scattered when the order
//! is shuffled, and also when several ranks share an unshuffled one: rank
//! `r` of `W` takes every `W`-th row, so column by column each rank would
//! pull in every cache line of every column for the few values it keeps
//! (`W` times the dataset's bytes from memory per epoch, over all ranks).
//!
//! The copy sits *beside* the columnar batches rather than replacing them:
//! every other reader of a sealed dataset (a single rank's unshuffled
//! read, the device tier, the trainer, spill and persist) keeps using
//! Arrow columns unchanged, and a run of neighbouring rows is already a
//! forward stream the packed layout cannot beat. The copy is built at the
//! first scattered read after the dataset has served one epoch's worth of
//! scattered streams (so a dataset read once holds its columns alone;
//! [`PackedCache::worth_packing`]), lives in the arena (so it counts in the
//! memory budget), is only built when the budget has room for it without
//! spilling anything, and is the first thing given up when memory is
//! needed ([`PackedCache::give_up`]). A dataset brought back from the store
//! is packed again at its next scattered read.
//!
//! Which columns are packed is the gather's choice of byte-copied columns
//! (fixed-width values without nulls, and lists whose rows all hold one
//! number of values; on a cluster's member, those its layout gathers as
//! bytes on every member); the gather transposes a small tile of records
//! at a time (each where it lies in the copy) back into columns, so the
//! arrays it produces are the ones the columnar gather produces.
//! The build is that transpose the other way: a block of records small
//! enough to stay in cache at a time, every column written into it (eight
//! side-by-side 4-byte columns eight rows at a time, in registers), and a
//! large copy's stored batches split over a few threads.
//!
//! Within a stored batch the records are grouped by the row's residue modulo
//! a stride `W` (the world size of the read that builds the copy; 1 keeps
//! storage order): the batch's rows `0, W, 2W, …` first, then `1, W + 1,
//! …`, and so on ([`Packed::position`]). An unshuffled read by `W` ranks
//! gives rank `r` the rows of one residue of the dataset's row numbers
//! (of the cluster's, for a cluster-wide read), which within one batch is
//! one residue of the batch's own rows: its rows of a batch are one run of
//! records back to back, which the gather copies into its tile as one
//! forward stream instead of fetching every record from its own place. A
//! shuffled read fetches records at random in any layout, and a read by
//! another number of ranks is strided, as it would be in storage order.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use arrow::buffer::Buffer;

use crate::catalog::SealedData;
use crate::error::{Error, Result};
use crate::memory::arena::Arena;
use crate::memory::device::{ColumnSegments, segments_at};
use crate::metrics::Metrics;

use super::{Untile, untile_steps};

/// Where one column's bytes sit in a packed record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    /// Byte offset in the record.
    pub offset: usize,
    /// Bytes of the column per row.
    pub width: usize,
}

/// A sealed dataset's fixed-width columns as row-major records, one buffer
/// per stored batch.
#[derive(Debug)]
pub struct Packed {
    /// Per column of the schema: its slot, when it is packed.
    slots: Vec<Option<Slot>>,
    /// Bytes per record.
    record: usize,
    /// Per stored batch: its rows' records, back to back, grouped by
    /// residue modulo `stride`.
    batches: Vec<Buffer>,
    /// The residue groups' stride (at least 1).
    stride: usize,
    /// Per stored batch: rows `/` stride and rows `%` stride (the sizes of
    /// its residue groups: the first `%` have one row more).
    groups: Vec<(usize, usize)>,
}

impl Packed {
    /// Packs every column of `data` that has fixed-width values and no
    /// nulls, lists whose rows all hold one number of values among them
    /// (with `only`, per column of the schema, just those it says: a
    /// cluster's member packs its layout's byte-gathered columns, so that
    /// every member lays its records out alike); `None` when fewer than
    /// two columns qualify (one column is already contiguous per row) or
    /// there are no rows. Each batch's records are grouped by row residue
    /// modulo `stride` (see the module overview; 0 is taken as 1). Memory
    /// comes from `arena`; a full budget is a `ResourceExhausted` error and
    /// nothing is kept. Large copies are built by several threads, a range
    /// of stored batches each.
    pub fn build(
        data: &SealedData,
        arena: &Arena,
        dataset: &str,
        (stride, only): (usize, Option<&[bool]>),
    ) -> Result<Option<Self>> {
        Self::build_on(data, arena, dataset, (stride, only), None)
    }

    /// [`Self::build`] on `threads` threads (`None`: as many as its size
    /// and the cores call for).
    fn build_on(
        data: &SealedData,
        arena: &Arena,
        dataset: &str,
        (stride, only): (usize, Option<&[bool]>),
        threads: Option<usize>,
    ) -> Result<Option<Self>> {
        let stride = stride.max(1);
        let mut slots = Vec::with_capacity(data.schema().fields().len());
        let mut segments = Vec::new();
        let mut record = 0usize;
        for i in 0..data.schema().fields().len() {
            if only.is_some_and(|o| !o.get(i).copied().unwrap_or(false)) {
                slots.push(None);
                continue;
            }
            match segments_at(data, i) {
                Ok(s) => {
                    let width = s.element.primitive_width().unwrap_or(1) * s.width;
                    slots.push(Some(Slot {
                        offset: record,
                        width,
                    }));
                    record += width;
                    segments.push((record - width, width, s));
                }
                Err(_) => slots.push(None),
            }
        }
        if segments.len() < 2 || data.rows() == 0 {
            return Ok(None);
        }
        let what = || format!("packing the rows of dataset '{dataset}' for scattered reads");
        // Refused up front when it cannot fit: a build that fills the
        // budget and fails near its end would be repeated, in vain, by
        // every scattered stream.
        let needed = data.rows().saturating_mul(record as u64);
        let room = arena.budget().free() + arena.stats().idle_bytes;
        if needed > room {
            return Err(Error::ResourceExhausted(format!(
                "{}: {needed} bytes needed, {room} free",
                what()
            )));
        }
        let groups: Vec<(usize, usize)> = data
            .batches()
            .iter()
            .map(|b| (b.num_rows() / stride, b.num_rows() % stride))
            .collect();
        let pack = Pack {
            columns: &segments,
            // The gather's untile steps over the record's slots, taken
            // the other way: runs of eight side-by-side 4-byte columns
            // transposed together, every other column on its own.
            steps: untile_steps(
                &segments
                    .iter()
                    .enumerate()
                    .map(|(i, &(offset, width, _))| (i, Slot { offset, width }))
                    .collect::<Vec<_>>(),
            ),
            record,
            stride,
        };
        // Batches split into contiguous ranges, one per thread: the
        // streams waiting for the copy hold their threads idle meanwhile,
        // and most of a build is the kernel giving the copy fresh pages,
        // which runs in parallel as well.
        let threads = threads
            .unwrap_or_else(|| build_threads(groups.len(), needed))
            .clamp(1, groups.len().max(1));
        let per_thread = groups.len().div_ceil(threads);
        let ranges: Vec<std::ops::Range<usize>> = (0..groups.len())
            .step_by(per_thread.max(1))
            .map(|first| first..(first + per_thread).min(groups.len()))
            .collect();
        let build = |range| pack.batches(range, &groups, arena, &what);
        let build = &build;
        let parts: Vec<Result<Vec<Buffer>>> = std::thread::scope(|scope| {
            // The first range on this thread, every other on one of its own
            // (one that cannot be started is built here too, after).
            let others: Vec<_> = ranges
                .iter()
                .skip(1)
                .map(|range| {
                    let (range, again) = (range.clone(), range.clone());
                    std::thread::Builder::new()
                        .name("flightdeck-pack".to_string())
                        .spawn_scoped(scope, move || build(range))
                        .map_err(|_| again)
                })
                .collect();
            let mut parts = Vec::with_capacity(ranges.len());
            parts.extend(ranges.first().cloned().map(build));
            for other in others {
                parts.push(match other {
                    Ok(thread) => thread.join().unwrap_or_else(|_| {
                        Err(Error::Internal(format!(
                            "{}: a packing thread panicked",
                            what()
                        )))
                    }),
                    Err(range) => build(range),
                });
            }
            parts
        });
        let mut batches = Vec::with_capacity(groups.len());
        for part in parts {
            batches.extend(part?);
        }
        Ok(Some(Self {
            slots,
            record,
            batches,
            stride,
            groups,
        }))
    }

    /// The residue groups' stride: an unshuffled read by this many ranks
    /// finds each rank's rows of a batch back to back.
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// Which record of stored batch `b` holds its row `r`.
    #[inline]
    pub fn position(&self, b: usize, r: usize) -> usize {
        if self.stride == 1 {
            r
        } else {
            position(self.groups[b], self.stride, r)
        }
    }

    /// Record `at` of stored batch `b` (a [`Self::position`]).
    #[inline]
    pub fn at(&self, b: usize, at: usize) -> &[u8] {
        &self.batch(b)[at * self.record..][..self.record]
    }

    /// The slot of column `index` of the schema, when it is packed.
    pub fn slot(&self, index: usize) -> Option<Slot> {
        self.slots.get(index).copied().flatten()
    }

    /// Bytes per record.
    pub fn record(&self) -> usize {
        self.record
    }

    /// The records of stored batch `b`.
    pub fn batch(&self, b: usize) -> &[u8] {
        self.batches[b].as_slice()
    }

    /// Bytes the copy holds.
    pub fn bytes(&self) -> u64 {
        self.batches.iter().map(|b| b.len() as u64).sum()
    }
}

/// Where row `r` of a batch whose rows are `(quotient, remainder)` times
/// `stride` sits when its rows are grouped by residue: the groups of
/// residues `0..remainder` hold `quotient + 1` rows, the others `quotient`,
/// and within a group rows keep their order.
#[inline]
fn position((quotient, remainder): (usize, usize), stride: usize, r: usize) -> usize {
    let residue = r % stride;
    residue * quotient + residue.min(remainder) + r / stride
}

/// Most threads a build uses, and the fewest bytes of records each is
/// given (below that, one thread does it all).
const BUILD_THREADS: usize = 8;
const BUILD_BYTES_PER_THREAD: u64 = 16 << 20;
/// Bytes of records a build fills column by column before it moves on: the
/// block stays in cache while every column is written into it (written a
/// whole batch per column, each value lands on a line of its own and every
/// column pass went back out to memory).
const BUILD_BLOCK_BYTES: usize = 32 << 10;

/// Threads to build a copy of `batches` stored batches and `bytes` bytes
/// of records with.
fn build_threads(batches: usize, bytes: u64) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let by_size = usize::try_from(bytes / BUILD_BYTES_PER_THREAD).unwrap_or(usize::MAX);
    cores.min(BUILD_THREADS).min(by_size).min(batches).max(1)
}

/// What a build writes into each record: the packed columns as `(offset,
/// width, values batch by batch)`, the steps that write them, the record's
/// bytes and the stride.
struct Pack<'a> {
    columns: &'a [(usize, usize, Arc<ColumnSegments>)],
    steps: Vec<Untile>,
    record: usize,
    stride: usize,
}

impl Pack<'_> {
    /// The records of stored batches `range` (`groups`: every batch's
    /// residue group sizes), each copied into one arena allocation.
    fn batches(
        &self,
        range: std::ops::Range<usize>,
        groups: &[(usize, usize)],
        arena: &Arena,
        what: &dyn Fn() -> String,
    ) -> Result<Vec<Buffer>> {
        let (mut staged, mut places) = (Vec::new(), Vec::new());
        range
            .map(|b| {
                self.batch(b, groups[b], &mut staged, &mut places);
                arena.copy_bytes(&staged, None, what)
            })
            .collect()
    }

    /// Fills `staged` with the records of stored batch `b`, whose residue
    /// groups are `shape`, a block of rows at a time.
    fn batch(
        &self,
        b: usize,
        shape: (usize, usize),
        staged: &mut Vec<u8>,
        places: &mut Vec<usize>,
    ) {
        let rows = shape.0 * self.stride + shape.1;
        places.clear();
        places.extend((0..rows).map(|r| position(shape, self.stride, r) * self.record));
        // Every byte is written below (the slots tile the record and the
        // places are a permutation), so a buffer kept from the batch before
        // needs no zeroing.
        staged.resize(rows * self.record, 0);
        let block = (BUILD_BLOCK_BYTES / self.record).max(16);
        for first in (0..rows).step_by(block) {
            let end = rows.min(first + block);
            let places = &places[first..end];
            let values = |i: usize| {
                let (_, width, column) = &self.columns[i];
                &column.segments[b].as_slice()[first * width..end * width]
            };
            for &step in &self.steps {
                match step {
                    Untile::Eight(i) => {
                        let eight = std::array::from_fn(|k| values(i + k));
                        pack_eight(eight, places, self.columns[i].0, self.record, staged);
                    }
                    Untile::One(i) => {
                        let (offset, width, _) = self.columns[i];
                        tile_column(values(i), width, places, &mut staged[offset..]);
                    }
                }
            }
        }
    }
}

/// Writes eight 4-byte columns (`columns[k]`: the `k`-th one's values of
/// the rows `places` names, row by row) side by side at `offset` of each
/// row's record (`places[i]`: the byte of `into` where row `i`'s
/// `record`-byte record starts): eight rows at a time transposed in
/// registers and stored 32 bytes a record where the CPU has AVX, the rows
/// left (and every row elsewhere) value by value. The inverse of the
/// gather's `untile_eight`.
#[allow(unsafe_code)]
fn pack_eight(
    columns: [&[u8]; 8],
    places: &[usize],
    offset: usize,
    record: usize,
    into: &mut [u8],
) {
    let rows = places.len();
    assert!(offset + 32 <= record && columns.iter().all(|c| c.len() == rows * 4));
    assert!(places.iter().all(|&at| at + record <= into.len()));
    #[cfg(target_arch = "x86_64")]
    let done = if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: the CPU has the feature `pack_eight_avx` is compiled for;
        // each column holds `rows` values and every place leaves room for
        // 32 bytes at `offset` inside `into` (both checked above).
        unsafe { pack_eight_avx(columns, places, offset, into) }
    } else {
        0
    };
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    for (i, &at) in places.iter().enumerate().skip(done) {
        for (k, column) in columns.iter().enumerate() {
            into[at + offset + 4 * k..][..4].copy_from_slice(&column[4 * i..4 * i + 4]);
        }
    }
}

/// The AVX part of [`pack_eight`]: rows `0..` eight at a time (two 4 × 4
/// transposes a lane, the halves of each record's 32 bytes then paired
/// across lanes); returns the rows written, the rest left to the caller.
///
/// # Safety
///
/// Each of `columns` holds `places.len()` 4-byte values, and `at + offset
/// + 32 <= into.len()` for every `at` of `places`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
#[allow(unsafe_code)]
unsafe fn pack_eight_avx(
    columns: [&[u8]; 8],
    places: &[usize],
    offset: usize,
    into: &mut [u8],
) -> usize {
    use std::arch::x86_64::*;
    let rows = places.len();
    let base = into.as_mut_ptr();
    let mut i = 0;
    while i + 8 <= rows {
        // SAFETY: the loads read values `i..i + 8` of each column (`i + 8
        // <= rows`); the stores write 32 bytes at `places[i + j] + offset`,
        // inside `into` by the caller's promise.
        unsafe {
            let c = columns.map(|column| _mm256_loadu_ps(column.as_ptr().add(4 * i).cast()));
            let t = [
                _mm256_unpacklo_ps(c[0], c[1]),
                _mm256_unpackhi_ps(c[0], c[1]),
                _mm256_unpacklo_ps(c[2], c[3]),
                _mm256_unpackhi_ps(c[2], c[3]),
                _mm256_unpacklo_ps(c[4], c[5]),
                _mm256_unpackhi_ps(c[4], c[5]),
                _mm256_unpacklo_ps(c[6], c[7]),
                _mm256_unpackhi_ps(c[6], c[7]),
            ];
            // Row j's first four values (columns 0..4) in `low[j % 4]`, lane
            // j / 4; its last four in `high[j % 4]`.
            let low = [
                _mm256_shuffle_ps::<0x44>(t[0], t[2]),
                _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
                _mm256_shuffle_ps::<0x44>(t[1], t[3]),
                _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
            ];
            let high = [
                _mm256_shuffle_ps::<0x44>(t[4], t[6]),
                _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
                _mm256_shuffle_ps::<0x44>(t[5], t[7]),
                _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
            ];
            for j in 0..4 {
                let first = _mm256_permute2f128_ps::<0x20>(low[j], high[j]);
                let second = _mm256_permute2f128_ps::<0x31>(low[j], high[j]);
                _mm256_storeu_ps(base.add(places[i + j] + offset).cast(), first);
                _mm256_storeu_ps(base.add(places[i + j + 4] + offset).cast(), second);
            }
        }
        i += 8;
    }
    i
}

/// Writes each `width`-byte value of `column` at the byte of `into` that
/// `places` gives its row (the common widths as fixed-size copies).
fn tile_column(column: &[u8], width: usize, places: &[usize], into: &mut [u8]) {
    match width {
        1 => tile_rows::<1>(column, places, into),
        2 => tile_rows::<2>(column, places, into),
        4 => tile_rows::<4>(column, places, into),
        8 => tile_rows::<8>(column, places, into),
        16 => tile_rows::<16>(column, places, into),
        n => {
            for (value, &at) in column.chunks_exact(n).zip(places) {
                into[at..][..n].copy_from_slice(value);
            }
        }
    }
}

/// Writes each `N`-byte value of `column` at the byte of `into` that
/// `places` gives its row.
fn tile_rows<const N: usize>(column: &[u8], places: &[usize], into: &mut [u8]) {
    for (value, &at) in column.chunks_exact(N).zip(places) {
        let mut v = [0u8; N];
        v.copy_from_slice(value);
        into[at..][..N].copy_from_slice(&v);
    }
}

/// A sealed dataset's packed copy, built on demand and given up under
/// memory pressure.
#[derive(Debug, Default)]
pub struct PackedCache {
    copy: Mutex<Option<Arc<Packed>>>,
    /// Scattered streams begun over the dataset (see [`Self::worth_packing`]).
    scattered: AtomicU64,
}

impl PackedCache {
    /// Counts one more scattered stream over the dataset, one of the
    /// `ranks` streams an epoch of its plan begins here, and says whether
    /// it should gather from packed rows: once the dataset has begun as
    /// many scattered streams as one epoch has (its first epoch is read
    /// column by column), or whenever a copy is already held. A dataset
    /// read once (ingest, then one epoch) so keeps its memory at the
    /// columns alone: the copy doubles what a dataset holds, though its
    /// build now costs less than one epoch column by column saves.
    pub fn worth_packing(&self, ranks: u64) -> bool {
        let before = self.scattered.fetch_add(1, Ordering::Relaxed);
        before >= ranks.max(1) || self.bytes() > 0
    }

    /// The packed copy, building it first when there is none; `None` when
    /// the dataset has nothing worth packing or the budget has no room (the
    /// read then gathers column by column, as before). Concurrent callers
    /// wait for one build.
    ///
    /// `(stride, only)` shape a new copy (see [`Packed::build`]); a copy
    /// already held keeps its own. A build that keeps its copy is logged
    /// and its time observed in `metrics`.
    pub fn get_or_build(
        &self,
        data: &SealedData,
        arena: &Arena,
        dataset: &str,
        shape: (usize, Option<&[bool]>),
        metrics: &Metrics,
    ) -> Option<Arc<Packed>> {
        let mut slot = self.copy.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(packed) = slot.as_ref() {
            return Some(packed.clone());
        }
        let start = std::time::Instant::now();
        match Packed::build(data, arena, dataset, shape) {
            Ok(Some(packed)) => {
                // Once per dataset (again after a spill, a restart or the
                // copy given up for memory): its scattered reads waited.
                let took = start.elapsed();
                tracing::info!(
                    dataset,
                    bytes = packed.bytes(),
                    ms = took.as_secs_f64() * 1e3,
                    "packed rows for scattered reads"
                );
                metrics.packed(took);
                let packed = Arc::new(packed);
                *slot = Some(packed.clone());
                Some(packed)
            }
            Ok(None) => None,
            Err(e) => {
                tracing::debug!(dataset, error = %e, "rows not packed; gathering column by column");
                None
            }
        }
    }

    /// Gives the packed copy up (its memory returns to the budget once the
    /// reads using it end); the bytes it held, 0 when there was none or a
    /// build is under way.
    pub fn give_up(&self) -> u64 {
        let Ok(mut slot) = self.copy.try_lock() else {
            return 0;
        };
        slot.take().map_or(0, |p| p.bytes())
    }

    /// Bytes of the packed copy now held.
    pub fn bytes(&self) -> u64 {
        self.copy
            .try_lock()
            .ok()
            .and_then(|s| s.as_ref().map(|p| p.bytes()))
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::Budget;
    use crate::memory::arena::HostMemory;
    use arrow::array::{ArrayRef, Float32Array, Float64Array, Int16Array, Int64Array, RecordBatch};
    use arrow::datatypes::{DataType, Field, Schema};
    use proptest::prelude::*;

    proptest! {
        /// Grouping by residue moves every row to its own record, and each
        /// residue's rows (one rank's rows of an unshuffled read by
        /// `stride` ranks) are back to back, in order.
        #[test]
        fn residue_groups_are_a_permutation_with_each_group_one_run(
            rows in 0usize..300,
            stride in 1usize..20,
        ) {
            let shape = (rows / stride, rows % stride);
            let places: Vec<usize> = (0..rows).map(|r| position(shape, stride, r)).collect();
            let mut seen = vec![false; rows];
            for &p in &places {
                prop_assert!(p < rows && !seen[p]);
                seen[p] = true;
            }
            for residue in 0..stride.min(rows) {
                let first = places[residue];
                for (k, r) in (residue..rows).step_by(stride).enumerate() {
                    prop_assert_eq!(places[r], first + k);
                }
            }
        }
    }

    #[test]
    fn each_row_is_found_in_its_record_whatever_the_stride() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("a", DataType::Int64, false),
            Field::new("b", DataType::Float64, false),
        ]));
        let batch = |start: i64, rows: i64| {
            RecordBatch::try_new(
                schema.clone(),
                vec![
                    Arc::new(Int64Array::from_iter_values(start..start + rows)),
                    Arc::new(Float64Array::from_iter_values(
                        (start..start + rows).map(|v| v as f64 * 0.5),
                    )),
                ],
            )
            .expect("batch")
        };
        let data =
            SealedData::from_batches(schema.clone(), vec![], vec![batch(0, 7), batch(7, 100)]);
        let arena = Arena::new(Budget::new(8 << 20), 1 << 16, HostMemory::Heap);
        for stride in [0, 1, 3, 8, 200] {
            let packed = Packed::build(&data, &arena, "d", (stride, None))
                .expect("fits")
                .expect("packed");
            assert_eq!(packed.stride(), stride.max(1));
            for (b, rows) in [(0, 0..7i64), (1, 7..107)] {
                for (r, v) in rows.enumerate() {
                    let record = packed.at(b, packed.position(b, r));
                    let mut want = v.to_le_bytes().to_vec();
                    want.extend_from_slice(&(v as f64 * 0.5).to_le_bytes());
                    assert_eq!(record, &want[..], "stride {stride} batch {b} row {r}");
                }
            }
        }
    }

    #[test]
    fn side_by_side_float_columns_are_packed_eight_at_a_time_into_the_same_records() {
        // int64, eight float32 (one transposed run), an int16 that breaks
        // the run, nine float32 (a run and one more): a 78-byte record,
        // blocks of 420 rows (4 rows past the last eight of each), batches
        // shorter than eight rows, and every tail.
        let mut fields = vec![Field::new("id", DataType::Int64, false)];
        fields.extend((0..8).map(|k| Field::new(format!("a{k}"), DataType::Float32, false)));
        fields.push(Field::new("s", DataType::Int16, false));
        fields.extend((0..9).map(|k| Field::new(format!("b{k}"), DataType::Float32, false)));
        let schema = Arc::new(Schema::new(fields));
        let value = |v: i64, k: usize| v as f32 * 0.25 + k as f32 * 1000.0;
        let batch = |start: i64, rows: i64| {
            let ids = start..start + rows;
            let mut columns: Vec<ArrayRef> =
                vec![Arc::new(Int64Array::from_iter_values(ids.clone()))];
            columns.extend((0..8).map(|k| {
                Arc::new(Float32Array::from_iter_values(
                    ids.clone().map(|v| value(v, k)),
                )) as ArrayRef
            }));
            columns.push(Arc::new(Int16Array::from_iter_values(
                ids.clone().map(|v| v as i16),
            )));
            columns.extend((8..17).map(|k| {
                Arc::new(Float32Array::from_iter_values(
                    ids.clone().map(|v| value(v, k)),
                )) as ArrayRef
            }));
            RecordBatch::try_new(schema.clone(), columns).expect("batch")
        };
        let sizes = [7i64, 100, 1003, 8];
        let mut batches = Vec::new();
        let mut start = 0;
        for rows in sizes {
            batches.push(batch(start, rows));
            start += rows;
        }
        let data = SealedData::from_batches(schema.clone(), vec![], batches);
        let arena = Arena::new(Budget::new(8 << 20), 1 << 16, HostMemory::Heap);
        // One thread, and the batches split between threads (asked for
        // three, four batches make two ranges of two).
        for (stride, threads) in [(1, 1), (3, 1), (8, 1), (1, 3), (8, 3)] {
            let packed = Packed::build_on(&data, &arena, "d", (stride, None), Some(threads))
                .expect("fits")
                .expect("packed");
            assert_eq!(packed.record(), 78);
            let mut start = 0;
            for (b, rows) in sizes.into_iter().enumerate() {
                for r in 0..rows as usize {
                    let v = start + r as i64;
                    let mut want = v.to_le_bytes().to_vec();
                    (0..8).for_each(|k| want.extend_from_slice(&value(v, k).to_le_bytes()));
                    want.extend_from_slice(&(v as i16).to_le_bytes());
                    (8..17).for_each(|k| want.extend_from_slice(&value(v, k).to_le_bytes()));
                    let record = packed.at(b, packed.position(b, r));
                    assert_eq!(
                        record,
                        &want[..],
                        "stride {stride} threads {threads} batch {b} row {r}"
                    );
                }
                start += rows;
            }
        }
    }

    #[test]
    fn a_copy_that_cannot_fit_is_refused_before_anything_is_copied() {
        let (rows, batches) = (10_000, 10);
        let schema = Arc::new(Schema::new(vec![
            Field::new("a", DataType::Int64, false),
            Field::new("b", DataType::Float64, false),
        ]));
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(Int64Array::from_iter_values(0..rows)),
                Arc::new(Float64Array::from_iter_values((0..rows).map(|v| v as f64))),
            ],
        )
        .expect("batch");
        let data = SealedData::from_batches(schema, vec![], vec![batch; batches]);
        // 1.6 MB of records into a 1 MiB budget: refused before the first
        // batch's records are copied (the budget never held any).
        let small = Arena::new(Budget::new(1 << 20), 1 << 16, HostMemory::Heap);
        let err = Packed::build(&data, &small, "d", (1, None)).expect_err("does not fit");
        assert!(matches!(err, Error::ResourceExhausted(_)), "{err}");
        assert_eq!(small.budget().peak(), 0);
        let roomy = Arena::new(Budget::new(8 << 20), 1 << 16, HostMemory::Heap);
        let packed = Packed::build(&data, &roomy, "d", (1, None))
            .expect("fits")
            .expect("packed");
        assert_eq!(packed.bytes(), 16 * (rows as u64) * batches as u64);
    }

    #[test]
    fn packing_waits_for_one_epoch_of_shuffled_streams() {
        let cache = PackedCache::default();
        let asked: Vec<bool> = (0..5).map(|_| cache.worth_packing(3)).collect();
        assert_eq!(asked, [false, false, false, true, true]);
        // A plan of one rank: its second epoch packs.
        let cache = PackedCache::default();
        assert!(!cache.worth_packing(1));
        assert!(cache.worth_packing(1));
    }
}
