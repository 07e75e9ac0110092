//! The spill and persistence store: sealed datasets as Parquet files (Arrow
//! schema embedded) in an `object_store` — a local directory, memory, or a
//! cloud bucket.
//!
//! Layout under the store's root:
//!
//! ```text
//! datasets/<name>/<generation>/data.parquet    persisted (--persist), with
//! datasets/<name>/<generation>/manifest.json   the catalog entry for restart
//! datasets/server.json                         the server persisting here (heartbeat.rs)
//! spill/<session>/<name>/<generation>/data.parquet
//!                                              spilled by a server without --persist;
//!                                              removed on drop and at shutdown, or by
//!                                              any server once this one has stopped
//! spill/<session>/server.json                  whose they are (heartbeat.rs)
//! ```
//!
//! One file per dataset, rows in the dataset's row order, so a dataset read
//! back serves the same bytes in the same order. Row groups are kept small so
//! writing a spill needs little memory — spilling happens when memory is
//! short.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use arrow::array::RecordBatch;
use arrow::datatypes::{DataType, IntervalUnit, Schema, SchemaRef};
use arrow::ipc::writer::IpcWriteOptions;
use arrow_flight::{IpcMessage, SchemaAsIpc};
use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use object_store::buffered::BufWriter;
use object_store::path::{Path, PathPart};
use object_store::{GetOptions, GetRange};
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use parquet::arrow::arrow_reader::ArrowReaderOptions;
use parquet::arrow::async_reader::{
    AsyncFileReader, MetadataSuffixFetch, ParquetRecordBatchStreamBuilder,
};
use parquet::arrow::async_writer::AsyncArrowWriter;
use parquet::errors::ParquetError;
use parquet::file::metadata::{ParquetMetaData, ParquetMetaDataReader};
use parquet::file::properties::WriterProperties;
use serde_json::{Value, json};

use super::heartbeat::{Holder, Process, Timing};
use crate::catalog::{AttemptKey, ClusterState, PartitionSummary, SealedData};
use crate::cluster::{Layout, Member};
use crate::error::{Error, Result};

/// Rows per Parquet row group (and per batch read back).
const ROW_GROUP_ROWS: usize = 65_536;
/// Version of the manifest layout.
const MANIFEST_FORMAT: u64 = 1;

/// Where a dataset's copy lives in the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// The dataset's folder.
    pub dir: Path,
    /// Written by `--persist` (with a manifest; survives restart), or a spill.
    pub persisted: bool,
}

impl Stored {
    fn data(&self) -> Path {
        self.dir.clone().join("data.parquet")
    }

    fn manifest(&self) -> Path {
        self.dir.clone().join("manifest.json")
    }
}

/// A persisted dataset as found at start.
#[derive(Debug, Clone)]
pub struct PersistedDataset {
    /// Dataset name.
    pub name: String,
    /// Its generation when sealed.
    pub generation: u64,
    /// Its schema.
    pub schema: SchemaRef,
    /// Winning partitions.
    pub partitions: Vec<PartitionSummary>,
    /// Where it lives.
    pub stored: Stored,
    /// Its place in a cluster, if it is part of one.
    pub cluster: Option<ClusterState>,
}

/// Longest folder name a dataset's files go under: file systems allow 255
/// bytes a name, and a name is percent-encoded (`é` takes 6 bytes, `/` 3).
const MAX_FOLDER: usize = 200;

/// The folder dataset `name`'s files go under: its name, percent-encoded
/// as the store encodes a path's part; a name whose encoding is longer than
/// [`MAX_FOLDER`] is cut, and the FNV-1a hash of the whole name follows
/// (`…-h` and 16 hex digits), so that it still fits a file system. Folders
/// only group a dataset's generations: its manifest holds its name.
fn folder(name: &str) -> PathPart<'static> {
    let encoded_len = |s: &str| PathPart::from(s).as_ref().len();
    if encoded_len(name) <= MAX_FOLDER {
        return PathPart::from(name.to_string());
    }
    // Cut between characters of the name, so that no escape is split; the
    // hash's 18 bytes and its dash follow.
    let cut = name
        .char_indices()
        .map(|(i, c)| i + c.len_utf8())
        .take_while(|&end| encoded_len(&name[..end]) <= MAX_FOLDER - 19)
        .last()
        .unwrap_or(0);
    let hash = crate::cluster::fnv1a(name.as_bytes(), 0xcbf2_9ce4_8422_2325);
    PathPart::from(format!("{}-h{hash:016x}", &name[..cut]))
}

/// Why the store cannot hold a column of type `data_type`, and what a
/// writer can do instead; `None` when it can. Parquet has no union (its
/// writer panics on one), no month-day-nano interval and no struct without
/// fields, and reads a run-end encoded column back as its plain values —
/// the same rows, but not the type the dataset was sealed with. A type
/// made of one of those (a list of unions) cannot be held either.
pub fn unstorable(data_type: &DataType) -> Option<Unstorable> {
    unstorable_itself(data_type).or_else(|| parts(data_type).into_iter().find_map(unstorable))
}

/// [`unstorable`] for the type itself, not the types it is made of.
fn unstorable_itself(data_type: &DataType) -> Option<Unstorable> {
    let (what, instead) = match data_type {
        DataType::Union(..) => (
            "a union",
            "write each of its variants as a column of its own",
        ),
        DataType::Interval(IntervalUnit::MonthDayNano) => (
            "a month-day-nano interval",
            "cast it to a duration, or write months, days and nanoseconds as three columns",
        ),
        DataType::RunEndEncoded(..) => ("a run-end encoded array", "cast it to its values' type"),
        DataType::Struct(fields) if fields.is_empty() => {
            ("a struct without fields", "leave it out")
        }
        _ => return None,
    };
    Some(Unstorable { what, instead })
}

