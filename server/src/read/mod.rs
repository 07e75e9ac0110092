//! Reading a shard: the rows a [`ShardOrder`] names, gathered from a sealed
//! dataset into record batches of the plan's size, with only the projected
//! columns.
//!
//! Numeric columns (and `fixed_size_list`s of numbers) without nulls — what
//! training data is — are gathered by copying each row's bytes, visiting the
//! source rows in ascending order (the reads stream forward; the writes land
//! in the small output batch). When the rows are scattered (a shuffled
//! order, or one rank's every `W`-th row of an unshuffled one) and the
//! gather was given the arena, those columns are instead gathered from the
//! dataset's [`packed`] copy: one contiguous record per row, a tile's worth
//! of records at a time transposed back into columns where they lie. The
//! copy groups each stored batch's records by row residue modulo the world
//! size of the plan that built it, so a rank's rows of an unshuffled read by
//! that many ranks are one run of records, read as one forward stream. Other
//! columns go through Arrow's `interleave`. Where cores are to spare, a
//! batch's packed gather is split into parts gathered on threads of their
//! own (`gather_ways`, `--gather-threads`). Every path gives the same
//! arrays, and writes a batch's fixed-width columns into one buffer, back
//! to back as an Arrow IPC body lays them out (`output.rs`), so that the
//! `DoGet` edge sends them as one piece. A member's rows of another
//! member's rank stream cross between them as those [`records`] where the
//! copy holds every gathered column.
//!
//! Synchronous and CPU-bound: the Flight edge runs it off the async reactor and
//! feeds a small bounded channel, so memory waits for the socket.

mod output;
pub mod packed;
pub mod records;

use std::borrow::Cow;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use arrow::array::{Array, ArrayData, ArrayRef, RecordBatch, RecordBatchOptions, make_array};
use arrow::buffer::Buffer;
use arrow::compute::interleave;
use arrow::datatypes::{DataType, Schema, SchemaRef};

use crate::catalog::{SealedData, describe_fields};
use crate::error::{Error, Result};
use crate::memory::arena::Arena;
use crate::memory::device::{ColumnSegments, segments_at, value_bytes};
use crate::metrics::Metrics;
use crate::order::{ReadPlan, ShardOrder};
use crate::query::{Derive, Filter, Selection};
use output::{Columns, Output};
use packed::{Packed, Slot};

/// Bytes of the records a packed gather transposes into columns at a time
/// (a tile): small enough to stay in the first-level cache meanwhile.
const TILE_BYTES: usize = 32 << 10;
/// Up to this many packed columns are copied straight from each record
/// to their columns; more are transposed a tile at a time.
const DIRECT_COLUMNS: usize = 4;
/// How many rows ahead a packed gather asks for a record to be loaded
/// (see [`prefetch`]: fewer leave misses unoverlapped, more gain nothing).
const PREFETCH_ROWS: usize = 16;
/// How many picks ahead a column's gather of scattered values (in stored
/// order, a cache line or so apart) asks for a value to be loaded: a value
/// is one line where a packed record is several, so more of them are
/// asked for at once (2 M rows × 65 four-byte columns gathered in
/// 16 384-row batches, Zen 4: 12–14 ns a value with no prefetch, 6.8–7.8 ns
/// 64 picks ahead, the same 128 or 512 ahead; `bench/RESULTS.md`).
const PREFETCH_VALUES: usize = 64;
/// Most parts one batch's packed gather is split into ([`gather_ways`]).
const MAX_WAYS: usize = 4;
/// Fewest rows a part of a split gather takes: a thread's start costs
/// about what gathering a few hundred scattered rows does.
const WAY_ROWS: usize = 2048;

/// Read streams open in this process ([`Streaming`]): what shares its cores.
static STREAMS: AtomicUsize = AtomicUsize::new(0);

/// One open read stream, counted while it lives: the split of a batch's
/// gather (`gather_ways`) leaves the cores to the streams there are.
#[derive(Debug)]
pub struct Streaming(());

impl Streaming {
    /// Counts a stream until the value is dropped.
    pub fn begin() -> Self {
        STREAMS.fetch_add(1, Ordering::Relaxed);
        Self(())
    }
}

impl Drop for Streaming {
    fn drop(&mut self) {
        STREAMS.fetch_sub(1, Ordering::Relaxed);
    }
}

/// How many threads gather one batch of `rows` scattered rows from packed
/// records when the server was not told (`--gather-threads`): half the
/// machine's cores (the other half sends the messages and, on a training
/// node, reads them) shared among the open streams, at most [`MAX_WAYS`],
/// and no part under [`WAY_ROWS`] rows. One thread alone waits on memory a
/// record at a time (a scattered record is a cache miss): with cores to
/// spare, a stream of few ranks is bound by it; on a machine with few
/// cores the gather keeps one thread a stream.
fn gather_ways(rows: usize) -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    let cores = *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let streams = STREAMS.load(Ordering::Relaxed).max(1);
    (cores / (2 * streams))
        .min(MAX_WAYS)
        .min(rows / WAY_ROWS)
        .max(1)
}

/// Runs `gather` over `rows` in parts of `part` rows, appending to `outs`
/// (one output per column, `widths[k]` bytes a row) in order: the first
/// part on this thread, each other on a thread of its own into the part of
/// each output that [`Output::split_rest`] gives, joined when done. A part
/// that panics panics here, as one gather would.
fn in_parts<T: Sync, O: Output>(
    rows: &[T],
    part: usize,
    outs: &mut [O],
    widths: &[usize],
    gather: impl Fn(&[T], &mut [O]) + Sync,
) {
    if part == 0 || part >= rows.len() {
        return gather(rows, outs);
    }
    let (first, rest) = rows.split_at(part);
    // Each part's outputs split from the part's before it.
    let mut parts: Vec<Vec<O>> = Vec::new();
    let mut keep = first.len();
    for chunk in rest.chunks(part) {
        let before = parts.last_mut().map_or(&mut *outs, |p| p.as_mut_slice());
        let split = before
            .iter_mut()
            .zip(widths)
            .map(|(out, &width)| out.split_rest(keep * width, chunk.len() * width))
            .collect();
        parts.push(split);
        keep = chunk.len();
    }
    let gather = &gather;
    std::thread::scope(|scope| {
        let others: Vec<_> = rest
            .chunks(part)
            .zip(parts)
            .map(|(rows, mut outs)| {
                scope.spawn(move || {
                    gather(rows, &mut outs);
                    outs
                })
            })
            .collect();
        gather(first, outs);
        for other in others {
            let parts = other
                .join()
                .unwrap_or_else(|e| std::panic::resume_unwind(e));
            for (out, part) in outs.iter_mut().zip(parts) {
                out.join(part);
            }
        }
    });
}

/// What other members sent of a batch's rows, for [`Gather::gather_rows`]:
/// per fetched batch its records when laid out as the packed copy's, and
/// per packed output its values by fetched batch.
#[derive(Clone, Copy)]
struct Fetched<'a> {
    records: &'a [Option<Buffer>],
    values: &'a [Vec<Buffer>],
}

/// Indices of `columns` in `schema` and the projected schema; empty = all.
pub fn project(
    schema: &Schema,
    columns: &[String],
    dataset: &str,
) -> Result<(Vec<usize>, SchemaRef)> {
    if columns.is_empty() {
        return Ok((
            (0..schema.fields().len()).collect(),
            Arc::new(schema.clone()),
        ));
    }
    let indices = columns
        .iter()
        .map(|c| {
            schema.index_of(c).map_err(|_| {
                Error::invalid(format!(
                    "dataset '{dataset}' has no column '{c}'; its columns are {}",
                    describe_fields(schema)
                ))
            })
        })
        .collect::<Result<Vec<usize>>>()?;
    let projected = schema
        .project(&indices)
        .map_err(|e| Error::Internal(format!("projection of valid indices failed: {e}")))?;
    Ok((indices, Arc::new(projected)))
}

/// Gathers rows of a sealed dataset — and rows fetched from other members —
/// into record batches of the projected columns.
#[derive(Debug)]
pub struct Gather {
    data: Arc<SealedData>,
    dataset: String,
    /// Per projected column: its index in the dataset's schema.
    indices: Vec<usize>,
    /// How each projected column is gathered.
    columns: Vec<Column>,
    schema: SchemaRef,
    /// Where a packed copy's memory comes from, and what is told of its
    /// build; `None`: never packed.
    packing: Option<(Arc<Arena>, Arc<Metrics>)>,
    /// The packed gather, decided at the first shuffled batch.
    packed: OnceLock<Option<PackedGather>>,
    /// The stride a packed copy built here groups its records by: the
    /// plan's world size (see [`packed`]).
    stride: usize,
    /// The columns a packed copy built here holds: on a cluster's member,
    /// its layout's byte-gathered columns (so every member's records are
    /// laid out alike); `None` on a server of its own: every column that
    /// can be.
    packs: Option<Vec<bool>>,
    /// The rows a filter selected: read row `i` is stored row
    /// `selection.row(i)`; `None` = every row.
    selection: Option<Arc<Selection>>,
    /// Columns derived from the gathered ones, the plan's `select`.
    derive: Option<Derive>,
    /// Parts a packed gather of a batch is split into; `None`: as many as
    /// [`gather_ways`] gives.
    split: Option<usize>,
}

/// The columns a plan gathers and the derivation applied to them: its
/// `select` list's inputs, or its `columns`.
pub fn plan_columns(plan: &ReadPlan, schema: &Schema) -> Result<(Vec<String>, Option<Derive>)> {
    if plan.select.is_empty() {
        return Ok((plan.columns.clone(), None));
    }
    let derive = Derive::compile(schema, &plan.select, &plan.dataset)?;
    Ok((derive.inputs().to_vec(), Some(derive)))
}

/// The schema a plan's batches have over a dataset of `schema`.
pub fn plan_schema(plan: &ReadPlan, schema: &Schema) -> Result<SchemaRef> {
    match plan_columns(plan, schema)? {
        (_, Some(derive)) => Ok(derive.schema()),
        (columns, None) => Ok(project(schema, &columns, &plan.dataset)?.1),
    }
}

/// The plan's filter compiled over `schema`; `None` when it has none.
pub fn plan_filter(plan: &ReadPlan, schema: &Schema) -> Result<Option<Filter>> {
    if plan.filter.is_empty() {
        return Ok(None);
    }
    Filter::compile(schema, &plan.filter, &plan.dataset).map(Some)
}

/// The projected columns a shuffled batch gathers from packed records.
#[derive(Debug)]
struct PackedGather {
    packed: Arc<Packed>,
    /// `(projected column, its slot in a record)`.
    outputs: Vec<(usize, Slot)>,
    /// How a tile of records is turned back into `outputs`.
    untiles: Vec<Untile>,
    /// The schema of the gathered rows as records for another member, when
    /// they can be sent so ([`records`]).
    records: Option<SchemaRef>,
}

/// One step of turning a tile of records back into a packed gather's
/// outputs (indices into [`PackedGather::outputs`]); the packed copy's
/// build takes the same steps the other way, columns into records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Untile {
    /// Outputs `first..first + 8`: 4-byte values side by side in each
    /// record, from the first one's offset on (eight `float32` columns in
    /// schema order, the common case), transposed eight rows at a time.
    Eight(usize),
    /// One output, on its own.
    One(usize),
}

