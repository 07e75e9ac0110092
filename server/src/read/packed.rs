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
    /// Per stored batch: its rows' records, back to back.
    batches: Vec<Buffer>,
}

impl Packed {
    /// Packs every column of `data` that has fixed-width values and no
    /// nulls; `None` when fewer than two columns qualify (one column is
    /// already contiguous per row) or there are no rows. Memory comes from
    /// `arena`; a full budget is a `ResourceExhausted` error and nothing is
    /// kept.
    pub fn build(data: &SealedData, arena: &Arena, dataset: &str) -> Result<Option<Self>> {
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
        let mut staged = Vec::new();
        for (b, batch) in data.batches().iter().enumerate() {
            let rows = batch.num_rows();
            staged.clear();
            staged.resize(rows * record, 0u8);
            for (offset, width, column) in &segments {
                let into = &mut staged[*offset..];
                match width {
                    1 => tile_rows::<1>(column[b].as_slice(), record, into),
                    2 => tile_rows::<2>(column[b].as_slice(), record, into),
                    4 => tile_rows::<4>(column[b].as_slice(), record, into),
                    8 => tile_rows::<8>(column[b].as_slice(), record, into),
                    16 => tile_rows::<16>(column[b].as_slice(), record, into),
                    &n => {
                        for (r, value) in column[b].as_slice().chunks_exact(n).enumerate() {
                            into[r * record..][..n].copy_from_slice(value);
                        }
                    }
                }
            }
            batches.push(arena.copy_bytes(&staged, &what)?);
        }
        Ok(Some(Self {
            slots,
            record,
            batches,
        }))
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

/// Writes each `N`-byte value of `column` at the start of a `record`-byte
/// stride of `into`.
fn tile_rows<const N: usize>(column: &[u8], record: usize, into: &mut [u8]) {
    for (r, value) in column.chunks_exact(N).enumerate() {
        let mut v = [0u8; N];
        v.copy_from_slice(value);
        into[r * record..][..N].copy_from_slice(&v);
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
    pub fn get_or_build(
        &self,
        data: &SealedData,
        arena: &Arena,
        dataset: &str,
    ) -> Option<Arc<Packed>> {
        let mut slot = self.copy.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(packed) = slot.as_ref() {
            return Some(packed.clone());
        }
        match Packed::build(data, arena, dataset) {
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
        let err = Packed::build(&data, &small, "d").expect_err("does not fit");
        assert!(matches!(err, Error::ResourceExhausted(_)), "{err}");
        assert_eq!(small.budget().peak(), 0);
        let roomy = Arena::new(Budget::new(8 << 20), 1 << 16, HostMemory::Heap);
        let packed = Packed::build(&data, &roomy, "d")
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