/// The types a nested type is made of (none for the others; a union's and
/// a run-end encoded array's do not matter: they are refused themselves).
fn parts(data_type: &DataType) -> Vec<&DataType> {
    match data_type {
        DataType::Struct(fields) => fields.iter().map(|f| f.data_type()).collect(),
        DataType::List(f)
        | DataType::LargeList(f)
        | DataType::ListView(f)
        | DataType::LargeListView(f)
        | DataType::FixedSizeList(f, _)
        | DataType::Map(f, _) => vec![f.data_type()],
        DataType::Dictionary(_, values) => vec![values],
        _ => Vec::new(),
    }
}

/// A type the store cannot hold (see [`unstorable`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unstorable {
    /// The type, as a person names it ("a union").
    pub what: &'static str,
    /// What a writer can send instead.
    pub instead: &'static str,
}

/// The first column of `schema` the store cannot hold, in words: "column
/// 'u' is a union", "column 'l' holds a union". `None` when it holds
/// every column.
pub fn unstorable_column(schema: &Schema) -> Option<(String, Unstorable)> {
    schema.fields().iter().find_map(|f| {
        let why = unstorable(f.data_type())?;
        let verb = match unstorable_itself(f.data_type()) {
            Some(_) => "is",
            None => "holds",
        };
        Some((format!("column '{}' {verb} {}", f.name(), why.what), why))
    })
}

/// An object store with flightdeck's layout.
#[derive(Debug, Clone)]
pub struct Store {
    pub(super) store: Arc<dyn ObjectStore>,
    pub(super) root: Path,
    pub(super) url: String,
    /// This server, as its records in the store name it; its session
    /// (unique per run) names its spill folder.
    pub(super) holder: Holder,
    /// Beats written so far (a record's `beat`).
    pub(super) beats: Arc<AtomicU64>,
    /// Spill folders this session holds or is writing (its record in the
    /// store is kept while there are any).
    pub(super) spill_folders: Arc<tokio::sync::Mutex<usize>>,
    pub(super) timing: Timing,
}

/// The store failing to answer while doing `what` (`UNAVAILABLE`).
pub(super) fn store_error(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Unavailable(format!("{what}: {e}"))
}

/// Dataset `name`'s stored copy is lost (`DATA_LOSS`: no retry brings it
/// back): what reading it (`what`) found, and what to do.
fn lost(name: &str, what: &str, found: impl std::fmt::Display) -> Error {
    Error::DataLoss(format!(
        "dataset '{name}' cannot be brought back from the store: {what}: {found}; drop it and \
         write it again"
    ))
}

/// A failed read of dataset `name`'s file: the file gone, or not the
/// Parquet it was written as, is [`lost`]; the store failing to answer is
/// [`store_error`].
fn read_error(name: &str, what: &str, e: ParquetError) -> Error {
    let lost = match &e {
        // The store's own errors reach Parquet wrapped (`ObjectReader`).
        ParquetError::External(inner) => matches!(
            inner.downcast_ref::<object_store::Error>(),
            Some(object_store::Error::NotFound { .. })
        ),
        _ => true,
    };
    if lost {
        self::lost(
            name,
            what,
            format!("{e}; the stored copy is missing or damaged"),
        )
    } else {
        store_error(what, e)
    }
}

/// The object store and path a URL names: `file:///abs/path`, `memory://…`,
/// `s3://bucket/prefix`, `gs://…`, `az://…` (credentials from the
/// environment), or a plain local path. With `shared_memory`, every
/// `memory://` URL of this process names one store (so a checkpoint written
/// there can be read back by a later job); otherwise each call gets a fresh
/// one. Nothing is created until something is written.
pub fn open_location(
    url: &str,
    shared_memory: bool,
) -> std::result::Result<(Arc<dyn ObjectStore>, Path), String> {
    static SHARED: std::sync::OnceLock<Arc<object_store::memory::InMemory>> =
        std::sync::OnceLock::new();
    if let Some(rest) = url.strip_prefix("memory:") {
        let store: Arc<dyn ObjectStore> = if shared_memory {
            SHARED
                .get_or_init(|| Arc::new(object_store::memory::InMemory::new()))
                .clone()
        } else {
            Arc::new(object_store::memory::InMemory::new())
        };
        let path = Path::parse(rest.trim_start_matches('/')).map_err(|e| e.to_string())?;
        return Ok((store, path));
    }
    if !url.contains("://") {
        let dir = std::path::absolute(url).map_err(|e| e.to_string())?;
        let root = Path::from_absolute_path(&dir).map_err(|e| e.to_string())?;
        return Ok((Arc::new(object_store::local::LocalFileSystem::new()), root));
    }
    let parsed = url::Url::parse(url).map_err(|e| e.to_string())?;
    let (store, root) =
        object_store::parse_url_opts(&parsed, cloud_options()).map_err(|e| e.to_string())?;
    Ok((Arc::from(store), root))
}

/// Environment variables that configure cloud stores (credentials, region,
/// endpoint), passed to the store's builder.
fn cloud_options() -> Vec<(String, String)> {
    std::env::vars()
        .filter(|(k, _)| {
            ["AWS_", "GOOGLE_", "AZURE_"]
                .iter()
                .any(|p| k.starts_with(p))
        })
        .map(|(k, v)| (k.to_ascii_lowercase(), v))
        .collect()
}

/// How long [`check_writable`] waits for a store's answer.
pub const WRITE_CHECK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Name prefix of the objects [`check_writable`] writes.
const PROBE_PREFIX: &str = ".flightdeck-write-check";

/// A probe this old was left by a process stopped between writing and
/// deleting it (a probe lives for one round trip, at most
/// [`WRITE_CHECK_TIMEOUT`]).
const STALE_PROBE: std::time::Duration = std::time::Duration::from_secs(600);

