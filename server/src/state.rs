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
use futures::TryStreamExt;
use tracing::{info, warn};

use crate::catalog::{Catalog, DatasetSummary, SealRequest, SealedData, SealedView};
use crate::config::ServerConfig;
use crate::convert::PlaceRequest;
use crate::error::{Error, Result};
use crate::memory::Budget;
use crate::memory::arena::{Arena, ArenaStats, HostMemory, slab_bytes_for};
use crate::memory::device::{CudaHost, DevicePlacement, column_segments};
use crate::memory::spill::Store;

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

/// State shared by all requests of one server.
#[derive(Debug)]
pub struct State {
    catalog: Mutex<Catalog>,
    arena: Arena,
    store: Store,
    cuda: Option<CudaHost>,
    placements: Mutex<Placements>,
    /// One spill at a time: two writers short of memory must not both write
    /// the same victim.
    spill_lock: tokio::sync::Mutex<()>,
    /// One restore at a time: two readers of a spilled dataset must not both
    /// load it. (A restore may spill others; a spill never restores.)
    restore_lock: tokio::sync::Mutex<()>,
    spills: AtomicU64,
    restores: AtomicU64,
    /// Training jobs since start.
    pub(crate) jobs: crate::jobs::Jobs,
    /// The configuration the server runs with.
    pub config: ServerConfig,
}

impl State {
    /// State for `config`: opens the store, probes the CUDA driver, and with
    /// `persist` reloads the datasets an earlier run sealed.
    pub async fn open(config: ServerConfig) -> Result<Self> {
        let store = Store::open(&config.spill_url())?;
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
        let mut catalog = Catalog::new();
        if config.persist {
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
            arena: Arena::new(budget, slab, source),
            store,
            cuda,
            placements: Mutex::new(BTreeMap::new()),
            spill_lock: tokio::sync::Mutex::new(()),
            restore_lock: tokio::sync::Mutex::new(()),
            spills: AtomicU64::new(0),
            restores: AtomicU64::new(0),
            jobs: crate::jobs::Jobs::default(),
            config,
        })
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
    pub fn arena(&self) -> &Arena {
        &self.arena
    }

    /// The CUDA driver, when present and enabled.
    pub fn cuda(&self) -> Option<&CudaHost> {
        self.cuda.as_ref()
    }

    /// Copies `batch` into the arena. When the budget is full (idle slabs
    /// already given back), least-recently-read sealed datasets (other than
    /// `except`) are spilled one by one; when nothing is left to spill the
    /// arena's `ResourceExhausted` stands.
    pub async fn admit(
        &self,
        batch: &RecordBatch,
        except: Option<&str>,
        what: &(dyn Fn() -> String + Sync),
    ) -> Result<(RecordBatch, u64)> {
        loop {
            match self.arena.copy_batch(batch, what) {
                Err(Error::ResourceExhausted(msg)) => {
                    if !self.spill_one(except).await? {
                        return Err(Error::ResourceExhausted(msg));
                    }
                }
                other => return other,
            }
        }
    }

    /// Spills the least-recently-read resident sealed dataset; false when
    /// there is none.
    async fn spill_one(&self, except: Option<&str>) -> Result<bool> {
        let _one = self.spill_lock.lock().await;
        let Some(victim) = self.catalog().spill_candidate(except) else {
            return Ok(false);
        };
        let stored = match victim.stored.clone() {
            Some(stored) => stored,
            None => {
                let stored = self
                    .store
                    .write(&victim.name, victim.generation, &victim.data, None)
                    .await
                    .map_err(|e| {
                        Error::ResourceExhausted(format!(
                            "the memory budget is full and spilling dataset '{}' failed: {e}",
                            victim.name
                        ))
                    })?;
                if !self
                    .catalog()
                    .set_stored(&victim.name, victim.generation, stored.clone())
                {
                    // Dropped while being written: nothing to keep.
                    self.delete_quietly(&stored).await;
                    return Ok(true);
                }
                stored
            }
        };
        self.catalog().release_host(&victim.name, victim.generation);
        self.spills.fetch_add(1, Ordering::Relaxed);
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

    /// The rows of sealed dataset `name`, brought back from the store when
    /// spilled; marks it read.
    pub async fn resident(&self, name: &str) -> Result<(u64, Arc<SealedData>)> {
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
        // Another reader may be restoring it: wait, then look again.
        let _one = self.restore_lock.lock().await;
        let again = self.catalog().lookup(name)?;
        if let SealedView::Resident { generation, data } = again {
            self.catalog().touch(name);
            return Ok((generation, data));
        }
        let mut stream = self.store.read(&stored, schema.clone()).await?;
        let what = || format!("bringing dataset '{name}' back from the store");
        let mut batches = Vec::new();
        while let Some(batch) = stream.try_next().await? {
            batches.push(self.admit(&batch, Some(name), &what).await?.0);
        }
        let data = SealedData::from_batches(schema, winners, batches);
        let data = self
            .catalog()
            .restore(name, generation, data)
            .ok_or_else(|| Error::DatasetNotFound {
                dataset: name.to_string(),
            })?;
        self.catalog().touch(name);
        self.restores.fetch_add(1, Ordering::Relaxed);
        info!(dataset = %name, rows = data.rows(), "brought dataset back from the store");
        Ok((generation, data))
    }

    /// Seals a dataset; with `persist`, writes it to the store before
    /// answering, so a restart keeps it.
    pub async fn seal(&self, req: &SealRequest) -> Result<DatasetSummary> {
        let (summary, freed) = self.catalog().seal(req)?;
        info!(
            dataset = %summary.name,
            partitions = summary.partitions.len(),
            rows = summary.rows,
            bytes = summary.bytes,
            freed,
            "sealed dataset"
        );
        if !self.config.persist {
            return Ok(summary);
        }
        let (generation, data) = self.catalog().sealed(&summary.name)?;
        let stored = self
            .store
            .write(&summary.name, generation, &data, Some(&summary.partitions))
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

    /// Drops a dataset: its memory, its device copies and its store files.
    pub async fn drop_dataset(&self, name: &str) -> Result<DatasetSummary> {
        let (summary, freed) = self.catalog().drop_dataset(name)?;
        self.placements()
            .retain(|(n, g), _| !(n == name && *g == summary.generation));
        if let Some(stored) = &summary.stored {
            self.delete_quietly(stored).await;
        }
        info!(dataset = %name, rows = summary.rows, freed, "dropped dataset");
        Ok(summary)
    }

    /// Copies columns of a sealed dataset to GPUs (replacing earlier copies
    /// on those devices).
    pub async fn place(&self, req: &PlaceRequest) -> Result<DatasetSummary> {
        let Some(cuda) = self.cuda.clone() else {
            return Err(Error::FailedPrecondition(
                "no CUDA driver on this server: 'place' needs a GPU; read the dataset with \
                 DoGet instead"
                    .to_string(),
            ));
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
            device_bytes: self.placements().values().flatten().map(|p| p.bytes).sum(),
            spills: self.spills.load(Ordering::Relaxed),
            restores: self.restores.load(Ordering::Relaxed),
            spill_url: self.store.url().to_string(),
            persist: self.config.persist,
            cuda_devices: self.cuda.as_ref().map_or(0, CudaHost::device_count),
        }
    }

    /// Cleans up at shutdown: this server's spill files (not persisted ones).
    pub async fn shutdown(&self) {
        if let Err(e) = self.store.clear_session().await {
            warn!(error = %e, "could not remove spill files at shutdown");
        }
    }
}
