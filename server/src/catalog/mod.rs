//! The catalog: datasets, committed attempts, seal and winners — the commit
//! protocol of exactly-once ingest.
//!
//! A dataset is `open` (taking partition attempts) until `seal` makes it
//! `sealed` (immutable, readable), until it is dropped. An attempt enters the
//! catalog only through [`Catalog::commit`], which the ingest path calls once a
//! `DoPut` stream has ended cleanly; nothing of a broken stream ever reaches
//! here. At seal each partition's winner is the attempt named by the caller,
//! else its first committed attempt; losers are freed.
//!
//! A write that replaces a dataset (`mode("overwrite")`) stages its
//! attempts under [`staged_key`], beside the dataset, which stays as it is
//! (readable, if sealed) until [`Catalog::swap_in`] puts the sealed
//! replacement in its place at once; a failed write drops only what it
//! staged. What a write left unsealed and idle for long (its job died
//! before sealing or dropping it) is found by [`Catalog::abandoned`] and
//! dropped by [`Catalog::drop_abandoned`], which refuses that write's later
//! attempts as a failed job's drop does.
//!
//! This module is pure: no I/O, no locks, no async. The caller serialises
//! access and returns the bytes this module reports as freed to the budget.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow::array::RecordBatch;
use arrow::datatypes::{Schema, SchemaRef};

use crate::cluster::Layout;
use crate::error::{Error, Result};
use crate::memory::device::SegmentsCache;
use crate::memory::spill::{PersistedDataset, Stored, unstorable_column};
use crate::query::SelectionCache;
use crate::read::packed::PackedCache;

mod rows;
use rows::RowIndex;

/// The most rows a dataset (and so any attempt or batch of it) may have.
/// Columns of Arrow's null type take no memory, so a writer could otherwise
/// claim any row count for free; 2^40 is far past what any memory holds in
/// real columns.
pub const MAX_ROWS: u64 = 1 << 40;

/// `total + more`, or `INVALID_ARGUMENT` naming [`MAX_ROWS`] when that is
/// past it; `what` names what is counted.
pub fn add_rows(total: u64, more: u64, what: impl FnOnce() -> String) -> Result<u64> {
    total
        .checked_add(more)
        .filter(|&t| t <= MAX_ROWS)
        .ok_or_else(|| {
            Error::invalid(format!(
                "{} would hold more than {MAX_ROWS} rows, the most a dataset may have",
                what()
            ))
        })
}

/// Separates a dataset's name from a write's id in the catalog key of what
/// that write stages to replace the dataset: a control character, which no
/// client's dataset name may hold, so no client names a staged entry.
const STAGED: char = '\u{1f}';

/// The catalog key of what write `write_id` stages to replace `dataset`.
pub fn staged_key(dataset: &str, write_id: &str) -> String {
    format!("{dataset}{STAGED}{write_id}")
}

/// The dataset a catalog key belongs to: the key itself, or the dataset a
/// staged write will replace.
pub fn public_name(key: &str) -> &str {
    key.split(STAGED).next().unwrap_or(key)
}

/// Refuses a schema naming a column twice: its rows could be stored, but a
/// read could select, filter or query only one of the two by name.
fn distinct_names(dataset: &str, schema: &Schema) -> Result<()> {
    let names: Vec<&String> = schema.fields().iter().map(|f| f.name()).collect();
    match crate::convert::first_repeat(&names) {
        Some((first, i)) => Err(Error::invalid(format!(
            "the schema written to dataset '{}' names column '{}' twice (fields {first} and {i}); \
             reads select, filter and query columns by name: rename one (Spark: alias it; \
             pyarrow: Table.rename_columns)",
            public_name(dataset),
            names[i]
        ))),
        None => Ok(()),
    }
}

/// Refuses, on a server that persists every sealed dataset, a schema with
/// a column the store cannot hold: its dataset could be read, but not
/// persisted, and would be lost at the next restart.
fn persistable(dataset: &str, schema: &Schema) -> Result<()> {
    match unstorable_column(schema) {
        Some((column, why)) => Err(Error::invalid(format!(
            "dataset '{}' cannot be persisted: {column}, which the store (Parquet) cannot hold, \
             and this server persists every dataset it seals (--persist); {} (or write it to a \
             server without --persist, which keeps it in memory and never spills it)",
            public_name(dataset),
            why.instead
        ))),
        None => Ok(()),
    }
}

/// A message naming catalog keys as a person reads them: a staged entry
/// `'d<STAGED>w'` becomes `'d', as replaced by write 'w'`.
pub fn readable(message: &str) -> std::borrow::Cow<'_, str> {
    if message.contains(STAGED) {
        message.replace(STAGED, "', as replaced by write '").into()
    } else {
        message.into()
    }
}

/// The dataset and write of a staged entry's key; `None` for a dataset's.
pub fn staged_parts(key: &str) -> Option<(&str, &str)> {
    key.split_once(STAGED)
}

fn is_staged(key: &str) -> bool {
    key.contains(STAGED)
}

/// A dataset's place in a cluster of members.
#[derive(Debug, Clone)]
pub enum ClusterState {
    /// This member's part is sealed; the dataset stays unreadable until the
    /// coordinating member commits the whole layout.
    Pending,
    /// Member `index` of `layout`.
    Member {
        /// The whole dataset's layout.
        layout: Arc<Layout>,
        /// This server's index in it.
        index: usize,
    },
}

/// One attempt of one partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AttemptKey {
    /// Partition number.
    pub partition: u32,
    /// Attempt number within the partition.
    pub attempt: u32,
}

/// Lifecycle state of a dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DatasetState {
    /// Accepting partitions, not readable.
    Open,
    /// Immutable and readable.
    Sealed,
}

/// The data of one committed attempt.
#[derive(Debug, Clone)]
pub struct AttemptData {
    /// Record batches in stream order.
    pub batches: Vec<RecordBatch>,
    /// Total rows.
    pub rows: u64,
    /// Bytes charged to the memory budget.
    pub bytes: u64,
}

