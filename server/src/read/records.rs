//! Rows between members as packed records: a member's rows of another
//! member's rank stream sent as one fixed-size binary value a row — the
//! records of its packed copy ([`super::packed`]) — instead of one column
//! each.
//!
//! Sent as columns, every fetched row is taken apart twice: the sending
//! member transposes its records back into columns, and the rank's member
//! writes each of them, value by value, into the records of its own tile
//! before transposing the tile into the batch's columns. Sent as records,
//! the sender copies each picked record once and the receiver copies each
//! fetched record once, whole, into its tile.
//!
//! A member sends records only when every column the stream gathers is in
//! its packed copy and together they are the whole record (nothing the rank
//! did not ask for crosses). The record's layout travels in the schema
//! (each gathered column's offset and width, in the field's metadata), so
//! the receiver checks it rather than assuming it: records laid out as its
//! own packed copy's are copied whole; any others (a member whose copy
//! packs other columns, or a rank's member gathering without a packed copy)
//! are turned back into columns first, which is what they would have been
//! sent as.

use std::collections::HashMap;
use std::sync::Arc;

use arrow::array::{Array, AsArray, FixedSizeBinaryArray, RecordBatch, RecordBatchOptions};
use arrow::buffer::{Buffer, MutableBuffer};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};

use super::packed::{Packed, Slot};
use super::{
    Column, Gather, PREFETCH_ROWS, PackedGather, Picks, TILE_BYTES, Tile, gather_ways, in_parts,
    prefetch, untile_records, untile_steps,
};
use crate::error::{Error, Result};

/// The name of the one field of a batch of records.
const RECORDS_FIELD: &str = "flightdeck.records";
/// The records field's metadata key: each gathered column's `offset:width`
/// in a record, comma-separated, in the gather's column order.
const SLOTS_KEY: &str = "flightdeck.slots";

/// The schema of batches of `record`-byte records whose gathered columns
/// sit at `slots`.
pub(super) fn records_schema(record: usize, slots: &[Slot]) -> SchemaRef {
    let field = Field::new(
        RECORDS_FIELD,
        DataType::FixedSizeBinary(record as i32),
        false,
    )
    .with_metadata(HashMap::from([(SLOTS_KEY.to_string(), slots_text(slots))]));
    Arc::new(Schema::new(vec![field]))
}

fn slots_text(slots: &[Slot]) -> String {
    let slots: Vec<String> = slots
        .iter()
        .map(|s| format!("{}:{}", s.offset, s.width))
        .collect();
    slots.join(",")
}

/// Whether `batch` holds records rather than columns.
fn is_records(batch: &RecordBatch) -> bool {
    let fields = batch.schema_ref().fields();
    fields.len() == 1 && fields[0].name() == RECORDS_FIELD
}

/// A batch of records taken apart: its records, bytes per record, and each
/// gathered column's slot.
struct Records {
    values: Buffer,
    record: usize,
    slots: Vec<Slot>,
}

/// Checks a batch of records a member sent.
fn records_of(batch: &RecordBatch) -> Result<Records> {
    let bad = |what: &str| {
        Error::Internal(format!(
            "a member sent records {what}; do the members run the same version?"
        ))
    };
    let field = batch.schema_ref().field(0).clone();
    let DataType::FixedSizeBinary(record) = *field.data_type() else {
        return Err(bad("that are not fixed-size binary values"));
    };
    let record = usize::try_from(record)
        .ok()
        .filter(|&r| r > 0)
        .ok_or_else(|| bad("of no size"))?;
    let slots = field
        .metadata()
        .get(SLOTS_KEY)
        .ok_or_else(|| bad("without their layout"))?
        .split(',')
        .map(|s| {
            let (offset, width) = s.split_once(':')?;
            Some(Slot {
                offset: offset.parse().ok()?,
                width: width.parse().ok()?,
            })
        })
        .collect::<Option<Vec<Slot>>>()
        .filter(|slots| {
            slots.iter().all(|s| {
                s.offset
                    .checked_add(s.width)
                    .is_some_and(|end| end <= record)
            })
        })
        .ok_or_else(|| bad("with a layout that does not fit them"))?;
    let array: &FixedSizeBinaryArray = batch.column(0).as_fixed_size_binary();
    if array.null_count() > 0 {
        return Err(bad("with nulls"));
    }
    if batch
        .num_rows()
        .checked_mul(record)
        .is_none_or(|bytes| array.values().len() < bytes)
    {
        return Err(bad("shorter than their rows"));
    }
    Ok(Records {
        values: array.values().clone(),
        record,
        slots,
    })
}

impl PackedGather {
    /// The records of `batch` when it holds records laid out as this
    /// gather's own (so each is copied whole); `None` for anything else.
    pub(super) fn own_records(&self, batch: &RecordBatch) -> Option<Buffer> {
        let own = self.records.as_ref()?.field(0);
        let field = batch.schema_ref().fields().first()?;
        let same = is_records(batch)
            && field.data_type() == own.data_type()
            && field.metadata().get(SLOTS_KEY) == own.metadata().get(SLOTS_KEY);
        let array: &FixedSizeBinaryArray = batch.column(0).as_fixed_size_binary_opt()?;
        let whole = array.values().len() >= batch.num_rows() * self.packed.record();
        (same && whole && array.null_count() == 0).then(|| array.values().clone())
    }
}

