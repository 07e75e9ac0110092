//! The server's state and the tier policy that ties the catalog to memory:
//! copying ingest into the arena, spilling least-recently-read datasets when
//! the budget is full, bringing spilled datasets back on read, persisting at
//! seal, reloading at start, and device placements.
//!
//! The catalog stays pure; everything here that waits (store I/O) happens
//! outside its lock.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use arrow::array::RecordBatch;
use arrow::buffer::Buffer;
use arrow::datatypes::Schema;
use futures::TryStreamExt;
use tracing::{info, warn};

use flightdeck_protos::{self as pb, actions};

use crate::catalog::{
    Catalog, ClusterState, DatasetSummary, SealRequest, SealedData, SealedView, same_fields,
};
use crate::cluster::peer::Peers;
use crate::cluster::{Layout, Member};
use crate::config::{ServerConfig, show_age, show_size};
use crate::convert::{self, PlaceRequest};
use crate::error::{Error, Result};
use crate::memory::arena::{Arena, ArenaStats, HostMemory, slab_bytes_for};
use crate::memory::device::{CudaHost, DevicePlacement, column_segments};
use crate::memory::spill::{Store, unstorable_column};
use crate::memory::{Budget, Reservation};
use crate::query::{Filter, Selection};

/// Columns of one dataset generation on each device.
type Placements = BTreeMap<(String, u64), Vec<Arc<DevicePlacement>>>;

/// What `stats` reports about the tiers.
#[derive(Debug, Clone, Default)]
pub struct TierStats {
    /// The host arena.
    pub arena: ArenaStats,
    /// Budget bytes in use and the limit.
    pub budget_used: u64,
    /// The limit.
    pub budget_limit: u64,
    /// The most budget bytes in use at once since start.
    pub budget_peak: u64,
    /// Device bytes over all placements.
    pub device_bytes: u64,
    /// Spills and restores since start.
    pub spills: u64,
    /// Restores since start.
    pub restores: u64,
    /// The store URL.
    pub spill_url: String,
    /// Whether sealed datasets are persisted.
    pub persist: bool,
    /// CUDA devices visible (0 without a driver).
    pub cuda_devices: u32,
}

/// The one schema every member's prepare reply carries; a member holding
/// another schema is `FAILED_PRECONDITION`, naming both.
fn one_schema(name: &str, replies: &[(&str, pb::MemberPrepared)]) -> Result<Schema> {
    let Some((first_location, first)) = replies.first() else {
        return Err(Error::invalid(format!(
            "seal of dataset '{name}' names no member holding a partition"
        )));
    };
    let schema = convert::schema_from_ipc(&first.schema, "a member's prepare reply")?;
    for (location, p) in &replies[1..] {
        let other = convert::schema_from_ipc(&p.schema, "a member's prepare reply")?;
        if !same_fields(&schema, &other) {
            return Err(Error::FailedPrecondition(format!(
                "cannot seal dataset '{name}': members {first_location} and {location} hold \
                 different schemas ({} and {}); drop the dataset and write it again",
                crate::catalog::describe_fields(&schema),
                crate::catalog::describe_fields(&other)
            )));
        }
    }
    Ok(schema)
}

/// Refuses a cluster seal whose members did not prepare exactly the
/// winners it named for them: a member whose dataset another write sealed
/// or replaced while this seal prepared it answers with that write's
/// partitions, and a layout built from them would take two writes' rows (or
/// name a partition twice).
fn as_named(
    name: &str,
    named: &[&(String, Vec<crate::catalog::AttemptKey>)],
    replies: &[(&str, pb::MemberPrepared)],
) -> Result<()> {
    for ((location, winners), (_, reply)) in named.iter().zip(replies) {
        let mut want: Vec<(u32, u32)> = winners.iter().map(|k| (k.partition, k.attempt)).collect();
        let mut have: Vec<(u32, u32)> = reply
            .partitions
            .iter()
            .map(|p| (p.partition, p.attempt))
            .collect();
        want.sort_unstable();
        have.sort_unstable();
        if want != have {
            return Err(Error::FailedPrecondition(format!(
                "cannot seal dataset '{name}': member {location} prepared other partitions than \
                 the seal named for it ({} of them, not {}) — another write sealed or replaced \
                 the dataset there meanwhile; one job writes a dataset at a time: seal again, \
                 or drop the dataset and write it again",
                have.len(),
                want.len()
            )));
        }
    }
    Ok(())
}

/// Refuses a cluster seal whose members hold attempts of different writes
/// (one member's part was dropped and written by another job meanwhile):
/// the layout would take partitions of two jobs. Members whose writes are
/// not known (written without write ids, restored) are not compared.
fn one_write(name: &str, replies: &[(&str, pb::MemberPrepared)]) -> Result<()> {
    let mut first: Option<(&str, &str)> = None;
    for (location, p) in replies {
        for write in &p.writes {
            match first {
                None => first = Some((location, write)),
                Some((_, w)) if w == write => {}
                Some((at, w)) => {
                    return Err(Error::FailedPrecondition(format!(
                        "cannot seal dataset '{name}': member {at} holds attempts of write \
                         '{w}' and member {location} of write '{write}' (two jobs wrote it, or \
                         it was dropped on a member and written again meanwhile); nothing was \
                         sealed — drop the dataset and write it again"
                    )));
                }
            }
        }
    }
    Ok(())
}

/// How many times a read brings a dataset back from the store when a drop
/// or a new write keeps replacing it under the read.
const RESTORE_TRIES: u32 = 4;

/// Most datasets one attempt to make room tries to spill when the store
/// fails to take them (each a write that failed).
const SPILL_TRIES: usize = 3;

/// The refusal when making room failed because the store took none of the
/// datasets tried (`failed`, in the order tried); `None` when none was.
fn spill_failed(failed: &[(String, Error)]) -> Option<Error> {
    let ((first, e), others) = failed.split_first()?;
    let also: String = others
        .iter()
        .map(|(name, e)| format!("; spilling dataset '{name}' failed too: {e}"))
        .collect();
    Some(Error::ResourceExhausted(format!(
        "the memory budget is full and spilling dataset '{first}' failed: {e}; make room in the \
         spill store (--spill-url) or drop datasets that are no longer needed (`flightdeck drop \
         NAME`), then retry{also}"
    )))
}

/// How often a writer waiting for memory looks again.
const ADMISSION_POLL: std::time::Duration = std::time::Duration::from_millis(20);

/// The error for reading a dataset whose cluster seal is unfinished here.
pub fn unfinished_seal(name: &str) -> Error {
    Error::FailedPrecondition(format!(
        "dataset '{name}' is being sealed across members and this member has not adopted its \
         layout yet; send the seal again to finish it"
    ))
}

/// Rows and IPC body bytes streamed by this server, for `stats`.
#[derive(Debug, Default)]
pub struct Traffic {
    /// To ranks reading from this server.
    pub rows_served: AtomicU64,
    /// Bytes of those.
    pub bytes_served: AtomicU64,
    /// To other members (rows they fetch for their ranks).
    pub rows_to_peers: AtomicU64,
    /// Bytes of those.
    pub bytes_to_peers: AtomicU64,
    /// From other members, for this server's ranks.
    pub rows_from_peers: AtomicU64,
    /// Bytes of those.
    pub bytes_from_peers: AtomicU64,
}

/// Rows and IPC body bytes of one stream.
#[derive(Debug, Default)]
pub struct Tally {
    /// Rows encoded.
    pub rows: AtomicU64,
    /// Bytes of their IPC bodies.
    pub bytes: AtomicU64,
}

impl Traffic {
    /// Adds `rows` and `bytes` to a pair of counters.
    pub fn add(rows_counter: &AtomicU64, bytes_counter: &AtomicU64, rows: u64, bytes: u64) {
        rows_counter.fetch_add(rows, Ordering::Relaxed);
        bytes_counter.fetch_add(bytes, Ordering::Relaxed);
    }
}

