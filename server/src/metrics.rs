//! Prometheus metrics, served as OpenMetrics text on `/metrics` of
//! `--metrics-listen`.
//!
//! Two kinds: what the server *did* is counted where it happens, in
//! [`Metrics`] (calls by method and code with their durations, streams in
//! flight, each rank's rows, bytes and read time, rows and bytes committed
//! per dataset, attempts, seals, spills, restores and packed-copy builds
//! with their durations, time to a read's first batch); what it *holds* is
//! read from the [`State`] at each scrape (`StateCollector`: memory per
//! tier and the budget, datasets, traffic totals, training jobs). Labels
//! are bounded:
//! method names, status codes, dataset names, ranks and job ids — never
//! per-request values; a dropped dataset's label sets go with it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use tracing::info;

use crate::state::{State, Tally};

/// A gRPC method.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MethodLabel {
    /// `DoGet`, `DoPut`, `DoAction`, … (the last part of the gRPC path).
    pub method: String,
}

/// A gRPC method and the status code it ended with.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CallLabels {
    /// The method.
    pub method: String,
    /// The status code's name (`OK`, `RESOURCE_EXHAUSTED`, …).
    pub code: String,
}

/// One dataset.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DatasetLabel {
    /// The dataset's name.
    pub dataset: String,
}

/// One rank of a dataset's reads.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RankLabels {
    /// The dataset's name.
    pub dataset: String,
    /// The rank.
    pub rank: u32,
}

/// How a write attempt or a SQL query ended.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    /// A write attempt's `committed` or `aborted`; a query's
    /// [`QueryOutcome`] word.
    pub outcome: &'static str,
}

/// How a SQL query (a statement or a `derive`) ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueryOutcome {
    /// It produced its whole result.
    Done,
    /// It failed (an error of the engine, memory), its error sent.
    Failed,
    /// Its client went away before its end, and it stopped there.
    GivenUp,
}

impl QueryOutcome {
    /// The outcome's label value.
    pub fn word(self) -> &'static str {
        match self {
            Self::Done => "done",
            Self::Failed => "failed",
            Self::GivenUp => "given_up",
        }
    }
}

/// One training job.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct JobLabels {
    job: u64,
    dataset: String,
}

/// A tier of memory.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierLabel {
    tier: &'static str,
}

/// Ended training jobs `/metrics` still shows (the newest); running jobs
/// are always shown, and `flightdeck jobs` lists every job.
pub const ENDED_JOBS_SHOWN: usize = 16;

/// Ranks with a label set of their own in the per-rank metrics.
pub const MAX_RANK_LABELS: u32 = 4096;

type Seconds = Family<MethodLabel, Histogram, fn() -> Histogram>;

/// Buckets from 1 ms to about 9 minutes, doubling.
fn seconds_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 20))
}

/// What the server did, counted where it happens. Cheap to update: atomics
/// behind a map lookup per label set.
#[derive(Debug)]
pub struct Metrics {
    calls: Family<CallLabels, Counter>,
    call_seconds: Seconds,
    active: Family<MethodLabel, Gauge>,
    first_batch_seconds: Histogram,
    rank_rows: Family<RankLabels, Counter>,
    rank_bytes: Family<RankLabels, Counter>,
    rank_seconds: Family<RankLabels, Counter<f64, AtomicU64>>,
    committed_rows: Family<DatasetLabel, Counter>,
    committed_bytes: Family<DatasetLabel, Counter>,
    attempts: Family<OutcomeLabel, Counter>,
    seals: Counter,
    spill_seconds: Histogram,
    restore_seconds: Histogram,
    pack_seconds: Histogram,
    queries_running: Gauge,
    queries: Family<OutcomeLabel, Counter>,
    query_seconds: Histogram,
    credential_reloads: Family<OutcomeLabel, Counter>,
    store_beats: Family<OutcomeLabel, Counter>,
    stopped_sessions_removed: Counter,
    in_flight: AtomicU64,
    /// Per dataset, one past the highest rank its reads have label sets
    /// for: what [`Metrics::forget`] removes.
    rank_bounds: Mutex<HashMap<String, u32>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            calls: Family::default(),
            call_seconds: Family::new_with_constructor(seconds_histogram),
            active: Family::default(),
            first_batch_seconds: seconds_histogram(),
            rank_rows: Family::default(),
            rank_bytes: Family::default(),
            rank_seconds: Family::default(),
            committed_rows: Family::default(),
            committed_bytes: Family::default(),
            attempts: Family::default(),
            seals: Counter::default(),
            spill_seconds: seconds_histogram(),
            restore_seconds: seconds_histogram(),
            pack_seconds: seconds_histogram(),
            queries_running: Gauge::default(),
            queries: Family::default(),
            query_seconds: seconds_histogram(),
            credential_reloads: Family::default(),
            store_beats: Family::default(),
            stopped_sessions_removed: Counter::default(),
            in_flight: AtomicU64::new(0),
            rank_bounds: Mutex::default(),
        }
    }
}