/// The steps that untile `outputs`: each run of eight 4-byte columns
/// adjacent in the record and in the projection as one step, the rest one
/// column at a time.
fn untile_steps(outputs: &[(usize, Slot)]) -> Vec<Untile> {
    let mut steps = Vec::with_capacity(outputs.len());
    let mut i = 0;
    while i < outputs.len() {
        let offset = outputs[i].1.offset;
        let adjacent = outputs.get(i..i + 8).is_some_and(|run| {
            run.iter()
                .enumerate()
                .all(|(k, (_, s))| s.width == 4 && s.offset == offset + 4 * k)
        });
        if adjacent {
            steps.push(Untile::Eight(i));
            i += 8;
        } else {
            steps.push(Untile::One(i));
            i += 1;
        }
    }
    steps
}

impl PackedGather {
    /// Appends the records of `from` to `outs` (one buffer per output),
    /// column by column.
    fn untile(&self, from: impl Records, outs: &mut [impl Output]) {
        untile_records(from, &self.outputs, &self.untiles, outs);
    }
}

/// Records an untile reads, each of the same size: back to back in one
/// buffer ([`Tile`]), or each where it lies ([`Scattered`]).
///
/// # Safety
///
/// For every `i < rows()`, `start(i)` is valid to read `record()` bytes
/// from (the untile kernels load through it without bounds checks).
#[allow(unsafe_code)]
unsafe trait Records: Copy {
    /// Bytes of each record.
    fn record(&self) -> usize;
    /// Records held.
    fn rows(&self) -> usize;
    /// The start of record `i`: an address only, valid to read
    /// `record()` bytes from where `i < rows()`.
    fn start(&self, i: usize) -> *const u8;
    /// Record `i` (below `rows()`).
    fn at(&self, i: usize) -> &[u8];
    /// The records as one buffer, when they lie back to back.
    fn tile(&self) -> Option<&[u8]>;
}

/// `rows` records of `record` bytes, back to back.
#[derive(Debug, Clone, Copy)]
struct Tile<'a> {
    bytes: &'a [u8],
    record: usize,
    rows: usize,
}

impl<'a> Tile<'a> {
    /// The first `rows` records of `record` bytes in `bytes`.
    fn new(bytes: &'a [u8], record: usize, rows: usize) -> Self {
        assert!(bytes.len() >= rows * record, "a tile of {rows} records");
        Self {
            bytes,
            record,
            rows,
        }
    }
}

// SAFETY: `Tile::new` checks that `bytes` holds `rows` records.
#[allow(unsafe_code)]
unsafe impl Records for Tile<'_> {
    fn record(&self) -> usize {
        self.record
    }
    fn rows(&self) -> usize {
        self.rows
    }
    #[inline(always)]
    fn start(&self, i: usize) -> *const u8 {
        self.bytes.as_ptr().wrapping_add(i * self.record)
    }
    fn at(&self, i: usize) -> &[u8] {
        &self.bytes[i * self.record..][..self.record]
    }
    fn tile(&self) -> Option<&[u8]> {
        Some(&self.bytes[..self.rows * self.record])
    }
}

/// Records each where it lies (a shuffled batch's, in the packed copy),
/// read there rather than copied into a tile first.
#[derive(Debug, Clone, Copy)]
struct Scattered<'a, 'b> {
    records: &'b [&'a [u8]],
    record: usize,
}

impl<'a, 'b> Scattered<'a, 'b> {
    /// `records`, each `record` bytes.
    fn new(records: &'b [&'a [u8]], record: usize) -> Self {
        assert!(
            records.iter().all(|r| r.len() == record),
            "records of {record} bytes"
        );
        Self { records, record }
    }
}

// SAFETY: `Scattered::new` checks that every record is `record` bytes.
#[allow(unsafe_code)]
unsafe impl Records for Scattered<'_, '_> {
    fn record(&self) -> usize {
        self.record
    }
    fn rows(&self) -> usize {
        self.records.len()
    }
    #[inline(always)]
    fn start(&self, i: usize) -> *const u8 {
        self.records[i].as_ptr()
    }
    fn at(&self, i: usize) -> &[u8] {
        self.records[i]
    }
    fn tile(&self) -> Option<&[u8]> {
        None
    }
}

/// Appends the records of `from` to `outs`, one buffer per output
/// (`(projected column, slot)`), by `steps` ([`untile_steps`] of
/// `outputs`).
fn untile_records(
    from: impl Records,
    outputs: &[(usize, Slot)],
    steps: &[Untile],
    outs: &mut [impl Output],
) {
    for &step in steps {
        match step {
            Untile::Eight(first) => {
                let offset = outputs[first].1.offset;
                untile_eight(from, offset, &mut outs[first..first + 8]);
            }
            Untile::One(i) => untile(from, outputs[i].1, &mut outs[i]),
        }
    }
}

impl Gather {
    /// Gathers `columns` (empty = all) of `data`. `fixed`, per column of the
    /// schema, forces the choice of byte gather (a cluster decides it over
    /// every member, so each member gathers as one server would); `None`
    /// decides from `data`.
    pub fn new(
        data: Arc<SealedData>,
        columns: &[String],
        dataset: &str,
        fixed: Option<&[bool]>,
    ) -> Result<Self> {
        let (indices, schema) = project(data.schema(), columns, dataset)?;
        let columns = indices
            .iter()
            .map(|&i| Column::new(&data, i, fixed.and_then(|f| f.get(i).copied())))
            .collect::<Result<_>>()?;
        Ok(Self {
            data,
            dataset: dataset.to_string(),
            indices,
            columns,
            schema,
            packing: None,
            packed: OnceLock::new(),
            stride: 1,
            packs: fixed.map(<[bool]>::to_vec),
            selection: None,
            derive: None,
            split: None,
        })
    }

    /// The gather of a plan over `data`: the rows of `selection` (`None`:
    /// all), the columns its `select` list reads (or its `columns`), and
    /// the derived columns on top.
    pub fn for_plan(
        data: Arc<SealedData>,
        plan: &ReadPlan,
        fixed: Option<&[bool]>,
        selection: Option<Arc<Selection>>,
    ) -> Result<Self> {
        let (columns, derive) = plan_columns(plan, data.schema())?;
        let mut gather = Self::new(data, &columns, &plan.dataset, fixed)?;
        gather.selection = selection;
        gather.derive = derive;
        gather.stride = plan.world_size as usize;
        Ok(gather)
    }

    /// Rows to read: the selected ones, or every stored row.
    pub fn rows(&self) -> u64 {
        self.selection
            .as_ref()
            .map_or_else(|| self.data.rows(), |s| s.len())
    }

    /// `(batch, row within batch)` of read row `row` (below `rows()`).
    pub fn locate(&self, row: u64) -> (usize, usize) {
        self.data.locate(self.stored(row))
    }

    /// The stored row of read row `row`.
    fn stored(&self, row: u64) -> u64 {
        self.selection.as_ref().map_or(row, |s| s.row(row))
    }

    /// [`Self::locate`] of each of `rows`, in order. (Each row is looked
    /// up on its own: the lookups of a batch overlap in the CPU, where
    /// looking first in the batch of the row before chained each to the
    /// last and took three times as long on a shuffled read.)
    pub fn locate_all(&self, rows: impl IntoIterator<Item = u64>) -> Vec<(usize, usize)> {
        rows.into_iter()
            .map(|row| self.data.locate(self.stored(row)))
            .collect()
    }

    /// Lets shuffled batches gather from the dataset's packed copy, built
    /// in `arena` at the first one when there is none (and the build's
    /// time observed in `metrics`).
    pub fn packing(mut self, arena: Arc<Arena>, metrics: Arc<Metrics>) -> Self {
        self.packing = Some((arena, metrics));
        self
    }

    /// Splits each batch's packed gather into `ways` parts (at most: each a
    /// whole number of groups of 16 rows) whatever the machine and the
    /// streams open (`--gather-threads`); 1: one thread, the caller's.
    pub fn split(mut self, ways: usize) -> Self {
        self.split = Some(ways);
        self
    }

    /// The schema every batch has: the derived columns, or the projected.
    pub fn schema(&self) -> SchemaRef {
        match &self.derive {
            Some(d) => d.schema(),
            None => self.schema.clone(),
        }
    }

    /// The schema of gathered batches before any derivation (what one
    /// member sends another).
    pub fn gathered_schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    /// The local rows.
    pub fn data(&self) -> &SealedData {
        &self.data
    }

    /// What a cluster's member says of its part for the seal to decide
    /// which columns it gathers as bytes ([`crate::cluster::byte_columns`]):
    /// per column of the dataset's schema, whether its values are
    /// fixed-width without nulls in every stored batch here (lists aside:
    /// a coordinator of an older build takes this alone), and for a list
    /// whose rows here all hold one number of values, without nulls, that
    /// number (0 for any other column): another member's lists may hold
    /// another.
    pub fn byte_columns(data: &SealedData) -> (Vec<bool>, Vec<u32>) {
        crate::cluster::list_columns(data.schema())
            .into_iter()
            .enumerate()
            .map(|(i, list)| match segments_at(data, i) {
                Ok(s) if list => (false, u32::try_from(s.width).unwrap_or(0)),
                Ok(_) => (true, 0),
                Err(_) => (false, 0),
            })
            .unzip()
    }

    /// One batch of the picked rows, derived columns applied. A pick's
    /// batch index past the local batches names `extra[index - local
    /// batches]`, a batch of the gathered columns.
    pub fn batch(&self, picks: &Picks, extra: &[RecordBatch]) -> Result<RecordBatch> {
        let gathered = self.gathered(picks, extra)?;
        match &self.derive {
            Some(d) => d.apply(&gathered, &self.dataset),
            None => Ok(gathered),
        }
    }

    /// One batch of the picked rows' gathered columns, nothing derived.
    pub fn gathered(&self, picks: &Picks, extra: &[RecordBatch]) -> Result<RecordBatch> {
        let p = self.packed_gather(picks);
        let extra = &*self.usable_extra(p, extra)?;
        let mut packed = match p {
            Some(p) => self.gather_packed(p, picks, extra)?,
            None => Vec::new(),
        };
        // The fixed-width columns not gathered packed, in one buffer as
        // the packed ones are (`gather_packed`).
        let fixed: Vec<(usize, &FixedColumn)> = self
            .columns
            .iter()
            .enumerate()
            .filter_map(|(j, c)| match c {
                Column::Fixed(c) if packed.get(j).is_none_or(Option::is_none) => Some((j, c)),
                _ => None,
            })
            .collect();
        let n = picks.len();
        let widths: Vec<usize> = fixed.iter().map(|(_, c)| c.row_bytes).collect();
        let mut values = Columns::new(n, &widths)
            .fill(|outs| {
                for (out, &(j, c)) in outs.iter_mut().zip(&fixed) {
                    c.gather_into(picks, extra, j, out)?;
                }
                Ok(())
            })?
            .into_iter();
        let columns = self
            .columns
            .iter()
            .enumerate()
            .map(
                |(j, c)| match (packed.get_mut(j).and_then(Option::take), c) {
                    (Some(array), _) => Ok(array),
                    (None, Column::Fixed(c)) => {
                        let v = values.next().ok_or_else(|| {
                            Error::Internal("a gathered column went missing".into())
                        })?;
                        c.array(v, n)
                    }
                    (None, Column::Other(arrays)) => Column::gather_other(arrays, extra, picks, j),
                },
            )
            .collect::<Result<Vec<_>>>()?;
        let options = RecordBatchOptions::new().with_row_count(Some(picks.len()));
        RecordBatch::try_new_with_options(self.schema.clone(), columns, &options)
            .map_err(|e| Error::Internal(format!("gathering rows: {e}")))
    }

