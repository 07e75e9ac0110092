//! Training jobs as the server runs them: a job is checked before it
//! starts (errors are the `train` call's own error), runs on blocking
//! threads, streams its progress, writes checkpoints through
//! `object_store`, and stops when its caller hangs up. The registry keeps
//! the status of every job since start for action `job`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use object_store::ObjectStoreExt;
use object_store::PutPayload;
use tokio::sync::mpsc;
use tracing::{info, warn};

use crate::error::{Error, Result};
use crate::memory::spill::{check_writable, open_location};
use crate::state::State;
use crate::train::checkpoint::Checkpoint;
use crate::train::{Devices, Hooks, Job, JobSpec, Progress};

/// How a job stands.
#[derive(Debug, Clone, PartialEq)]
pub struct JobStatus {
    /// Job id.
    pub id: u64,
    /// Dataset it trains on.
    pub dataset: String,
    /// Samples per step (the global batch).
    pub batch_size: u32,
    /// `running`, `finished`, `failed` or `cancelled`.
    pub state: &'static str,
    /// The last progress report.
    pub last: Progress,
    /// Why it failed.
    pub error: Option<String>,
}

/// Every job since start.
#[derive(Debug, Default)]
pub struct Jobs {
    next: AtomicU64,
    all: Mutex<BTreeMap<u64, JobStatus>>,
}