#[derive(Debug)]
struct CommittedAttempt {
    data: AttemptData,
    /// Global commit order, for "first committed wins".
    seq: u64,
}

/// A seal request in domain terms.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SealRequest {
    /// Dataset to seal.
    pub dataset: String,
    /// Expected number of partitions `0..partitions`; 0 = don't check.
    pub partitions: u32,
    /// Named winners; partitions not named keep their first committed attempt.
    pub winners: Vec<AttemptKey>,
    /// A cluster seal: each member's location and winners (then `winners`
    /// is empty).
    pub members: Vec<(String, Vec<AttemptKey>)>,
    /// Seal what this write staged to replace the dataset, and swap it in
    /// ("" = seal the dataset itself).
    pub replace_write: String,
}

/// The immutable, readable content of a sealed dataset: the winning attempts
/// in partition order, rows addressed `0..rows` across them.
#[derive(Debug)]
pub struct SealedData {
    schema: SchemaRef,
    winners: Vec<AttemptKey>,
    batches: Vec<RecordBatch>,
    /// Where each row is.
    rows: RowIndex,
    /// The row-major copy shuffled reads gather from, once built.
    packed: PackedCache,
    /// The rows read-plan filters selected, by filter.
    selections: SelectionCache,
    /// Each column's values as byte runs, once worked out.
    segments: SegmentsCache,
}

impl SealedData {
    fn new(schema: SchemaRef, parts: Vec<(AttemptKey, AttemptData)>) -> Self {
        let winners = parts.iter().map(|(key, _)| *key).collect();
        let batches = parts.into_iter().flat_map(|(_, data)| data.batches);
        Self::from_batches(schema, winners, batches)
    }

    /// Sealed data from the winners' batches in row order (as read back from
    /// the spill store); empty batches are left out.
    pub fn from_batches(
        schema: SchemaRef,
        winners: Vec<AttemptKey>,
        all: impl IntoIterator<Item = RecordBatch>,
    ) -> Self {
        let batches: Vec<RecordBatch> = all.into_iter().filter(|b| b.num_rows() > 0).collect();
        let rows = RowIndex::new(batches.iter().map(|b| b.num_rows() as u64));
        Self {
            segments: SegmentsCache::new(schema.fields().len()),
            schema,
            winners,
            batches,
            rows,
            packed: PackedCache::default(),
            selections: SelectionCache::default(),
        }
    }

    /// The dataset's schema.
    pub fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    /// Total rows.
    pub fn rows(&self) -> u64 {
        self.rows.rows()
    }

    /// The winning attempt of each partition, in partition order.
    pub fn winners(&self) -> &[AttemptKey] {
        &self.winners
    }

    /// The non-empty record batches, in row order.
    pub fn batches(&self) -> &[RecordBatch] {
        &self.batches
    }

    /// The row-major copy of the fixed-width columns for shuffled reads.
    pub fn packed(&self) -> &PackedCache {
        &self.packed
    }

    /// The rows read-plan filters selected from this data.
    pub fn selections(&self) -> &SelectionCache {
        &self.selections
    }

    /// Each column's values as byte runs, once worked out (see
    /// [`crate::memory::device::segments_at`]).
    pub fn segments(&self) -> &SegmentsCache {
        &self.segments
    }

    /// `(batch index, row within batch)` of global row `row` (below `rows()`).
    #[inline]
    pub fn locate(&self, row: u64) -> (usize, usize) {
        self.rows.locate(row)
    }
}

/// Where a sealed dataset's rows are.
#[derive(Debug)]
struct Sealed {
    /// In the host arena (readable now), or `None` when spilled.
    data: Option<Arc<SealedData>>,
    /// Its copy in the spill store, if written.
    stored: Option<Stored>,
    /// Tick of the last read, for least-recently-read spilling.
    last_read: u64,
}

/// One dataset and its attempts.
#[derive(Debug)]
struct Dataset {
    generation: u64,
    schema: SchemaRef,
    /// Committed attempts while open; the winners' data moves to `sealed`.
    attempts: BTreeMap<AttemptKey, CommittedAttempt>,
    sealed: Option<Sealed>,
    /// Per winning partition: (rows, bytes, committed attempts), kept after seal.
    sealed_parts: Vec<PartitionSummary>,
    /// Set when the dataset is one member's part of a cluster dataset.
    cluster: Option<ClusterState>,
    /// When its last attempt was committed (or it was restored).
    written: Instant,
    /// The replacing write that swapped it in ("" = none, or before a
    /// restart), so that the same seal sent again finds it done.
    swapped_in_by: String,
    /// The write whose attempts it holds (`None`: written without write
    /// ids, or restored): one write per open dataset
    /// ([`Catalog::check_writer`]), kept after its seal; a failed or
    /// abandoned write's drop refuses its later attempts.
    write: Option<String>,
}

/// What `describe` tells about one partition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionSummary {
    /// The winning (or, while open, first committed) attempt.
    pub key: AttemptKey,
    /// Rows of that attempt.
    pub rows: u64,
    /// Bytes of that attempt.
    pub bytes: u64,
    /// Committed attempts of the partition.
    pub committed_attempts: u32,
}

/// What `describe`, `seal` and `drop` report about a dataset.
#[derive(Debug, Clone)]
pub struct DatasetSummary {
    /// Dataset name.
    pub name: String,
    /// Lifecycle state.
    pub state: DatasetState,
    /// Generation: new each time a dataset of this name is created.
    pub generation: u64,
    /// The dataset's schema.
    pub schema: SchemaRef,
    /// Rows of the winning (or first committed) attempts.
    pub rows: u64,
    /// Host bytes held for the dataset, all attempts included (0 when spilled).
    pub bytes: u64,
    /// One entry per partition with a committed attempt, in partition order.
    pub partitions: Vec<PartitionSummary>,
    /// Whether the rows are in host memory (always, unless sealed and spilled).
    pub resident: bool,
    /// The dataset's copy in the spill store, if any.
    pub stored: Option<Stored>,
    /// Its place in a cluster, if it is part of one.
    pub cluster: Option<ClusterState>,
    /// Time since its last attempt was committed (or it was restored).
    pub idle: Duration,
}