/// Writes and deletes a small object under `dir` of `store`: whether
/// anything can be written there, checked before work that would write there
/// much later (a server's spills, a job's checkpoints). The reason when not.
/// Probes that processes stopped mid-check left in `dir` are removed.
pub async fn check_writable(
    store: &dyn ObjectStore,
    dir: &Path,
) -> std::result::Result<(), String> {
    // A name of its own: servers (or jobs) sharing a folder probe it at the
    // same time, and one's delete must not take away another's probe.
    static PROBES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let probe = dir
        .clone()
        .join(format!("{PROBE_PREFIX}-{}-{n}", std::process::id()).as_str());
    let round_trip = async {
        store
            .put(&probe, PutPayload::from_static(b"flightdeck"))
            .await?;
        store.delete(&probe).await
    };
    match tokio::time::timeout(WRITE_CHECK_TIMEOUT, round_trip).await {
        Ok(Ok(())) => {
            // Best effort: a folder that can be written but not listed keeps them.
            let _ =
                tokio::time::timeout(WRITE_CHECK_TIMEOUT, remove_stale_probes(store, dir)).await;
            Ok(())
        }
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer within {WRITE_CHECK_TIMEOUT:?}")),
    }
}

/// How long ago the store last wrote the object `meta` describes.
pub(super) fn age_of(meta: &object_store::ObjectMeta) -> std::time::Duration {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64);
    let written = meta.last_modified.timestamp_millis();
    std::time::Duration::from_millis(now.saturating_sub(written).max(0) as u64)
}

/// Deletes the probes in `dir` older than [`STALE_PROBE`].
async fn remove_stale_probes(store: &dyn ObjectStore, dir: &Path) {
    let Ok(listing) = store.list_with_delimiter(Some(dir)).await else {
        return;
    };
    for meta in listing.objects {
        let probe = meta
            .location
            .filename()
            .is_some_and(|name| name.starts_with(PROBE_PREFIX));
        if probe && age_of(&meta) > STALE_PROBE {
            tracing::info!(probe = %meta.location, "removing a write check a stopped process left");
            let _ = store.delete(&meta.location).await;
        }
    }
}

impl Store {
    /// Opens the store at `url`: `file:///abs/dir`, `memory://`, `s3://bucket/prefix`,
    /// `gs://…`, `az://…` (credentials from the environment), or a plain
    /// local path. Nothing is created until something is written.
    pub fn open(url: &str) -> Result<Self> {
        let (store, root) = open_location(url, false).map_err(|e| {
            Error::invalid(format!(
                "--spill-url '{url}' is not usable: {e}; give a local directory, file:///path, \
                 memory://, s3://bucket/prefix, gs://bucket/prefix or az://container/prefix"
            ))
        })?;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        Ok(Self {
            store,
            root,
            holder: Holder {
                session: format!("{}-{nanos}", std::process::id()),
                host: crate::config::host_name().unwrap_or_default(),
                location: String::new(),
                process: Process::current(),
            },
            url: url.to_string(),
            beats: Arc::default(),
            spill_folders: Arc::default(),
            timing: Timing::DEFAULT,
        })
    }

    /// The store of a server that serves at `location` (as its records
    /// name it).
    pub fn serving_at(mut self, location: &str) -> Self {
        self.holder.location = location.to_string();
        self
    }

    /// How often [`Store::beat`] should run.
    pub fn beat_every(&self) -> std::time::Duration {
        self.timing.beat
    }

    /// Fails, naming the URL, when nothing can be written under the store's
    /// root (checked at server start, not at the first spill).
    pub async fn check_writable(&self) -> Result<()> {
        check_writable(self.store.as_ref(), &self.root)
            .await
            .map_err(|e| {
                Error::invalid(format!(
                    "--spill-url '{}' cannot be written: {e}; give a folder or prefix this \
                     server may write",
                    self.url
                ))
            })
    }

    /// The URL it was opened with.
    pub fn url(&self) -> &str {
        &self.url
    }

    fn dir(&self, persisted: bool, name: &str, generation: u64) -> Path {
        let base = if persisted {
            self.root.clone().join("datasets")
        } else {
            self.root
                .clone()
                .join("spill")
                .join(self.holder.session.as_str())
        };
        // What a write stages goes under its dataset's name too (the
        // generation, unique per server, keeps the two apart).
        base.join(folder(crate::catalog::public_name(name)))
            .join(generation.to_string())
    }

    /// Writes `data` as Parquet; with `manifest` (persisting), also the
    /// catalog entry restart needs, written last so that a manifest always
    /// names a complete file.
    pub async fn write(
        &self,
        name: &str,
        generation: u64,
        data: &SealedData,
        manifest: Option<(&[PartitionSummary], Option<&ClusterState>)>,
    ) -> Result<Stored> {
        let stored = Stored {
            dir: self.dir(manifest.is_some(), name, generation),
            persisted: manifest.is_some(),
        };
        let what = || format!("writing dataset '{name}' to {}", self.url);
        if let Some((column, _)) = unstorable_column(data.schema()) {
            return Err(Error::FailedPrecondition(format!(
                "{}: {column}, which the store (Parquet) cannot hold",
                what()
            )));
        }
        let spill = manifest.is_none();
        if spill {
            // Its session's record first (a spill of a stopped server is
            // then known as one): failing, it is this write that failed.
            self.spill_begins()
                .await
                .map_err(|e| store_error(&what(), e))?;
        }
        let written = self
            .write_files(&stored, name, generation, data, manifest)
            .await;
        if spill && written.is_err() {
            // Nothing part-written stays behind.
            let _ = self.delete_under(&stored.dir).await;
            let _ = self.spill_ends().await;
        }
        written.map(|()| stored)
    }

    async fn write_files(
        &self,
        stored: &Stored,
        name: &str,
        generation: u64,
        data: &SealedData,
        manifest: Option<(&[PartitionSummary], Option<&ClusterState>)>,
    ) -> Result<()> {
        let what = || format!("writing dataset '{name}' to {}", self.url);
        let props = WriterProperties::builder()
            .set_max_row_group_row_count(Some(ROW_GROUP_ROWS))
            .build();
        let sink = BufWriter::new(self.store.clone(), stored.data());
        let mut writer = AsyncArrowWriter::try_new(sink, data.schema().clone(), Some(props))
            .map_err(|e| store_error(&what(), e))?;
        for batch in data.batches() {
            writer
                .write(batch)
                .await
                .map_err(|e| store_error(&what(), e))?;
        }
        writer.close().await.map_err(|e| store_error(&what(), e))?;
        if let Some((parts, cluster)) = manifest {
            self.write_manifest(stored, name, generation, data.schema(), parts, cluster)
                .await?;
        }
        Ok(())
    }

