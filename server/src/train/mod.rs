//! The embedded training runtime: data-parallel training of a linear model
//! or an MLP straight from the cache.
//!
//! One thread per rank. Every step, rank `r` of `W` takes positions
//! `r + k·W` of the epoch's sample order for its `G/W` samples — the same
//! order `DoGet` serves for `(seed, epoch, W)` — so the global batch at step
//! `s` is positions `[s·G, (s+1)·G)` of the epoch whatever `W` is. It
//! gathers those rows, runs forward and backward ([`model`]), all-reduces
//! the gradients (mean) and updates; every rank holds identical parameters
//! after every step. Each epoch has `⌊N / G⌋` steps (the last partial
//! global batch is dropped).
//!
//! - [`backend`]: the operations a step needs; [`cpu`]: the CPU backend with
//!   an in-process all-reduce between rank threads.
//! - [`data`]: the job's columns, checked once, and the gather.
//! - [`checkpoint`]: parameters and optimizer state as safetensors.
//!
//! - [`cuda`]: the CUDA backend — cuBLAS GEMMs, NVRTC kernels, NCCL
//!   all-reduce, one thread and context per GPU; [`cudalib`]: those three
//!   libraries, opened by the names their packages install.

pub mod backend;
pub mod checkpoint;
pub mod cpu;
pub mod cuda;
pub mod cudalib;
pub mod data;
pub mod model;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender};
use std::time::Instant;

use backend::Backend;
use checkpoint::{Checkpoint, Tensor};
use cpu::{Cpu, CpuGroup};
use data::{LabelKind, TrainData};
use model::{Model, OptState, Optimizer, Task};

/// A batch's features and labels gathered on the host.
type HostBatch = (Vec<f32>, Vec<f32>);

use crate::error::{Error, Result};
use crate::memory::device::DevicePlacement;
use crate::order::{EpochOrder, ShardOrder, Shares, Shuffle};
use crate::query::Selection;

/// Where a job runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Devices {
    /// This many CPU ranks (threads).
    Cpu(u32),
    /// These GPU ordinals, one rank each.
    Gpu(Vec<u32>),
}

impl Devices {
    /// Number of ranks.
    pub fn world(&self) -> u32 {
        match self {
            Devices::Cpu(n) => *n,
            Devices::Gpu(d) => d.len() as u32,
        }
    }
}

/// A training job in domain terms.
#[derive(Debug, Clone, PartialEq)]
pub struct JobSpec {
    /// Sealed dataset to train on.
    pub dataset: String,
    /// Feature columns, concatenated in this order.
    pub features: Vec<String>,
    /// Label column.
    pub label: String,
    /// Classification with N classes, or regression.
    pub task: TaskSpec,
    /// Hidden layer sizes; empty = a linear model.
    pub hidden: Vec<usize>,
    /// Optimizer.
    pub optimizer: Optimizer,
    /// Learning rate.
    pub lr: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
    /// Samples per step over all ranks.
    pub global_batch: u32,
    /// Epochs.
    pub epochs: u32,
    /// Seed of the initial weights and the sample order.
    pub seed: u64,
    /// Sample order of each epoch.
    pub shuffle: Shuffle,
    /// Ranks.
    pub devices: Devices,
    /// Folder URL for checkpoints (`file:///…`, `memory://…`, `s3://…`).
    pub checkpoint_url: Option<String>,
    /// Checkpoint every this many steps (0 = only at the end).
    pub checkpoint_every: u64,
    /// Checkpoint file URL to continue from.
    pub resume_from: Option<String>,
    /// Stop after this many steps in total (0 = run every epoch).
    pub max_steps: u64,
    /// The newest checkpoints of the job kept in `checkpoint_url`; older
    /// ones are deleted as newer ones are written.
    pub keep_checkpoints: usize,
    /// SQL condition selecting the rows trained on; empty = every row.
    pub filter: String,
}

/// [`JobSpec::keep_checkpoints`] when the request leaves it 0.
pub const DEFAULT_KEEP_CHECKPOINTS: usize = 3;

/// The task as the job names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskSpec {
    /// Cross-entropy over this many classes.
    Classification(u32),
    /// Squared error.
    Regression,
}