/// What one replacing write has staged so far.
#[derive(Debug, Clone)]
pub struct StagedSummary {
    /// The dataset it replaces.
    pub dataset: String,
    /// The write.
    pub write_id: String,
    /// The staged entry as a dataset (named by its catalog key).
    pub summary: DatasetSummary,
}

/// A sealed dataset as a reader finds it.
#[derive(Debug, Clone)]
pub enum SealedView {
    /// In host memory.
    Resident {
        /// Dataset generation.
        generation: u64,
        /// The rows.
        data: Arc<SealedData>,
    },
    /// Spilled: only in the store.
    Stored {
        /// Dataset generation.
        generation: u64,
        /// Where its rows are.
        stored: Stored,
        /// Its schema.
        schema: SchemaRef,
        /// The winning attempts, in partition order.
        winners: Vec<AttemptKey>,
    },
}

/// A sealed, resident dataset that could be spilled.
#[derive(Debug, Clone)]
pub struct SpillCandidate {
    /// Dataset name.
    pub name: String,
    /// Its generation.
    pub generation: u64,
    /// Its rows.
    pub data: Arc<SealedData>,
    /// Its copy in the store, when already written (persisted).
    pub stored: Option<Stored>,
    /// Its winning partitions.
    pub partitions: Vec<PartitionSummary>,
}

/// Totals for `stats`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CatalogTotals {
    /// Datasets, open or sealed.
    pub datasets: u32,
    /// Sealed datasets.
    pub sealed: u32,
    /// Rows over all datasets (winners or first committed).
    pub rows: u64,
    /// Bytes held over all datasets.
    pub bytes: u64,
    /// Sealed datasets that are spilled (in the store only).
    pub spilled: u32,
    /// Bytes of packed row copies for shuffled reads (in the arena, beside
    /// `bytes`).
    pub packed_bytes: u64,
}

/// All datasets of the server.
#[derive(Debug, Default)]
pub struct Catalog {
    datasets: BTreeMap<String, Dataset>,
    next_generation: u64,
    next_seq: u64,
    /// Logical clock of reads.
    tick: u64,
    /// Writes whose job failed: their attempts are refused.
    aborted: AbortedWrites,
    /// Every sealed dataset is written to the store (`--persist`): a schema
    /// the store cannot hold is refused before any row is taken.
    persisting: bool,
}

/// The ids of the most recent [`AbortedWrites::LIMIT`] aborted writes, each
/// with why it was aborted.
#[derive(Debug, Default)]
struct AbortedWrites {
    order: std::collections::VecDeque<String>,
    ids: std::collections::HashMap<String, String>,
}

impl AbortedWrites {
    /// Ids remembered; the oldest are forgotten past it (a job's tasks end
    /// long before thousands of later writes have failed).
    const LIMIT: usize = 4096;

    fn add(&mut self, id: &str, why: &str) {
        if id.is_empty() || self.ids.contains_key(id) {
            return;
        }
        self.ids.insert(id.to_string(), why.to_string());
        self.order.push_back(id.to_string());
        while self.order.len() > Self::LIMIT {
            if let Some(old) = self.order.pop_front() {
                self.ids.remove(&old);
            }
        }
    }

    /// Why write `id` was aborted; `None` if it was not (or is forgotten).
    fn reason(&self, id: &str) -> Option<&str> {
        self.ids.get(id).map(String::as_str)
    }
}

/// Whether two schemas are the same for the purpose of one dataset: same
/// fields (names, types, nullability) in the same order. Schema-level metadata
/// is not compared, since writers attach different ones.
pub fn same_fields(a: &Schema, b: &Schema) -> bool {
    a.fields().len() == b.fields().len()
        && a.fields().iter().zip(b.fields().iter()).all(|(x, y)| {
            x.name() == y.name()
                && x.data_type() == y.data_type()
                && x.is_nullable() == y.is_nullable()
        })
}

/// A short human rendering of a schema's fields for error messages.
pub fn describe_fields(schema: &Schema) -> String {
    let fields: Vec<String> = schema
        .fields()
        .iter()
        .map(|f| {
            let null = if f.is_nullable() { "" } else { " not null" };
            format!("{}: {}{null}", f.name(), f.data_type())
        })
        .collect();
    format!("[{}]", fields.join(", "))
}

impl Catalog {
    /// An empty catalog.
    pub fn new() -> Self {
        Self {
            // From 1: a plan's `sealed_as` 0 means "any generation".
            next_generation: 1,
            ..Self::default()
        }
    }

    /// A catalog whose sealed datasets are all written to the store
    /// (`--persist`); see [`Catalog::check_put`].
    pub fn persisting() -> Self {
        Self {
            persisting: true,
            ..Self::new()
        }
    }

    /// Checks, before any data is received, that an attempt with `schema`
    /// could be committed to `dataset`. [`Catalog::commit`] checks again.
    pub fn check_put(&self, dataset: &str, key: AttemptKey, schema: &Schema) -> Result<()> {
        distinct_names(dataset, schema)?;
        if self.persisting {
            persistable(dataset, schema)?;
        }
        let Some(ds) = self.datasets.get(dataset) else {
            return Ok(());
        };
        if ds.sealed.is_some() {
            return Err(Error::DatasetSealed {
                dataset: dataset.to_string(),
            });
        }
        if !same_fields(&ds.schema, schema) {
            return Err(schema_mismatch(dataset, key, &ds.schema, schema));
        }
        if ds.attempts.contains_key(&key) {
            return Err(Error::AttemptExists {
                dataset: dataset.to_string(),
                partition: key.partition,
                attempt: key.attempt,
            });
        }
        Ok(())
    }