    /// The packed gather for `picks`: only for scattered rows (a run of
    /// neighbouring rows is read column by column at the speed of a copy,
    /// while rows spread out — shuffled, or every `W`-th of a strided read —
    /// pull in a cache line of every column for each row), and only when
    /// the projected columns are at least half of a record (else copying
    /// whole records costs more than it saves).
    fn packed_gather(&self, picks: &Picks) -> Option<&PackedGather> {
        if !picks.scattered {
            return None;
        }
        self.packed_copy()
    }

    /// The packed gather of this gather's columns, decided (and the
    /// dataset's packed copy built, when there is none and it is worth it)
    /// the first time it is asked for.
    fn packed_copy(&self) -> Option<&PackedGather> {
        let (arena, metrics) = self.packing.as_ref()?;
        self.packed
            .get_or_init(|| {
                let packed = self.data.packed().get_or_build(
                    &self.data,
                    arena,
                    &self.dataset,
                    (self.stride, self.packs.as_deref()),
                    metrics,
                )?;
                let outputs: Vec<(usize, Slot)> = self
                    .columns
                    .iter()
                    .zip(&self.indices)
                    .enumerate()
                    .filter(|(_, (c, _))| matches!(c, Column::Fixed(_)))
                    .filter_map(|(j, (_, &i))| Some((j, packed.slot(i)?)))
                    .collect();
                let projected: usize = outputs.iter().map(|(_, s)| s.width).sum();
                (outputs.len() >= 2 && 2 * projected >= packed.record()).then(|| {
                    let untiles = untile_steps(&outputs);
                    let whole = outputs.len() == self.columns.len() && projected == packed.record();
                    let slots: Vec<Slot> = outputs.iter().map(|&(_, s)| s).collect();
                    PackedGather {
                        records: whole.then(|| records::records_schema(packed.record(), &slots)),
                        packed,
                        outputs,
                        untiles,
                    }
                })
            })
            .as_ref()
    }

    /// The packed columns of one batch, by projected column (`None` for the
    /// others), gathered by [`Gather::gather_rows`] — in [`gather_ways`]
    /// parts at once, each on a thread of its own, when the server has
    /// cores to spare: a scattered gather waits on memory a record at a
    /// time, and other cores can wait on other records meanwhile.
    fn gather_packed(
        &self,
        p: &PackedGather,
        picks: &Picks,
        extra: &[RecordBatch],
    ) -> Result<Vec<Option<ArrayRef>>> {
        let n = picks.len();
        // Per fetched batch: its records, when it holds records laid out as
        // this copy's (copied whole); else its values, column by column.
        let extra_records: Vec<Option<Buffer>> = extra.iter().map(|b| p.own_records(b)).collect();
        let extra_values = p
            .outputs
            .iter()
            .map(|&(j, slot)| {
                extra
                    .iter()
                    .zip(&extra_records)
                    .map(|(b, records)| match records {
                        // Never read: its rows are copied whole.
                        Some(_) => Ok(Buffer::from_vec(Vec::<u8>::new())),
                        None => fetched_values(b, j, slot.width),
                    })
                    .collect::<Result<Vec<Buffer>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        let fetched = Fetched {
            records: &extra_records,
            values: &extra_values,
        };
        let ways = self.split.unwrap_or_else(|| gather_ways(n));
        // Parts of whole groups of 16 rows (the transposes' step).
        let part = n.div_ceil(ways.max(1)).next_multiple_of(16);
        // The columns in one buffer, as the IPC body lays them out: the
        // `DoGet` edge sends neighbours in it as one piece.
        let widths: Vec<usize> = p.outputs.iter().map(|(_, s)| s.width).collect();
        let values = Columns::new(n, &widths).fill(|outs| {
            in_parts(&picks.rows, part, outs, &widths, |rows, outs| {
                self.gather_rows(p, rows, fetched, outs)
            });
            Ok(())
        })?;
        self.packed_arrays(p, values, n)
    }

    /// Appends the packed columns of `rows` (`(batch, row)`; a batch index
    /// past the local batches names a fetched one) to `outs`, one buffer per
    /// packed output: a tile's worth of records at a time transposed into
    /// columns where they lie; for a few (wide) columns, each value copied
    /// straight from its record. A tile with rows fetched from other
    /// members as columns is copied into a buffer, their values written
    /// into it column by column, and transposed from there.
    fn gather_rows(
        &self,
        p: &PackedGather,
        rows: &[(usize, usize)],
        fetched: Fetched<'_>,
        outs: &mut [impl Output],
    ) {
        let local = self.data.batches().len();
        let record = p.packed.record();
        let n = rows.len();
        // The record of a pick at its place: a local one, or a fetched one
        // sent as a record.
        let record_at = |b: usize, at: usize| -> Option<&[u8]> {
            if b < local {
                Some(p.packed.at(b, at))
            } else {
                let records = fetched.records[b - local].as_ref()?;
                Some(&records.as_slice()[at * record..][..record])
            }
        };
        // Where each pick's record is: `(batch, record)` of a local pick
        // (its place in the copy's residue groups, found once per pick),
        // `(batch, row)` of one fetched from a member.
        let place = |&(b, r): &(usize, usize)| {
            if b < local {
                (b, p.packed.position(b, r))
            } else {
                (b, r)
            }
        };
        if p.outputs.len() <= DIRECT_COLUMNS {
            // Few (wide) columns: each value straight from its record.
            // (Storage order needs no mapping: the picks are the places.)
            let places: Cow<'_, [(usize, usize)]> = if p.packed.stride() == 1 {
                Cow::Borrowed(rows)
            } else {
                Cow::Owned(rows.iter().map(place).collect())
            };
            for (i, &(b, at)) in places.iter().enumerate() {
                if let Some(&(b, at)) = places.get(i + PREFETCH_ROWS)
                    && b < local
                {
                    prefetch(p.packed.at(b, at));
                }
                let whole = record_at(b, at);
                for ((out, &(_, slot)), values) in
                    outs.iter_mut().zip(&p.outputs).zip(fetched.values)
                {
                    let from = if let Some(record) = whole {
                        &record[slot.offset..][..slot.width]
                    } else {
                        &values[b - local].as_slice()[at * slot.width..][..slot.width]
                    };
                    out.extend_from_slice(from);
                }
            }
            return;
        }
        // A whole number of 16-record gathers where the tile holds that
        // many (no rows left over to take out one by one).
        let tile_rows = match TILE_BYTES / record {
            r if r >= 16 => r / 16 * 16,
            r => r.max(1),
        };
        // The tile's records where they lie (empty for a row a member sent
        // as columns), and a tile to copy them into only where some are.
        let mut scattered: Vec<&[u8]> = Vec::with_capacity(tile_rows);
        let mut tile: Vec<u8> = Vec::new();
        // The tile's rows fetched from other members as columns: (tile
        // row, extra batch, row in it).
        let mut from_members: Vec<(usize, usize, usize)> = Vec::new();
        let mut places: Vec<(usize, usize)> = Vec::with_capacity(tile_rows + PREFETCH_ROWS);
        for start in (0..n).step_by(tile_rows) {
            let tile_picks = &rows[start..n.min(start + tile_rows)];
            if let Some(run) = packed_run(&p.packed, tile_picks, local) {
                // Records back to back (an unshuffled read by as many
                // ranks as the copy's stride): untiled where they lie.
                p.untile(Tile::new(run, record, tile_picks.len()), outs);
                continue;
            }
            // The tile's picks and those a prefetch ahead of its last.
            places.clear();
            let ahead = &rows[start..n.min(start + tile_picks.len() + PREFETCH_ROWS)];
            places.extend(ahead.iter().map(place));
            scattered.clear();
            for (i, &(b, at)) in places[..tile_picks.len()].iter().enumerate() {
                if let Some(&(b, at)) = places.get(i + PREFETCH_ROWS)
                    && b < local
                {
                    prefetch(p.packed.at(b, at));
                }
                match record_at(b, at) {
                    Some(from) => scattered.push(from),
                    None => {
                        from_members.push((i, b - local, at));
                        scattered.push(&[]);
                    }
                }
            }
            if from_members.is_empty() {
                // Transposed from where the records lie: copying them
                // into a tile first cost as much again.
                p.untile(Scattered::new(&scattered, record), outs);
                continue;
            }
            // Rows other members sent as columns: the others' records
            // copied into the tile, theirs written column by column.
            tile.resize(tile_rows * record, 0);
            for (i, from) in scattered.iter().enumerate() {
                if !from.is_empty() {
                    tile[i * record..][..record].copy_from_slice(from);
                }
            }
            for (values, &(_, slot)) in fetched.values.iter().zip(&p.outputs) {
                fetched_into_tile(&mut tile, record, slot, values, &from_members);
            }
            from_members.clear();
            p.untile(Tile::new(&tile, record, tile_picks.len()), outs);
        }
    }

    /// The arrays of a packed gather's columns, by projected column.
    fn packed_arrays(
        &self,
        p: &PackedGather,
        outs: Vec<Buffer>,
        n: usize,
    ) -> Result<Vec<Option<ArrayRef>>> {
        let mut arrays: Vec<Option<ArrayRef>> = vec![None; self.columns.len()];
        for (out, &(j, _)) in outs.into_iter().zip(&p.outputs) {
            let Column::Fixed(c) = &self.columns[j] else {
                return Err(Error::Internal("a packed column is not fixed-width".into()));
            };
            arrays[j] = Some(c.array(out, n)?);
        }
        Ok(arrays)
    }
}

/// One rank's shard of one epoch, ready to stream.
#[derive(Debug)]
pub struct Shard {
    gather: Gather,
    order: ShardOrder,
    plan: ReadPlan,
}

impl Shard {
    /// Rank `rank`'s shard of `plan` over `data`; checks columns and start.
    pub fn new(data: Arc<SealedData>, plan: &ReadPlan, rank: u32) -> Result<Self> {
        Self::selecting(data, plan, rank, None)
    }

    /// Rank `rank`'s shard of `plan` over the rows of `data` that
    /// `selection` names (`None`: all), numbered `0..` in storage order.
    pub fn selecting(
        data: Arc<SealedData>,
        plan: &ReadPlan,
        rank: u32,
        selection: Option<Arc<Selection>>,
    ) -> Result<Self> {
        let gather = Gather::for_plan(data, plan, None, selection)?;
        let n = gather.rows();
        let order = ShardOrder::new(plan.epoch_order(n), plan.shares(n)?, rank)?;
        Ok(Self {
            gather,
            order,
            plan: plan.clone(),
        })
    }

    /// Lets shuffled batches gather from packed rows ([`Gather::packing`]).
    pub fn packing(mut self, arena: Arc<Arena>, metrics: Arc<Metrics>) -> Self {
        self.gather = self.gather.packing(arena, metrics);
        self
    }

    /// Splits each batch's packed gather into `ways` parts ([`Gather::split`]).
    pub fn split(mut self, ways: usize) -> Self {
        self.gather = self.gather.split(ways);
        self
    }

    /// The projected schema every batch has.
    pub fn schema(&self) -> SchemaRef {
        self.gather.schema()
    }

    /// The dataset the shard reads.
    pub fn data(&self) -> &SealedData {
        self.gather.data()
    }

    /// Rows of the rank's whole share (before any split).
    pub fn rank_rows(&self) -> u64 {
        self.order.len()
    }

    /// The stream's record batches, in order; the last may be shorter.
    pub fn batches(&self) -> impl Iterator<Item = Result<RecordBatch>> + '_ {
        (0..).map_while(|j| self.batch(j))
    }

    /// The stream's `j`-th record batch; `None` past the last.
    pub fn batch(&self, j: u64) -> Option<Result<RecordBatch>> {
        let samples = self.plan.stream_batch(self.rank_rows(), j)?;
        Some(self.gather(samples))
    }