impl Metrics {
    /// A call of `method` from `peer` started; the guard ends it.
    pub fn call(self: &Arc<Self>, method: &str, peer: Option<SocketAddr>) -> CallGuard {
        let method = MethodLabel {
            method: method.to_string(),
        };
        self.active.get_or_create(&method).inc();
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        CallGuard {
            metrics: self.clone(),
            method,
            peer,
            started: Instant::now(),
            read: None,
            detail: CallDetail::default(),
            ended: false,
        }
    }

    /// Calls in flight (streams included).
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Acquire)
    }

    /// A read stream sent its first batch `after` its call started.
    pub fn first_batch(&self, after: Duration) {
        self.first_batch_seconds.observe(after.as_secs_f64());
    }

    /// A rank's stream of `dataset` ended after `rows` rows and `bytes`
    /// bytes of batches in `took`.
    /// Ranks from [`MAX_RANK_LABELS`] on are left out (the server totals
    /// still count them), so that a plan of a huge world cannot grow the
    /// label sets without bound.
    pub fn rank_read(&self, dataset: &str, rank: u32, rows: u64, bytes: u64, took: Duration) {
        if rank >= MAX_RANK_LABELS {
            return;
        }
        let labels = RankLabels {
            dataset: dataset.to_string(),
            rank,
        };
        self.rank_rows.get_or_create(&labels).inc_by(rows);
        self.rank_bytes.get_or_create(&labels).inc_by(bytes);
        self.rank_seconds
            .get_or_create(&labels)
            .inc_by(took.as_secs_f64());
        let mut bounds = self.rank_bounds.lock().unwrap_or_else(|e| e.into_inner());
        let bound = bounds.entry(labels.dataset).or_default();
        *bound = (*bound).max(rank + 1);
    }

    /// Removes the label sets of a dataset that was dropped — its rows and
    /// bytes committed and each rank's reads — so that a server whose jobs
    /// write a dataset a day (`clicks-2026-11-29`) and drop old ones does
    /// not keep series for every dataset it ever held.
    pub fn forget(&self, dataset: &str) {
        let labels = DatasetLabel {
            dataset: dataset.to_string(),
        };
        self.committed_rows.remove(&labels);
        self.committed_bytes.remove(&labels);
        let bound = self
            .rank_bounds
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(dataset);
        for rank in 0..bound.unwrap_or(0) {
            let labels = RankLabels {
                dataset: dataset.to_string(),
                rank,
            };
            self.rank_rows.remove(&labels);
            self.rank_bytes.remove(&labels);
            self.rank_seconds.remove(&labels);
        }
    }

    /// A write attempt of `dataset` was committed with `rows` and `bytes`.
    pub fn committed(&self, dataset: &str, rows: u64, bytes: u64) {
        let labels = DatasetLabel {
            dataset: dataset.to_string(),
        };
        self.committed_rows.get_or_create(&labels).inc_by(rows);
        self.committed_bytes.get_or_create(&labels).inc_by(bytes);
        self.attempts
            .get_or_create(&OutcomeLabel {
                outcome: "committed",
            })
            .inc();
    }

    /// A write attempt ended without a commit (refused, failed, cut off).
    pub fn aborted(&self) {
        self.attempts
            .get_or_create(&OutcomeLabel { outcome: "aborted" })
            .inc();
    }

    /// Credential files that changed were read again: `taken` are in use,
    /// `refused` could not be (the server goes on with the previous ones).
    pub fn credentials_read(&self, taken: usize, refused: usize) {
        for (outcome, n) in [("taken", taken), ("refused", refused)] {
            if n > 0 {
                self.credential_reloads
                    .get_or_create(&OutcomeLabel { outcome })
                    .inc_by(n as u64);
            }
        }
    }

    /// This server wrote its records in the spill store (a beat), or
    /// failed to (`ok` false).
    pub fn store_beat(&self, ok: bool) {
        let outcome = if ok { "ok" } else { "failed" };
        self.store_beats
            .get_or_create(&OutcomeLabel { outcome })
            .inc();
    }

    /// `n` spill folders of servers that stopped without shutting down
    /// were removed from the store.
    pub fn stopped_sessions_removed(&self, n: usize) {
        self.stopped_sessions_removed.inc_by(n as u64);
    }

    /// A dataset was sealed.
    pub fn sealed(&self) {
        self.seals.inc();
    }

    /// A dataset was spilled in `took`.
    pub fn spilled(&self, took: Duration) {
        self.spill_seconds.observe(took.as_secs_f64());
    }

    /// A dataset was brought back from the store in `took`.
    pub fn restored(&self, took: Duration) {
        self.restore_seconds.observe(took.as_secs_f64());
    }

    /// A dataset's packed copy of rows for scattered reads was built in
    /// `took`.
    pub fn packed(&self, took: Duration) {
        self.pack_seconds.observe(took.as_secs_f64());
    }

    /// A SQL query started running; the guard, ended with how it ended,
    /// counts it (a guard dropped without [`QueryGuard::end`] counts the
    /// query as given up).
    pub fn query_started(self: &Arc<Self>) -> QueryGuard {
        self.queries_running.inc();
        QueryGuard {
            metrics: self.clone(),
            started: Instant::now(),
            outcome: QueryOutcome::GivenUp,
        }
    }

    /// SQL queries running now, and those ended since start by outcome
    /// (`[done, failed, given_up]`).
    pub fn query_counts(&self) -> (u64, [u64; 3]) {
        let ended = [
            QueryOutcome::Done,
            QueryOutcome::Failed,
            QueryOutcome::GivenUp,
        ]
        .map(|o| {
            self.queries
                .get_or_create(&OutcomeLabel { outcome: o.word() })
                .get()
        });
        (self.queries_running.get().max(0) as u64, ended)
    }

    /// A registry holding these metrics and, read at each scrape, what
    /// `state` holds.
    pub fn registry(&self, state: Weak<State>) -> Registry {
        let mut r = Registry::with_prefix("flightdeck");
        r.register(
            "calls",
            "gRPC calls ended, by method and status code (refusals included)",
            self.calls.clone(),
        );
        r.register(
            "call_duration_seconds",
            "gRPC call durations, to the end of the response stream",
            self.call_seconds.clone(),
        );
        r.register(
            "active_calls",
            "gRPC calls in flight (open streams included)",
            self.active.clone(),
        );
        r.register(
            "read_first_batch_seconds",
            "time from a DoGet call to its first record batch",
            self.first_batch_seconds.clone(),
        );
        r.register(
            "rank_rows_served",
            "rows streamed to each rank by finished DoGet streams",
            self.rank_rows.clone(),
        );
        r.register(
            "rank_bytes_served",
            "bytes of record batches streamed to each rank by finished DoGet streams",
            self.rank_bytes.clone(),
        );
        r.register(
            "rank_read_seconds",
            "seconds each rank's DoGet streams took, first call to last byte (a slow rank stands out)",
            self.rank_seconds.clone(),
        );
        r.register(
            "committed_rows",
            "rows of committed write attempts, per dataset",
            self.committed_rows.clone(),
        );
        r.register(
            "committed_bytes",
            "bytes of committed write attempts, per dataset",
            self.committed_bytes.clone(),
        );
        r.register(
            "attempts",
            "write attempts ended, committed or aborted",
            self.attempts.clone(),
        );
        r.register("seals", "datasets sealed", self.seals.clone());
        r.register(
            "credential_reloads",
            "credential files (tokens, TLS certificate and key, member roots) read again after \
             they changed, on SIGHUP or the 10 s check: taken, or refused as unusable (the server \
             goes on with the previous ones: alert on refused)",
            self.credential_reloads.clone(),
        );
        r.register(
            "store_beats",
            "rewrites of this server's records in the spill store every 10 s (while it has \
             spill files, and always with --persist): ok, or failed (the store does not answer: \
             alert on failed, spills and persists will fail too)",
            self.store_beats.clone(),
        );
        r.register(
            "stopped_sessions_removed",
            "spill folders of servers that stopped without shutting down, removed from the \
             store by this server",
            self.stopped_sessions_removed.clone(),
        );
        r.register(
            "spill_duration_seconds",
            "time to spill a dataset to the store",
            self.spill_seconds.clone(),
        );
        r.register(
            "restore_duration_seconds",
            "time to bring a spilled dataset back",
            self.restore_seconds.clone(),
        );
        r.register(
            "pack_duration_seconds",
            "time to build a dataset's packed copy of rows, which its scattered reads wait for \
             (one build a dataset; a count that grows each epoch means the copy is given up for \
             memory and built again)",
            self.pack_seconds.clone(),
        );
        r.register(
            "queries_running",
            "SQL queries (statements and derive) running on the query threads",
            self.queries_running.clone(),
        );
        r.register(
            "queries",
            "SQL queries ended: done, failed, or given_up (the client went away first)",
            self.queries.clone(),
        );
        r.register(
            "query_duration_seconds",
            "SQL query run times, from the start of execution to its end",
            self.query_seconds.clone(),
        );
        r.register_collector(Box::new(StateCollector(state)));
        r
    }
}

