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
//! scattered streams (one pass does not repay the build;
//! [`PackedCache::worth_packing`]), lives in the arena (so it counts in the
//! memory budget), is only built when the budget has room for it without
//! spilling anything, and is the first thing given up when memory is
//! needed ([`PackedCache::give_up`]). A dataset brought back from the store
//! is packed again at its next scattered read.
//!
//! Which columns are packed is the gather's choice of byte-copied columns
//! (fixed-width values without nulls); the gather copies records into a
//! small tile that stays in cache and transposes the tile back into columns,
//! so the arrays it produces are the ones the columnar gather produces.
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
use crate::memory::device::segments_at;

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
    /// nulls; `None` when fewer than two columns qualify (one column is
    /// already contiguous per row) or there are no rows. Each batch's
    /// records are grouped by row residue modulo `stride` (see the module
    /// overview; 0 is taken as 1). Memory comes from `arena`; a full budget
    /// is a `ResourceExhausted` error and nothing is kept.
    pub fn build(
        data: &SealedData,
        arena: &Arena,
        dataset: &str,
        stride: usize,
    ) -> Result<Option<Self>> {
        let stride = stride.max(1);
        let mut slots = Vec::with_capacity(data.schema().fields().len());
        let mut segments = Vec::new();
        let mut record = 0usize;
        for i in 0..data.schema().fields().len() {
            match segments_at(data, i) {
                Ok(s) => {
                    let width = s.element.primitive_width().unwrap_or(1) * s.width;
                    slots.push(Some(Slot {
                        offset: record,
                        width,
                    }));
                    record += width;
                    segments.push((record - width, width, s.segments));
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
        let mut batches = Vec::with_capacity(data.batches().len());
        let mut groups = Vec::with_capacity(data.batches().len());
        let mut staged = Vec::new();
        let mut places = Vec::new();
        for (b, batch) in data.batches().iter().enumerate() {
            let rows = batch.num_rows();
            let shape = (rows / stride, rows % stride);
            places.clear();
            places.extend((0..rows).map(|r| position(shape, stride, r) * record));
            staged.clear();
            staged.resize(rows * record, 0u8);
            for (offset, width, column) in &segments {
                let into = &mut staged[*offset..];
                match width {
                    1 => tile_rows::<1>(column[b].as_slice(), &places, into),
                    2 => tile_rows::<2>(column[b].as_slice(), &places, into),
                    4 => tile_rows::<4>(column[b].as_slice(), &places, into),
                    8 => tile_rows::<8>(column[b].as_slice(), &places, into),
                    16 => tile_rows::<16>(column[b].as_slice(), &places, into),
                    &n => {
                        for (value, &at) in column[b].as_slice().chunks_exact(n).zip(&places) {
                            into[at..][..n].copy_from_slice(value);
                        }
                    }
                }
            }
            batches.push(arena.copy_bytes(&staged, &what)?);
            groups.push(shape);
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
    /// column by column), or whenever a copy is already held. One pass does
    /// not pay for the copy — building it costs about what it saves in one
    /// epoch — and a dataset read once (ingest, then one epoch) keeps its
    /// memory at the columns alone.
    pub fn worth_packing(&self, ranks: u64) -> bool {
        let before = self.scattered.fetch_add(1, Ordering::Relaxed);
        before >= ranks.max(1) || self.bytes() > 0
    }

    /// The packed copy, building it first when there is none; `None` when
    /// the dataset has nothing worth packing or the budget has no room (the
    /// read then gathers column by column, as before). Concurrent callers
    /// wait for one build.
    ///
    /// `stride` groups a new copy's records (see [`Packed::build`]); a
    /// copy already held keeps its own.
    pub fn get_or_build(
        &self,
        data: &SealedData,
        arena: &Arena,
        dataset: &str,
        stride: usize,
    ) -> Option<Arc<Packed>> {
        let mut slot = self.copy.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(packed) = slot.as_ref() {
            return Some(packed.clone());
        }
        match Packed::build(data, arena, dataset, stride) {
            Ok(Some(packed)) => {
                tracing::debug!(
                    dataset,
                    bytes = packed.bytes(),
                    "packed rows for scattered reads"
                );
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
    use arrow::array::{Float64Array, Int64Array, RecordBatch};
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
            let packed = Packed::build(&data, &arena, "d", stride)
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
        let err = Packed::build(&data, &small, "d", 1).expect_err("does not fit");
        assert!(matches!(err, Error::ResourceExhausted(_)), "{err}");
        assert_eq!(small.budget().peak(), 0);
        let roomy = Arena::new(Budget::new(8 << 20), 1 << 16, HostMemory::Heap);
        let packed = Packed::build(&data, &roomy, "d", 1)
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