impl Jobs {
    fn all(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, JobStatus>> {
        self.all.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Status of job `id`, or of all jobs when `id` is 0.
    pub fn status(&self, id: u64) -> Result<Vec<JobStatus>> {
        let all = self.all();
        if id == 0 {
            return Ok(all.values().cloned().collect());
        }
        all.get(&id)
            .cloned()
            .map(|s| vec![s])
            .ok_or_else(|| Error::NotFound(format!("no training job {id} on this server")))
    }

    fn update(&self, id: u64, f: impl FnOnce(&mut JobStatus)) {
        if let Some(s) = self.all().get_mut(&id) {
            f(s);
        }
    }
}

/// What a running job sends: progress, then possibly its error.
pub type ProgressStream = mpsc::UnboundedReceiver<Result<Progress>>;

async fn read_checkpoint(url: &str) -> Result<Checkpoint> {
    let (store, path) = open_location(url, true)
        .map_err(|e| Error::invalid(format!("resume_from '{url}' is not usable: {e}")))?;
    let bytes = store
        .get(&path)
        .await
        .map_err(|e| Error::invalid(format!("cannot read checkpoint '{url}': {e}")))?
        .bytes()
        .await
        .map_err(|e| Error::Unavailable(format!("cannot read checkpoint '{url}': {e}")))?;
    Checkpoint::decode(&bytes)
}

impl State {
    /// Checks and starts a job; returns its id and its progress.
    pub async fn train(self: &Arc<Self>, mut spec: JobSpec) -> Result<(u64, ProgressStream)> {
        for (url, field) in [
            (&mut spec.resume_from, "resume_from"),
            (&mut spec.checkpoint_url, "checkpoint_url"),
        ] {
            if let Some(u) = url.as_mut() {
                *u = self.config.checkpoint_location(u, field)?;
            }
        }
        if let Devices::Gpu(_) = spec.devices
            && self.cuda().is_none()
        {
            return Err(Error::FailedPrecondition(format!(
                "{}: train on cpu ranks instead",
                self.no_cuda()
            )));
        }
        self.readable(&spec.dataset)?;
        if let Some(crate::catalog::ClusterState::Member { layout, .. }) =
            self.catalog().describe(&spec.dataset)?.cluster
            && layout.members.len() > 1
        {
            return Err(Error::FailedPrecondition(format!(
                "dataset '{}' is spread over {} members; the embedded trainer trains on a \
                 dataset one server holds whole: read it with DoGet (FlightDeckIterableDataset) \
                 on every node instead",
                spec.dataset,
                layout.members.len()
            )));
        }
        let (generation, data) = self.resident(&spec.dataset).await?;
        let placed = self.device_copies(&spec.dataset, generation);
        let selection = self.selection(&data, &spec.filter, &spec.dataset).await?;
        let mut job = tokio::task::spawn_blocking(move || Job::prepare(spec, &data, selection))
            .await
            .map_err(|e| Error::Internal(format!("preparing the job panicked: {e}")))??;
        job.placed = placed;
        let resume = match &job.spec.resume_from {
            Some(url) => {
                let c = read_checkpoint(url).await?;
                job.check_resume(&c)?;
                Some(c)
            }
            None => None,
        };
        let checkpoints = match &job.spec.checkpoint_url {
            Some(url) => {
                let (store, dir) = open_location(url, true).map_err(|e| {
                    Error::invalid(format!("checkpoint_url '{url}' is not usable: {e}"))
                })?;
                // Now, not at the first checkpoint minutes in.
                check_writable(store.as_ref(), &dir).await.map_err(|e| {
                    Error::invalid(format!(
                        "checkpoint_url '{url}' cannot be written: {e}; give a folder under \
                         --checkpoint-root this server may write"
                    ))
                })?;
                Some((url.trim_end_matches('/').to_string(), (store, dir)))
            }
            None => None,
        };
        let id = self.jobs.next.fetch_add(1, Ordering::Relaxed) + 1;
        self.jobs.all().insert(
            id,
            JobStatus {
                id,
                dataset: job.spec.dataset.clone(),
                batch_size: job.spec.global_batch,
                state: "running",
                last: Progress {
                    total_steps: job.total_steps(),
                    ..Progress::default()
                },
                error: None,
            },
        );
        info!(job = id, dataset = %job.spec.dataset, steps = job.total_steps(), "training job started");
        let (tx, rx) = mpsc::unbounded_channel();
        let cancel = Arc::new(AtomicBool::new(false));
        // The caller hanging up cancels the job; the watcher lets go of its
        // sender when the job ends, so that the stream can end.
        let (finished, job_ended) = tokio::sync::oneshot::channel::<()>();
        {
            let (tx, cancel) = (tx.clone(), cancel.clone());
            tokio::spawn(async move {
                tokio::select! {
                    () = tx.closed() => cancel.store(true, Ordering::Release),
                    _ = job_ended => {}
                }
            });
        }
        let state = self.clone();
        let runtime = tokio::runtime::Handle::current();
        tokio::task::spawn_blocking(move || {
            let report = |p: &Progress| {
                state.jobs.update(id, |s| s.last = p.clone());
                let _ = tx.send(Ok(p.clone()));
            };
            // This job's checkpoints, oldest first, with what each holds of
            // the memory budget (memory:// ones live in this process).
            let written = Mutex::new(std::collections::VecDeque::new());
            let in_memory = job
                .spec
                .checkpoint_url
                .as_deref()
                .is_some_and(|u| u.starts_with("memory:"));
            let keep = job.spec.keep_checkpoints.max(1);
            let budget = state.arena().budget().clone();
            let write = |step: u64, c: &Checkpoint| -> Result<String> {
                let Some((url, (store, dir))) = &checkpoints else {
                    return Err(Error::Internal("no checkpoint store".into()));
                };
                let name = format!("step-{step:010}.safetensors");
                let bytes = c.encode()?;
                let held = if in_memory { bytes.len() as u64 } else { 0 };
                budget
                    .try_take(held, &|| format!("checkpoint {name} in {url}"))
                    .map_err(|e| {
                        Error::ResourceExhausted(format!(
                            "{e} (memory:// checkpoints are kept in the server's memory \
                             budget); write them under --checkpoint-root, or keep fewer \
                             (keep_checkpoints)"
                        ))
                    })?;
                let path = dir.clone().join(name.as_str());
                if let Err(e) = runtime.block_on(store.put(&path, PutPayload::from(bytes))) {
                    budget.release(held);
                    return Err(Error::Unavailable(format!(
                        "writing checkpoint {name} to {url}: {e}"
                    )));
                }
                let mut written = written.lock().unwrap_or_else(|p| p.into_inner());
                written.push_back((path, held));
                while written.len() > keep {
                    let Some((old, held)) = written.pop_front() else {
                        break;
                    };
                    match runtime.block_on(store.delete(&old)) {
                        Ok(()) => budget.release(held),
                        // Left behind, not fatal: the job goes on.
                        Err(e) => warn!(job = id, checkpoint = %old, error = %e,
                            "could not delete an old checkpoint"),
                    }
                }
                Ok(format!("{url}/{name}"))
            };
            let hooks = Hooks {
                progress: &report,
                cancel: &cancel,
                checkpoint: checkpoints.as_ref().map(|_| &write as _),
            };
            let result = job.run(resume.as_ref(), &hooks);
            let (state_name, error) = match &result {
                Ok(_) => ("finished", None),
                Err(Error::Aborted(m)) if cancel.load(Ordering::Acquire) => {
                    ("cancelled", Some(m.clone()))
                }
                Err(e) => ("failed", Some(e.to_string())),
            };
            match &error {
                None => info!(job = id, "training job finished"),
                Some(e) => warn!(job = id, error = %e, "training job ended early"),
            }
            state.jobs.update(id, |s| {
                s.state = state_name;
                s.error = error;
            });
            if let Err(e) = result {
                let _ = tx.send(Err(e));
            }
            let _ = finished.send(());
        });
        Ok((id, rx))
    }

    /// Status of job `id` (0 = all).
    pub fn jobs(&self, id: u64) -> Result<Vec<JobStatus>> {
        self.jobs.status(id)
    }
}