impl Gather {
    /// The schema this gather's rows take as records for another member:
    /// `Some` when every gathered column is in the dataset's packed copy
    /// and together they are the whole record. Decides (and may build) the
    /// packed copy, as the first scattered batch would.
    pub fn records_schema(&self) -> Option<SchemaRef> {
        self.packed_copy()?.records.clone()
    }

    /// The picked (local) rows as one batch of records of
    /// [`Self::records_schema`].
    pub fn gathered_records(&self, picks: &Picks) -> Result<RecordBatch> {
        let (p, schema) = self
            .packed_copy()
            .and_then(|p| Some((p, p.records.clone()?)))
            .ok_or_else(|| Error::Internal("records asked of a gather without them".into()))?;
        let local = self.data.batches().len();
        if picks.rows.iter().any(|&(b, _)| b >= local) {
            return Err(Error::Internal(
                "records are gathered from local rows only".into(),
            ));
        }
        let record = p.packed.record();
        let places: Vec<(usize, usize)> = picks
            .rows
            .iter()
            .map(|&(b, r)| (b, p.packed.position(b, r)))
            .collect();
        let mut out = MutableBuffer::with_capacity(places.len() * record);
        // In parts on threads of their own, as a batch of columns is
        // (`Gather::gather_packed`).
        let ways = self.split.unwrap_or_else(|| gather_ways(places.len()));
        in_parts(
            &places,
            places.len().div_ceil(ways.max(1)),
            std::slice::from_mut(&mut out),
            &[record],
            |places, out| copy_records(&p.packed, places, &mut out[0]),
        );
        let internal = |e: arrow::error::ArrowError| Error::Internal(format!("records: {e}"));
        let array =
            FixedSizeBinaryArray::try_new_with_len(record as i32, out.into(), None, places.len())
                .map_err(internal)?;
        RecordBatch::try_new(schema, vec![Arc::new(array)]).map_err(internal)
    }

    /// `extra` with every batch of records that `packed` (the gather of
    /// the batch at hand, if packed) cannot copy whole turned into the
    /// gathered columns; borrowed when there is none.
    pub(super) fn usable_extra<'a>(
        &self,
        packed: Option<&PackedGather>,
        extra: &'a [RecordBatch],
    ) -> Result<std::borrow::Cow<'a, [RecordBatch]>> {
        let convert =
            |b: &RecordBatch| is_records(b) && packed.is_none_or(|p| p.own_records(b).is_none());
        if !extra.iter().any(convert) {
            return Ok(extra.into());
        }
        extra
            .iter()
            .map(|b| {
                if convert(b) {
                    self.columns_of(b)
                } else {
                    Ok(b.clone())
                }
            })
            .collect::<Result<Vec<_>>>()
            .map(Into::into)
    }

    /// A batch of records as the gathered columns.
    fn columns_of(&self, batch: &RecordBatch) -> Result<RecordBatch> {
        let records = records_of(batch)?;
        if records.slots.len() != self.columns.len() {
            return Err(Error::Internal(format!(
                "a member sent records of {} columns where {} are gathered; do the members run \
                 the same version?",
                records.slots.len(),
                self.columns.len()
            )));
        }
        let n = batch.num_rows();
        let mut fixed = Vec::with_capacity(self.columns.len());
        for (c, slot) in self.columns.iter().zip(&records.slots) {
            let Column::Fixed(c) = c else {
                return Err(Error::Internal(
                    "a member sent records of a column that is not fixed-width here".into(),
                ));
            };
            if c.row_bytes != slot.width {
                return Err(Error::Internal(format!(
                    "a member sent {}-byte values of a column of {} bytes a row",
                    slot.width, c.row_bytes
                )));
            }
            fixed.push(c);
        }
        // Transposed a tile's worth of records at a time, as a packed
        // gather transposes its tile.
        let outputs: Vec<(usize, Slot)> = records.slots.iter().copied().enumerate().collect();
        let steps = untile_steps(&outputs);
        let mut outs: Vec<MutableBuffer> = outputs
            .iter()
            .map(|(_, s)| MutableBuffer::with_capacity(n * s.width))
            .collect();
        let record = records.record;
        let tile_rows = (TILE_BYTES / record).max(1);
        for start in (0..n).step_by(tile_rows) {
            let rows = tile_rows.min(n - start);
            let tile = Tile::new(&records.values.as_slice()[start * record..], record, rows);
            untile_records(tile, &outputs, &steps, &mut outs);
        }
        let columns = fixed
            .into_iter()
            .zip(outs)
            .map(|(c, out)| c.array(out.into(), n))
            .collect::<Result<Vec<_>>>()?;
        let options = RecordBatchOptions::new().with_row_count(Some(n));
        RecordBatch::try_new_with_options(self.schema.clone(), columns, &options)
            .map_err(|e| Error::Internal(format!("records into columns: {e}")))
    }
}

/// Appends the records at `places` (`(batch, record)` in `packed`) to
/// `out`, each asked for a few records ahead.
fn copy_records(packed: &Packed, places: &[(usize, usize)], out: &mut MutableBuffer) {
    for (i, &(b, at)) in places.iter().enumerate() {
        if let Some(&(b, at)) = places.get(i + PREFETCH_ROWS) {
            prefetch(packed.at(b, at));
        }
        out.extend_from_slice(packed.at(b, at));
    }
}