    /// Writes (or rewrites) the manifest of a persisted dataset.
    pub async fn write_manifest(
        &self,
        stored: &Stored,
        name: &str,
        generation: u64,
        schema: &Schema,
        parts: &[PartitionSummary],
        cluster: Option<&ClusterState>,
    ) -> Result<()> {
        let body = manifest_json(name, generation, schema, parts, cluster)?;
        self.store
            .put(&stored.manifest(), PutPayload::from(body))
            .await
            .map_err(|e| store_error(&format!("writing the manifest of '{name}'"), e))?;
        Ok(())
    }

    /// Dataset `name`'s record batches, read back in row order with
    /// `schema`.
    pub async fn read(
        &self,
        name: &str,
        stored: &Stored,
        schema: SchemaRef,
    ) -> Result<BoxStream<'static, Result<RecordBatch>>> {
        let path = stored.data();
        let (name, what) = (
            name.to_string(),
            format!("reading {path} from {}", self.url),
        );
        let reader = ObjectReader {
            store: self.store.clone(),
            path,
        };
        let stream = ParquetRecordBatchStreamBuilder::new(reader)
            .await
            .map_err(|e| read_error(&name, &what, e))?
            .with_batch_size(ROW_GROUP_ROWS)
            .build()
            .map_err(|e| read_error(&name, &what, e))?;
        let (n, w) = (name.clone(), what.clone());
        Ok(stream
            .map_err(move |e| read_error(&n, &w, e))
            .and_then(move |batch| {
                // The catalog's schema, metadata included; types must match.
                let fitted = RecordBatch::try_new(schema.clone(), batch.columns().to_vec());
                std::future::ready(fitted.map_err(|e| {
                    let found = format!(
                        "a stored batch does not fit the dataset's schema ({e}); the stored \
                         copy is damaged"
                    );
                    lost(&name, &what, found)
                }))
            })
            .boxed())
    }

    /// Removes a dataset's files.
    pub async fn delete(&self, stored: &Stored) -> Result<()> {
        self.delete_under(&stored.dir).await?;
        if !stored.persisted {
            self.spill_ends().await?;
        }
        Ok(())
    }

    async fn delete_under(&self, dir: &Path) -> Result<()> {
        let paths: Vec<Path> = self
            .store
            .list(Some(dir))
            .map_ok(|m| m.location)
            .try_collect()
            .await
            .map_err(|e| store_error(&format!("listing {dir}"), e))?;
        self.delete_each(&paths).await
    }

    /// Deletes each object of `paths`; one already gone is no error.
    pub(super) async fn delete_each(&self, paths: &[Path]) -> Result<()> {
        for p in paths {
            match self.store.delete(p).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(store_error(&format!("deleting {p}"), e)),
            }
        }
        Ok(())
    }

    /// Removes this server's spill files (at shutdown).
    pub async fn clear_session(&self) -> Result<()> {
        let dir = self
            .root
            .clone()
            .join("spill")
            .join(self.holder.session.as_str());
        self.delete_under(&dir).await?;
        self.spills_cleared().await;
        Ok(())
    }

    /// Every persisted dataset with a manifest, newest generation per name.
    /// A manifest that does not parse (its file damaged) is logged and left
    /// out, and so is every older generation of its dataset: serving one
    /// would serve a write that is not the last. The others are served.
    /// The generations nothing serves — older than a served one, or
    /// without a manifest — are removed, found in the same listing, so only
    /// the server holding the store ([`Store::claim`]) may ask, at start.
    pub async fn persisted(&self) -> Result<Vec<PersistedDataset>> {
        let dir = self.root.clone().join("datasets");
        let files: Vec<object_store::ObjectMeta> = self
            .store
            .list(Some(&dir))
            .try_collect()
            .await
            .map_err(|e| store_error(&format!("listing {dir} in {}", self.url), e))?;
        let manifests = files
            .iter()
            .map(|f| f.location.clone())
            .filter(|p| p.filename() == Some("manifest.json"));
        // Each served dataset beside its folder (…/datasets/NAME), the
        // newest generation per name; (folder, generation) of each damaged
        // manifest.
        let mut found: Vec<(Path, PersistedDataset)> = Vec::new();
        let mut damaged: Vec<(Path, u64)> = Vec::new();
        for path in manifests {
            let what = format!("reading {path} from {}", self.url);
            let bytes = self
                .store
                .get(&path)
                .await
                .map_err(|e| store_error(&what, e))?
                .bytes()
                .await
                .map_err(|e| store_error(&what, e))?;
            // …/datasets/NAME/GENERATION/manifest.json
            let parts: Vec<PathPart<'_>> = path.parts().collect();
            let up = |levels: usize| {
                Path::from_iter(parts[..parts.len().saturating_sub(levels)].iter().cloned())
            };
            let (dir, folder) = (up(1), up(2));
            match parse_manifest(&bytes) {
                Ok(mut ds) => {
                    ds.stored = Stored {
                        dir,
                        persisted: true,
                    };
                    match found.iter_mut().find(|(_, f)| f.name == ds.name) {
                        Some((_, f)) if f.generation < ds.generation => *f = ds,
                        Some(_) => {}
                        None => found.push((folder, ds)),
                    }
                }
                Err(e) => {
                    tracing::error!(
                        manifest = %path,
                        store = %self.url,
                        error = %e,
                        "a persisted dataset's manifest is damaged (not a flightdeck manifest): \
                         that copy is not served; write the dataset again, and remove the \
                         manifest's folder"
                    );
                    let generation = dir.filename().and_then(|g| g.parse().ok());
                    damaged.push((folder, generation.unwrap_or(u64::MAX)));
                }
            }
        }
        let mut found: Vec<PersistedDataset> = found
            .into_iter()
            .filter_map(|(folder, ds)| {
                let superseded = damaged
                    .iter()
                    .any(|(f, g)| *f == folder && *g > ds.generation);
                if superseded {
                    tracing::error!(
                        dataset = %ds.name,
                        generation = ds.generation,
                        "a persisted dataset is not served: a newer persisted copy of it is \
                         damaged, and this older one is not its last write; write the dataset \
                         again"
                    );
                }
                (!superseded).then_some(ds)
            })
            .collect();
        found.sort_by(|a, b| a.name.cmp(&b.name));
        if let Err(e) = self.remove_superseded(&dir, &files, &found).await {
            tracing::warn!(error = %e, "could not remove persisted generations that nothing serves");
        }
        Ok(found)
    }
}