/// State shared by all requests of one server.
#[derive(Debug)]
pub struct State {
    catalog: Mutex<Catalog>,
    arena: Arc<Arena>,
    store: Store,
    cuda: Option<CudaHost>,
    placements: Mutex<Placements>,
    /// One spill at a time: two writers short of memory must not both write
    /// the same victim.
    spill_lock: tokio::sync::Mutex<()>,
    /// Held by the writer whose reservation is being made: writers that
    /// said their size are admitted in the order they asked (tokio's mutex
    /// is fair).
    admission: tokio::sync::Mutex<()>,
    /// One restore at a time: two readers of a spilled dataset must not both
    /// load it. (A restore may spill others; a spill never restores.)
    restore_lock: tokio::sync::Mutex<()>,
    spills: AtomicU64,
    restores: AtomicU64,
    /// Training jobs since start.
    pub(crate) jobs: crate::jobs::Jobs,
    /// The configuration the server runs with.
    pub config: ServerConfig,
    /// Where other members and ranks reach this server (`--advertise`).
    pub location: String,
    /// Connections to other members.
    pub peers: Arc<Peers>,
    /// What this server streamed.
    pub traffic: Arc<Traffic>,
    /// The tokens callers must send (`--auth-token-file`), the TLS
    /// certificate and the roots members are checked against, as last read
    /// from their files ([`State::refresh_credentials`]).
    pub credentials: Arc<crate::credentials::Credentials>,
    /// What read streams may hold ahead of their sockets
    /// (`--read-ahead-memory`).
    pub read_ahead: Arc<crate::service::outbox::ReadAhead>,
    /// What the server did, for `/metrics` and the calls' log lines.
    pub metrics: Arc<crate::metrics::Metrics>,
    /// Set on SIGTERM/SIGINT: new calls are refused while the ones in
    /// flight finish.
    draining: std::sync::atomic::AtomicBool,
}