    /// Refuses an attempt of a write that was aborted ([`Catalog::abort_write`])
    /// or that replaced `dataset` already ([`Catalog::swap_in`]): a late
    /// attempt (a speculative task ending after its job's seal) would
    /// otherwise stage a replacement no seal ever takes.
    pub fn check_write(&self, dataset: &str, write_id: &str) -> Result<()> {
        if let Some(why) = self.aborted.reason(write_id) {
            return Err(Error::Aborted(format!(
                "write '{write_id}' to dataset '{}' was aborted ({why}); this attempt is not \
                 stored",
                public_name(dataset)
            )));
        }
        if self.swapped_in_by(public_name(dataset), write_id) {
            return Err(Error::FailedPrecondition(format!(
                "write '{write_id}' replaced dataset '{}' already (it is sealed); this late \
                 attempt is not stored — to replace the dataset again, write it with a new \
                 write id",
                public_name(dataset)
            )));
        }
        Ok(())
    }

    /// Refuses an attempt of write `write_id` to open entry `entry` (a
    /// dataset, or what a write stages) that holds another write's
    /// attempts: one job writes a dataset at a time, so that a seal never
    /// takes partitions of two jobs (two Spark jobs creating the same
    /// dataset at once; a new job onto what a dead one left). Attempts
    /// without a write id are not checked.
    pub fn check_writer(&self, entry: &str, write_id: &str) -> Result<()> {
        let Some(ds) = self.datasets.get(entry) else {
            return Ok(());
        };
        let Some(other) = ds.write.as_deref() else {
            return Ok(());
        };
        if write_id.is_empty() || ds.sealed.is_some() || other == write_id {
            return Ok(());
        }
        let name = public_name(entry);
        Err(Error::FailedPrecondition(format!(
            "dataset '{name}' is being written by another write ('{other}': {} attempts \
             committed, the last {}s ago); one job writes a dataset at a time — wait for that \
             write to seal it, or drop it here (`flightdeck drop {name}`) if its job is gone; \
             nothing of write '{write_id}' was stored",
            ds.attempts.len(),
            ds.written.elapsed().as_secs()
        )))
    }

    /// Whether dropping `entry` because write `write_id` failed should leave
    /// it: it holds attempts of other writes only, not of that one (another
    /// job's dataset, which the failed job was refused from). An entry
    /// whose writes are not known (written without write ids, or restored)
    /// is dropped.
    pub fn held_by_others(&self, entry: &str, write_id: &str) -> bool {
        self.datasets.get(entry).is_some_and(|ds| {
            !write_id.is_empty() && ds.write.as_deref().is_some_and(|w| w != write_id)
        })
    }

    /// The write whose attempts `entry` holds, as `MemberPrepared.writes`
    /// lists it (empty when not known: written without write ids, or
    /// restored).
    pub fn writes(&self, entry: &str) -> Vec<String> {
        self.datasets
            .get(entry)
            .and_then(|ds| ds.write.clone())
            .into_iter()
            .collect()
    }

    /// Remembers that write `write_id` failed: its attempts are refused from
    /// now on, committed ones dropped with the dataset by the caller.
    pub fn abort_write(&mut self, write_id: &str) {
        self.aborted
            .add(write_id, "its job failed and dropped what it wrote");
    }

    /// Commits a complete attempt, creating the dataset if it does not exist.
    /// On error nothing is stored and the caller still owns the bytes.
    pub fn commit(
        &mut self,
        dataset: &str,
        key: AttemptKey,
        schema: SchemaRef,
        data: AttemptData,
    ) -> Result<()> {
        self.commit_write(dataset, key, "", schema, data)
    }

    /// [`Catalog::commit`] of an attempt of write `write_id` (refused if
    /// that write was aborted).
    pub fn commit_write(
        &mut self,
        dataset: &str,
        key: AttemptKey,
        write_id: &str,
        schema: SchemaRef,
        data: AttemptData,
    ) -> Result<()> {
        self.check_write(dataset, write_id)?;
        self.check_writer(dataset, write_id)?;
        self.check_put(dataset, key, &schema)?;
        let seq = self.next_seq;
        self.next_seq += 1;
        if !self.datasets.contains_key(dataset) {
            let generation = self.next_generation;
            self.next_generation += 1;
            self.datasets.insert(
                dataset.to_string(),
                Dataset {
                    generation,
                    schema,
                    attempts: BTreeMap::new(),
                    sealed: None,
                    sealed_parts: Vec::new(),
                    cluster: None,
                    written: Instant::now(),
                    swapped_in_by: String::new(),
                    write: None,
                },
            );
        }
        let ds = self
            .datasets
            .get_mut(dataset)
            .ok_or_else(|| Error::Internal(format!("dataset '{dataset}' vanished in commit")))?;
        ds.attempts.insert(key, CommittedAttempt { data, seq });
        ds.written = Instant::now();
        if !write_id.is_empty() && ds.write.is_none() {
            ds.write = Some(write_id.to_string());
        }
        Ok(())
    }

    /// Notes that an attempt of open dataset `dataset` began streaming: a
    /// write under way is not left unfinished ([`Catalog::abandoned`]).
    pub fn writing(&mut self, dataset: &str) {
        if let Some(ds) = self.datasets.get_mut(dataset)
            && ds.sealed.is_none()
        {
            ds.written = Instant::now();
        }
    }

    /// The catalog keys of datasets (and of what replacing writes staged)
    /// never sealed, to which no attempt was committed or begun for `idle`
    /// or longer: writes whose jobs died without sealing or dropping them.
    pub fn abandoned(&self, idle: Duration) -> Vec<String> {
        self.datasets
            .iter()
            .filter(|(_, ds)| ds.sealed.is_none() && ds.written.elapsed() >= idle)
            .map(|(key, _)| key.clone())
            .collect()
    }