/// A progress report (rank 0's view; losses are over the global batch).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Progress {
    /// Current epoch.
    pub epoch: u64,
    /// Steps done in total.
    pub step: u64,
    /// Steps the job will run.
    pub total_steps: u64,
    /// Mean loss over the steps since the last report.
    pub loss: f64,
    /// Samples per second since the last report (all ranks).
    pub samples_per_second: f64,
    /// Seconds rank 0 spent gathering data since the last report.
    pub data_stall_seconds: f64,
    /// Fraction of step time spent gathering data since the last report.
    pub data_stall_fraction: f64,
    /// Training accuracy over the whole dataset (classification, final report).
    pub accuracy: Option<f64>,
    /// URL of the checkpoint written at this step, if any.
    pub checkpoint: Option<String>,
    /// The job has finished.
    pub done: bool,
}

/// The prepared job: checked spec, model and data.
#[derive(Debug)]
pub struct Job {
    /// The spec.
    pub spec: JobSpec,
    /// The model.
    pub model: Model,
    /// The data.
    pub data: Arc<TrainData>,
    /// Steps per epoch.
    pub steps_per_epoch: u64,
    /// The dataset's copies in the device tier: a GPU rank whose device
    /// holds every feature column as `f32` builds its rows from them
    /// instead of uploading them from host memory.
    pub placed: Vec<Arc<DevicePlacement>>,
}

/// What a finished job leaves.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// Final parameters, `[W₀, b₀, …]`.
    pub params: Vec<Vec<f32>>,
    /// Steps run in total.
    pub steps: u64,
    /// The final report.
    pub last: Progress,
}

/// Writes a checkpoint at a step and returns its URL.
pub type CheckpointWriter<'a> = dyn Fn(u64, &Checkpoint) -> Result<String> + Sync + 'a;

/// Callbacks a running job uses, from rank 0's thread.
pub struct Hooks<'a> {
    /// Receives progress.
    pub progress: &'a (dyn Fn(&Progress) + Sync),
    /// Set to stop the job at the next step.
    pub cancel: &'a AtomicBool,
    /// Writes a checkpoint at a step; returns its URL.
    pub checkpoint: Option<&'a CheckpointWriter<'a>>,
}

/// The sizes the GPU kernels index with 32-bit counts: at most `i32::MAX`
/// rows, and a feature copy of at most `u32::MAX` values per launch.
fn check_gpu_sizes(rows: u64, dim: usize) -> Result<()> {
    let values = rows.saturating_mul(dim as u64);
    if rows > i32::MAX as u64 || values > u64::from(u32::MAX) {
        return Err(Error::invalid(format!(
            "a GPU job takes at most {} rows and {} feature values; this dataset has {rows} \
             rows × {dim} features ({values} values): train on a part of it (a filtered \
             dataset) or on CPU ranks",
            i32::MAX,
            u32::MAX
        )));
    }
    Ok(())
}