/// A running SQL query, for the query metrics.
#[derive(Debug)]
pub struct QueryGuard {
    metrics: Arc<Metrics>,
    started: Instant,
    outcome: QueryOutcome,
}

impl QueryGuard {
    /// The query ended so.
    pub fn end(mut self, outcome: QueryOutcome) {
        self.outcome = outcome;
    }
}

impl Drop for QueryGuard {
    fn drop(&mut self) {
        let m = &self.metrics;
        m.queries_running.dec();
        m.queries
            .get_or_create(&OutcomeLabel {
                outcome: self.outcome.word(),
            })
            .inc();
        m.query_seconds
            .observe(self.started.elapsed().as_secs_f64());
    }
}

/// Ends a call: counts it with its code, observes its duration and logs
/// one line for it. Dropped without [`CallGuard::end`], the call counts as
/// `CANCELLED` (the client went away before the response ended).
#[derive(Debug)]
pub struct CallGuard {
    metrics: Arc<Metrics>,
    method: MethodLabel,
    peer: Option<SocketAddr>,
    started: Instant,
    read: Option<ReadStream>,
    detail: CallDetail,
    ended: bool,
}

/// What a handler behind the edge says about its call, for the call's log
/// line: the edge puts one in the request's extensions, `DoPut` fills it.
#[derive(Debug, Default, Clone)]
pub struct CallDetail(Arc<std::sync::Mutex<Option<WriteDetail>>>);