impl State {
    /// State for `config`, reachable at `location`: opens the store, probes
    /// the CUDA driver, and with `persist` reloads the datasets an earlier
    /// run sealed.
    pub async fn open(config: ServerConfig, location: String) -> Result<Self> {
        let credentials = Arc::new(crate::credentials::Credentials::open(&config)?);
        let store = Store::open(&config.spill_url())?.serving_at(&location);
        store.check_writable().await.map_err(|e| match e {
            // The store the user did not name: say which flag placed it.
            Error::InvalidArgument(m) if config.spill_url.is_none() => Error::invalid(format!(
                "{m} (the store under --data-dir '{}': give a --data-dir this server may \
                 write, or a --spill-url)",
                config.data_dir.display()
            )),
            e => e,
        })?;
        let cuda = if config.use_cuda {
            CudaHost::probe()
        } else {
            None
        };
        let source = match &cuda {
            Some(host) => HostMemory::Pinned(host.clone()),
            None => HostMemory::Heap,
        };
        let slab = config
            .slab_bytes
            .unwrap_or_else(|| slab_bytes_for(config.memory_limit));
        let budget = Budget::new(config.memory_limit);
        let config_read_ahead = config.read_ahead_bytes();
        let mut catalog = if config.persist {
            Catalog::persisting()
        } else {
            Catalog::new()
        };
        if config.persist {
            // One server a store: two would number generations alike and
            // write over each other's datasets.
            store.claim().await?;
            for ds in store.persisted().await? {
                info!(dataset = %ds.name, generation = ds.generation, "reloaded persisted dataset");
                catalog.insert_persisted(ds)?;
            }
        }
        info!(
            spill_url = store.url(),
            persist = config.persist,
            pinned = cuda.is_some(),
            slab_bytes = slab,
            "memory tiers ready"
        );
        Ok(Self {
            catalog: Mutex::new(catalog),
            arena: Arc::new(Arena::new(budget, slab, source)),
            store,
            cuda,
            placements: Mutex::new(BTreeMap::new()),
            spill_lock: tokio::sync::Mutex::new(()),
            admission: tokio::sync::Mutex::new(()),
            restore_lock: tokio::sync::Mutex::new(()),
            spills: AtomicU64::new(0),
            restores: AtomicU64::new(0),
            jobs: crate::jobs::Jobs::default(),
            config,
            location,
            peers: Arc::new(Peers::new(credentials.clone())),
            credentials,
            traffic: Arc::new(Traffic::default()),
            read_ahead: crate::service::outbox::ReadAhead::new(config_read_ahead),
            metrics: Arc::default(),
            draining: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Reads the credential files again and takes what changed
    /// ([`crate::credentials::Credentials::refresh`]): calls check the new
    /// tokens, new connections get the new certificate, and calls to other
    /// members carry the new token and check them against the new roots.
    pub fn refresh_credentials(&self) -> crate::credentials::Refreshed {
        let refreshed = self.credentials.refresh();
        let taken = [refreshed.tokens, refreshed.identity, refreshed.roots];
        self.metrics.credentials_read(
            taken.iter().filter(|t| **t).count(),
            refreshed.refused.len(),
        );
        refreshed
    }

    /// The catalog, locked. Catalog operations do not panic; if one ever did,
    /// the catalog is still consistent (each operation validates before it
    /// mutates), so a poisoned lock is taken over rather than spread.
    pub fn catalog(&self) -> MutexGuard<'_, Catalog> {
        self.catalog.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn placements(&self) -> MutexGuard<'_, Placements> {
        self.placements.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The host arena.
    pub fn arena(&self) -> &Arc<Arena> {
        &self.arena
    }

    /// The CUDA driver, when present and enabled.
    pub fn cuda(&self) -> Option<&CudaHost> {
        self.cuda.as_ref()
    }

    /// The start of the error of a call that needs a GPU on a server that
    /// has none: whether the machine has no driver or it was turned off.
    pub fn no_cuda(&self) -> &'static str {
        if self.config.use_cuda {
            "no CUDA driver on this server"
        } else {
            "no CUDA driver on this server (it was started with --no-cuda)"
        }
    }

    /// Runs `attempt` (an arena allocation) until it fits: when the budget
    /// is full (idle slabs already given back), packed copies are given up
    /// and least-recently-read sealed datasets (other than `except`) are
    /// spilled one by one; when nothing is left to spill it waits for memory
    /// given back until `until` (none: not at all), then the arena's
    /// `ResourceExhausted` stands, naming the datasets that hold memory no
    /// spill can free (written, never sealed).
    async fn with_room<T>(
        &self,
        except: Option<&str>,
        until: Option<tokio::time::Instant>,
        mut attempt: impl FnMut() -> Result<T>,
    ) -> Result<T> {
        loop {
            match attempt() {
                Err(Error::ResourceExhausted(msg)) => {
                    if self.spill_one(except).await? {
                        continue;
                    }
                    if until.is_some_and(|t| tokio::time::Instant::now() < t) {
                        tokio::time::sleep(ADMISSION_POLL).await;
                        continue;
                    }
                    let wait = self.config.admission_wait;
                    let waited = if until.is_some() && !wait.is_zero() {
                        format!("after waiting {wait:?} for memory (--admission-wait): ")
                    } else {
                        String::new()
                    };
                    let held = self.unspillable_note();
                    return Err(Error::ResourceExhausted(format!("{waited}{msg}{held}")));
                }
                other => return other,
            }
        }
    }

    /// Copies `batch` into the arena, drawing on `reservation` first, making
    /// room as `State::with_room` does.
    pub async fn admit(
        &self,
        batch: &RecordBatch,
        except: Option<&str>,
        mut reservation: Option<&mut Reservation>,
        what: &(dyn Fn() -> String + Sync),
    ) -> Result<(RecordBatch, u64)> {
        self.with_room(except, None, || {
            self.arena
                .copy_batch_in(batch, reservation.as_deref_mut(), what)
        })
        .await
    }

    /// Sets `bytes` of the budget aside for one writer that said its size:
    /// spills what it can to make room, then waits (first come, first
    /// served among such writers) up to `--admission-wait` for memory that
    /// others give back, and fails with `ResourceExhausted` when none came.
    pub async fn reserve(
        &self,
        bytes: u64,
        what: &(dyn Fn() -> String + Sync),
    ) -> Result<Reservation> {
        let budget = self.arena.budget().clone();
        if bytes > budget.limit() {
            return Err(Error::ResourceExhausted(format!(
                "{} says it will send {bytes} bytes, more than the whole memory budget ({} \
                 bytes); split it into smaller partitions or start the server with a larger \
                 --memory-limit",
                what(),
                budget.limit()
            )));
        }
        self.wait_for_room(bytes, None, what).await
    }

    /// Sets `bytes` (at most the budget) aside: spills what it can to make
    /// room, then waits in turn with writers that said their size, up to
    /// `--admission-wait`, for memory that others give back. `except` is
    /// not spilled (the dataset the memory is for).
    async fn wait_for_room(
        &self,
        bytes: u64,
        except: Option<&str>,
        what: &(dyn Fn() -> String + Sync),
    ) -> Result<Reservation> {
        let budget = self.arena.budget().clone();
        let deadline = tokio::time::Instant::now() + self.config.admission_wait;
        let _turn = tokio::time::timeout_at(deadline, self.admission.lock())
            .await
            .map_err(|_| self.not_admitted(bytes, true, what))?;
        loop {
            match budget.try_reserve(bytes, what) {
                Ok(r) => return Ok(r),
                Err(Error::ResourceExhausted(_)) => {}
                Err(e) => return Err(e),
            }
            // Idle slabs are charged to the budget: give them back first.
            self.arena.trim();
            if let Ok(r) = budget.try_reserve(bytes, what) {
                return Ok(r);
            }
            if self.spill_one(except).await? {
                continue;
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(self.not_admitted(bytes, false, what));
            }
            tokio::time::sleep(ADMISSION_POLL).await;
        }
    }

    /// The refusal of `bytes` for `what` after `--admission-wait`: no room
    /// came, or (`queued`) calls ahead of it waited for memory all along.
    fn not_admitted(&self, bytes: u64, queued: bool, what: &dyn Fn() -> String) -> Error {
        let budget = self.arena.budget();
        let waited = if queued {
            format!(
                "waited {:?} behind other calls waiting for memory (first come, first served; \
                 the budget has {} of {} free)",
                self.config.admission_wait,
                budget.free(),
                budget.limit()
            )
        } else {
            format!(
                "the memory budget had only {} of {} free after waiting {:?}",
                budget.free(),
                budget.limit(),
                self.config.admission_wait
            )
        };
        Error::ResourceExhausted(format!(
            "{} needs {bytes} bytes and {waited}; retry later, drop datasets that are no longer \
             needed, or start the server with a larger --memory-limit (or a longer \
             --admission-wait){}",
            what(),
            self.unspillable_note(),
        ))
    }

    /// What a refusal for memory adds about the datasets holding memory no
    /// spill can free (see [`unsealed_text`] and [`unspillable_text`]).
    fn unspillable_note(&self) -> String {
        let catalog = self.catalog();
        unsealed_text(&catalog.unsealed_holders())
            + &unspillable_text(&catalog.unspillable_holders())
    }

    /// [`Arena::copy_body`] for a writer's message body, making room as
    /// [`State::admit`] does.
    ///
    /// [`Arena::copy_body`]: crate::memory::arena::Arena::copy_body
    pub async fn land_body(
        &self,
        body: &[u8],
        mut reservation: Option<&mut Reservation>,
        what: &(dyn Fn() -> String + Sync),
    ) -> Result<(Buffer, u64)> {
        self.with_room(None, None, || {
            self.arena.copy_body(body, reservation.as_deref_mut(), what)
        })
        .await
    }

    /// Makes room: gives up a packed copy of rows (no data lost) or else
    /// spills the least-recently-read resident sealed dataset; false when
    /// there is neither. A dataset the store fails to take is passed over
    /// for the next (a smaller one may fit where it did not), up to
    /// [`SPILL_TRIES`] datasets; when none is taken the error names the
    /// first failure, and the others after it.
    async fn spill_one(&self, except: Option<&str>) -> Result<bool> {
        let _one = self.spill_lock.lock().await;
        let started = std::time::Instant::now();
        // Packed copies go first: giving one up loses no data.
        let packed = self.catalog().give_up_packed(except);
        if packed > 0 {
            info!(bytes = packed, "gave up a packed copy to make room");
            return Ok(true);
        }
        let mut failed: Vec<(String, Error)> = Vec::new();
        let found = loop {
            let tried: Vec<String> = failed.iter().map(|(name, _)| name.clone()).collect();
            let Some(victim) = self.catalog().spill_candidate(except, &tried) else {
                break None;
            };
            if let Some(stored) = victim.stored.clone() {
                break Some((victim, stored));
            }
            match self
                .store
                .write(&victim.name, victim.generation, &victim.data, None)
                .await
            {
                Ok(stored) => break Some((victim, stored)),
                Err(e) => {
                    warn!(dataset = %victim.name, error = %e, "could not spill dataset to the store");
                    failed.push((victim.name, e));
                    if failed.len() == SPILL_TRIES {
                        break None;
                    }
                }
            }
        };
        let Some((victim, stored)) = found else {
            return spill_failed(&failed).map_or(Ok(false), Err);
        };
        if victim.stored.is_none()
            && !self
                .catalog()
                .set_stored(&victim.name, victim.generation, stored.clone())
        {
            // Dropped while being written: nothing to keep.
            self.delete_quietly(&stored).await;
            return Ok(true);
        }
        self.catalog().release_host(&victim.name, victim.generation);
        self.spills.fetch_add(1, Ordering::Relaxed);
        self.metrics.spilled(started.elapsed());
        info!(
            dataset = %victim.name,
            rows = victim.data.rows(),
            persisted = stored.persisted,
            "spilled dataset to the store"
        );
        Ok(true)
    }

    async fn delete_quietly(&self, stored: &crate::memory::spill::Stored) {
        if let Err(e) = self.store.delete(stored).await {
            warn!(error = %e, "could not delete stored files");
        }
    }

    /// Refuses to read a dataset whose cluster seal is unfinished here.
    pub fn readable(&self, name: &str) -> Result<()> {
        match self.catalog().describe(name)?.cluster {
            Some(ClusterState::Pending) => Err(unfinished_seal(name)),
            _ => Ok(()),
        }
    }

    /// The rows of sealed dataset `name`, brought back from the store when
    /// spilled; marks it read.
    ///
    /// A drop or a new write may delete the files being read back (or
    /// replace the generation) meanwhile: the dataset is then looked up
    /// again, so the caller gets what it is now — `NotFound`, another
    /// generation (which a read planned on the old one refuses as written
    /// again), or its rows — and a store failure is reported only while the
    /// files read are still the dataset's.
    pub async fn resident(&self, name: &str) -> Result<(u64, Arc<SealedData>)> {
        for tries in 1..=RESTORE_TRIES {
            let view = self.catalog().lookup(name)?;
            if let SealedView::Resident { generation, data } = view {
                self.catalog().touch(name);
                return Ok((generation, data));
            }
            // Another reader may be restoring it: wait, then look again.
            let _one = self.restore_lock.lock().await;
            let view = self.catalog().lookup(name)?;
            let (generation, stored, schema, winners) = match view {
                SealedView::Resident { generation, data } => {
                    self.catalog().touch(name);
                    return Ok((generation, data));
                }
                SealedView::Stored {
                    generation,
                    stored,
                    schema,
                    winners,
                } => (generation, stored, schema, winners),
            };
            let started = std::time::Instant::now();
            match self.bring_back(name, &stored, schema, winners).await {
                Ok(data) => {
                    let restored = self.catalog().restore(name, generation, data);
                    if let Some(data) = restored {
                        self.catalog().touch(name);
                        self.restores.fetch_add(1, Ordering::Relaxed);
                        self.metrics.restored(started.elapsed());
                        info!(dataset = %name, rows = data.rows(), "brought dataset back from the store");
                        return Ok((generation, data));
                    }
                    // Dropped or written again meanwhile: look again.
                }
                Err(e) if tries == RESTORE_TRIES || self.still_stored(name, generation) => {
                    return Err(e);
                }
                // Its files went with a drop or a new write: look again.
                Err(_) => {}
            }
        }
        Err(Error::DatasetNotFound {
            dataset: name.to_string(),
        })
    }

    /// Whether generation `generation` of `name` is still the one in the
    /// store (not dropped, written again or brought back meanwhile).
    fn still_stored(&self, name: &str, generation: u64) -> bool {
        matches!(
            self.catalog().lookup(name),
            Ok(SealedView::Stored { generation: g, .. }) if g == generation
        )
    }

    /// Reads a spilled dataset's batches back from the store into the arena.
    async fn bring_back(
        &self,
        name: &str,
        stored: &crate::memory::spill::Stored,
        schema: arrow::datatypes::SchemaRef,
        winners: Vec<crate::catalog::AttemptKey>,
    ) -> Result<SealedData> {
        let what = || format!("bringing dataset '{name}' back from the store");
        let need = self
            .catalog()
            .describe(name)
            .map_or(0, |d| d.partitions.iter().map(|p| p.bytes).sum::<u64>());
        let limit = self.arena.budget().limit();
        if need > limit {
            return Err(Error::ResourceExhausted(format!(
                "dataset '{name}' needs {need} bytes in memory to be read, more than the whole \
                 memory budget ({limit} bytes); start the server with a larger --memory-limit"
            )));
        }
        // Under passing pressure (other readers still holding datasets
        // spilled for room, writers about to seal) a batch that finds no
        // room waits for memory given back, up to `--admission-wait`.
        let until = Some(tokio::time::Instant::now() + self.config.admission_wait);
        let mut stream = self.store.read(name, stored, schema.clone()).await?;
        let mut batches = Vec::new();
        while let Some(batch) = stream.try_next().await? {
            let copy = || self.arena.copy_batch_in(&batch, None, &what);
            batches.push(self.with_room(Some(name), until, copy).await?.0);
        }
        Ok(SealedData::from_batches(schema, winners, batches))
    }

    /// The rows of `data` (generation of dataset `dataset` in memory) that
    /// the SQL condition `filter` selects, made once per generation and
    /// filter (off the reactor) and kept; `None` for an empty filter. Their
    /// memory is made room for as a sized writer's is: other datasets
    /// spill, then it waits up to `--admission-wait`.
    pub async fn selection(
        &self,
        data: &Arc<SealedData>,
        filter: &str,
        dataset: &str,
    ) -> Result<Option<Arc<Selection>>> {
        if filter.is_empty() {
            return Ok(None);
        }
        if let Some(hit) = data.selections().get(filter) {
            return Ok(Some(hit));
        }
        let rows = {
            let (data, filter, dataset) = (data.clone(), filter.to_string(), dataset.to_string());
            tokio::task::spawn_blocking(move || {
                let compiled = Filter::compile(data.schema(), &filter, &dataset)?;
                Selection::select(&data, &compiled, &dataset)
            })
            .await
            .map_err(|e| Error::Internal(format!("selecting rows failed: {e}")))??
        };
        let what = || Selection::what(filter, dataset);
        let mut room = self
            // (Ids are taken in 64-byte units.)
            .wait_for_room(8 * rows.len() as u64 + 64, Some(dataset), &what)
            .await?;
        let selection = Selection::keep(rows, &self.arena, Some(&mut room), &what)?;
        Ok(Some(data.selections().keep(filter, dataset, selection)))
    }

    /// Seals a dataset; with `persist`, writes it to the store before
    /// answering, so a restart keeps it. A seal naming members seals the
    /// dataset across them (`State::seal_cluster`).
    pub async fn seal(&self, req: &SealRequest) -> Result<pb::DatasetInfo> {
        if !req.members.is_empty() {
            return self.seal_cluster(req).await;
        }
        if !req.replace_write.is_empty() {
            return self
                .seal_replacing(req)
                .await
                .and_then(|s| convert::dataset_info(&s));
        }
        let (summary, freed) = self.catalog().seal(req)?;
        self.sealed(summary, freed)
            .await
            .and_then(|s| convert::dataset_info(&s))
    }

    /// Seals what write `req.replace_write` staged and puts it in the
    /// dataset's place at once (one lock: no reader sees neither); then the
    /// replaced dataset's device copies, files and other members' parts go.
    async fn seal_replacing(&self, req: &SealRequest) -> Result<DatasetSummary> {
        let name = req.dataset.as_str();
        let staged = SealRequest {
            dataset: crate::catalog::staged_key(name, &req.replace_write),
            replace_write: String::new(),
            ..req.clone()
        };
        let (summary, replaced, freed) = {
            let mut catalog = self.catalog();
            if !catalog.holds(&staged.dataset) {
                return Err(crate::catalog::nothing_staged(name, &req.replace_write));
            }
            let (_, freed) = catalog.seal(&staged)?;
            let (summary, replaced) = catalog.swap_in(name, &req.replace_write)?;
            (summary, replaced, freed)
        };
        // Persisted (newer generation) before the old files go, so a
        // restart in between brings back the new dataset.
        let sealed = self.sealed(summary, freed).await;
        let elsewhere = self.replaced(name, replaced).await;
        self.drop_elsewhere(name, &elsewhere).await;
        sealed
    }

    /// After `old` gave way to a new dataset of the same name: drops its
    /// device copies and stored files; returns the other members of its
    /// cluster layout, if it had one (they still hold their parts of it).
    async fn replaced(&self, name: &str, old: Option<DatasetSummary>) -> Vec<String> {
        let Some(old) = old else {
            return Vec::new();
        };
        self.placements()
            .retain(|(n, g), _| !(n == name && *g == old.generation));
        if let Some(stored) = &old.stored {
            self.delete_quietly(stored).await;
        }
        info!(dataset = %name, rows = old.rows, generation = old.generation, "replaced dataset");
        match &old.cluster {
            Some(ClusterState::Member { layout, index }) => {
                layout.others(*index).map(|m| m.location.clone()).collect()
            }
            _ => Vec::new(),
        }
    }

    /// Drops `name` on each of `members` (their part of a replaced cluster
    /// dataset); a member that cannot be reached keeps its part, which a
    /// warning names (its plans are refused: it holds another layout).
    async fn drop_elsewhere(&self, name: &str, members: &[String]) {
        let body = pb::DropDataset {
            dataset: name.to_string(),
            ..Default::default()
        };
        for (location, e) in self.drop_parts(members.iter(), body).await {
            warn!(
                dataset = %name,
                member = %location,
                error = %e,
                "could not drop the replaced dataset's part on a member; drop it there"
            );
        }
    }

    /// Sends `body` as a member-only `drop` to each of `members` at once;
    /// returns the members that failed and why (one that no longer holds
    /// the dataset has nothing left to drop).
    async fn drop_parts<'a>(
        &self,
        members: impl Iterator<Item = &'a String>,
        body: pb::DropDataset,
    ) -> Vec<(&'a String, Error)> {
        let body = pb::DropDataset {
            member_only: true,
            ..body
        };
        let name = body.dataset.as_str();
        let replies = futures::future::join_all(members.map(|location| {
            let body = body.clone();
            async move {
                let reply = self
                    .peers
                    .action::<pb::DatasetInfo>(location, name, actions::DROP, body)
                    .await;
                (location, reply)
            }
        }))
        .await;
        replies
            .into_iter()
            .filter_map(|(location, reply)| match reply {
                Ok(_) => None,
                Err(Error::FailedPrecondition(msg)) if msg.contains("no longer holds") => None,
                Err(e) => Some((location, e)),
            })
            .collect()
    }

    /// The members of the cluster layout `name` belongs to here, if any.
    fn layout_locations(&self, name: &str) -> Vec<String> {
        match self.catalog().describe(name).map(|s| s.cluster) {
            Ok(Some(ClusterState::Member { layout, .. })) => {
                layout.members.iter().map(|m| m.location.clone()).collect()
            }
            _ => Vec::new(),
        }
    }

    /// After a local seal: logs it and, with `persist`, writes the dataset.
    async fn sealed(&self, summary: DatasetSummary, freed: u64) -> Result<DatasetSummary> {
        // What a replacing write staged is logged under its dataset's name.
        let (dataset, write) =
            crate::catalog::staged_parts(&summary.name).unwrap_or((summary.name.as_str(), ""));
        info!(
            dataset = %dataset,
            partitions = summary.partitions.len(),
            rows = summary.rows,
            bytes = summary.bytes,
            freed,
            replacing_write = %write,
            "sealed dataset"
        );
        if !self.config.persist || summary.stored.is_some() {
            if let Some((column, _)) = unstorable_column(&summary.schema) {
                warn!(
                    dataset = %dataset,
                    "dataset cannot spill: {column}, which the store (Parquet) cannot hold; it \
                     stays in memory until dropped"
                );
            }
            return Ok(summary);
        }
        let (generation, data) = self.catalog().sealed(&summary.name)?;
        let stored = self
            .store
            .write(
                &summary.name,
                generation,
                &data,
                Some((&summary.partitions, summary.cluster.as_ref())),
            )
            .await
            .map_err(|e| {
                Error::Unavailable(format!(
                    "dataset '{}' is sealed and readable, but persisting it failed: {e}; it \
                     will not survive a restart",
                    summary.name
                ))
            })?;
        self.catalog().set_stored(&summary.name, generation, stored);
        self.catalog().describe(&summary.name)
    }

    /// Seals this member's part of a cluster dataset (action
    /// `member_prepare`); it stays unreadable until `member_commit`. With
    /// `check_only`, only checks that it could. With `replace_write`, the
    /// part is what that write staged, and the reply names the members of
    /// the layout it will replace.
    pub async fn prepare_member(
        &self,
        req: &convert::PrepareRequest,
    ) -> Result<pb::MemberPrepared> {
        let mut want = req.winners.clone();
        want.sort_unstable();
        let (entry, replaces) = if req.replace_write.is_empty() {
            (req.dataset.clone(), Vec::new())
        } else {
            let key = crate::catalog::staged_key(&req.dataset, &req.replace_write);
            let catalog = self.catalog();
            // Sent again after this member swapped it in: it is the dataset now.
            let swapped = catalog.swapped_in_by(&req.dataset, &req.replace_write);
            if !swapped && !catalog.holds(&key) {
                return Err(crate::catalog::nothing_staged(
                    &req.dataset,
                    &req.replace_write,
                ));
            }
            drop(catalog);
            let entry = if swapped { req.dataset.clone() } else { key };
            (entry, self.layout_locations(&req.dataset))
        };
        if req.check_only {
            let (schema, writes) = {
                let catalog = self.catalog();
                catalog.check_member(&entry, &want)?;
                (catalog.schema(&entry)?, catalog.writes(&entry))
            };
            return Ok(pb::MemberPrepared {
                schema: convert::schema_to_ipc(&schema)?,
                replaces,
                writes,
                ..Default::default()
            });
        }
        let (prepared, freed) = self.catalog().prepare_member(&entry, &req.winners)?;
        let generation = prepared.generation;
        let summary = self.sealed(prepared, freed).await?;
        // Persisting it awaited: another write may have replaced the dataset
        // here meanwhile, and what it answers with is then that write's.
        if summary.generation != generation {
            return Err(Error::FailedPrecondition(format!(
                "dataset '{}' was replaced on this member while its part of a cluster seal was \
                 being sealed (another write); one job writes a dataset at a time: seal again, \
                 or drop the dataset and write it again",
                req.dataset
            )));
        }
        let (_, data) = self.resident(&entry).await?;
        let mut reply =
            convert::member_prepared(&summary, crate::read::Gather::byte_columns(&data))?;
        reply.replaces = replaces;
        Ok(reply)
    }

    /// Adopts a cluster layout (action `member_commit`); with `persist`, the
    /// manifest records it, so a restarted member serves the same tickets.
    ///
    /// With `replace_write`, what that write staged adopts the layout and
    /// takes the dataset's place at once (the coordinator drops the
    /// replaced dataset on members the new layout leaves out).
    pub async fn commit_layout(
        &self,
        dataset: &str,
        layout: Layout,
        index: usize,
        replace_write: &str,
    ) -> Result<DatasetSummary> {
        let layout = Arc::new(layout);
        let (summary, replaced) = {
            let mut catalog = self.catalog();
            let key = crate::catalog::staged_key(dataset, replace_write);
            if replace_write.is_empty() || catalog.swapped_in_by(dataset, replace_write) {
                // (Sent again after the swap: the dataset holds the layout.)
                (catalog.commit_layout(dataset, layout, index)?, None)
            } else if catalog.holds(&key) {
                catalog.commit_layout(&key, layout, index)?;
                catalog.swap_in(dataset, replace_write)?
            } else {
                return Err(crate::catalog::nothing_staged(dataset, replace_write));
            }
        };
        // The new manifest first, then the old files: a restart in between
        // finds the new dataset.
        let written = self.write_layout_manifest(dataset, &summary).await;
        self.replaced(dataset, replaced).await;
        written?;
        info!(dataset = %dataset, member = index, "joined cluster layout");
        Ok(summary)
    }

    /// Rewrites a persisted dataset's manifest (its cluster layout, its
    /// name after a swap).
    async fn write_layout_manifest(&self, dataset: &str, summary: &DatasetSummary) -> Result<()> {
        if let Some(stored) = summary.stored.as_ref().filter(|s| s.persisted) {
            self.store
                .write_manifest(
                    stored,
                    dataset,
                    summary.generation,
                    &summary.schema,
                    &summary.partitions,
                    summary.cluster.as_ref(),
                )
                .await?;
        }
        Ok(())
    }

    /// Seals a dataset across members: each seals its part (`member_prepare`,
    /// in parallel), then every member adopts the whole layout
    /// (`member_commit`). Until every member has adopted it no plan is
    /// served; sending the same seal again completes a half-done one.
    async fn seal_cluster(&self, req: &SealRequest) -> Result<pb::DatasetInfo> {
        let name = req.dataset.as_str();
        let members: Vec<&(String, Vec<crate::catalog::AttemptKey>)> =
            req.members.iter().filter(|(_, w)| !w.is_empty()).collect();
        let mut held: BTreeMap<u32, &str> = BTreeMap::new();
        for (location, winners) in &members {
            for k in winners {
                if let Some(other) = held.insert(k.partition, location) {
                    return Err(Error::invalid(format!(
                        "seal of dataset '{name}' names partition {} on two members ({other} \
                         and {location}); name one winner per partition",
                        k.partition
                    )));
                }
            }
        }
        crate::catalog::check_partition_count(name, req.partitions, held.keys().copied())?;
        // Every member is checked before any seals its part, so a wrong
        // layout leaves every member as it was.
        let prepare = |check_only| {
            futures::future::join_all(members.iter().map(move |(location, winners)| {
                self.peers.action::<pb::MemberPrepared>(
                    location,
                    name,
                    actions::MEMBER_PREPARE,
                    convert::prepare_body(name, winners, check_only, &req.replace_write),
                )
            }))
        };
        let mut checked = Vec::with_capacity(members.len());
        for ((location, _), c) in members.iter().zip(prepare(true).await) {
            checked.push((location.as_str(), c?));
        }
        one_schema(name, &checked)?;
        one_write(name, &checked)?;
        // The members of every layout this seal replaces.
        let mut replaced: Vec<String> = checked
            .iter()
            .flat_map(|(_, c)| c.replaces.iter().cloned())
            .collect();
        let mut parts = Vec::with_capacity(members.len());
        for ((location, _), p) in members.iter().zip(prepare(false).await) {
            parts.push((location.as_str(), p?));
        }
        as_named(name, &members, &parts)?;
        let schema = one_schema(name, &parts)?;
        let words: Vec<(&[bool], &[u32])> = parts
            .iter()
            .map(|(_, p)| (p.fixed_columns.as_slice(), p.list_widths.as_slice()))
            .collect();
        let fixed = crate::cluster::byte_columns(&words, &crate::cluster::list_columns(&schema));
        let members: Vec<Member> = parts
            .iter()
            .map(|(location, p)| convert::member_from_prepared(location, p))
            .collect();
        let layout = Layout::new(members, fixed)?;
        let wire = convert::layout_to_proto(&layout, &schema)?;
        let committed =
            futures::future::join_all(layout.members.iter().enumerate().map(|(i, m)| {
                self.peers.action::<pb::DatasetInfo>(
                    &m.location,
                    name,
                    actions::MEMBER_COMMIT,
                    pb::CommitLayout {
                        dataset: name.to_string(),
                        layout: Some(wire.clone()),
                        member: i as u32,
                        replace_write: req.replace_write.clone(),
                    },
                )
            }))
            .await;
        let mut info = None;
        for c in committed {
            let c = c?;
            info.get_or_insert(c);
        }
        // Members of a replaced layout that the new one leaves out still
        // hold their parts of the old dataset.
        replaced.sort_unstable();
        replaced.dedup();
        replaced.retain(|l| !layout.members.iter().any(|m| &m.location == l));
        self.drop_elsewhere(name, &replaced).await;
        info!(
            dataset = %name,
            members = layout.members.len(),
            rows = layout.rows(),
            layout = format!("{:016x}", layout.id),
            "sealed dataset across members"
        );
        info.ok_or_else(|| Error::Internal("a cluster seal committed no member".into()))
    }

    /// Checks that every other member of `layout` holds it; a member that
    /// is down is `UNAVAILABLE`, one that dropped the dataset or holds
    /// another layout is `FAILED_PRECONDITION`.
    pub async fn check_members(&self, dataset: &str, layout: &Layout, index: usize) -> Result<()> {
        let replies = futures::future::join_all(layout.others(index).map(|m| async move {
            let info: pb::DatasetInfo = self
                .peers
                .action(
                    &m.location,
                    dataset,
                    actions::DESCRIBE,
                    pb::DescribeDataset {
                        dataset: dataset.to_string(),
                    },
                )
                .await?;
            match info.layout {
                Some(l) if l.id == layout.id => Ok(()),
                _ => Err(Error::FailedPrecondition(format!(
                    "member {} does not hold the layout of dataset '{dataset}' that this member \
                     holds (it was dropped or written again there, or its seal is unfinished); \
                     seal the cluster again, or drop the dataset and write it again",
                    m.location
                ))),
            }
        }))
        .await;
        replies.into_iter().collect()
    }

    /// Drops a dataset: its memory, its device copies and its store files;
    /// a cluster dataset also on every other member, unless `member_only`.
    /// With `abort_write`, that write's attempts are refused from now on
    /// (recorded first, under the same lock, so no attempt of it can land
    /// between the drop and the refusal; recorded even with no dataset).
    /// A dataset holding only other writes' attempts is left as it is when
    /// `abort_write` names a write that is not among them (refused as
    /// `FAILED_PRECONDITION`): a failed job drops what it wrote, not the
    /// dataset of the job it was refused by.
    /// With `keep_write`, a dataset that write swapped in stays (refused
    /// as `FAILED_PRECONDITION`, checked under the same lock).
    pub async fn drop_dataset(&self, req: &convert::DropRequest) -> Result<DatasetSummary> {
        let name = req.dataset.as_str();
        // What a replacing write staged, or the dataset itself.
        let entry = if req.staged {
            crate::catalog::staged_key(name, &req.abort_write)
        } else {
            name.to_string()
        };
        let (mut summary, freed) = {
            let mut catalog = self.catalog();
            catalog.abort_write(&req.abort_write);
            if catalog.held_by_others(&entry, &req.abort_write) {
                return Err(Error::FailedPrecondition(format!(
                    "dataset '{name}' here holds no attempt of the failed write '{}' (another \
                     write's rows): left as it is",
                    req.abort_write
                )));
            }
            if catalog.swapped_in_by(&entry, &req.keep_write) {
                return Err(Error::FailedPrecondition(format!(
                    "dataset '{name}' here is what write '{}' swapped in: left as it is",
                    req.keep_write
                )));
            }
            catalog.drop_dataset(&entry)?
        };
        summary.name = name.to_string();
        self.placements()
            .retain(|(n, g), _| !(*n == entry && *g == summary.generation));
        if let Some(stored) = &summary.stored {
            self.delete_quietly(stored).await;
        }
        info!(dataset = %name, rows = summary.rows, freed, staged = req.staged, "dropped dataset");
        if !req.staged {
            self.metrics.forget(name);
        }
        let Some(ClusterState::Member { layout, index }) = &summary.cluster else {
            return Ok(summary);
        };
        if req.member_only {
            return Ok(summary);
        }
        let body = pb::DropDataset {
            dataset: name.to_string(),
            abort_write: req.abort_write.clone(),
            staged: req.staged,
            keep_write: req.keep_write.clone(),
            ..Default::default()
        };
        let others = layout.others(*index).map(|m| &m.location);
        let failed: Vec<String> = self
            .drop_parts(others, body)
            .await
            .into_iter()
            .map(|(location, e)| format!("{location}: {e}"))
            .collect();
        if failed.is_empty() {
            return Ok(summary);
        }
        Err(Error::Unavailable(format!(
            "dataset '{name}' is dropped here, but not on every member: {}; drop it there once \
             they are back",
            failed.join("; ")
        )))
    }

    /// Drops what was left unsealed for `idle` or longer (see
    /// [`crate::catalog::Catalog::abandoned`]), refusing the later attempts
    /// of its writes; how many entries went.
    pub async fn drop_abandoned(&self, idle: std::time::Duration) -> usize {
        let keys = self.catalog().abandoned(idle);
        let mut dropped = 0;
        for key in keys {
            let gone = self.catalog().drop_abandoned(&key, idle);
            let Some((summary, freed, writes)) = gone else {
                continue;
            };
            if let Some(stored) = &summary.stored {
                self.delete_quietly(stored).await;
            }
            let name = crate::catalog::public_name(&key);
            if crate::catalog::staged_parts(&key).is_none() {
                self.metrics.forget(name);
            }
            warn!(
                dataset = %name,
                writes = %writes.join(","),
                rows = summary.rows,
                freed,
                idle_seconds = idle.as_secs(),
                staged = crate::catalog::staged_parts(&key).is_some(),
                "dropped what a write left unsealed: nothing was written to it for --unsealed-timeout"
            );
            dropped += 1;
        }
        dropped
    }

    /// Copies columns of a sealed dataset to GPUs (replacing earlier copies
    /// on those devices).
    pub async fn place(&self, req: &PlaceRequest) -> Result<DatasetSummary> {
        let Some(cuda) = self.cuda.clone() else {
            return Err(Error::FailedPrecondition(format!(
                "{}: 'place' needs a GPU; read the dataset with DoGet instead",
                self.no_cuda()
            )));
        };
        let (generation, data) = self.resident(&req.dataset).await?;
        let columns = if req.columns.is_empty() {
            // Every column that can be placed.
            data.schema()
                .fields()
                .iter()
                .filter(|f| column_segments(&data, f.name()).is_ok())
                .map(|f| f.name().clone())
                .collect()
        } else {
            for c in &req.columns {
                column_segments(&data, c).map_err(|e| {
                    Error::invalid(format!("cannot place dataset '{}': {e}", req.dataset))
                })?;
            }
            req.columns.clone()
        };
        let devices = req.devices.clone();
        let placed = tokio::task::spawn_blocking(move || {
            devices
                .iter()
                .map(|&d| cuda.place(&data, &columns, d))
                .collect::<Result<Vec<_>>>()
        })
        .await
        .map_err(|e| Error::Internal(format!("placing columns panicked: {e}")))??;
        {
            let mut all = self.placements();
            let entry = all.entry((req.dataset.clone(), generation)).or_default();
            entry.retain(|p| !req.devices.contains(&p.device));
            entry.extend(placed.into_iter().map(Arc::new));
            entry.sort_by_key(|p| p.device);
        }
        self.catalog().describe(&req.dataset)
    }

    /// Frees a dataset's device copies on `devices` (empty = all).
    pub fn evict(&self, dataset: &str, devices: &[u32]) -> Result<DatasetSummary> {
        let summary = self.catalog().describe(dataset)?;
        let mut all = self.placements();
        if let Some(list) = all.get_mut(&(dataset.to_string(), summary.generation)) {
            list.retain(|p| !devices.is_empty() && !devices.contains(&p.device));
        }
        all.retain(|_, list| !list.is_empty());
        Ok(summary)
    }

    /// The device-tier copies of a dataset's generation (shared: a training
    /// job keeps the ones it reads alive until it ends, even if evicted).
    pub fn device_copies(&self, dataset: &str, generation: u64) -> Vec<Arc<DevicePlacement>> {
        self.placements()
            .get(&(dataset.to_string(), generation))
            .cloned()
            .unwrap_or_default()
    }

    /// `(device, columns, bytes)` of a dataset's placements.
    pub fn placements_of(&self, dataset: &str, generation: u64) -> Vec<(u32, Vec<String>, u64)> {
        self.device_copies(dataset, generation)
            .iter()
            .map(|p| {
                (
                    p.device,
                    p.columns.iter().map(|c| c.name.clone()).collect(),
                    p.bytes,
                )
            })
            .collect()
    }

    /// Figures of every tier.
    pub fn tier_stats(&self) -> TierStats {
        TierStats {
            arena: self.arena.stats(),
            budget_used: self.arena.budget().used(),
            budget_limit: self.arena.budget().limit(),
            budget_peak: self.arena.budget().peak(),
            device_bytes: self.placements().values().flatten().map(|p| p.bytes).sum(),
            spills: self.spills.load(Ordering::Relaxed),
            restores: self.restores.load(Ordering::Relaxed),
            spill_url: self.store.url().to_string(),
            persist: self.config.persist,
            cuda_devices: self.cuda.as_ref().map_or(0, CudaHost::device_count),
        }
    }

    /// Refuses new calls from now on (the server is shutting down).
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Release);
    }

    /// Whether the server is shutting down.
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// With `beat`, keeps this server's records in the store fresh (see
    /// [`crate::memory::heartbeat`]); with `clean`, removes the spill files
    /// of servers that stopped without shutting down.
    pub async fn tend_store(&self, beat: bool, clean: bool) -> Result<()> {
        if beat {
            let beaten = self.store.beat(self.config.persist).await;
            match beaten {
                Ok(true) => self.metrics.store_beat(true),
                Ok(false) => {}
                Err(_) => self.metrics.store_beat(false),
            }
            beaten?;
        }
        if clean {
            let removed = self.store.remove_stopped_sessions().await?;
            self.metrics.stopped_sessions_removed(removed);
        }
        Ok(())
    }

    /// How often [`State::tend_store`] should run.
    pub fn tend_store_every(&self) -> std::time::Duration {
        self.store.beat_every()
    }

    /// Cleans up at shutdown: this server's spill files (not persisted
    /// ones), and its hold on the store's persisted datasets.
    pub async fn shutdown(&self) {
        if let Err(e) = self.store.clear_session().await {
            warn!(error = %e, "could not remove spill files at shutdown");
        }
        if self.config.persist
            && let Err(e) = self.store.release().await
        {
            warn!(error = %e, "could not give up the store's persisted datasets at shutdown");
        }
    }
}