impl Job {
    /// Checks `spec` against the dataset's columns and prepares the data:
    /// every row, or the rows `selection` holds (the selection of
    /// `spec.filter`, [`crate::state::State::selection`]). Every problem is
    /// `InvalidArgument` naming it.
    pub fn prepare(
        spec: JobSpec,
        data: &crate::catalog::SealedData,
        selection: Option<Arc<Selection>>,
    ) -> Result<Self> {
        if spec.filter.is_empty() != selection.is_none() {
            return Err(Error::Internal(
                "a job's filter and its selection disagree".into(),
            ));
        }
        let world = spec.devices.world();
        if world == 0 {
            return Err(Error::invalid(
                "the job has no devices; give cpu ranks or GPU ordinals",
            ));
        }
        if spec.global_batch == 0 {
            return Err(Error::invalid(format!(
                "global batch size 0: give the samples of a step over all ranks, a multiple of \
                 the {world} ranks"
            )));
        }
        if !spec.global_batch.is_multiple_of(world) {
            return Err(Error::invalid(format!(
                "global batch size {} is not divisible by the {world} ranks; use a multiple of \
                 {world}",
                spec.global_batch
            )));
        }
        if let Devices::Gpu(ordinals) = &spec.devices
            && let Some((first, i)) = crate::convert::first_repeat(ordinals)
        {
            return Err(Error::invalid(format!(
                "GPU {} is listed twice (positions {first} and {i}); give each GPU once",
                ordinals[i]
            )));
        }
        if spec.epochs == 0 {
            return Err(Error::invalid("epochs must be at least 1"));
        }
        if !(spec.lr.is_finite() && spec.lr > 0.0) {
            return Err(Error::invalid(format!(
                "learning rate {} must be positive",
                spec.lr
            )));
        }
        if !(spec.weight_decay.is_finite() && spec.weight_decay >= 0.0) {
            return Err(Error::invalid("weight decay must be 0 or more"));
        }
        if let Optimizer::Sgd { momentum } = spec.optimizer
            && !(0.0..1.0).contains(&momentum)
        {
            return Err(Error::invalid(format!(
                "momentum {momentum} must be in [0, 1)"
            )));
        }
        if spec.hidden.contains(&0) {
            return Err(Error::invalid("hidden layer sizes must be at least 1"));
        }
        if spec.hidden.len() > MAX_HIDDEN_LAYERS {
            return Err(Error::invalid(format!(
                "the job asks for {} hidden layers; at most {MAX_HIDDEN_LAYERS} are allowed",
                spec.hidden.len()
            )));
        }
        if let TaskSpec::Classification(c) = spec.task
            && c as usize > MAX_WIDTH
        {
            return Err(Error::invalid(format!(
                "the job asks for {c} classes; at most {MAX_WIDTH} are allowed"
            )));
        }
        if let Some(w) = spec.hidden.iter().find(|&&w| w > MAX_WIDTH) {
            return Err(Error::invalid(format!(
                "a hidden layer of {w} units is wider than the {MAX_WIDTH} allowed"
            )));
        }
        let kind = match spec.task {
            TaskSpec::Classification(c) if c < 2 => {
                return Err(Error::invalid(format!(
                    "classification needs at least 2 classes, the job says {c}"
                )));
            }
            TaskSpec::Classification(c) => LabelKind::Classes(c as usize),
            TaskSpec::Regression => LabelKind::Values,
        };
        let prepared = TrainData::new(data, &spec.features, &spec.label, kind, selection)?;
        if let Devices::Gpu(_) = spec.devices {
            check_gpu_sizes(prepared.rows(), prepared.dim)?;
        }
        let task = match spec.task {
            TaskSpec::Classification(c) => Task::Classification {
                classes: c as usize,
            },
            TaskSpec::Regression => Task::Regression {
                outputs: prepared.label_width,
            },
        };
        let model = Model::new(prepared.dim, &spec.hidden, task);
        check_model_size(&model, spec.global_batch / world)?;
        let per_rank = Shares::new(prepared.rows(), world, 0, true)?.per_rank();
        let steps_per_epoch = per_rank / u64::from(spec.global_batch / world);
        if steps_per_epoch == 0 {
            return Err(Error::invalid(format!(
                "global batch size {} is larger than the dataset's {} rows",
                spec.global_batch,
                prepared.rows()
            )));
        }
        Ok(Self {
            spec,
            model,
            data: Arc::new(prepared),
            steps_per_epoch,
            placed: Vec::new(),
        })
    }

    /// Steps the job runs in total.
    pub fn total_steps(&self) -> u64 {
        let all = self.steps_per_epoch * u64::from(self.spec.epochs);
        if self.spec.max_steps > 0 {
            all.min(self.spec.max_steps)
        } else {
            all
        }
    }