    /// Drops entry `key` if it is still [`Catalog::abandoned`] after `idle`,
    /// refusing the later attempts of the writes it holds (as a failed job's
    /// drop does); its summary, the bytes freed and those writes.
    pub fn drop_abandoned(
        &mut self,
        key: &str,
        idle: Duration,
    ) -> Option<(DatasetSummary, u64, Vec<String>)> {
        let ds = self.datasets.get(key)?;
        if ds.sealed.is_some() || ds.written.elapsed() < idle {
            return None;
        }
        let writes: Vec<String> = ds.write.iter().cloned().collect();
        let why = format!(
            "nothing of it was written for {} and it was never sealed, so the server dropped what \
             it wrote (--unsealed-timeout)",
            crate::config::show_age(idle)
        );
        for write in &writes {
            self.aborted.add(write, &why);
        }
        let (summary, freed) = self.drop_dataset(key).ok()?;
        Some((summary, freed, writes))
    }

    /// Seals a dataset; returns its summary and the bytes freed (losers).
    pub fn seal(&mut self, req: &SealRequest) -> Result<(DatasetSummary, u64)> {
        self.seal_winners(req, false)
    }

    /// Seals this member's part of a cluster dataset with exactly `winners`
    /// (attempts of other partitions are losers: their winners are on other
    /// members), leaving it pending until [`Catalog::commit_layout`]. Sealing
    /// again with the same winners is a no-op.
    pub fn prepare_member(
        &mut self,
        dataset: &str,
        winners: &[AttemptKey],
    ) -> Result<(DatasetSummary, u64)> {
        let mut want = winners.to_vec();
        want.sort_unstable();
        if self.check_member(dataset, &want)? {
            return Ok((self.describe(dataset)?, 0));
        }
        let req = SealRequest {
            dataset: dataset.to_string(),
            partitions: 0,
            winners: want,
            members: vec![],
            replace_write: String::new(),
        };
        let (_, freed) = self.seal_winners(&req, true)?;
        let ds = self
            .datasets
            .get_mut(dataset)
            .ok_or_else(|| Error::Internal(format!("dataset '{dataset}' vanished in seal")))?;
        ds.cluster = Some(ClusterState::Pending);
        Ok((summarize(dataset, ds), freed))
    }

    /// Checks that this member can seal exactly `want` (sorted) of
    /// `dataset`, sealing nothing; true when it already has.
    pub fn check_member(&self, dataset: &str, want: &[AttemptKey]) -> Result<bool> {
        let ds = self.get(dataset)?;
        if ds.sealed.is_some() {
            let have: Vec<AttemptKey> = ds.sealed_parts.iter().map(|p| p.key).collect();
            if ds.cluster.is_some() && have == want {
                return Ok(true);
            }
            return Err(Error::FailedPrecondition(format!(
                "dataset '{dataset}' is already sealed here with other partitions; drop it on \
                 every member and write it again"
            )));
        }
        let lacking = || want.iter().filter(|k| !ds.attempts.contains_key(k));
        let count = lacking().count();
        if count > 0 {
            let first: Vec<String> = lacking()
                .take(crate::error::MISSING_SHOWN)
                .map(|k| format!("{} (attempt {})", k.partition, k.attempt))
                .collect();
            return Err(Error::FailedPrecondition(format!(
                "dataset '{dataset}' lacks {count} of its partitions on this member (the first: {}); \
                 write them here, or name the member that holds them in the layout",
                first.join(", ")
            )));
        }
        Ok(false)
    }

    /// Makes this member's sealed part of `dataset` member `index` of
    /// `layout`; refuses a layout that does not describe what is here.
    pub fn commit_layout(
        &mut self,
        dataset: &str,
        layout: Arc<Layout>,
        index: usize,
    ) -> Result<DatasetSummary> {
        let ds = self
            .datasets
            .get_mut(dataset)
            .ok_or_else(|| Error::DatasetNotFound {
                dataset: dataset.to_string(),
            })?;
        let refuse = |why: String| {
            Err(Error::FailedPrecondition(format!(
                "cannot adopt the cluster layout of dataset '{dataset}': {why}; seal the cluster \
                 again"
            )))
        };
        let Some(member) = layout.members.get(index) else {
            return refuse(format!("it has no member {index}"));
        };
        if ds.generation != member.generation {
            return refuse(format!(
                "it names generation {} here, this member holds generation {}",
                member.generation, ds.generation
            ));
        }
        let have: Vec<AttemptKey> = ds.sealed_parts.iter().map(|p| p.key).collect();
        let want: Vec<AttemptKey> = member.partitions.iter().map(|p| p.key).collect();
        match &ds.cluster {
            _ if ds.sealed.is_none() => return refuse("this member's part is not sealed".into()),
            _ if have != want => return refuse("it names other partitions for this member".into()),
            Some(ClusterState::Member { layout: l, .. }) if l.id != layout.id => {
                return refuse(format!(
                    "this member already belongs to layout {:016x}",
                    l.id
                ));
            }
            None => return refuse("this member's part was sealed on its own".into()),
            _ => {}
        }
        ds.cluster = Some(ClusterState::Member { layout, index });
        Ok(summarize(dataset, ds))
    }