/// Parquet's view of one object: ranged reads, footer by suffix.
struct ObjectReader {
    store: Arc<dyn ObjectStore>,
    path: Path,
}

fn parquet_error(e: object_store::Error) -> ParquetError {
    ParquetError::External(Box::new(e))
}

impl AsyncFileReader for ObjectReader {
    fn get_bytes(
        &mut self,
        range: std::ops::Range<u64>,
    ) -> BoxFuture<'_, parquet::errors::Result<Bytes>> {
        async move {
            self.store
                .get_range(&self.path, range)
                .await
                .map_err(parquet_error)
        }
        .boxed()
    }

    fn get_byte_ranges(
        &mut self,
        ranges: Vec<std::ops::Range<u64>>,
    ) -> BoxFuture<'_, parquet::errors::Result<Vec<Bytes>>> {
        async move {
            self.store
                .get_ranges(&self.path, &ranges)
                .await
                .map_err(parquet_error)
        }
        .boxed()
    }

    fn get_metadata<'a>(
        &'a mut self,
        options: Option<&'a ArrowReaderOptions>,
    ) -> BoxFuture<'a, parquet::errors::Result<Arc<ParquetMetaData>>> {
        async move {
            let metadata = ParquetMetaDataReader::new()
                .with_arrow_reader_options(options)
                .load_via_suffix_and_finish(self)
                .await?;
            Ok(Arc::new(metadata))
        }
        .boxed()
    }
}

impl MetadataSuffixFetch for &mut ObjectReader {
    fn fetch_suffix(&mut self, suffix: usize) -> BoxFuture<'_, parquet::errors::Result<Bytes>> {
        let options = GetOptions {
            range: Some(GetRange::Suffix(suffix as u64)),
            ..Default::default()
        };
        async move {
            let got = self
                .store
                .get_opts(&self.path, options)
                .await
                .map_err(parquet_error)?;
            got.bytes().await.map_err(parquet_error)
        }
        .boxed()
    }
}

fn schema_bytes(schema: &Schema) -> Result<Vec<u8>> {
    let msg: IpcMessage = SchemaAsIpc::new(schema, &IpcWriteOptions::default())
        .try_into()
        .map_err(|e| Error::Internal(format!("cannot encode schema: {e}")))?;
    Ok(msg.0.to_vec())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

fn partitions_json(parts: &[PartitionSummary]) -> Vec<Value> {
    parts
        .iter()
        .map(|p| {
            json!({
                "partition": p.key.partition,
                "attempt": p.key.attempt,
                "rows": p.rows,
                "bytes": p.bytes,
                "committed_attempts": p.committed_attempts,
            })
        })
        .collect()
}

fn cluster_json(cluster: Option<&ClusterState>) -> Value {
    match cluster {
        None => Value::Null,
        Some(ClusterState::Pending) => json!({ "pending": true }),
        Some(ClusterState::Member { layout, index }) => json!({
            "member": index,
            "id": layout.id,
            "fixed": layout.fixed,
            "members": layout.members.iter().map(|m| json!({
                "location": m.location,
                "generation": m.generation,
                "partitions": partitions_json(&m.partitions),
            })).collect::<Vec<_>>(),
        }),
    }
}

type Parsed<T> = std::result::Result<T, String>;

fn u(v: &Value, k: &str) -> Parsed<u64> {
    v.get(k).and_then(Value::as_u64).ok_or(format!("no '{k}'"))
}

fn parse_partitions(v: &Value) -> Parsed<Vec<PartitionSummary>> {
    v.get("partitions")
        .and_then(Value::as_array)
        .ok_or("no 'partitions'")?
        .iter()
        .map(|p| {
            let small = |k: &str| {
                u(p, k).and_then(|v| u32::try_from(v).map_err(|_| format!("'{k}' too large")))
            };
            Ok(PartitionSummary {
                key: AttemptKey {
                    partition: small("partition")?,
                    attempt: small("attempt")?,
                },
                rows: u(p, "rows")?,
                bytes: u(p, "bytes")?,
                committed_attempts: small("committed_attempts")?,
            })
        })
        .collect()
}

fn parse_cluster(v: Option<&Value>) -> Parsed<Option<ClusterState>> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    if v.get("pending").and_then(Value::as_bool) == Some(true) {
        return Ok(Some(ClusterState::Pending));
    }
    let members = v
        .get("members")
        .and_then(Value::as_array)
        .ok_or("no cluster 'members'")?
        .iter()
        .map(|m| {
            Ok(Member {
                location: m
                    .get("location")
                    .and_then(Value::as_str)
                    .ok_or("no 'location'")?
                    .to_string(),
                generation: u(m, "generation")?,
                partitions: parse_partitions(m)?,
            })
        })
        .collect::<Parsed<Vec<_>>>()?;
    let fixed = v
        .get("fixed")
        .and_then(Value::as_array)
        .ok_or("no cluster 'fixed'")?
        .iter()
        .map(|f| f.as_bool().ok_or("'fixed' holds a non-boolean".to_string()))
        .collect::<Parsed<Vec<_>>>()?;
    let layout = Layout::new(members, fixed).map_err(|e| e.to_string())?;
    if layout.id != u(v, "id")? {
        return Err("the cluster layout does not match its id".into());
    }
    let index = usize::try_from(u(v, "member")?).map_err(|e| e.to_string())?;
    Ok(Some(ClusterState::Member {
        layout: Arc::new(layout),
        index,
    }))
}