/// What a refusal for memory says of datasets that hold memory no spill
/// can free (written, never sealed): the largest three, and how long ago
/// each was last written; nothing where there are none.
fn unsealed_text(held: &[(String, u64, std::time::Duration)]) -> String {
    if held.is_empty() {
        return String::new();
    }
    let total: u64 = held.iter().map(|h| h.1).sum();
    let named: Vec<String> = held
        .iter()
        .take(3)
        .map(|(name, bytes, idle)| {
            let (size, age) = (show_size(*bytes), show_age(*idle));
            match crate::catalog::staged_parts(name) {
                Some((dataset, write)) => format!(
                    "what write '{write}' staged to replace '{dataset}' ({size}, last written \
                     {age} ago; `flightdeck drop {dataset} --staged-by {write}` if its job is gone)"
                ),
                None => format!("'{name}' ({size}, last written {age} ago)"),
            }
        })
        .collect();
    let more = match held.len() {
        n if n > 3 => format!(" and {} more", n - 3),
        _ => String::new(),
    };
    format!(
        ". Of the budget, {} is held by datasets written but never sealed, which cannot spill: \
         {}{more}; seal them, or drop those whose writers are gone (`flightdeck drop NAME`)",
        show_size(total),
        named.join(", ")
    )
}

/// What a refusal for memory adds about sealed datasets that cannot spill
/// because the store cannot hold one of their columns; "" when none.
fn unspillable_text(held: &[(String, u64, String)]) -> String {
    let Some((name, _, column)) = held.first() else {
        return String::new();
    };
    let total: u64 = held.iter().map(|h| h.1).sum();
    let more = match held.len() {
        1 => String::new(),
        n => format!(" and {} more", n - 1),
    };
    format!(
        ". Of the budget, {} is held by sealed datasets the store cannot hold, which cannot \
         spill: '{name}' ({column}){more}; drop them when done with them",
        show_size(total)
    )
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use arrow::array::{Array, Int64Array, RecordBatch};
    use arrow::datatypes::{DataType, Field, Schema};

    use super::{State, as_named, unsealed_text};
    use crate::catalog::{AttemptData, AttemptKey, SealRequest};
    use crate::config::ServerConfig;
    use crate::convert::DropRequest;

    /// Writes and seals dataset `name` of one partition holding `values`,
    /// then spills it; its generation.
    async fn sealed_and_spilled(state: &State, name: &str, values: &[i64]) -> u64 {
        let schema = Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, false)]));
        let column = Arc::new(Int64Array::from(values.to_vec()));
        let batch = RecordBatch::try_new(schema.clone(), vec![column]).expect("batch");
        let data = AttemptData {
            batches: vec![batch],
            rows: values.len() as u64,
            bytes: 8 * values.len() as u64,
        };
        let key = AttemptKey {
            partition: 0,
            attempt: 0,
        };
        state
            .catalog()
            .commit(name, key, schema, data)
            .expect("commit");
        let seal = SealRequest {
            dataset: name.to_string(),
            partitions: 1,
            winners: vec![],
            members: vec![],
            replace_write: String::new(),
        };
        let info = state.seal(&seal).await.expect("seal");
        assert!(
            state.spill_one(None).await.expect("spill"),
            "nothing spilled"
        );
        assert!(!state.catalog().describe(name).expect("describe").resident);
        info.generation
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_read_bringing_back_a_dataset_written_again_meanwhile_gets_the_new_write() {
        let config = ServerConfig {
            spill_url: Some("memory://".to_string()),
            use_cuda: false,
            ..ServerConfig::default()
        };
        let state = Arc::new(
            State::open(config, "grpc://test".into())
                .await
                .expect("open"),
        );
        sealed_and_spilled(&state, "a", &[1, 2, 3]).await;
        // The read finds "a" in the store, then waits its turn to bring it
        // back; meanwhile "a" is dropped (its files deleted) and written
        // again (and spilled, to other files).
        let turn = state.restore_lock.lock().await;
        let reader = tokio::spawn({
            let state = state.clone();
            async move { state.resident("a").await }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        let gone = DropRequest {
            dataset: "a".to_string(),
            member_only: false,
            abort_write: String::new(),
            staged: false,
            keep_write: String::new(),
        };
        state.drop_dataset(&gone).await.expect("drop");
        let generation = sealed_and_spilled(&state, "a", &[7, 8]).await;
        drop(turn);
        // It reads the new write's files (a read planned on the old one
        // then refuses it as written again), not the deleted ones.
        let (got, data) = reader.await.expect("joins").expect("brought back");
        assert_eq!(got, generation);
        let column = data.batches()[0].column(0);
        let values = column.as_any().downcast_ref::<Int64Array>().expect("int64");
        assert_eq!(values.values().to_vec(), vec![7, 8]);
    }

    /// A server with a 4 MiB budget, spilling to memory, whose calls wait
    /// up to `wait` for memory.
    async fn small_budget(wait: Duration) -> Arc<State> {
        let config = ServerConfig {
            spill_url: Some("memory://".to_string()),
            use_cuda: false,
            memory_limit: 4 << 20,
            admission_wait: wait,
            ..ServerConfig::default()
        };
        Arc::new(
            State::open(config, "grpc://test".into())
                .await
                .expect("open"),
        )
    }

    /// Another writer holding all but 64 bytes of the free budget, nothing
    /// of it spillable.
    async fn all_but_64_bytes(state: &State) -> crate::memory::Reservation {
        let what = || "another writer".to_string();
        let free = state.arena().budget().free();
        state.reserve(free - 64, &what).await.expect("held")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_read_of_a_spilled_dataset_waits_for_memory_given_back() {
        let state = small_budget(Duration::from_secs(20)).await;
        let big: Vec<i64> = (0..(1 << 20)).collect();
        sealed_and_spilled(&state, "big", &big).await;
        let values: Vec<i64> = (0..4096).collect();
        sealed_and_spilled(&state, "a", &values).await;
        // Another writer holds all but a few bytes of the budget, nothing
        // spillable: the read waits for it rather than failing at once.
        let held = all_but_64_bytes(&state).await;
        let reader = tokio::spawn({
            let state = state.clone();
            async move { state.resident("a").await }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!reader.is_finished(), "waits for memory");
        drop(held);
        let (_, data) = reader.await.expect("joins").expect("brought back");
        assert_eq!(data.rows(), 4096);
        // A dataset larger than the whole budget is refused saying so.
        let err = state
            .resident("big")
            .await
            .expect_err("larger than the budget");
        assert!(
            err.to_string()
                .contains("more than the whole memory budget (4194304 bytes)"),
            "{err}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_read_refused_for_memory_after_waiting_says_it_waited() {
        let state = small_budget(Duration::from_millis(200)).await;
        let values: Vec<i64> = (0..4096).collect();
        sealed_and_spilled(&state, "a", &values).await;
        let _held = all_but_64_bytes(&state).await;
        let err = state.resident("a").await.expect_err("no memory came");
        assert!(
            err.to_string().starts_with(
                "after waiting 200ms for memory (--admission-wait): bringing dataset 'a' back \
                 from the store needs"
            ),
            "{err}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_filters_selection_makes_room_and_waits_for_memory() {
        let state = small_budget(Duration::from_secs(20)).await;
        let values: Vec<i64> = (0..4096).collect();
        sealed_and_spilled(&state, "d", &values).await;
        let (_, data) = state.resident("d").await.expect("in memory");
        // Memory held by another writer, then given back: the selection
        // waits for it rather than failing at once.
        let held = all_but_64_bytes(&state).await;
        let selecting = tokio::spawn({
            let (state, data) = (state.clone(), data.clone());
            async move { state.selection(&data, "v % 2 = 0", "d").await }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!selecting.is_finished(), "waits for memory");
        drop(held);
        let selection = selecting.await.expect("joins").expect("selected");
        assert_eq!(selection.expect("a filter").len(), 2048);
        // Kept: asked again, the same selection.
        let again = state.selection(&data, "v % 2 = 0", "d").await;
        assert_eq!(again.expect("kept").expect("a filter").len(), 2048);
        assert!(
            state
                .selection(&data, "", "d")
                .await
                .expect("none")
                .is_none()
        );
    }

    #[test]
    fn a_refusal_names_the_unsealed_datasets_holding_memory_largest_first() {
        assert_eq!(unsealed_text(&[]), "");
        let held: Vec<(String, u64, Duration)> =
            [(3 << 30, 18_720), (1 << 20, 40), (1024, 5), (1, 0)]
                .into_iter()
                .enumerate()
                .map(|(i, (bytes, secs))| (format!("d{i}"), bytes, Duration::from_secs(secs)))
                .collect();
        let staged = [(
            crate::catalog::staged_key("d", "w"),
            1 << 20,
            Duration::from_secs(90),
        )];
        assert_eq!(
            unsealed_text(&staged),
            ". Of the budget, 1.0MiB is held by datasets written but never sealed, which cannot \
             spill: what write 'w' staged to replace 'd' (1.0MiB, last written 1m30s ago; \
             `flightdeck drop d --staged-by w` if its job is gone); seal them, or drop those \
             whose writers are gone (`flightdeck drop NAME`)"
        );
        assert_eq!(
            unsealed_text(&held),
            ". Of the budget, 3.0GiB is held by datasets written but never sealed, which cannot \
             spill: 'd0' (3.0GiB, last written 5h12m ago), 'd1' (1.0MiB, last written 40s ago), \
             'd2' (1.0KiB, last written 5s ago) and 1 more; seal them, or drop those whose \
             writers are gone (`flightdeck drop NAME`)"
        );
    }

    #[test]
    fn a_member_that_prepared_other_partitions_than_named_fails_the_seal() {
        let key = |partition, attempt| AttemptKey { partition, attempt };
        let reply = |parts: &[(u32, u32)]| super::pb::MemberPrepared {
            partitions: parts
                .iter()
                .map(|&(partition, attempt)| super::pb::PartitionInfo {
                    partition,
                    attempt,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        };
        let x = ("grpc://x:1".to_string(), vec![key(2, 0), key(0, 1)]);
        let y = ("grpc://y:1".to_string(), vec![key(1, 0)]);
        let named = [&x, &y];
        // As named (in any order): sealed.
        let same = [
            ("grpc://x:1", reply(&[(0, 1), (2, 0)])),
            ("grpc://y:1", reply(&[(1, 0)])),
        ];
        as_named("d", &named, &same).expect("as named");
        // Member y answers with another write's part (partition 2 too, or
        // another attempt): refused, naming it, never a layout.
        for other in [&[(1, 0), (2, 0)][..], &[(1, 1)][..], &[][..]] {
            let replies = [
                ("grpc://x:1", reply(&[(0, 1), (2, 0)])),
                ("grpc://y:1", reply(other)),
            ];
            let err = as_named("d", &named, &replies).expect_err("another write's part");
            assert!(
                matches!(&err, crate::error::Error::FailedPrecondition(m)
                    if m.contains("member grpc://y:1 prepared other partitions")),
                "{err:?}"
            );
        }
    }
}