    fn seal_winners(
        &mut self,
        req: &SealRequest,
        only_named: bool,
    ) -> Result<(DatasetSummary, u64)> {
        let name = req.dataset.as_str();
        let ds = self
            .datasets
            .get_mut(name)
            .ok_or_else(|| Error::DatasetNotFound {
                dataset: name.to_string(),
            })?;
        if ds.sealed.is_some() {
            return Err(Error::FailedPrecondition(format!(
                "dataset '{name}' is already sealed; drop it and write it again to change it"
            )));
        }
        // Winners: named ones first, validated; then first committed.
        let mut winners: BTreeMap<u32, AttemptKey> = BTreeMap::new();
        for &w in &req.winners {
            if winners.insert(w.partition, w).is_some() {
                return Err(Error::invalid(format!(
                    "seal of dataset '{name}' names partition {} more than once",
                    w.partition
                )));
            }
            if !ds.attempts.contains_key(&w) {
                return Err(Error::FailedPrecondition(format!(
                    "cannot seal dataset '{name}': the named winner, attempt {} of partition {}, \
                     was never committed; name a committed attempt (see action 'describe')",
                    w.attempt, w.partition
                )));
            }
        }
        if !only_named {
            for (p, key) in first_committed(&ds.attempts) {
                winners.entry(p).or_insert(key);
            }
        }
        check_partition_count(name, req.partitions, winners.keys().copied())?;
        let mut total = 0u64;
        for key in winners.values() {
            let rows = ds.attempts.get(key).map_or(0, |a| a.data.rows);
            total = add_rows(total, rows, || format!("dataset '{name}'"))?;
        }
        // Move winners out, free losers.
        let counts = attempt_counts(&ds.attempts);
        let mut freed = 0u64;
        let mut parts = Vec::with_capacity(winners.len());
        let mut summaries = Vec::with_capacity(winners.len());
        for (key, a) in std::mem::take(&mut ds.attempts) {
            if winners.get(&key.partition) == Some(&key) {
                summaries.push(PartitionSummary {
                    key,
                    rows: a.data.rows,
                    bytes: a.data.bytes,
                    committed_attempts: counts.get(&key.partition).copied().unwrap_or(1),
                });
                parts.push((key, a.data));
            } else {
                freed += a.data.bytes;
            }
        }
        // Sealing counts as a read: a fresh dataset is not the first to spill.
        self.tick += 1;
        ds.sealed = Some(Sealed {
            data: Some(Arc::new(SealedData::new(ds.schema.clone(), parts))),
            stored: None,
            last_read: self.tick,
        });
        ds.sealed_parts = summaries;
        Ok((summarize(name, ds), freed))
    }

    /// Removes a dataset; returns its last summary and the bytes freed.
    pub fn drop_dataset(&mut self, name: &str) -> Result<(DatasetSummary, u64)> {
        let ds = self
            .datasets
            .remove(name)
            .ok_or_else(|| Error::DatasetNotFound {
                dataset: name.to_string(),
            })?;
        let summary = summarize(name, &ds);
        Ok((summary.clone(), summary.bytes))
    }

    /// What replacing writes have staged: of `dataset`, or of every
    /// dataset; by dataset, then write.
    pub fn staged(&self, dataset: Option<&str>) -> Vec<StagedSummary> {
        self.datasets
            .iter()
            .filter_map(|(key, ds)| {
                let (name, write) = staged_parts(key)?;
                dataset.is_none_or(|d| d == name).then(|| StagedSummary {
                    dataset: name.to_string(),
                    write_id: write.to_string(),
                    summary: summarize(key, ds),
                })
            })
            .collect()
    }

    /// Whether `dataset` is what write `write_id` staged, swapped in
    /// already (since this server started).
    pub fn swapped_in_by(&self, dataset: &str, write_id: &str) -> bool {
        self.datasets
            .get(dataset)
            .is_some_and(|ds| !write_id.is_empty() && ds.swapped_in_by == write_id)
    }

    /// Whether the catalog has an entry of this name (a dataset, or what a
    /// write stages: [`staged_key`]).
    pub fn holds(&self, name: &str) -> bool {
        self.datasets.contains_key(name)
    }

    /// Summary of one dataset.
    pub fn describe(&self, name: &str) -> Result<DatasetSummary> {
        self.datasets
            .get(name)
            .map(|ds| summarize(name, ds))
            .ok_or_else(|| Error::DatasetNotFound {
                dataset: name.to_string(),
            })
    }

    /// Summaries of all datasets, by name (not what writes stage to
    /// replace them: that is not readable until it is swapped in).
    pub fn list(&self) -> Vec<DatasetSummary> {
        self.datasets
            .iter()
            .filter(|(name, _)| !is_staged(name))
            .map(|(name, ds)| summarize(name, ds))
            .collect()
    }

    /// Puts what write `write_id` staged (and sealed) to replace `dataset`
    /// in its place, at once: readers see the old dataset until now and the
    /// new one from now on (a new generation, so tickets of the old one are
    /// refused as written again). Returns the new summary and that of the
    /// dataset it replaced, if there was one; the replaced dataset's bytes
    /// go back to the budget once its last reader ends.
    pub fn swap_in(
        &mut self,
        dataset: &str,
        write_id: &str,
    ) -> Result<(DatasetSummary, Option<DatasetSummary>)> {
        let key = staged_key(dataset, write_id);
        let ready = self
            .datasets
            .get(&key)
            .map(|ds| ds.sealed.is_some() && !matches!(ds.cluster, Some(ClusterState::Pending)));
        match ready {
            None => Err(nothing_staged(dataset, write_id)),
            Some(false) => Err(Error::Internal(format!(
                "the replacement of dataset '{dataset}' by write '{write_id}' is not sealed"
            ))),
            Some(true) => {
                let mut staged = self.datasets.remove(&key).ok_or_else(|| {
                    Error::Internal(format!("the replacement of '{dataset}' vanished"))
                })?;
                staged.swapped_in_by = write_id.to_string();
                let new = summarize(dataset, &staged);
                let old = self.datasets.insert(dataset.to_string(), staged);
                Ok((new, old.map(|ds| summarize(dataset, &ds))))
            }
        }
    }

    /// The readable content of a sealed dataset and its generation.
    pub fn sealed(&self, name: &str) -> Result<(u64, Arc<SealedData>)> {
        let ds = self
            .datasets
            .get(name)
            .ok_or_else(|| Error::DatasetNotFound {
                dataset: name.to_string(),
            })?;
        let sealed = ds.sealed.as_ref().ok_or_else(|| Error::DatasetNotSealed {
            dataset: name.to_string(),
        })?;
        let data = sealed.data.clone().ok_or_else(|| {
            Error::FailedPrecondition(format!(
                "dataset '{name}' is spilled to the store; read it to bring it back"
            ))
        })?;
        Ok((ds.generation, data))
    }