fn manifest_json(
    name: &str,
    generation: u64,
    schema: &Schema,
    parts: &[PartitionSummary],
    cluster: Option<&ClusterState>,
) -> Result<Vec<u8>> {
    let partitions = partitions_json(parts);
    let doc = json!({
        "format": MANIFEST_FORMAT,
        "dataset": name,
        "generation": generation,
        "rows": parts.iter().map(|p| p.rows).sum::<u64>(),
        "schema_ipc_hex": hex(&schema_bytes(schema)?),
        "partitions": partitions,
        "cluster": cluster_json(cluster),
    });
    serde_json::to_vec_pretty(&doc).map_err(|e| Error::Internal(format!("manifest: {e}")))
}

fn parse_manifest(bytes: &[u8]) -> std::result::Result<PersistedDataset, String> {
    let doc: Value = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    if u(&doc, "format")? != MANIFEST_FORMAT {
        return Err("unknown manifest format".into());
    }
    let name = doc
        .get("dataset")
        .and_then(Value::as_str)
        .ok_or("no 'dataset'")?
        .to_string();
    let ipc = doc
        .get("schema_ipc_hex")
        .and_then(Value::as_str)
        .and_then(unhex)
        .ok_or("no 'schema_ipc_hex'")?;
    let schema = Schema::try_from(IpcMessage(ipc.into())).map_err(|e| e.to_string())?;
    let partitions = parse_partitions(&doc)?;
    Ok(PersistedDataset {
        name,
        generation: u(&doc, "generation")?,
        schema: Arc::new(schema),
        partitions,
        stored: Stored {
            dir: Path::default(),
            persisted: true,
        },
        cluster: parse_cluster(doc.get("cluster"))?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::datatypes::{DataType, Field};

    /// Many probes of one folder at once (servers sharing a spill folder
    /// starting together) all succeed and leave nothing behind.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_write_checks_of_one_folder_all_succeed() {
        let dir = std::env::temp_dir().join(format!("flightdeck-probe-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let (store, root) = open_location(&dir.display().to_string(), true).expect("opens");
        let checks = (0..16).map(|_| check_writable(store.as_ref(), &root));
        for r in futures::future::join_all(checks).await {
            r.expect("writable");
        }
        assert_eq!(std::fs::read_dir(&dir).expect("reads").count(), 0);
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    /// A probe left by a process stopped mid-check (old) is removed by the
    /// next check; a recent one, perhaps another process's in flight, and
    /// other files are not.
    #[tokio::test]
    async fn a_write_check_removes_probes_stopped_processes_left() {
        let dir = std::env::temp_dir().join(format!("flightdeck-stale-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let old = dir.join(format!("{PROBE_PREFIX}-1-0"));
        let recent = dir.join(format!("{PROBE_PREFIX}-2-0"));
        let other = dir.join("spilled.parquet");
        for f in [&old, &recent, &other] {
            std::fs::write(f, b"flightdeck").expect("writes");
        }
        let an_hour_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
        for f in [&old, &other] {
            std::fs::File::options()
                .write(true)
                .open(f)
                .and_then(|f| f.set_modified(an_hour_ago))
                .expect("sets mtime");
        }
        let (store, root) = open_location(&dir.display().to_string(), true).expect("opens");
        check_writable(store.as_ref(), &root)
            .await
            .expect("writable");
        assert!(!old.exists(), "the stale probe is removed");
        assert!(recent.exists() && other.exists());
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    #[test]
    fn manifests_round_trip() {
        let schema = Schema::new(vec![
            Field::new("x", DataType::Float32, false),
            Field::new("name", DataType::Utf8, true),
        ]);
        let parts = vec![PartitionSummary {
            key: AttemptKey {
                partition: 0,
                attempt: 2,
            },
            rows: 10,
            bytes: 640,
            committed_attempts: 3,
        }];
        let body = manifest_json("a/b c", 7, &schema, &parts, None).expect("encodes");
        let back = parse_manifest(&body).expect("parses");
        assert_eq!(back.name, "a/b c");
        assert_eq!(back.generation, 7);
        assert_eq!(*back.schema, schema);
        assert_eq!(back.partitions, parts);
        assert!(back.cluster.is_none());
        let pending = manifest_json("a", 7, &schema, &parts, Some(&ClusterState::Pending));
        let back = parse_manifest(&pending.expect("encodes")).expect("parses");
        assert!(matches!(back.cluster, Some(ClusterState::Pending)));
        let layout = Layout::new(
            vec![
                Member {
                    location: "grpc://b:1".into(),
                    generation: 7,
                    partitions: parts.clone(),
                },
                Member {
                    location: "grpc://a:1".into(),
                    generation: 3,
                    partitions: vec![PartitionSummary {
                        key: AttemptKey {
                            partition: 1,
                            attempt: 0,
                        },
                        ..parts[0].clone()
                    }],
                },
            ],
            vec![true, false],
        )
        .expect("layout");
        let member = ClusterState::Member {
            layout: Arc::new(layout.clone()),
            index: 1,
        };
        let back = parse_manifest(
            &manifest_json("a", 7, &schema, &parts, Some(&member)).expect("encodes"),
        )
        .expect("parses");
        match back.cluster {
            Some(ClusterState::Member { layout: l, index }) => {
                assert_eq!((l.id, &l.members, index), (layout.id, &layout.members, 1));
            }
            other => panic!("cluster state lost: {other:?}"),
        }
        assert!(parse_manifest(b"{}").is_err());
        assert!(parse_manifest(b"not json").is_err());
    }

    /// One column of each kind a dataset may hold, with nulls where the
    /// type has them.
    fn every_storable_kind() -> RecordBatch {
        use arrow::array::{
            ArrayRef, BooleanArray, Int32Array, Int64Array, IntervalDayTimeArray,
            IntervalYearMonthArray, ListViewArray, MapArray, StringArray, StructArray,
        };
        use arrow::buffer::ScalarBuffer;
        use arrow::compute::cast;
        use arrow::datatypes::{IntervalDayTime, TimeUnit};
        let ints: ArrayRef = Arc::new(Int64Array::from(vec![Some(1), None, Some(3), Some(4)]));
        let words: ArrayRef = Arc::new(StringArray::from(vec![
            Some("a"),
            None,
            Some("bc"),
            Some("a"),
        ]));
        let item = |t: DataType| Arc::new(Field::new_list_field(t, true));
        // 32-bit times come from 32-bit integers.
        let cast_to = |from: &ArrayRef, t: DataType| {
            let from = match t {
                DataType::Time32(_) => cast(from, &DataType::Int32).expect("casts"),
                _ => from.clone(),
            };
            cast(&from, &t).expect("casts")
        };
        let mut columns: Vec<(&str, ArrayRef)> = vec![
            ("null", arrow::array::new_null_array(&DataType::Null, 4)),
            (
                "bool",
                Arc::new(BooleanArray::from(vec![
                    Some(true),
                    None,
                    Some(false),
                    Some(true),
                ])),
            ),
            (
                "interval_ym",
                Arc::new(IntervalYearMonthArray::from(vec![
                    Some(14),
                    None,
                    Some(-1),
                    Some(0),
                ])),
            ),
            (
                "interval_dt",
                Arc::new(IntervalDayTimeArray::from(vec![
                    Some(IntervalDayTime::new(1, 2)),
                    None,
                    Some(IntervalDayTime::new(-3, 4)),
                    None,
                ])),
            ),
            (
                "list_view",
                Arc::new(ListViewArray::new(
                    item(DataType::Int32),
                    ScalarBuffer::from(vec![0, 1, 0, 2]),
                    ScalarBuffer::from(vec![1, 2, 0, 1]),
                    Arc::new(Int32Array::from(vec![7, 8, 9])),
                    None,
                )),
            ),
            (
                "struct",
                Arc::new(StructArray::from(vec![
                    (
                        Arc::new(Field::new("i", DataType::Int64, true)),
                        ints.clone(),
                    ),
                    (
                        Arc::new(Field::new("s", DataType::Utf8, true)),
                        words.clone(),
                    ),
                ])),
            ),
            (
                "map",
                Arc::new(
                    MapArray::new_from_strings(
                        ["k", "l", "m", "n"].into_iter(),
                        &Int64Array::from(vec![1, 2, 3, 4]),
                        &[0, 1, 1, 3, 4],
                    )
                    .expect("map"),
                ),
            ),
        ];
        for (name, t) in [
            ("i8", DataType::Int8),
            ("u64", DataType::UInt64),
            ("f16", DataType::Float16),
            ("f64", DataType::Float64),
            ("ts_s", DataType::Timestamp(TimeUnit::Second, None)),
            (
                "ts_ns_tz",
                DataType::Timestamp(TimeUnit::Nanosecond, Some("Asia/Tokyo".into())),
            ),
            ("date32", DataType::Date32),
            ("date64", DataType::Date64),
            ("time32", DataType::Time32(TimeUnit::Millisecond)),
            ("time64", DataType::Time64(TimeUnit::Nanosecond)),
            ("duration", DataType::Duration(TimeUnit::Second)),
            ("decimal32", DataType::Decimal32(7, 2)),
            ("decimal64", DataType::Decimal64(12, 2)),
            ("decimal128", DataType::Decimal128(20, 2)),
            ("decimal256", DataType::Decimal256(50, 2)),
            ("list", DataType::List(item(DataType::Int64))),
            ("large_list", DataType::LargeList(item(DataType::Int64))),
            (
                "fixed_list",
                DataType::FixedSizeList(item(DataType::Int64), 1),
            ),
        ] {
            columns.push((name, cast_to(&ints, t)));
        }
        for (name, t) in [
            ("utf8", DataType::Utf8),
            ("large_utf8", DataType::LargeUtf8),
            ("utf8_view", DataType::Utf8View),
            ("binary", DataType::Binary),
            ("binary_view", DataType::BinaryView),
            (
                "dictionary",
                DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8)),
            ),
        ] {
            columns.push((name, cast_to(&words, t)));
        }
        let fields: Vec<Field> = columns
            .iter()
            .map(|(name, a)| Field::new(*name, a.data_type().clone(), true))
            .collect();
        let arrays = columns.into_iter().map(|(_, a)| a).collect();
        RecordBatch::try_new(Arc::new(Schema::new(fields)), arrays).expect("batch")
    }

    /// Columns of the kinds [`unstorable`] names, nested ones included.
    fn unstorable_kinds() -> Vec<(&'static str, arrow::array::ArrayRef)> {
        use arrow::array::{
            Int32Array, Int64Array, IntervalMonthDayNanoArray, ListArray, RunArray, StructArray,
            UnionArray,
        };
        use arrow::buffer::{NullBuffer, OffsetBuffer, ScalarBuffer};
        use arrow::datatypes::{Int32Type, IntervalMonthDayNano, UnionFields};
        let union = || {
            let fields = UnionFields::try_new(
                [0, 1],
                [
                    Field::new("i", DataType::Int64, true),
                    Field::new("f", DataType::Float64, true),
                ],
            )
            .expect("union fields");
            let children: Vec<arrow::array::ArrayRef> = vec![
                Arc::new(Int64Array::from(vec![1, 2])),
                Arc::new(arrow::array::Float64Array::from(vec![0.5, 1.5])),
            ];
            Arc::new(
                UnionArray::try_new(fields, ScalarBuffer::from(vec![0i8, 1]), None, children)
                    .expect("union"),
            ) as arrow::array::ArrayRef
        };
        vec![
            ("union", union()),
            (
                "list_of_unions",
                Arc::new(ListArray::new(
                    Arc::new(Field::new_list_field(union().data_type().clone(), true)),
                    OffsetBuffer::new(ScalarBuffer::from(vec![0, 1, 2])),
                    union(),
                    None,
                )),
            ),
            (
                "month_day_nano",
                Arc::new(IntervalMonthDayNanoArray::from(vec![
                    IntervalMonthDayNano::new(1, 2, 3),
                    IntervalMonthDayNano::new(0, 0, 0),
                ])),
            ),
            (
                "run_end",
                Arc::new(
                    RunArray::<Int32Type>::try_new(
                        &Int32Array::from(vec![2]),
                        &Int64Array::from(vec![5]),
                    )
                    .expect("runs"),
                ),
            ),
            (
                "empty_struct",
                Arc::new(StructArray::new_empty_fields(
                    2,
                    Some(NullBuffer::new_null(2)),
                )),
            ),
        ]
    }

    fn sealed(batch: RecordBatch) -> SealedData {
        SealedData::from_batches(batch.schema(), vec![], vec![batch])
    }

    /// Every kind of column the store says it holds comes back from it as
    /// it went in (type, values and nulls); a column of a kind it says it
    /// cannot hold is refused by name before anything is written — the
    /// Parquet writer would panic on a union.
    #[tokio::test]
    async fn the_store_gives_back_what_it_holds_and_refuses_the_rest_by_name() {
        let store = Store::open("memory://").expect("opens");
        let batch = every_storable_kind();
        assert_eq!(unstorable_column(&batch.schema()), None);
        let stored = store
            .write("kinds", 1, &sealed(batch.clone()), None)
            .await
            .expect("writes");
        let back: Vec<RecordBatch> = store
            .read("kinds", &stored, batch.schema())
            .await
            .expect("reads")
            .try_collect()
            .await
            .expect("reads back");
        assert_eq!(back, vec![batch]);

        for (name, column) in unstorable_kinds() {
            let id: arrow::array::ArrayRef = Arc::new(arrow::array::Int64Array::from_iter_values(
                0..column.len() as i64,
            ));
            let batch = RecordBatch::try_from_iter([("id", id), (name, column)]).expect("batch");
            let said = unstorable_column(&batch.schema()).expect("unstorable").0;
            assert!(said.starts_with(&format!("column '{name}' ")), "{said}");
            let err = store
                .write(name, 1, &sealed(batch), None)
                .await
                .expect_err(name);
            assert!(matches!(err, Error::FailedPrecondition(_)), "{err}");
            assert!(err.to_string().contains(&said), "{err}");
        }
        let files: Vec<_> = store
            .store
            .list(None)
            .try_filter(|f| std::future::ready(f.location.filename() != Some("server.json")))
            .try_collect()
            .await
            .expect("lists");
        assert_eq!(files.len(), 1, "only the storable batch's file: {files:?}");
    }

    /// Whether Parquet gives `batch` back as it was written: false on an
    /// error, a panic, or another type read back.
    fn parquet_round_trips(batch: &RecordBatch) -> bool {
        use parquet::arrow::ArrowWriter;
        use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
        let back = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut file = Vec::new();
            let mut writer = ArrowWriter::try_new(&mut file, batch.schema(), None).ok()?;
            writer.write(batch).ok()?;
            writer.close().ok()?;
            let reader = ParquetRecordBatchReaderBuilder::try_new(Bytes::from(file))
                .ok()?
                .build()
                .ok()?;
            reader.collect::<std::result::Result<Vec<_>, _>>().ok()
        }));
        matches!(back, Ok(Some(ref got)) if got == std::slice::from_ref(batch))
    }

    /// Each kind [`unstorable`] names is one Parquet cannot take back as
    /// it was given, so the list refuses nothing the store could hold.
    #[test]
    fn parquet_cannot_round_trip_any_kind_called_unstorable() {
        assert!(parquet_round_trips(&every_storable_kind()));
        for (name, column) in unstorable_kinds() {
            let batch = RecordBatch::try_from_iter([(name, column)]).expect("batch");
            assert!(
                !parquet_round_trips(&batch),
                "{name} round-trips through Parquet: the store could hold it"
            );
        }
    }

    /// A dataset's folder is its encoded name while that fits a file
    /// system's 255-byte names, and a cut of it with the name's hash after;
    /// names that share the cut still get folders of their own.
    #[test]
    fn folders_fit_a_file_system_whatever_the_name() {
        assert_eq!(folder("clicks").as_ref(), "clicks");
        assert_eq!(folder("a/b").as_ref(), "a%2Fb");
        assert_eq!(folder("..").as_ref(), "%2E%2E");
        let a200 = "a".repeat(200);
        assert_eq!(folder(&a200).as_ref(), a200, "fits as it is");
        let long = [
            "é".repeat(127) + "x",
            "é".repeat(127) + "y",
            "/".repeat(256),
            "a".repeat(201),
            format!("{}{}", "a".repeat(180), "é".repeat(30)),
        ];
        let folders: Vec<String> = long
            .iter()
            .map(|n| folder(n).as_ref().to_string())
            .collect();
        for (name, f) in long.iter().zip(&folders) {
            assert!(f.len() <= MAX_FOLDER, "{} bytes: {f}", f.len());
            assert!(
                f.len() >= MAX_FOLDER - 20,
                "cut no shorter than needed: {f}"
            );
            let (cut, hash) = f.rsplit_once("-h").expect("hashed");
            assert_eq!(hash.len(), 16);
            assert!(!cut.ends_with('%') && PathPart::parse(f).is_ok(), "{f}");
            assert_eq!(folder(name).as_ref(), f, "the same every time");
        }
        assert_ne!(folders[0], folders[1]);
    }

    #[test]
    fn plain_paths_and_bad_urls() {
        assert!(Store::open("memory://").is_ok());
        assert!(Store::open("relative/dir").is_ok());
        let err = Store::open("nosuch://x/y").expect_err("unknown scheme");
        assert!(err.to_string().contains("--spill-url"), "{err}");
    }
}