    fn gather(&self, samples: std::ops::Range<u64>) -> Result<RecordBatch> {
        let picks = Picks::new(self.gather.locate_all(self.order.rows(samples)));
        self.gather.batch(&picks, &[])
    }
}

/// The stored rows one output batch takes.
#[derive(Debug)]
pub struct Picks {
    /// `(batch, row within batch)` per output row, in output order.
    rows: Vec<(usize, usize)>,
    /// Whether output order is stored order.
    in_order: bool,
    /// Whether most picks are not the stored row right after the one
    /// before (a shuffled order, or a strided one: rank `r` of `W` taking
    /// every `W`-th row).
    scattered: bool,
    /// `(batch, row within batch, output row)`, in stored order: made for
    /// the first column gathered byte by byte (a packed gather needs none).
    sorted: std::cell::OnceCell<Vec<(u32, u32, u32)>>,
    /// The picks as runs, made for the first column copied run by run:
    /// every column of a batch takes the same runs.
    runs: std::cell::OnceCell<Vec<(usize, std::ops::Range<usize>)>>,
}

impl Picks {
    /// Picks of `(batch, row within batch)`, one per output row in order.
    pub fn new(rows: Vec<(usize, usize)>) -> Self {
        let in_order = rows.is_sorted();
        let neighbours = rows
            .windows(2)
            .filter(|w| w[1] == (w[0].0, w[0].1 + 1) || w[1] == (w[0].0 + 1, 0))
            .count();
        Self {
            scattered: 2 * neighbours < rows.len(),
            rows,
            in_order,
            sorted: std::cell::OnceCell::new(),
            runs: std::cell::OnceCell::new(),
        }
    }

    /// The picks in stored order, with their output rows.
    fn sorted(&self) -> &[(u32, u32, u32)] {
        self.sorted.get_or_init(|| {
            let mut sorted: Vec<(u32, u32, u32)> = self
                .rows
                .iter()
                .enumerate()
                // A dataset's batch count and rows per batch fit u32 (a batch
                // is one Flight message), and so does a batch's row count.
                .map(|(at, &(b, r))| (b as u32, r as u32, at as u32))
                .collect();
            if !self.in_order {
                sorted.sort_unstable();
            }
            sorted
        })
    }

    /// The picks as runs of neighbouring rows of one batch, in output
    /// order: `(batch, rows)`; found once, at the first call.
    fn runs(&self) -> &[(usize, std::ops::Range<usize>)] {
        self.runs.get_or_init(|| {
            let mut runs: Vec<(usize, std::ops::Range<usize>)> = Vec::new();
            for &(b, r) in &self.rows {
                match runs.last_mut() {
                    Some((last, rows)) if *last == b && rows.end == r => rows.end += 1,
                    _ => runs.push((b, r..r + 1)),
                }
            }
            runs
        })
    }

    /// Output rows.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether no row is picked.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }
}

/// How one projected column is gathered.
#[derive(Debug)]
enum Column {
    /// Fixed-width rows and no nulls in any stored batch: rows are copied as
    /// bytes.
    Fixed(FixedColumn),
    /// Anything else: Arrow's `interleave` over the stored arrays.
    Other(Vec<ArrayRef>),
}

#[derive(Debug)]
struct FixedColumn {
    data_type: DataType,
    /// Per stored batch, its rows' bytes; element type and values per row.
    segments: Arc<ColumnSegments>,
    /// Bytes per row.
    row_bytes: usize,
}

impl Column {
    fn new(data: &SealedData, index: usize, fixed: Option<bool>) -> Result<Self> {
        let other = || {
            Self::Other(
                data.batches()
                    .iter()
                    .map(|b| b.column(index).clone())
                    .collect(),
            )
        };
        // A cluster's members decide together (`fixed`).
        match (segments_at(data, index), fixed) {
            (Ok(segments), None | Some(true)) => Ok(Self::Fixed(FixedColumn {
                data_type: data.schema().field(index).data_type().clone(),
                row_bytes: segments.element.primitive_width().unwrap_or(1) * segments.width,
                segments,
            })),
            (Err(e), Some(true)) => Err(Error::Internal(format!(
                "the cluster layout says column {index} has no nulls, but here: {e}"
            ))),
            (_, _) => Ok(other()),
        }
    }

    /// Column `j` of the picked rows, for a column gathered by `interleave`.
    fn gather_other(
        arrays: &[ArrayRef],
        extra: &[RecordBatch],
        picks: &Picks,
        j: usize,
    ) -> Result<ArrayRef> {
        let arrays: Vec<&dyn Array> = arrays
            .iter()
            .chain(extra.iter().map(|b| b.column(j)))
            .map(|a| a.as_ref())
            .collect();
        interleave(&arrays, &picks.rows)
            .map_err(|e| Error::Internal(format!("gathering rows: {e}")))
    }
}

impl FixedColumn {
    /// Appends the bytes of column `j` of the picked rows to `out`.
    fn gather_into(
        &self,
        picks: &Picks,
        extra: &[RecordBatch],
        j: usize,
        out: &mut impl Output,
    ) -> Result<()> {
        let extra_segments = extra
            .iter()
            .map(|b| fetched_values(b, j, self.row_bytes))
            .collect::<Result<Vec<_>>>()?;
        let sources: Vec<&[u8]> = self
            .segments
            .segments
            .iter()
            .chain(&extra_segments)
            .map(|s| s.as_slice())
            .collect();
        let len = picks.len() * self.row_bytes;
        out.reserve(len);
        if !picks.scattered {
            // Mostly runs of neighbouring rows: one copy per run.
            for (b, rows) in picks.runs().iter().cloned() {
                out.extend_from_slice(
                    &sources[b][rows.start * self.row_bytes..rows.end * self.row_bytes],
                );
            }
        } else if picks.in_order {
            // Output order is source order: append, nothing to zero.
            let values = picks
                .rows
                .iter()
                .map(|&(b, r)| (sources[b], r * self.row_bytes));
            append_values(values, self.row_bytes, out);
        } else {
            let start = out.len();
            out.extend_zeros(len);
            let to = &mut out.as_slice_mut()[start..];
            gather_bytes(&sources, picks.sorted(), self.row_bytes, to);
        }
        Ok(())
    }

    /// The column's array of `rows` rows whose bytes are `values`.
    fn array(&self, values: Buffer, rows: usize) -> Result<ArrayRef> {
        let internal =
            |e: arrow::error::ArrowError| Error::Internal(format!("gathering rows: {e}"));
        let values = ArrayData::try_new(
            self.segments.element.clone(),
            rows * self.segments.width,
            None,
            0,
            vec![values],
            vec![],
        )
        .map_err(internal)?;
        let width = self.segments.width;
        let data = match &self.data_type {
            DataType::FixedSizeList(..) => {
                ArrayData::try_new(self.data_type.clone(), rows, None, 0, vec![], vec![values])
                    .map_err(internal)?
            }
            // A list whose rows all hold `width` values.
            DataType::List(_) | DataType::LargeList(_) => {
                let offsets = (0..=rows).map(|r| r * width);
                let offsets = if matches!(self.data_type, DataType::List(_)) {
                    let too_many = || {
                        Error::invalid(format!(
                            "a batch of {rows} rows of {width} values each is more than a list \
                             column holds in one batch ({} values): ask for smaller batches",
                            i32::MAX
                        ))
                    };
                    i32::try_from(rows * width).map_err(|_| too_many())?;
                    Buffer::from_iter(offsets.map(|o| o as i32))
                } else {
                    Buffer::from_iter(offsets.map(|o| o as i64))
                };
                ArrayData::try_new(
                    self.data_type.clone(),
                    rows,
                    None,
                    0,
                    vec![offsets],
                    vec![values],
                )
                .map_err(internal)?
            }
            _ => values,
        };
        Ok(make_array(data))
    }
}

/// The values of column `j` of a batch fetched from another member, checked
/// to hold `row_bytes` bytes for each of its rows (so that no row the merge
/// picks can fall outside them).
fn fetched_values(batch: &RecordBatch, j: usize, row_bytes: usize) -> Result<Buffer> {
    if batch.num_rows() == 0 {
        // No rows to take a list's length from: nothing any pick reads.
        return Ok(Buffer::from_vec(Vec::<u8>::new()));
    }
    let values = value_bytes(batch.column(j), "a column fetched from a peer")?;
    if values.len() != batch.num_rows() * row_bytes {
        return Err(Error::Internal(format!(
            "a member sent column {j} with {} bytes for {} rows, {row_bytes} bytes a row \
             expected; do the members run the same version?",
            values.len(),
            batch.num_rows()
        )));
    }
    Ok(values)
}

/// The records of `rows` when they lie back to back in `packed`: all rows
/// of one stored batch (below `local`, not fetched from a member), each the
/// copy's stride after the one before, so one residue group in order.
fn packed_run<'a>(packed: &'a Packed, rows: &[(usize, usize)], local: usize) -> Option<&'a [u8]> {
    let &(b, first) = rows.first()?;
    let stride = packed.stride();
    let follows = b < local
        && rows
            .iter()
            .enumerate()
            .all(|(i, &(c, r))| c == b && r == first + i * stride);
    if !follows {
        return None;
    }
    let record = packed.record();
    let at = packed.position(b, first) * record;
    Some(&packed.batch(b)[at..at + rows.len() * record])
}

/// Asks the CPU to start loading `bytes` into the second-level cache (a
/// packed record [`PREFETCH_ROWS`] rows ahead of its copy, a column's
/// value [`PREFETCH_VALUES`] picks ahead), every cache line it touches; a
/// hint only. Into the second level, not the first: a core can have far
/// more loads outstanding to it, so many more scattered records are on
/// their way at once (2 M random 264-byte records copied into a
/// tile, Zen 4: 42–53 ns a record asked into the first level 8 rows
/// ahead, 23–24 ns into the second 16 ahead, 15 ns in storage order;
/// `bench/RESULTS.md`).
#[inline(always)]
#[allow(unsafe_code)]
fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        // From the start of the first line `bytes` touches to its last byte.
        let skew = bytes.as_ptr() as usize % 64;
        for line in (0..skew + bytes.len()).step_by(64) {
            use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
            let at = bytes.as_ptr().wrapping_sub(skew).wrapping_add(line);
            // SAFETY: a prefetch neither reads into the program nor faults,
            // whatever the address; `at` is in a line `bytes` touches.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(at.cast()) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// Appends column `slot` of the records of `from` to `out`, row after row.
fn untile(from: impl Records, slot: Slot, out: &mut impl Output) {
    match slot.width {
        4 => untile_n::<4>(from, slot.offset, out),
        8 => untile_n::<8>(from, slot.offset, out),
        _ => {
            let values = (0..from.rows()).map(|i| (from.at(i), slot.offset));
            append_values(values, slot.width, out);
        }
    }
}

/// Appends the eight 4-byte columns side by side at `offset` in the
/// records of `from` to `outs` (eight buffers, the first column's values to
/// the first): eight rows at a time transposed in registers where the CPU
/// has AVX, the rows left (and every row elsewhere) value by value. Written
/// straight into each buffer's reserved room, not zeroed first (zeroing
/// eight outputs a tile cost four times the transpose).
#[allow(unsafe_code)]
fn untile_eight<O: Output>(from: impl Records, offset: usize, outs: &mut [O]) {
    let outs: &mut [O; 8] = outs.try_into().expect("eight outputs");
    let rows = from.rows();
    assert!(offset + 32 <= from.record());
    for out in outs.iter_mut() {
        out.reserve(rows * 4);
    }
    let to = outs
        .each_mut()
        .map(|out| out.as_mut_ptr().wrapping_add(out.len()));
    #[cfg(target_arch = "x86_64")]
    let done = if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: the CPU has the feature `untile_eight_avx` is compiled
        // for; `from` holds `rows` records of at least `offset + 32` bytes
        // and every `to[k]` has room for `rows * 4` bytes (all checked or
        // reserved above).
        unsafe { untile_eight_avx(from, offset, to) }
    } else {
        0
    };
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    for i in done..rows {
        let values = &from.at(i)[offset..offset + 32];
        for (k, &to) in to.iter().enumerate() {
            // SAFETY: `i < rows` and `to` has room for `rows * 4` bytes.
            unsafe { std::ptr::copy_nonoverlapping(values[4 * k..].as_ptr(), to.add(4 * i), 4) };
        }
    }
    for out in outs {
        // SAFETY: the `rows * 4` bytes after the end, within the capacity
        // reserved above, were all written: rows `..done` by the transpose,
        // the rest one by one.
        unsafe { out.set_len(out.len() + rows * 4) };
    }
}