    /// A sealed dataset, resident or spilled.
    pub fn lookup(&self, name: &str) -> Result<SealedView> {
        let ds = self.get(name)?;
        let sealed = ds.sealed.as_ref().ok_or_else(|| Error::DatasetNotSealed {
            dataset: name.to_string(),
        })?;
        match (&sealed.data, &sealed.stored) {
            (Some(data), _) => Ok(SealedView::Resident {
                generation: ds.generation,
                data: data.clone(),
            }),
            (None, Some(stored)) => Ok(SealedView::Stored {
                generation: ds.generation,
                stored: stored.clone(),
                schema: ds.schema.clone(),
                winners: ds.sealed_parts.iter().map(|p| p.key).collect(),
            }),
            (None, None) => Err(Error::Internal(format!(
                "dataset '{name}' is neither in memory nor in the store"
            ))),
        }
    }

    fn get(&self, name: &str) -> Result<&Dataset> {
        self.datasets
            .get(name)
            .ok_or_else(|| Error::DatasetNotFound {
                dataset: name.to_string(),
            })
    }

    fn sealed_mut(&mut self, name: &str, generation: u64) -> Option<&mut Sealed> {
        self.datasets
            .get_mut(name)
            .filter(|ds| ds.generation == generation)
            .and_then(|ds| ds.sealed.as_mut())
    }

    /// Records a read of a sealed dataset (for least-recently-read spilling).
    pub fn touch(&mut self, name: &str) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(s) = self.datasets.get_mut(name).and_then(|d| d.sealed.as_mut()) {
            s.last_read = tick;
        }
    }

    /// The resident sealed dataset read least recently (ties: by name),
    /// other than `except` and those in `tried` (whose spill just failed).
    ///
    /// A dataset with a column the store cannot hold is never one: it stays
    /// in memory until dropped ([`Catalog::unspillable_holders`]).
    pub fn spill_candidate(
        &self,
        except: Option<&str>,
        tried: &[String],
    ) -> Option<SpillCandidate> {
        self.resident(except)
            .filter(|(name, ..)| !tried.contains(name))
            .filter(|(.., s, data)| {
                s.stored.is_some() || unstorable_column(data.schema()).is_none()
            })
            .min_by_key(|(_, _, s, _)| s.last_read)
            .map(|(name, ds, s, data)| SpillCandidate {
                name: name.clone(),
                generation: ds.generation,
                data: data.clone(),
                stored: s.stored.clone(),
                partitions: ds.sealed_parts.clone(),
            })
    }

    /// Every sealed dataset whose rows are in memory, other than `except`.
    fn resident<'a>(
        &'a self,
        except: Option<&'a str>,
    ) -> impl Iterator<Item = (&'a String, &'a Dataset, &'a Sealed, &'a Arc<SealedData>)> {
        self.datasets
            .iter()
            .filter(move |(name, _)| Some(name.as_str()) != except)
            .filter_map(|(name, ds)| {
                let s = ds.sealed.as_ref()?;
                Some((name, ds, s, s.data.as_ref()?))
            })
    }

    /// Gives up the packed copy of the least-recently-read resident dataset
    /// that has one (other than `except`): the first memory given back when
    /// the budget is full. The bytes it held; 0 when no dataset has one.
    pub fn give_up_packed(&self, except: Option<&str>) -> u64 {
        self.resident(except)
            .filter(|(.., data)| data.packed().bytes() > 0)
            .min_by_key(|(_, _, s, _)| s.last_read)
            .map_or(0, |(.., data)| data.packed().give_up())
    }

    /// Records the store copy of a sealed dataset; false when the dataset
    /// (of that generation) is gone.
    pub fn set_stored(&mut self, name: &str, generation: u64, stored: Stored) -> bool {
        match self.sealed_mut(name, generation) {
            Some(s) => {
                s.stored = Some(stored);
                true
            }
            None => false,
        }
    }

    /// Lets go of the host copy of a sealed dataset that has a store copy;
    /// returns it (its memory is freed when the last reader lets go too).
    pub fn release_host(&mut self, name: &str, generation: u64) -> Option<Arc<SealedData>> {
        let s = self.sealed_mut(name, generation)?;
        s.stored.as_ref()?;
        s.data.take()
    }

    /// Puts a spilled dataset's rows back in memory; returns what is now
    /// resident (another reader may have restored it first), or `None` when
    /// the dataset of that generation is gone.
    pub fn restore(
        &mut self,
        name: &str,
        generation: u64,
        data: SealedData,
    ) -> Option<Arc<SealedData>> {
        let s = self.sealed_mut(name, generation)?;
        Some(s.data.get_or_insert_with(|| Arc::new(data)).clone())
    }

    /// Adds a dataset persisted by an earlier run, sealed and spilled; later
    /// datasets get newer generations.
    pub fn insert_persisted(&mut self, p: PersistedDataset) -> Result<()> {
        if self.datasets.contains_key(&p.name) {
            return Err(Error::Internal(format!(
                "dataset '{}' is persisted twice",
                p.name
            )));
        }
        self.next_generation = self.next_generation.max(p.generation + 1);
        self.datasets.insert(
            p.name,
            Dataset {
                generation: p.generation,
                schema: p.schema,
                attempts: BTreeMap::new(),
                sealed: Some(Sealed {
                    data: None,
                    stored: Some(p.stored),
                    last_read: 0,
                }),
                sealed_parts: p.partitions,
                cluster: p.cluster,
                written: Instant::now(),
                swapped_in_by: String::new(),
                write: None,
            },
        );
        Ok(())
    }

    /// The schema of a dataset, open or sealed.
    pub fn schema(&self, name: &str) -> Result<SchemaRef> {
        self.datasets
            .get(name)
            .map(|ds| ds.schema.clone())
            .ok_or_else(|| Error::DatasetNotFound {
                dataset: name.to_string(),
            })
    }

    /// Datasets holding memory that cannot spill because they were never
    /// sealed, largest first: name, bytes, and how long ago an attempt was
    /// last committed to each.
    pub fn unsealed_holders(&self) -> Vec<(String, u64, Duration)> {
        let mut held: Vec<(String, u64, Duration)> = self
            .datasets
            .iter()
            .filter(|(_, ds)| ds.sealed.is_none())
            .map(|(name, ds)| {
                let bytes = ds.attempts.values().map(|a| a.data.bytes).sum();
                (name.clone(), bytes, ds.written.elapsed())
            })
            .filter(|(_, bytes, _)| *bytes > 0)
            .collect();
        held.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        held
    }

    /// Every resident sealed dataset that cannot spill because the store
    /// cannot hold one of its columns: (name, bytes, which column and why),
    /// largest first.
    pub fn unspillable_holders(&self) -> Vec<(String, u64, String)> {
        let mut held: Vec<(String, u64, String)> = self
            .resident(None)
            .filter(|(.., s, _)| s.stored.is_none())
            .filter_map(|(name, ds, _, data)| {
                let (column, _) = unstorable_column(data.schema())?;
                let bytes = ds.sealed_parts.iter().map(|p| p.bytes).sum();
                Some((name.clone(), bytes, column))
            })
            .collect();
        held.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        held
    }

    /// Totals over all datasets.
    pub fn totals(&self) -> CatalogTotals {
        let totals = self
            .datasets
            .iter()
            .map(|(name, ds)| summarize(name, ds))
            .fold(CatalogTotals::default(), |mut t, s| {
                // What writes stage counts in memory, not as datasets.
                let shown = !is_staged(&s.name);
                t.datasets += u32::from(shown);
                t.sealed += u32::from(shown && s.state == DatasetState::Sealed);
                t.rows += s.rows;
                t.bytes += s.bytes;
                t.spilled += u32::from(!s.resident);
                t
            });
        let packed_bytes = self
            .resident(None)
            .map(|(.., data)| data.packed().bytes())
            .sum();
        CatalogTotals {
            packed_bytes,
            ..totals
        }
    }
}