/// A committed write attempt.
#[derive(Debug, Clone)]
pub struct WriteDetail {
    /// The dataset written.
    pub dataset: String,
    /// Its partition.
    pub partition: u32,
    /// The attempt.
    pub attempt: u32,
    /// Rows committed.
    pub rows: u64,
    /// Bytes committed.
    pub bytes: u64,
}

impl CallDetail {
    /// The call committed `write`.
    pub fn wrote(&self, write: WriteDetail) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(write);
    }

    fn take(&self) -> Option<WriteDetail> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// The `DoGet` stream a call serves.
#[derive(Debug)]
struct ReadStream {
    dataset: String,
    rank: u32,
    for_peer: bool,
    tally: Arc<Tally>,
    first_batch: bool,
}

impl CallGuard {
    /// A handle for the handler behind the edge to describe the call.
    pub fn detail(&self) -> CallDetail {
        self.detail.clone()
    }

    /// The call serves `rank`'s stream of `dataset` (for another member's
    /// rank with `for_peer`), whose rows and bytes `tally` counts.
    pub fn reading(&mut self, dataset: &str, rank: u32, for_peer: bool, tally: Arc<Tally>) {
        self.read = Some(ReadStream {
            dataset: dataset.to_string(),
            rank,
            for_peer,
            tally,
            first_batch: false,
        });
    }