/// The AVX part of [`untile_eight`]: writes to `to[k]` the 4-byte value at
/// `offset + 4k` of each record of `from`, eight rows at a time (two 4 × 4
/// transposes, one per half of the values, with rows `i..i + 4` in the low
/// lane and `i + 4..i + 8` in the high one); returns the rows written, the
/// rest left to the caller.
///
/// # Safety
///
/// `from`'s records are at least `offset + 32` bytes each, and each `to[k]`
/// is valid for writes of `from.rows() * 4` bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
#[allow(unsafe_code)]
unsafe fn untile_eight_avx(from: impl Records, offset: usize, to: [*mut u8; 8]) -> usize {
    use std::arch::x86_64::*;
    let rows = from.rows();
    let mut i = 0;
    while i + 8 <= rows {
        for half in 0..2 {
            // SAFETY: the loads read 16 bytes at `offset + 16 * half` of
            // records `i..i + 8` (`i + 8 <= rows`), inside each record
            // (`offset + 32` bytes or more); the stores write `to[k][i *
            // 4..i * 4 + 32]`, inside the room the caller gives.
            unsafe {
                let at = offset + 16 * half;
                let load = |j: usize| {
                    let low = _mm_loadu_ps(from.start(i + j).add(at).cast());
                    let high = _mm_loadu_ps(from.start(i + j + 4).add(at).cast());
                    _mm256_insertf128_ps::<1>(_mm256_castps128_ps256(low), high)
                };
                let (a0, a1, a2, a3) = (load(0), load(1), load(2), load(3));
                let (t0, t1) = (_mm256_unpacklo_ps(a0, a1), _mm256_unpacklo_ps(a2, a3));
                let (t2, t3) = (_mm256_unpackhi_ps(a0, a1), _mm256_unpackhi_ps(a2, a3));
                let columns = [
                    _mm256_shuffle_ps::<0x44>(t0, t1),
                    _mm256_shuffle_ps::<0xEE>(t0, t1),
                    _mm256_shuffle_ps::<0x44>(t2, t3),
                    _mm256_shuffle_ps::<0xEE>(t2, t3),
                ];
                for (k, column) in columns.into_iter().enumerate() {
                    _mm256_storeu_ps(to[4 * half + k].add(i * 4).cast(), column);
                }
            }
        }
        i += 8;
    }
    i
}

/// [`untile`] for a column of `W` bytes a row: the output grown once, then
/// each record's value copied into place — records back to back sixteen
/// (or eight) at a time with one AVX-512 gather where the CPU has it, else
/// one by one in a loop the compiler keeps tight (appending value by value
/// would check capacity at every row).
fn untile_n<const W: usize>(from: impl Records, offset: usize, out: &mut impl Output) {
    let rows = from.rows();
    let start = out.len();
    out.extend_zeros(rows * W);
    let to = &mut out.as_slice_mut()[start..];
    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code)]
    let done = match from.tile() {
        Some(tile) if std::arch::is_x86_feature_detected!("avx512f") => {
            // SAFETY: the CPU has the feature `untile_avx512` is compiled
            // for.
            unsafe { untile_avx512::<W>(tile, from.record(), offset, to) }
        }
        _ => 0,
    };
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    for (i, value) in to.chunks_exact_mut(W).enumerate().skip(done) {
        value.copy_from_slice(&from.at(i)[offset..offset + W]);
    }
}

/// The AVX-512 part of [`untile_n`] (`W` is 4 or 8): fills `to` with the
/// value at `offset` of each `record`-byte record of `tile`, a gather of
/// sixteen (or eight) records at a time; returns the rows written, the
/// rest left to the caller. Needs `tile` to hold `to.len() / W` records
/// and `offset + W <= record`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(unsafe_code)]
fn untile_avx512<const W: usize>(
    tile: &[u8],
    record: usize,
    offset: usize,
    to: &mut [u8],
) -> usize {
    use std::arch::x86_64::*;
    let rows = to.len() / W;
    let lanes = 64 / W;
    // The last lane's offset, `(lanes - 1) * record`, must fit an i32.
    let (Ok(r), Ok(_)) = (i32::try_from(record), i32::try_from(record * lanes)) else {
        return 0;
    };
    if !matches!(W, 4 | 8) || tile.len() < rows * record || offset + W > record {
        return 0;
    }
    let dwords = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(r),
    );
    let qwords = _mm256_mullo_epi32(
        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        _mm256_set1_epi32(r),
    );
    let mut i = 0;
    while i + lanes <= rows {
        // SAFETY: lane `k` reads the `W` bytes at `(i + k) * record +
        // offset`, inside `tile` since `i + k < rows`, `offset + W <=
        // record` and `tile` holds `rows` records (checked above); the
        // store writes `to[i * W..(i + lanes) * W]`, inside `to`.
        unsafe {
            let at = tile.as_ptr().add(i * record + offset);
            let values = if W == 4 {
                _mm512_i32gather_epi32::<1>(dwords, at.cast())
            } else {
                _mm512_i32gather_epi64::<1>(qwords, at.cast())
            };
            _mm512_storeu_si512(to.as_mut_ptr().add(i * W).cast(), values);
        }
        i += lanes;
    }
    i
}

/// Appends the `width` bytes at each `(source, offset)` to `out`, in order
/// (nothing to zero first: every byte is written).
fn append_values<'a>(
    values: impl Iterator<Item = (&'a [u8], usize)>,
    width: usize,
    out: &mut impl Output,
) {
    match width {
        1 => out.extend_values(values.map(|(s, at)| s[at])),
        2 => out.extend_values(values.map(|(s, at)| u16::from_ne_bytes(bytes_at(s, at)))),
        4 => out.extend_values(values.map(|(s, at)| u32::from_ne_bytes(bytes_at(s, at)))),
        8 => out.extend_values(values.map(|(s, at)| u64::from_ne_bytes(bytes_at(s, at)))),
        16 => out.extend_values(values.map(|(s, at)| i128::from_ne_bytes(bytes_at(s, at)))),
        n => {
            for (s, at) in values {
                out.extend_from_slice(&s[at..at + n]);
            }
        }
    }
}

/// Writes one column's values of the `fetched` rows (tile row, extra
/// batch, row in it) into their records of `tile`, one value per row.
fn fetched_into_tile(
    tile: &mut [u8],
    record: usize,
    slot: Slot,
    values: &[Buffer],
    fetched: &[(usize, usize, usize)],
) {
    fn copy<const N: usize>(
        tile: &mut [u8],
        record: usize,
        offset: usize,
        values: &[Buffer],
        fetched: &[(usize, usize, usize)],
    ) {
        for &(i, e, r) in fetched {
            tile[i * record + offset..][..N]
                .copy_from_slice(&bytes_at::<N>(values[e].as_slice(), r * N));
        }
    }
    match slot.width {
        4 => copy::<4>(tile, record, slot.offset, values, fetched),
        8 => copy::<8>(tile, record, slot.offset, values, fetched),
        n => {
            for &(i, e, r) in fetched {
                tile[i * record + slot.offset..][..n]
                    .copy_from_slice(&values[e].as_slice()[r * n..][..n]);
            }
        }
    }
}

/// The `N` bytes of `from` at `at`.
#[inline(always)]
fn bytes_at<const N: usize>(from: &[u8], at: usize) -> [u8; N] {
    let mut value = [0u8; N];
    value.copy_from_slice(&from[at..at + N]);
    value
}

/// Copies row `r` of source `b` to output row `at` for every pick (picks
/// in stored order), asking for each source value [`PREFETCH_VALUES`]
/// picks ahead.
fn gather_bytes(sources: &[&[u8]], picks: &[(u32, u32, u32)], row_bytes: usize, out: &mut [u8]) {
    match row_bytes {
        1 => gather_rows::<1>(sources, picks, out),
        2 => gather_rows::<2>(sources, picks, out),
        4 => gather_rows::<4>(sources, picks, out),
        8 => gather_rows::<8>(sources, picks, out),
        16 => gather_rows::<16>(sources, picks, out),
        n => {
            for (i, &(b, r, at)) in picks.iter().enumerate() {
                prefetch_pick(sources, picks, i + PREFETCH_VALUES, n);
                let (r, at) = (r as usize * n, at as usize * n);
                out[at..at + n].copy_from_slice(&sources[b as usize][r..r + n]);
            }
        }
    }
}

/// [`gather_bytes`] for rows of `N` bytes: one load and one store per row.
fn gather_rows<const N: usize>(sources: &[&[u8]], picks: &[(u32, u32, u32)], out: &mut [u8]) {
    for (i, &(b, r, at)) in picks.iter().enumerate() {
        prefetch_pick(sources, picks, i + PREFETCH_VALUES, N);
        let at = at as usize * N;
        out[at..at + N].copy_from_slice(&bytes_at::<N>(sources[b as usize], r as usize * N));
    }
}