    fn optimizer_name(&self) -> &'static str {
        match self.spec.optimizer {
            Optimizer::Sgd { .. } => "sgd",
            Optimizer::AdamW => "adamw",
        }
    }

    fn dims_text(&self) -> String {
        let dims: Vec<String> = self.model.dims.iter().map(usize::to_string).collect();
        dims.join(",")
    }

    /// What a checkpoint must record as this job has it for a resume to
    /// continue at the same sample: every field that changes the model or
    /// what a step and a sample position mean.
    fn resume_fields(&self) -> [(&'static str, String); 8] {
        [
            ("dataset", self.spec.dataset.clone()),
            ("filter", self.spec.filter.clone()),
            ("rows", self.data.rows().to_string()),
            ("seed", self.spec.seed.to_string()),
            ("shuffle", format!("{:?}", self.spec.shuffle)),
            ("global_batch", self.spec.global_batch.to_string()),
            ("dims", self.dims_text()),
            ("optimizer", self.optimizer_name().to_string()),
        ]
    }

    /// Checks that `ckpt` was written by a job this one continues: the same
    /// model, optimizer, dataset and sample order, at a step within this
    /// job. Anything else is `FAILED_PRECONDITION` naming the field and
    /// both values; the checkpoint's step otherwise.
    pub fn check_resume(&self, ckpt: &Checkpoint) -> Result<u64> {
        let refuse = |why: String| {
            Error::FailedPrecondition(format!(
                "resume_from: {why}; resume with the job that wrote the checkpoint, or train \
                 without resume_from"
            ))
        };
        for (field, ours) in self.resume_fields() {
            // Checkpoints from before jobs took a filter trained on every row.
            let before_filters = (field == "filter").then(String::new);
            match ckpt.metadata.get(field).or(before_filters.as_ref()) {
                Some(theirs) if *theirs == ours => {}
                Some(theirs) => {
                    return Err(refuse(format!(
                        "the checkpoint has {field} {theirs:?}, this job has {field} {ours:?}"
                    )));
                }
                None => {
                    return Err(refuse(format!(
                        "the checkpoint does not record its {field} (this job has {ours:?})"
                    )));
                }
            }
        }
        let step = ckpt
            .meta_u64("step")
            .map_err(|_| refuse("the checkpoint does not record its step".into()))?;
        if step > self.total_steps() {
            return Err(refuse(format!(
                "the checkpoint is at step {step}, past this job's {} steps",
                self.total_steps()
            )));
        }
        Ok(step)
    }

    /// Runs the job to the end (or until cancelled) on CPU ranks.
    pub fn run(&self, resume: Option<&Checkpoint>, hooks: &Hooks<'_>) -> Result<Outcome> {
        let start = match resume {
            Some(c) => self.check_resume(c)?,
            None => 0,
        };
        match &self.spec.devices {
            Devices::Cpu(n) => {
                let group = CpuGroup::new(*n as usize);
                let make = |rank: u32| Ok(Cpu::new(rank as usize, group.clone()));
                self.run_ranks(*n, start, resume, hooks, &make)
            }
            Devices::Gpu(ordinals) => {
                let setup = cuda::Setup::new(ordinals, &self.placed)?;
                let make = |rank: u32| setup.rank(rank);
                self.run_ranks(ordinals.len() as u32, start, resume, hooks, &make)
            }
        }
    }

    /// Runs `world` ranks, each with the backend `make` builds on the rank's
    /// own thread.
    fn run_ranks<B: Backend>(
        &self,
        world: u32,
        start: u64,
        resume: Option<&Checkpoint>,
        hooks: &Hooks<'_>,
        make: &(dyn Fn(u32) -> Result<B> + Sync),
    ) -> Result<Outcome> {
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    s.spawn(move || self.rank_loop(make(rank)?, rank, start, resume, hooks))
                })
                .collect();
            let mut outcome = None;
            let mut errors = Vec::new();
            for h in handles {
                match h.join() {
                    Ok(Ok(r)) => outcome = outcome.or(r),
                    Ok(Err(e)) => errors.push(e),
                    Err(_) => errors.push(Error::Internal("a training rank panicked".into())),
                }
            }
            // The rank that failed says why; the others only saw the stop.
            if let Some(i) = errors.iter().position(|e| !matches!(e, Error::Aborted(_))) {
                return Err(errors.swap_remove(i));
            }
            if let Some(e) = errors.into_iter().next() {
                return Err(e);
            }
            outcome.ok_or_else(|| Error::Internal("rank 0 returned no outcome".into()))
        })
    }

    /// One rank's loop; rank 0 returns the outcome. Where the backend
    /// gathers on the host, a second thread gathers the batch of step
    /// `s + 1` while the rank computes step `s` (one batch ahead), so the
    /// step waits for data only when the gather is slower than the compute.
    fn rank_loop<B: Backend>(
        &self,
        b: B,
        rank: u32,
        start: u64,
        resume: Option<&Checkpoint>,
        hooks: &Hooks<'_>,
    ) -> Result<Option<Outcome>> {
        if !b.gathers_on_host() {
            return self.rank_steps(b, rank, start, resume, hooks, None);
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        std::thread::scope(|s| {
            s.spawn(move || self.gather_ahead(rank, start, tx));
            // The receiver is dropped when the steps end, however they end;
            // the gatherer's next send then fails and it returns.
            self.rank_steps(b, rank, start, resume, hooks, Some(rx))
        })
    }

    /// The host batches of steps `start..` for `rank`, in step order, into
    /// `to`, until every step is gathered or the receiver is gone.
    fn gather_ahead(&self, rank: u32, start: u64, to: SyncSender<Result<HostBatch>>) {
        let mut order = None;
        let mut rows = Vec::new();
        for step in start..self.total_steps() {
            let batch = self
                .step_rows(&mut order, rank, step, &mut rows)
                .map(|()| self.data.gather(rows.iter().copied()));
            let failed = batch.is_err();
            if to.send(batch).is_err() || failed {
                return;
            }
        }
    }

    /// The global rows `rank` trains on at `step`, into `rows`; `order`
    /// keeps the current epoch's shard order between calls.
    fn step_rows(
        &self,
        order: &mut Option<(u64, ShardOrder)>,
        rank: u32,
        step: u64,
        rows: &mut Vec<u64>,
    ) -> Result<()> {
        let world = self.spec.devices.world();
        let per_rank = u64::from(self.spec.global_batch / world);
        let epoch = step / self.steps_per_epoch;
        let in_epoch = step % self.steps_per_epoch;
        if order.as_ref().is_none_or(|(e, _)| *e != epoch) {
            let shares = Shares::new(self.data.rows(), world, 0, true)?;
            let epoch_order =
                EpochOrder::new(self.data.rows(), self.spec.shuffle, self.spec.seed, epoch);
            *order = Some((epoch, ShardOrder::new(epoch_order, shares, rank)?));
        }
        let Some((_, shard)) = order.as_ref() else {
            return Err(Error::Internal("no sample order".into()));
        };
        rows.clear();
        rows.extend(shard.rows(in_epoch * per_rank..(in_epoch + 1) * per_rank));
        Ok(())
    }

    /// The steps of one rank, its batches gathered here or, with `ahead`,
    /// received from [`Job::gather_ahead`].
    fn rank_steps<B: Backend>(
        &self,
        mut b: B,
        rank: u32,
        start: u64,
        resume: Option<&Checkpoint>,
        hooks: &Hooks<'_>,
        ahead: Option<Receiver<Result<HostBatch>>>,
    ) -> Result<Option<Outcome>> {
        let world = self.spec.devices.world();
        let per_rank = u64::from(self.spec.global_batch / world);
        let global = u64::from(self.spec.global_batch);
        let names = self.model.tensors();
        let (mut params, mut opt) = match resume {
            Some(c) => self.restore(&mut b, c, start)?,
            None => {
                let init = self.model.init(self.spec.seed);
                let params: Vec<B::Buf> = init.iter().map(|t| b.upload(t)).collect();
                (
                    params,
                    OptState::new(&mut b, &self.model, self.spec.optimizer),
                )
            }
        };
        let total = self.total_steps();
        let report_every = (self.steps_per_epoch / 10).max(1);
        let mut order: Option<(u64, ShardOrder)> = None;
        let mut rows = Vec::with_capacity(per_rank as usize);
        let (mut loss_sum, mut loss_steps, mut stall, mut busy) = (0.0, 0u64, 0.0, 0.0);
        let mut since = Instant::now();
        let mut since_step = start;
        let mut last = Progress::default();
        // A failure on rank 0 (writing a checkpoint) stops every rank at the
        // next step, through the same reduction as a cancel.
        let mut failure: Option<Error> = None;
        for step in start..total {
            let epoch = step / self.steps_per_epoch;
            let in_epoch = step % self.steps_per_epoch;
            let t0 = Instant::now();
            let (x, y) = match &ahead {
                Some(ahead) => {
                    let (x, y) = ahead.recv().map_err(|_| {
                        Error::Internal(format!("rank {rank}'s batch gatherer stopped"))
                    })??;
                    b.host_batch(x, y)
                }
                None => {
                    self.step_rows(&mut order, rank, step, &mut rows)?;
                    b.batch(&self.data, &rows)
                }
            };
            // Wait for the gather, so that the stall is the gather's time
            // (or the wait for the gatherer) and not only the time to queue
            // it.
            b.sync();
            let gathered = t0.elapsed().as_secs_f64();
            let (mut grads, loss, _) =
                self.model
                    .gradients(&mut b, &params, x, &y, per_rank as usize);
            // Every step every rank says whether it failed (slot 2 + rank)
            // and rank 0 whether to stop: all ranks learn it from the same
            // sum, so none is left waiting in a collective the others skip.
            let stop = rank == 0 && (hooks.cancel.load(Ordering::Acquire) || failure.is_some());
            let mut agree = vec![0.0; 2 + world as usize];
            agree[0] = loss;
            agree[1] = f64::from(u8::from(stop));
            let failed_here = b.failure();
            if failed_here.is_some() {
                agree[2 + rank as usize] = 1.0;
            }
            b.all_reduce_sum_host(&mut agree);
            if let Some(e) = failed_here {
                return Err(Error::Internal(format!(
                    "training rank {rank} failed at step {step} of {total}: {e}"
                )));
            }
            if let Some(r) = (0..world).find(|&r| agree[2 + r as usize] > 0.0) {
                return Err(Error::Aborted(format!(
                    "training rank {rank} stopped at step {step}: rank {r} failed"
                )));
            }
            if agree[1] > 0.0 {
                return Err(failure.take().unwrap_or_else(|| {
                    Error::Aborted(format!("training job cancelled at step {step} of {total}"))
                }));
            }
            // The global batch's loss, the same sum on every rank: all stop
            // together rather than train on NaN to the end. (The data was
            // checked to be finite when the job was prepared: this is the
            // model diverging.)
            if !agree[0].is_finite() {
                return Err(Error::FailedPrecondition(format!(
                    "training stopped at step {step} of {total} (epoch {epoch}): the loss of the \
                     global batch is {} — the model diverged past what f32 holds; start again \
                     with a lower lr (this job's: {})",
                    agree[0], self.spec.lr
                )));
            }
            b.all_reduce_mean(&mut grads);
            opt.update(
                &mut b,
                self.spec.optimizer,
                &mut params,
                &grads,
                self.spec.lr,
                self.spec.weight_decay,
            );
            if rank != 0 {
                continue;
            }
            let done_steps = step + 1;
            stall += gathered;
            busy += t0.elapsed().as_secs_f64();
            loss_sum += agree[0] / global as f64;
            loss_steps += 1;
            let end_of_epoch = in_epoch + 1 == self.steps_per_epoch;
            let mut checkpoint = None;
            if let Some(write) = hooks.checkpoint
                && ((self.spec.checkpoint_every > 0
                    && done_steps % self.spec.checkpoint_every == 0)
                    || done_steps == total)
            {
                let ckpt = self.snapshot(&mut b, &names, &params, &opt, done_steps);
                match write(done_steps, &ckpt) {
                    Ok(url) => checkpoint = Some(url),
                    Err(e) => failure = Some(e),
                }
            }
            if done_steps % report_every == 0 || end_of_epoch || checkpoint.is_some() {
                let secs = since.elapsed().as_secs_f64().max(1e-9);
                last = Progress {
                    epoch,
                    step: done_steps,
                    total_steps: total,
                    loss: loss_sum / loss_steps as f64,
                    samples_per_second: (done_steps - since_step) as f64 * global as f64 / secs,
                    data_stall_seconds: stall,
                    data_stall_fraction: if busy > 0.0 { stall / busy } else { 0.0 },
                    accuracy: None,
                    checkpoint,
                    done: false,
                };
                (hooks.progress)(&last);
                (loss_sum, loss_steps, stall, busy) = (0.0, 0, 0.0, 0.0);
                since = Instant::now();
                since_step = done_steps;
            }
        }
        if let Some(e) = failure.or_else(|| b.failure().map(Error::Internal)) {
            return Err(e);
        }
        if rank != 0 {
            return Ok(None);
        }
        let host: Vec<Vec<f32>> = params.iter().map(|p| b.download(p)).collect();
        let (loss, accuracy) = self.evaluate(&mut b, &params);
        last.step = total;
        last.total_steps = total;
        last.epoch = total.saturating_sub(1) / self.steps_per_epoch;
        last.loss = loss;
        last.accuracy = accuracy;
        // With a checkpoint hook the last step always writes one and reports
        // it, so `last.checkpoint` is the final checkpoint (or none).
        last.done = true;
        (hooks.progress)(&last);
        Ok(Some(Outcome {
            params: host,
            steps: total,
            last,
        }))
    }

    /// Mean loss and (classification) accuracy over every row.
    fn evaluate<B: Backend>(&self, b: &mut B, params: &[B::Buf]) -> (f64, Option<f64>) {
        const CHUNK: u64 = 4096;
        let n = self.data.rows();
        let (mut loss, mut correct) = (0.0, 0u64);
        let mut at = 0;
        while at < n {
            let end = (at + CHUNK).min(n);
            let rows: Vec<u64> = (at..end).collect();
            let (x, y) = b.batch(&self.data, &rows);
            let (l, c) = self.model.evaluate(b, params, x, &y, (end - at) as usize);
            loss += l;
            correct += c;
            at = end;
        }
        let accuracy = matches!(self.model.task, Task::Classification { .. })
            .then(|| correct as f64 / n as f64);
        (loss / n as f64, accuracy)
    }

    fn snapshot<B: Backend>(
        &self,
        b: &mut B,
        names: &[(String, Vec<usize>)],
        params: &[B::Buf],
        opt: &OptState<B>,
        step: u64,
    ) -> Checkpoint {
        let mut c = Checkpoint::default();
        for (i, (name, shape)) in names.iter().enumerate() {
            let mut put = |key: String, buf: &B::Buf| {
                c.tensors.insert(
                    key,
                    Tensor {
                        shape: shape.clone(),
                        data: b.download(buf),
                    },
                );
            };
            put(name.clone(), &params[i]);
            put(format!("optim.m.{name}"), &opt.m[i]);
            if let Some(v) = opt.v.get(i) {
                put(format!("optim.v.{name}"), v);
            }
        }
        for (k, v) in [
            ("format", "flightdeck-checkpoint-1".to_string()),
            ("step", step.to_string()),
            ("epoch", (step / self.steps_per_epoch).to_string()),
            (
                "sample_position",
                ((step % self.steps_per_epoch) * u64::from(self.spec.global_batch)).to_string(),
            ),
        ]
        .into_iter()
        .chain(self.resume_fields())
        {
            c.metadata.insert(k.to_string(), v);
        }
        c
    }

    fn restore<B: Backend>(
        &self,
        b: &mut B,
        c: &Checkpoint,
        step: u64,
    ) -> Result<(Vec<B::Buf>, OptState<B>)> {
        let mut opt = OptState::new(b, &self.model, self.spec.optimizer);
        let mut params = Vec::new();
        for (i, (name, shape)) in self.model.tensors().iter().enumerate() {
            let mut get = |key: &str| {
                c.tensors
                    .get(key)
                    .filter(|t| &t.shape == shape)
                    .map(|t| b.upload(&t.data))
                    .ok_or_else(|| {
                        Error::invalid(format!(
                            "the checkpoint has no tensor '{key}' of shape {shape:?}"
                        ))
                    })
            };
            params.push(get(name)?);
            opt.m[i] = get(&format!("optim.m.{name}"))?;
            if !opt.v.is_empty() {
                opt.v[i] = get(&format!("optim.v.{name}"))?;
            }
        }
        opt.t = step;
        Ok((params, opt))
    }
}