    /// The call's stream sent a piece of a batch.
    pub fn sent_data(&mut self) {
        if let Some(read) = &mut self.read
            && !std::mem::replace(&mut read.first_batch, true)
        {
            self.metrics.first_batch(self.started.elapsed());
        }
    }

    /// The call ended with `code`.
    pub fn end(mut self, code: tonic::Code) {
        self.finish(code);
    }

    fn finish(&mut self, code: tonic::Code) {
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        let m = &self.metrics;
        let took = self.started.elapsed();
        m.in_flight.fetch_sub(1, Ordering::AcqRel);
        m.active.get_or_create(&self.method).dec();
        m.call_seconds
            .get_or_create(&self.method)
            .observe(took.as_secs_f64());
        let code = code_name(code);
        m.calls
            .get_or_create(&CallLabels {
                method: self.method.method.clone(),
                code: code.to_string(),
            })
            .inc();
        let method = self.method.method.as_str();
        let peer = self.peer.map(|p| p.to_string()).unwrap_or_default();
        let ms = took.as_secs_f64() * 1e3;
        match &self.read {
            Some(r) => {
                let rows = r.tally.rows.load(Ordering::Relaxed);
                let bytes = r.tally.bytes.load(Ordering::Relaxed);
                if !r.for_peer {
                    m.rank_read(&r.dataset, r.rank, rows, bytes, took);
                }
                info!(
                    method,
                    dataset = %r.dataset,
                    rank = r.rank,
                    for_peer = r.for_peer,
                    rows,
                    bytes,
                    ms,
                    peer,
                    code,
                    "call"
                );
            }
            None => match self.detail.take() {
                Some(w) => info!(
                    method,
                    dataset = %w.dataset,
                    partition = w.partition,
                    attempt = w.attempt,
                    rows = w.rows,
                    bytes = w.bytes,
                    ms,
                    peer,
                    code,
                    "call"
                ),
                None => info!(method, ms, peer, code, "call"),
            },
        }
    }
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        self.finish(tonic::Code::Cancelled);
    }
}

/// A status code's name as gRPC writes it (`RESOURCE_EXHAUSTED`).
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

/// What the server holds, read from its state at each scrape.
#[derive(Debug)]
struct StateCollector(Weak<State>);

/// Writes one unlabelled metric.
fn one(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    metric: &impl EncodeMetric,
) -> std::fmt::Result {
    metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)
}

/// Writes one metric with a value per label set.
fn family<L: EncodeLabelSet, M: EncodeMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    kind: MetricType,
    values: &[(L, M)],
) -> std::fmt::Result {
    let mut metric = encoder.encode_descriptor(name, help, None, kind)?;
    for (labels, value) in values {
        value.encode(metric.encode_family(labels)?)?;
    }
    Ok(())
}