/// The refusal of a seal or swap for a replacing write with nothing staged.
pub fn nothing_staged(dataset: &str, write_id: &str) -> Error {
    Error::FailedPrecondition(format!(
        "write '{write_id}' staged nothing to replace dataset '{dataset}' (it wrote no partition \
         here, was dropped, or was swapped in already); write the dataset again"
    ))
}

fn schema_mismatch(dataset: &str, key: AttemptKey, expected: &Schema, got: &Schema) -> Error {
    Error::invalid(format!(
        "schema of partition {} attempt {} does not match dataset '{dataset}': expected {}, got \
         {}; every partition of a dataset must have the same schema (drop the dataset to change \
         it)",
        key.partition,
        key.attempt,
        describe_fields(expected),
        describe_fields(got)
    ))
}

/// Checks that the partitions `held` (ascending) are exactly
/// `0..expected`; `expected` 0 checks nothing.
pub fn check_partition_count(
    dataset: &str,
    expected: u32,
    held: impl Iterator<Item = u32>,
) -> Result<()> {
    if expected == 0 {
        return Ok(());
    }
    let have: std::collections::BTreeSet<u32> = held.collect();
    // Counted, not listed: `expected` is the client's and may be 2^32 - 1.
    let count = u64::from(expected) - have.range(..expected).count() as u64;
    if count > 0 {
        let missing = (0..expected)
            .filter(|p| !have.contains(p))
            .take(crate::error::MISSING_SHOWN)
            .collect();
        return Err(Error::MissingPartitions {
            dataset: dataset.to_string(),
            expected,
            missing,
            count,
        });
    }
    let extra: Vec<u32> = have.range(expected..).copied().collect();
    if !extra.is_empty() {
        return Err(Error::FailedPrecondition(format!(
            "cannot seal dataset '{dataset}' with {expected} partitions: it also holds partitions \
             {extra:?}; seal with the right partition count, or drop the dataset and write it \
             again"
        )));
    }
    Ok(())
}

/// The first committed attempt of each partition.
fn first_committed(attempts: &BTreeMap<AttemptKey, CommittedAttempt>) -> BTreeMap<u32, AttemptKey> {
    let mut first: BTreeMap<u32, (u64, AttemptKey)> = BTreeMap::new();
    for (key, a) in attempts {
        let e = first.entry(key.partition).or_insert((a.seq, *key));
        if a.seq < e.0 {
            *e = (a.seq, *key);
        }
    }
    first.into_iter().map(|(p, (_, key))| (p, key)).collect()
}

/// The number of committed attempts of each partition.
fn attempt_counts(attempts: &BTreeMap<AttemptKey, CommittedAttempt>) -> BTreeMap<u32, u32> {
    let mut counts = BTreeMap::new();
    for key in attempts.keys() {
        *counts.entry(key.partition).or_default() += 1;
    }
    counts
}

fn summarize(name: &str, ds: &Dataset) -> DatasetSummary {
    let (state, partitions, bytes) = match &ds.sealed {
        Some(sealed) => {
            let parts = ds.sealed_parts.clone();
            let bytes = match sealed.data {
                Some(_) => parts.iter().map(|p| p.bytes).sum(),
                None => 0,
            };
            (DatasetState::Sealed, parts, bytes)
        }
        None => {
            let counts = attempt_counts(&ds.attempts);
            let parts = first_committed(&ds.attempts)
                .into_values()
                .filter_map(|key| {
                    let a = ds.attempts.get(&key)?;
                    Some(PartitionSummary {
                        key,
                        rows: a.data.rows,
                        bytes: a.data.bytes,
                        committed_attempts: counts.get(&key.partition).copied().unwrap_or(1),
                    })
                })
                .collect();
            let bytes = ds.attempts.values().map(|a| a.data.bytes).sum();
            (DatasetState::Open, parts, bytes)
        }
    };
    DatasetSummary {
        name: name.to_string(),
        state,
        generation: ds.generation,
        schema: ds.schema.clone(),
        // An open dataset's attempts are each within MAX_ROWS, not their sum.
        rows: partitions
            .iter()
            .fold(0u64, |t, p| t.saturating_add(p.rows)),
        bytes,
        partitions,
        resident: ds.sealed.as_ref().is_none_or(|s| s.data.is_some()),
        stored: ds.sealed.as_ref().and_then(|s| s.stored.clone()),
        cluster: ds.cluster.clone(),
        idle: ds.written.elapsed(),
    }
}

#[cfg(test)]
mod tests;