/// [`prefetch`]es the `row_bytes`-byte value of pick `i`, if there is one.
#[inline(always)]
fn prefetch_pick(sources: &[&[u8]], picks: &[(u32, u32, u32)], i: usize, row_bytes: usize) {
    if let Some(&(b, r, _)) = picks.get(i) {
        let from = r as usize * row_bytes;
        if let Some(value) = sources
            .get(b as usize)
            .and_then(|s| s.get(from..from + row_bytes))
        {
            prefetch(value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::AttemptKey;
    use crate::memory::Budget;
    use crate::memory::arena::HostMemory;
    use crate::order::Shuffle;
    use arrow::array::{
        AsArray, FixedSizeBinaryArray, FixedSizeListArray, Float32Array, Float64Array, Int16Array,
        Int64Array, ListArray, StringArray,
    };
    use arrow::buffer::MutableBuffer;
    use arrow::buffer::{NullBuffer, OffsetBuffer};
    use arrow::compute::interleave_record_batch;
    use arrow::datatypes::Field;

    fn list(values: ArrayRef, width: i32, nulls: Option<Vec<bool>>) -> ArrayRef {
        let item = Arc::new(Field::new("item", values.data_type().clone(), true));
        Arc::new(FixedSizeListArray::new(
            item,
            width,
            values,
            nulls.map(Into::into),
        ))
    }

    /// `batches` as a sealed dataset (no attempts recorded).
    fn sealed(batches: &[RecordBatch]) -> Arc<SealedData> {
        Arc::new(SealedData::from_batches(
            batches[0].schema(),
            vec![],
            batches.to_vec(),
        ))
    }

    /// An arena with room for every test's packed copy.
    fn roomy_arena() -> Arc<Arena> {
        Arc::new(Arena::new(Budget::new(64 << 20), 1 << 20, HostMemory::Heap))
    }

    /// A gather of `columns` of `data` each way a batch is gathered: column
    /// by column, packed, and packed in three parts on threads — with
    /// whether it packs and its split.
    fn every_gather(
        data: &Arc<SealedData>,
        columns: &[String],
    ) -> Vec<(bool, Option<usize>, Gather)> {
        let arena = roomy_arena();
        [(false, None), (true, None), (true, Some(3))]
            .into_iter()
            .map(|(packing, split)| {
                let mut gather = Gather::new(data.clone(), columns, "d", None).expect("gather");
                if packing {
                    gather = gather.packing(arena.clone(), Arc::default());
                }
                if let Some(ways) = split {
                    gather = gather.split(ways);
                }
                (packing, split, gather)
            })
            .collect()
    }

    /// Batch `i` of `rows` rows starting at `start`: every kind of column the
    /// gather distinguishes (1, 2, 4, 8, 12, 16 and 20 bytes per row,
    /// nulls, strings, nine `float32` columns side by side, lists).
    fn batch(start: usize, rows: usize) -> RecordBatch {
        let r = start..start + rows;
        let f = |k: usize| {
            r.clone()
                .flat_map(move |v| (0..k).map(move |j| (v * 10 + j) as f32))
        };
        let columns: Vec<ArrayRef> = vec![
            Arc::new(Int64Array::from_iter_values(r.clone().map(|v| v as i64))),
            Arc::new(Int16Array::from_iter_values(r.clone().map(|v| v as i16))),
            Arc::new(Float32Array::from_iter(
                r.clone().map(|v| (v % 3 != 0).then_some(v as f32)),
            )),
            list(Arc::new(Float32Array::from_iter_values(f(3))), 3, None),
            list(
                Arc::new(Float64Array::from_iter_values(f(2).map(f64::from))),
                2,
                None,
            ),
            list(Arc::new(Float32Array::from_iter_values(f(5))), 5, None),
            list(
                Arc::new(Float32Array::from_iter_values(f(2))),
                2,
                Some(r.clone().map(|v| v % 4 != 1).collect()),
            ),
            Arc::new(StringArray::from_iter_values(
                r.clone().map(|v| format!("s{v}")),
            )),
            Arc::new(arrow::array::UInt8Array::from_iter_values(
                r.clone().map(|v| v as u8),
            )),
            Arc::new(Float32Array::from_iter_values(
                r.clone().map(|v| v as f32 + 0.5),
            )),
        ];
        // Nine float32 columns side by side: eight untiled at a time and one
        // on its own; then lists (Spark's `array<float>`): of one length
        // (gathered as bytes), ragged, and with null rows (both not).
        let lists = |lengths: &dyn Fn(usize) -> usize, nulls: Option<NullBuffer>| -> ArrayRef {
            let lengths: Vec<usize> = r.clone().map(lengths).collect();
            let values = lengths
                .iter()
                .zip(r.clone())
                .flat_map(|(&n, v)| (0..n).map(move |j| (v * 10 + j) as f32 + 0.125));
            Arc::new(ListArray::new(
                Arc::new(Field::new("element", DataType::Float32, true)),
                OffsetBuffer::from_lengths(lengths.iter().copied()),
                Arc::new(Float32Array::from_iter_values(values)),
                nulls,
            ))
        };
        let columns: Vec<ArrayRef> = columns
            .into_iter()
            .chain((1..10).map(|k| -> ArrayRef {
                Arc::new(Float32Array::from_iter_values(
                    r.clone().map(move |v| (v * k) as f32 - 0.25),
                ))
            }))
            .chain([
                lists(&|_| 2, None),
                lists(&|v| v % 3, None),
                lists(
                    &|v| if v % 5 == 0 { 0 } else { 2 },
                    Some(r.clone().map(|v| v % 5 != 0).collect()),
                ),
            ])
            .collect();
        let fields: Vec<Field> = columns
            .iter()
            .enumerate()
            .map(|(i, c)| Field::new(format!("c{i}"), c.data_type().clone(), true))
            .collect();
        RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).expect("batch")
    }

    #[test]
    fn byte_gather_equals_interleave_for_every_order() {
        // Uneven batches, one of them a slice with an offset.
        let batches = vec![
            batch(0, 700),
            batch(700, 1300).slice(100, 1000),
            batch(1700, 1),
            batch(1701, 2299),
        ];
        let data = Arc::new(SealedData::from_batches(
            batches[0].schema(),
            vec![AttemptKey {
                partition: 0,
                attempt: 0,
            }],
            batches.clone(),
        ));
        let arena = roomy_arena();
        let shape = |name: &str| {
            let shard =
                Shard::new(data.clone(), &plan(Shuffle::None, 1, vec![]), 0).expect("shard");
            let i = data.schema().index_of(name).expect("column");
            matches!(shard.gather.columns[i], Column::Fixed(_))
        };
        // The fixed path takes numbers without nulls, with or without lists.
        for (name, fixed) in [
            ("c0", true),
            ("c1", true),
            ("c2", false),
            ("c3", true),
            ("c4", true),
            ("c5", true),
            ("c6", false),
            ("c7", false),
            ("c8", true),
            ("c19", true),
            ("c20", false),
            ("c21", false),
        ] {
            assert_eq!(shape(name), fixed, "{name}");
        }
        // A cluster's member says the same of its part for the seal, lists
        // aside, and the values a row of its list of one length (another
        // member's lists may hold another number).
        let (fixed, widths) = Gather::byte_columns(&data);
        assert!(fixed[0] && fixed[3] && !fixed[2] && !fixed[19] && !fixed[20] && !fixed[21]);
        assert_eq!(
            (widths[19], widths[20], widths[21], widths[0]),
            (2, 0, 0, 0)
        );
        for shuffle in [
            Shuffle::None,
            Shuffle::Global,
            Shuffle::Block { block_rows: 64 },
        ] {
            // Every column (through a tile), two narrow ones (not packed:
            // less than half a record), four wide ones (straight from
            // each record).
            let wide = ["c0", "c5", "c4", "c3"].map(String::from).to_vec();
            for (world, columns, packs) in [
                (1, vec![], true),
                (3, vec![], true),
                (8, vec!["c5".to_string(), "c0".to_string()], false),
                (3, wide.clone(), true),
            ] {
                let plan = plan(shuffle, world, columns);
                for (rank, packing) in (0..world).flat_map(|r| [(r, false), (r, true)]) {
                    let mut shard = Shard::new(data.clone(), &plan, rank).expect("shard");
                    if packing {
                        shard = shard.packing(arena.clone(), Arc::default());
                    }
                    let (indices, _) =
                        project(data.schema(), &plan.columns, "d").expect("projection");
                    let projected: Vec<RecordBatch> = batches
                        .iter()
                        .map(|b| b.project(&indices).expect("projection"))
                        .collect();
                    let sources: Vec<&RecordBatch> = projected.iter().collect();
                    for (got, range) in shard.batches().zip(plan.stream_batches(shard.rank_rows()))
                    {
                        let picks: Vec<(usize, usize)> =
                            range.map(|k| data.locate(shard.order.row(k))).collect();
                        let want = interleave_record_batch(&sources, &picks).expect("interleave");
                        assert_eq!(
                            got.expect("gathered"),
                            want,
                            "{shuffle:?} world {world} rank {rank} packing {packing}"
                        );
                    }
                    // Every shuffled read with the arena gathered from
                    // packed records, and so did every strided unshuffled
                    // one (several ranks); one rank's unshuffled read is
                    // runs of neighbouring rows and never does.
                    let packed = shard.gather.packed.get().is_some_and(Option::is_some);
                    if shuffle == Shuffle::None && world == 1 {
                        assert!(!packed);
                    } else {
                        assert_eq!(packed, packing && packs, "{shuffle:?} {world}");
                    }
                }
            }
        }
        // The copy counts in the budget, and giving it up returns it.
        let packed = data.packed().bytes();
        assert!(packed > 0);
        assert_eq!(arena.budget().used(), arena.stats().held_bytes);
        assert!(arena.stats().live_bytes >= packed);
        assert_eq!(data.packed().give_up(), packed);
        assert_eq!(data.packed().bytes(), 0);
    }

    #[test]
    fn a_batch_gathered_in_parts_on_threads_is_the_batch_gathered_whole() {
        let batches = vec![
            batch(0, 700),
            batch(700, 1300).slice(100, 1000),
            batch(1700, 2299),
        ];
        let data = sealed(&batches);
        let arena = roomy_arena();
        let wide = ["c0", "c5", "c4", "c3"].map(String::from).to_vec();
        for shuffle in [
            Shuffle::None,
            Shuffle::Global,
            Shuffle::Block { block_rows: 64 },
        ] {
            // Through a tile (every column) and straight from each record
            // (four wide ones); strided and scattered rows.
            for (world, columns) in [(3, vec![]), (1, wide.clone()), (8, wide.clone())] {
                let plan = plan(shuffle, world, columns);
                for rank in 0..world {
                    let shard = |split: Option<usize>| {
                        let shard = Shard::new(data.clone(), &plan, rank)
                            .expect("shard")
                            .packing(arena.clone(), Arc::default());
                        match split {
                            Some(ways) => shard.split(ways),
                            None => shard,
                        }
                    };
                    let whole: Vec<RecordBatch> = shard(Some(1))
                        .batches()
                        .collect::<Result<_>>()
                        .expect("whole");
                    // Parts of 16 rows and more: 333 rows a batch in two,
                    // three and five parts, and in as many as it has rows.
                    for ways in [2, 3, 5, 333] {
                        let split = shard(Some(ways));
                        let parts: Vec<RecordBatch> =
                            split.batches().collect::<Result<_>>().expect("parts");
                        assert_eq!(parts, whole, "{shuffle:?} world {world} rank {rank} {ways}");
                        if shuffle != Shuffle::None {
                            assert!(split.gather.packed.get().is_some_and(Option::is_some));
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_tile_untiles_to_each_records_value_at_every_width_offset_and_length() {
        fn check<const W: usize>(record: usize, offset: usize, rows: usize) {
            let tile: Vec<u8> = (0..rows * record + 7).map(|i| (i * 31 + 7) as u8).collect();
            let mut out = MutableBuffer::new(0);
            out.extend_from_slice(&[9u8; 3]);
            untile_n::<W>(Tile::new(&tile, record, rows), offset, &mut out);
            let expected: Vec<u8> = (0..rows)
                .flat_map(|i| tile[i * record + offset..][..W].to_vec())
                .collect();
            assert_eq!(&out.as_slice()[..3], &[9u8; 3], "what was there is kept");
            assert_eq!(
                &out.as_slice()[3..],
                &expected[..],
                "W {W} record {record} offset {offset} rows {rows}"
            );
        }
        // Gathers of 16 (or 8) records, then the rows left one by one.
        for rows in [0, 1, 7, 8, 15, 16, 17, 33, 124] {
            for (record, offset) in [(4, 0), (12, 4), (13, 9), (264, 0), (264, 260), (33, 21)] {
                check::<4>(record, offset, rows);
            }
            for (record, offset) in [(8, 0), (12, 4), (17, 9), (264, 256), (33, 25)] {
                check::<8>(record, offset, rows);
            }
        }
    }

    #[test]
    fn eight_columns_side_by_side_untile_as_each_would_alone() {
        for rows in [0, 1, 7, 8, 9, 16, 31, 124] {
            for (record, offset) in [(32, 0), (36, 4), (264, 8), (41, 9), (264, 232)] {
                let tile: Vec<u8> = (0..rows * record + 5).map(|i| (i * 29 + 3) as u8).collect();
                // What was there before is kept (a different length each).
                let before = || (0..8).map(|k| MutableBuffer::from_len_zeroed(k % 3));
                let mut outs: Vec<MutableBuffer> = before().collect();
                let mut expected: Vec<MutableBuffer> = before().collect();
                untile_eight(Tile::new(&tile, record, rows), offset, &mut outs);
                for (k, out) in expected.iter_mut().enumerate() {
                    let slot = Slot {
                        offset: offset + 4 * k,
                        width: 4,
                    };
                    untile(Tile::new(&tile, record, rows), slot, out);
                }
                for (k, (out, expected)) in outs.iter().zip(&expected).enumerate() {
                    assert_eq!(
                        out.as_slice(),
                        expected.as_slice(),
                        "column {k}, rows {rows}, record {record}, offset {offset}"
                    );
                }
            }
        }
    }

    #[test]
    fn scattered_records_untile_as_the_same_records_copied_into_a_tile() {
        for rows in [0, 1, 7, 8, 9, 16, 31, 124] {
            for record in [32, 41, 264] {
                let pool: Vec<u8> = (0..300 * record).map(|i| (i * 37 + 11) as u8).collect();
                // Records picked out of order, one of them twice.
                let picks: Vec<usize> = (0..rows).map(|i| (i * 113 + 7) % 300).collect();
                let picked: Vec<&[u8]> = picks
                    .iter()
                    .map(|&r| &pool[r * record..][..record])
                    .collect();
                let copied: Vec<u8> = picked.concat();
                let scattered = Scattered::new(&picked, record);
                let tile = Tile::new(&copied, record, rows);
                let slots = [(0, 4), (record - 8, 8), (3, 3), (record - 4, 4), (1, 8)];
                for (offset, width) in slots {
                    let slot = Slot { offset, width };
                    let (mut a, mut b) = (MutableBuffer::new(0), MutableBuffer::new(0));
                    untile(scattered, slot, &mut a);
                    untile(tile, slot, &mut b);
                    assert_eq!(a.as_slice(), b.as_slice(), "{rows} rows {record} {slot:?}");
                }
                for offset in [0, record - 32] {
                    let outs = || (0..8).map(|_| MutableBuffer::new(0)).collect::<Vec<_>>();
                    let (mut a, mut b) = (outs(), outs());
                    untile_eight(scattered, offset, &mut a);
                    untile_eight(tile, offset, &mut b);
                    for (k, (a, b)) in a.iter().zip(&b).enumerate() {
                        assert_eq!(a.as_slice(), b.as_slice(), "{rows} rows {record} {k}");
                    }
                }
            }
        }
    }

    #[test]
    fn only_eight_adjacent_four_byte_columns_untile_together() {
        let slot = |offset, width| Slot { offset, width };
        // An int64, then ten float32 side by side.
        let all: Vec<(usize, Slot)> = std::iter::once((0, slot(0, 8)))
            .chain((0..10).map(|k| (k + 1, slot(8 + 4 * k, 4))))
            .collect();
        assert_eq!(
            untile_steps(&all),
            [
                Untile::One(0),
                Untile::Eight(1),
                Untile::One(9),
                Untile::One(10),
            ]
        );
        // A projection that leaves a gap: no run of eight adjacent values.
        let gap: Vec<(usize, Slot)> = all.iter().copied().filter(|&(j, _)| j != 5).collect();
        assert_eq!(
            untile_steps(&gap),
            (0..10).map(Untile::One).collect::<Vec<_>>()
        );
        // Projected out of their stored order: taken one by one.
        let reversed: Vec<(usize, Slot)> = all[1..9].iter().rev().copied().collect();
        assert_eq!(
            untile_steps(&reversed),
            (0..8).map(Untile::One).collect::<Vec<_>>()
        );
    }

    /// Gathers of four wide columns (8, 12, 16 and 20 bytes a row) of one
    /// 10-row batch, as `(packing, gather)`: without and with a packed copy.
    fn wide_gathers() -> Vec<(bool, Gather)> {
        let data = sealed(&[batch(0, 10)]);
        let arena = roomy_arena();
        let columns: Vec<String> = ["c0", "c3", "c4", "c5"].map(String::from).into();
        [false, true]
            .into_iter()
            .map(|packing| {
                let gather = Gather::new(data.clone(), &columns, "d", None).expect("gather");
                let gather = if packing {
                    gather.packing(arena.clone(), Arc::default())
                } else {
                    gather
                };
                (packing, gather)
            })
            .collect()
    }

    #[test]
    fn rows_of_another_width_from_a_member_are_an_error_not_a_panic() {
        // What a member should send: the projected columns; this one sends
        // 2-byte values where 8, 12, 16 and 20 bytes a row are due.
        let short: Vec<ArrayRef> = (0..4)
            .map(|_| Arc::new(Int16Array::from_iter_values(0..4)) as ArrayRef)
            .collect();
        let fields: Vec<Field> = (0..4)
            .map(|i| Field::new(format!("x{i}"), DataType::Int16, false))
            .collect();
        let extra = RecordBatch::try_new(Arc::new(Schema::new(fields)), short).expect("batch");
        for (packing, gather) in wide_gathers() {
            // Out of stored order, so the packed gather is the one used.
            let picks = Picks::new(vec![(0, 5), (1, 3), (0, 1)]);
            let err = gather
                .batch(&picks, std::slice::from_ref(&extra))
                .expect_err("another width");
            assert!(err.to_string().contains("bytes a row expected"), "{err}");
            let packed = gather.packed.get().is_some_and(Option::is_some);
            assert_eq!(packed, packing);
        }
    }

    #[test]
    fn records_a_member_garbles_are_an_error_not_a_panic() {
        // Records of 56 bytes a row (the four columns' 8 + 12 + 16 + 20).
        const RECORD: usize = 56;
        let slot = |offset, width| Slot { offset, width };
        let four = [slot(0, 8), slot(8, 12), slot(20, 16), slot(36, 20)];
        let bad = [
            // Past the end of the record.
            vec![slot(0, 8), slot(8, 12), slot(20, 16), slot(40, 20)],
            vec![slot(usize::MAX, 8), slot(8, 12), slot(20, 16), slot(36, 20)],
            // Three columns where four are gathered.
            four[..3].to_vec(),
            // A value of another width.
            vec![slot(0, 8), slot(8, 12), slot(20, 20), slot(36, 20)],
        ];
        for slots in bad {
            let values =
                FixedSizeBinaryArray::try_new(RECORD as i32, vec![7u8; 3 * RECORD].into(), None)
                    .expect("records");
            let extra = RecordBatch::try_new(
                records::records_schema(RECORD, &slots),
                vec![Arc::new(values)],
            )
            .expect("batch");
            for (_, gather) in wide_gathers() {
                let picks = Picks::new(vec![(0, 5), (1, 2), (0, 1), (1, 0)]);
                let err = gather
                    .batch(&picks, std::slice::from_ref(&extra))
                    .expect_err("garbled records");
                assert!(err.to_string().contains("a member sent"), "{err}");
            }
        }
    }

    #[test]
    fn picks_split_into_runs_of_neighbouring_rows_and_say_when_scattered() {
        let runs = Picks::new(vec![(0, 4), (0, 5), (0, 6), (1, 0), (1, 1), (0, 9), (2, 3)]);
        assert_eq!(runs.runs(), [(0, 4..7), (1, 0..2), (0, 9..10), (2, 3..4)]);
        assert!(!runs.scattered);
        let strided = Picks::new((0..10).map(|k| (0, 3 * k)).collect());
        assert!(strided.in_order && strided.scattered);
        assert_eq!(strided.runs().len(), 10);
        assert!(Picks::new(vec![]).runs().is_empty());
        // A row of the same batch that does not follow starts a run, and
        // so does a batch's row 0 after another batch's last.
        let rows = vec![(0, 1), (0, 1), (0, 2), (1, 0), (0, 3)];
        assert_eq!(
            Picks::new(rows).runs(),
            [(0, 1..2), (0, 1..3), (1, 0..1), (0, 3..4)]
        );
    }

    #[test]
    fn a_gather_writes_its_fixed_width_columns_back_to_back_in_one_buffer() {
        // What lets the DoGet edge send them as one piece (service::ipc):
        // each column's values start at the next 64-byte boundary after
        // the one before, in projection order, in one allocation — packed
        // or column by column, and when a packed batch is gathered in
        // parts on threads.
        let local = vec![batch(0, 700), batch(700, 500)];
        let data = sealed(&local);
        let columns: Vec<String> = ["c0", "c10", "c11", "c12", "c13", "c14", "c15", "c16"]
            .into_iter()
            .chain(["c17", "c18", "c8", "c3"])
            .map(String::from)
            .collect();
        let rows: Vec<(usize, usize)> = (0..999).map(|i| (i % 2, (i * 7) % 500)).collect();
        let sources: Vec<&RecordBatch> = local.iter().collect();
        let (indices, _) = project(data.schema(), &columns, "d").expect("projection");
        let want = interleave_record_batch(&sources, &rows)
            .expect("interleave")
            .project(&indices)
            .expect("projection");
        for (packing, split, gather) in every_gather(&data, &columns) {
            let got = gather
                .batch(&Picks::new(rows.clone()), &[])
                .expect("gathered");
            assert_eq!(got, want, "packing {packing} split {split:?}");
            let packed = gather.packed.get().is_some_and(Option::is_some);
            assert_eq!(packed, packing);
            let values: Vec<Buffer> = got
                .columns()
                .iter()
                .map(|c| {
                    let data = c.to_data();
                    match data.child_data().first() {
                        Some(child) => child.buffers()[0].clone(),
                        None => data.buffers()[0].clone(),
                    }
                })
                .collect();
            let mut end = values[0].as_ptr() as usize;
            for v in &values {
                assert_eq!(v.data_ptr(), values[0].data_ptr(), "one allocation");
                assert_eq!(
                    v.as_ptr() as usize,
                    end.next_multiple_of(64),
                    "back to back"
                );
                end = v.as_ptr() as usize + v.len();
            }
        }
    }

    #[test]
    fn rows_from_members_gather_the_same_from_packed_rows() {
        let local = vec![batch(0, 700), batch(700, 500)];
        let extra = vec![batch(5000, 300), batch(6000, 1)];
        let data = sealed(&local);
        let sizes = [700, 500, 300, 1];
        // Scattered picks over both stored batches and both fetched ones,
        // every row of the fetched ones among them.
        let mut x = 12345u64;
        let mut rows: Vec<(usize, usize)> = (0..900)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let b = (x >> 33) as usize % sizes.len();
                (b, (x >> 40) as usize % sizes[b])
            })
            .collect();
        rows.extend((0..300).map(|r| (2, r)));
        rows.push((3, 0));
        let picks = Picks::new(rows.clone());
        let sources: Vec<&RecordBatch> = local.iter().chain(&extra).collect();
        let want = interleave_record_batch(&sources, &rows).expect("interleave");
        // Every column (through the tile), and four wide ones (straight
        // from each record).
        let wide = ["c0", "c5", "c4", "c3"].map(String::from).to_vec();
        for columns in [vec![], wide] {
            let (indices, _) = project(data.schema(), &columns, "d").expect("projection");
            let want = want.project(&indices).expect("projection");
            let extra: Vec<RecordBatch> = extra
                .iter()
                .map(|b| b.project(&indices).expect("projection"))
                .collect();
            // Packed, the batch also split among three threads.
            for (packing, split, gather) in every_gather(&data, &columns) {
                let got = gather.batch(&picks, &extra).expect("gathered");
                assert_eq!(got, want, "{columns:?} packing {packing} split {split:?}");
                let packed = gather.packed.get().is_some_and(Option::is_some);
                assert_eq!(packed, packing);
            }
        }
    }

    #[test]
    fn rows_from_members_as_records_gather_the_same_as_their_columns() {
        let local = vec![batch(0, 700), batch(700, 500)];
        let held = vec![batch(5000, 300), batch(6000, 40)];
        // Every packed column (all but c2, c6, c7, c20 and c21), out of
        // schema order: through a tile.
        let mut columns: Vec<String> = (0..20)
            .filter(|i| ![2, 6, 7].contains(i))
            .map(|i| format!("c{i}"))
            .collect();
        columns.reverse();
        columns.swap(0, 7);
        records_gather_as_columns(local.clone(), held.clone(), columns.clone(), false);
        // The same as a cluster's two members: a list of one length (c19)
        // is gathered as bytes and packed there too.
        records_gather_as_columns(local.clone(), held.clone(), columns, true);
        // A dataset of four wide columns: straight from each record.
        let wide = |b: &RecordBatch| {
            let i = [0, 5, 4, 3].map(|i| b.schema().index_of(&format!("c{i}")).expect("c"));
            b.project(&i).expect("projection")
        };
        let columns = ["c4", "c0", "c3", "c5"].map(String::from).to_vec();
        records_gather_as_columns(
            local.iter().map(wide).collect(),
            held.iter().map(wide).collect(),
            columns,
            false,
        );
    }

    /// A rank's rows merged with a member's rows of `held` sent as
    /// records — laid out as the rank's packed copy, laid out otherwise —
    /// are those sent as columns, gathered with and without a packed copy.
    fn records_gather_as_columns(
        local: Vec<RecordBatch>,
        held: Vec<RecordBatch>,
        columns: Vec<String>,
        cluster: bool,
    ) {
        let (data, member) = (sealed(&local), sealed(&held));
        // As members of a cluster: the columns the seal decides both gather
        // as bytes; else each decides alone.
        let layout = cluster.then(|| {
            let (a, b) = (Gather::byte_columns(&data), Gather::byte_columns(&member));
            let lists = crate::cluster::list_columns(data.schema());
            crate::cluster::byte_columns(&[(&a.0[..], &a.1[..]), (&b.0[..], &b.1[..])], &lists)
        });
        let fixed = layout.as_deref();
        let arena = roomy_arena();
        let (indices, _) = project(data.schema(), &columns, "d").expect("projection");
        // The member's picks of its rows, two messages' worth.
        let mut x = 99u64;
        let mut next = |n: usize| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 33) as usize % n
        };
        let mut pick = |sizes: &[usize]| {
            let b = next(sizes.len());
            (b, next(sizes[b]))
        };
        let sent: Vec<Vec<(usize, usize)>> = (0..2)
            .map(|_| (0..200).map(|_| pick(&[300, 40])).collect())
            .collect();
        let peer = Gather::new(member.clone(), &columns, "d", fixed)
            .expect("gather")
            .packing(arena.clone(), Arc::default());
        assert!(peer.records_schema().is_some());
        let records: Vec<RecordBatch> = sent
            .iter()
            .map(|rows| peer.gathered_records(&Picks::new(rows.clone())))
            .collect::<Result<_>>()
            .expect("records");
        // The same records gathered in parts on three threads.
        let parts = Gather::new(member.clone(), &columns, "d", fixed)
            .expect("gather")
            .packing(arena.clone(), Arc::default())
            .split(3);
        for (rows, whole) in sent.iter().zip(&records) {
            let got = parts.gathered_records(&Picks::new(rows.clone()));
            assert_eq!(&got.expect("records in parts"), whole);
        }
        // The same rows as the member's columns.
        let held_columns: Vec<RecordBatch> = held
            .iter()
            .map(|b| b.project(&indices).expect("projection"))
            .collect();
        let held_sources: Vec<&RecordBatch> = held_columns.iter().collect();
        let columns_sent: Vec<RecordBatch> = sent
            .iter()
            .map(|rows| interleave_record_batch(&held_sources, rows).expect("interleave"))
            .collect();
        // The rank's picks: its own rows, scattered, among every row of
        // both messages.
        let mut rows: Vec<(usize, usize)> = (0..500).map(|_| pick(&[700, 500])).collect();
        rows.extend((0..200).map(|r| (2, r)));
        rows.extend((0..200).rev().map(|r| (3, r)));
        rows.sort_by_key(|&(b, r)| (b * 7919 + r * 104729) % 1009);
        let picks = Picks::new(rows.clone());
        let local_columns: Vec<RecordBatch> = local
            .iter()
            .map(|b| b.project(&indices).expect("projection"))
            .collect();
        let sources: Vec<&RecordBatch> = local_columns.iter().chain(&columns_sent).collect();
        let want = interleave_record_batch(&sources, &rows).expect("interleave");
        // Another layout of the same columns: each at its own place in a
        // record of its own.
        let mut offset = 3;
        let slots: Vec<Slot> = peer.packed_copy().expect("packed").outputs[..]
            .iter()
            .map(|&(_, s)| {
                offset += s.width;
                Slot {
                    offset: offset - s.width,
                    width: s.width,
                }
            })
            .collect();
        let elsewhere: Vec<RecordBatch> = records
            .iter()
            .map(|b| {
                let record = offset + 5;
                let own = peer.packed_copy().expect("packed");
                let values = b.column(0).as_fixed_size_binary().values().as_slice();
                let mut moved = vec![0u8; b.num_rows() * record];
                for r in 0..b.num_rows() {
                    for (&(_, from), to) in own.outputs.iter().zip(&slots) {
                        moved[r * record + to.offset..][..to.width].copy_from_slice(
                            &values[r * own.packed.record() + from.offset..][..from.width],
                        );
                    }
                }
                let array = FixedSizeBinaryArray::try_new(record as i32, moved.into(), None)
                    .expect("records");
                RecordBatch::try_new(
                    records::records_schema(record, &slots),
                    vec![Arc::new(array)],
                )
                .expect("batch")
            })
            .collect();
        for (extra, what) in [
            (&records, "records"),
            (&elsewhere, "other records"),
            (&columns_sent, "columns"),
        ] {
            for (packing, split) in [(false, None), (true, None), (true, Some(3))] {
                let mut gather = Gather::new(data.clone(), &columns, "d", fixed).expect("gather");
                if packing {
                    gather = gather.packing(arena.clone(), Arc::default());
                }
                if let Some(ways) = split {
                    gather = gather.split(ways);
                }
                let got = gather.batch(&picks, extra).expect("gathered");
                assert_eq!(got, want, "{what}, packing {packing} split {split:?}");
                // Records laid out as the rank's copy are copied whole.
                let whole = gather.packed_copy().and_then(|p| p.own_records(&extra[0]));
                assert_eq!(whole.is_some(), packing && what == "records", "{what}");
                // Rows in order (no packed gather) from the same messages.
                let first = Picks::new((0..200).map(|r| (2, r)).collect());
                let got = gather.batch(&first, extra).expect("gathered");
                assert_eq!(got, columns_sent[0], "{what} in order, packing {packing}");
            }
        }
        // Records only when the gathered columns are the whole record.
        let part = Gather::new(member, &columns[..columns.len() - 1], "d", fixed)
            .expect("gather")
            .packing(arena, Arc::default());
        assert!(part.records_schema().is_none());
    }

    #[test]
    fn one_ranks_strided_rows_of_a_batch_are_one_run_of_packed_records() {
        let batches = vec![batch(0, 700), batch(700, 500)];
        let data = SealedData::from_batches(batches[0].schema(), vec![], batches);
        let arena = Arena::new(Budget::new(64 << 20), 1 << 20, HostMemory::Heap);
        let packed = Packed::build(&data, &arena, "d", (3, None))
            .expect("fits")
            .expect("packed");
        let record = packed.record();
        // Rank 2 of 3: rows 2, 5, 8, … of the first batch, and of the
        // second (its row 0 is the dataset's row 700) rows 1, 4, 7, …
        for (b, first) in [(0, 2), (1, 1)] {
            let rows: Vec<(usize, usize)> = (0..50).map(|k| (b, first + 3 * k)).collect();
            let run = packed_run(&packed, &rows, 2).expect("one run");
            for (k, &(b, r)) in rows.iter().enumerate() {
                assert_eq!(
                    &run[k * record..][..record],
                    packed.at(b, packed.position(b, r))
                );
            }
            // Fetched from a member (past the local batches): not a run.
            assert!(packed_run(&packed, &rows, b).is_none());
        }
        // Another stride, a gap, or a batch boundary: no run.
        let other: Vec<(usize, usize)> = (0..50).map(|k| (0, 2 * k)).collect();
        let gap = [(0, 2), (0, 5), (0, 11)];
        let across = [(0, 698), (1, 1)];
        for rows in [&other[..], &gap[..], &across[..]] {
            assert!(packed_run(&packed, rows, 2).is_none(), "{rows:?}");
        }
        assert!(packed_run(&packed, &[], 2).is_none());
    }

    #[test]
    fn rows_are_located_alike_in_any_order_with_and_without_a_selection() {
        let batches = vec![batch(0, 5), batch(5, 1), batch(6, 40), batch(46, 9)];
        let data = sealed(&batches);
        let n = data.rows();
        let strided: Vec<u64> = (0..3).flat_map(|r| (r..n).step_by(3)).collect();
        let shuffled: Vec<u64> = (0..n).map(|k| (k * 37 + 11) % n).collect();
        let backwards: Vec<u64> = (0..n).rev().collect();
        for rows in [strided, shuffled, backwards] {
            let gather = Gather::new(data.clone(), &[], "d", None).expect("gather");
            let want: Vec<(usize, usize)> = rows.iter().map(|&r| data.locate(r)).collect();
            assert_eq!(gather.locate_all(rows.iter().copied()), want);
        }
        // Through a selection: read row `i` is stored row `3 i + 1`.
        let selected: Vec<u64> = (0..n).filter(|r| r % 3 == 1).collect();
        let mut gather = Gather::new(data.clone(), &[], "d", None).expect("gather");
        gather.selection = Some(Arc::new(Selection::of(selected.clone())));
        let reads: Vec<u64> = (0..selected.len() as u64).rev().collect();
        let want: Vec<(usize, usize)> = reads
            .iter()
            .map(|&i| data.locate(selected[i as usize]))
            .collect();
        assert_eq!(gather.locate_all(reads), want);
    }

    #[test]
    fn a_full_budget_gathers_column_by_column() {
        let batches = vec![batch(0, 500), batch(500, 500)];
        let data = sealed(&batches);
        let arena = Arc::new(Arena::new(Budget::new(1 << 10), 1 << 10, HostMemory::Heap));
        let plan = plan(Shuffle::Global, 2, vec![]);
        let with = Shard::new(data.clone(), &plan, 1)
            .expect("shard")
            .packing(arena.clone(), Arc::default());
        let without = Shard::new(data.clone(), &plan, 1).expect("shard");
        for (a, b) in with.batches().zip(without.batches()) {
            assert_eq!(a.expect("gathered"), b.expect("gathered"));
        }
        assert!(with.gather.packed.get().is_some_and(Option::is_none));
        assert_eq!(data.packed().bytes(), 0);
        assert_eq!(arena.budget().used(), 0);
    }

    fn plan(shuffle: Shuffle, world_size: u32, columns: Vec<String>) -> ReadPlan {
        ReadPlan {
            epoch: 1,
            seed: 7,
            columns,
            ..ReadPlan::new("d", world_size, shuffle, 333)
        }
    }
}