impl Collector for StateCollector {
    fn encode(&self, mut e: DescriptorEncoder) -> std::fmt::Result {
        let Some(state) = self.0.upgrade() else {
            return Ok(());
        };
        let tiers = state.tier_stats();
        let (datasets, totals, staged) = {
            let catalog = state.catalog();
            (catalog.list(), catalog.totals(), catalog.staged(None))
        };
        let t = &state.traffic;
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let gauge = |v: u64| ConstGauge::new(v);
        let counter = |v: u64| ConstCounter::new(v);
        one(
            &mut e,
            "memory_limit_bytes",
            "the memory budget (--memory-limit)",
            &gauge(tiers.budget_limit),
        )?;
        one(
            &mut e,
            "memory_used_bytes",
            "bytes of the memory budget in use, staged attempts included",
            &gauge(tiers.budget_used),
        )?;
        one(
            &mut e,
            "memory_used_peak_bytes",
            "the most of the memory budget in use at once since start",
            &gauge(tiers.budget_peak),
        )?;
        let tier_bytes = [
            (TierLabel { tier: "held" }, gauge(tiers.arena.held_bytes)),
            (TierLabel { tier: "live" }, gauge(tiers.arena.live_bytes)),
            (TierLabel { tier: "idle" }, gauge(tiers.arena.idle_bytes)),
            (TierLabel { tier: "packed" }, gauge(totals.packed_bytes)),
            (TierLabel { tier: "device" }, gauge(tiers.device_bytes)),
            (
                TierLabel { tier: "pinned" },
                gauge(if tiers.arena.pinned {
                    tiers.arena.held_bytes
                } else {
                    0
                }),
            ),
            (
                TierLabel { tier: "spilled" },
                gauge(
                    datasets
                        .iter()
                        .filter(|d| !d.resident)
                        .map(|d| d.bytes)
                        .sum(),
                ),
            ),
        ];
        family(
            &mut e,
            "memory_bytes",
            "bytes per tier: host arena slabs held, live data in them, idle slabs, packed row \
             copies (part of live), placed GPU columns, page-locked slabs (held, when pinned), \
             datasets only in the spill store",
            MetricType::Gauge,
            &tier_bytes,
        )?;
        one(
            &mut e,
            "host_memory_pinned",
            "1 when the host arena's slabs are page-locked (a CUDA driver is present)",
            &gauge(u64::from(tiers.arena.pinned)),
        )?;
        one(
            &mut e,
            "credential_files_refused",
            "credentials (tokens, certificate and key, member roots) whose files changed to \
             something the server refused: it uses what it read before until they are fixed",
            &gauge(state.credentials.refused_now() as u64),
        )?;
        if let Some(expiry) = state.credentials.certificate_expiry() {
            one(
                &mut e,
                "tls_certificate_expiry_timestamp_seconds",
                "when the certificate served (--tls-cert) expires: the earliest notAfter of its \
                 chain, in seconds since the Unix epoch",
                &gauge(expiry.at.as_secs()),
            )?;
        }
        one(
            &mut e,
            "datasets",
            "datasets on the server",
            &gauge(datasets.len() as u64),
        )?;
        one(
            &mut e,
            "spilled_datasets",
            "sealed datasets held only in the spill store",
            &gauge(u64::from(totals.spilled)),
        )?;
        one(
            &mut e,
            "spills",
            "datasets spilled since start",
            &counter(tiers.spills),
        )?;
        one(
            &mut e,
            "restores",
            "spilled datasets brought back since start",
            &counter(tiers.restores),
        )?;
        let per_dataset = |f: &dyn Fn(&crate::catalog::DatasetSummary) -> u64| {
            datasets
                .iter()
                .map(|d| {
                    (
                        DatasetLabel {
                            dataset: d.name.clone(),
                        },
                        gauge(f(d)),
                    )
                })
                .collect::<Vec<_>>()
        };
        family(
            &mut e,
            "dataset_rows",
            "rows each dataset holds (committed winners once sealed)",
            MetricType::Gauge,
            &per_dataset(&|d| d.rows),
        )?;
        family(
            &mut e,
            "dataset_bytes",
            "bytes each dataset holds",
            MetricType::Gauge,
            &per_dataset(&|d| d.bytes),
        )?;
        family(
            &mut e,
            "dataset_sealed",
            "1 for a sealed dataset, 0 for an open one",
            MetricType::Gauge,
            &per_dataset(&|d| u64::from(d.state == crate::catalog::DatasetState::Sealed)),
        )?;
        // Overwrites under way: what each has staged, by the dataset it
        // replaces (several writes of one dataset add up).
        let mut replacing: std::collections::BTreeMap<&str, u64> = Default::default();
        for w in &staged {
            *replacing.entry(w.dataset.as_str()).or_default() += w.summary.bytes;
        }
        let replacing: Vec<_> = replacing
            .into_iter()
            .map(|(dataset, bytes)| {
                let label = DatasetLabel {
                    dataset: dataset.to_string(),
                };
                (label, gauge(bytes))
            })
            .collect();
        family(
            &mut e,
            "overwrite_staged_bytes",
            "bytes that overwrites under way have staged to replace each dataset (shown once \
             sealed; part of memory_used_bytes)",
            MetricType::Gauge,
            &replacing,
        )?;
        for (name, help, rows, bytes) in [
            (
                "served",
                "streamed to ranks reading from this server",
                &t.rows_served,
                &t.bytes_served,
            ),
            (
                "served_to_peers",
                "streamed to other members for their ranks",
                &t.rows_to_peers,
                &t.bytes_to_peers,
            ),
            (
                "fetched_from_peers",
                "fetched from other members for this server's ranks",
                &t.rows_from_peers,
                &t.bytes_from_peers,
            ),
        ] {
            one(
                &mut e,
                &format!("rows_{name}"),
                &format!("rows {help}"),
                &counter(load(rows)),
            )?;
            one(
                &mut e,
                &format!("bytes_{name}"),
                &format!("bytes of record batches {help}"),
                &counter(load(bytes)),
            )?;
        }
        let mut jobs = state.jobs(0).unwrap_or_default();
        // Every running job, and the newest ended ones: a server that runs a
        // job an hour does not export each one it ever ran.
        jobs.sort_by_key(|j| std::cmp::Reverse(j.id));
        let mut ended = 0;
        jobs.retain(|j| {
            ended += usize::from(j.state != "running");
            j.state == "running" || ended <= ENDED_JOBS_SHOWN
        });
        let per_job = |f: &dyn Fn(&crate::jobs::JobStatus) -> f64| {
            jobs.iter()
                .map(|j| {
                    (
                        JobLabels {
                            job: j.id,
                            dataset: j.dataset.clone(),
                        },
                        ConstGauge::new(f(j)),
                    )
                })
                .collect::<Vec<_>>()
        };
        family(
            &mut e,
            "job_running",
            "1 while a training job runs",
            MetricType::Gauge,
            &per_job(&|j| f64::from(u8::from(j.state == "running"))),
        )?;
        family(
            &mut e,
            "job_step",
            "steps a training job has finished",
            MetricType::Gauge,
            &per_job(&|j| j.last.step as f64),
        )?;
        family(
            &mut e,
            "job_loss",
            "a training job's mean loss over its last report",
            MetricType::Gauge,
            &per_job(&|j| j.last.loss),
        )?;
        family(
            &mut e,
            "job_samples_per_second",
            "a training job's samples per second over its last report",
            MetricType::Gauge,
            &per_job(&|j| j.last.samples_per_second),
        )?;
        family(
            &mut e,
            "job_data_stall_fraction",
            "share of a training job's step time spent waiting for its batch",
            MetricType::Gauge,
            &per_job(&|j| j.last.data_stall_fraction),
        )?;
        family(
            &mut e,
            "job_step_seconds",
            "a training job's seconds per step over its last report",
            MetricType::Gauge,
            &per_job(&|j| {
                if j.last.samples_per_second > 0.0 {
                    f64::from(j.batch_size) / j.last.samples_per_second
                } else {
                    0.0
                }
            }),
        )?;
        Ok(())
    }
}

/// Serves `/metrics` on `listener` until `shutdown` completes.
pub async fn serve(
    listener: tokio::net::TcpListener,
    registry: Registry,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let registry = std::sync::Arc::new(registry);
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let registry = registry.clone();
            async move {
                let mut body = String::new();
                match prometheus_client::encoding::text::encode(&mut body, &registry) {
                    Ok(()) => (
                        http::StatusCode::OK,
                        [(
                            http::header::CONTENT_TYPE,
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        body,
                    ),
                    Err(e) => (
                        http::StatusCode::INTERNAL_SERVER_ERROR,
                        [(http::header::CONTENT_TYPE, "text/plain; charset=utf-8")],
                        format!("cannot encode the metrics: {e}"),
                    ),
                }
            }
        }),
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}