/// The most hidden layers a job may ask for.
pub const MAX_HIDDEN_LAYERS: usize = 64;

/// The widest layer a job may ask for (hidden units or classes).
pub const MAX_WIDTH: usize = 1 << 20;

/// The most parameters a model may have: 2^26 `f32` are 256 MiB, about
/// 1 GiB with their gradients and AdamW's two moments.
pub const MAX_PARAMETERS: u64 = 1 << 26;

/// The most activations one rank's batch may take through the model: 2^27
/// `f32` are 512 MiB.
pub const MAX_ACTIVATIONS: u64 = 1 << 27;

/// Refuses models (and batches through them) too large to train here, before
/// anything of their size is allocated.
fn check_model_size(model: &Model, rank_batch: u32) -> Result<()> {
    let params = model.parameter_count().unwrap_or(u64::MAX);
    if params > MAX_PARAMETERS {
        return Err(Error::invalid(format!(
            "the model would have {params} parameters; at most {MAX_PARAMETERS} are allowed: use \
             narrower or fewer layers, or fewer features"
        )));
    }
    let activations = model.units().saturating_mul(u64::from(rank_batch));
    if activations > MAX_ACTIVATIONS {
        return Err(Error::invalid(format!(
            "a rank's batch of {rank_batch} rows through {} units needs {activations} \
             activations; at most {MAX_ACTIVATIONS} are allowed: use a smaller global batch or \
             narrower layers",
            model.units()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
