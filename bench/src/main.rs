//! `flightdeck-bench`: measures flightdeck on this machine against pyarrow's
//! C++ Flight server, the Parquet path and the machine's own limits.
//!
//! It generates a synthetic dataset in memory, starts a flightdeck server as
//! a child process on a free loopback port (so its peak memory can be read),
//! and runs the phases `put`, `get`, `e2e` and `limit` (and, on a GPU
//! machine, `h2d`; with `--members N`, `cluster`), each `--reps` times,
//! baselines interleaved with flightdeck run by run. A table goes to stdout,
//! `--json FILE` writes every figure, progress goes to stderr.

mod data;
mod h2d;
mod phases;
mod report;

use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Arc;

use clap::Parser;
use flightdeck_client::{Client, Shuffle};
use futures::StreamExt;
use serde_json::json;

use data::Shape;
use phases::BoxError;
use report::{Measured, Sample};

/// Benchmark flightdeck against pyarrow Flight, the Parquet path and the
/// machine's limits.
#[derive(Debug, Parser)]
#[command(name = "flightdeck-bench", version, about)]
struct Args {
    /// Rows of the synthetic dataset.
    #[arg(long, default_value_t = 4_000_000, value_parser = at_least_one::<u64>())]
    rows: u64,
    /// Float32 features per row.
    #[arg(long, default_value_t = 64)]
    features: usize,
    /// Features as one `fixed_size_list<float32>[features]` column.
    #[arg(long, conflicts_with = "list")]
    vector: bool,
    /// Features as one `list<float32>` column of `features` values a row
    /// (as Spark writes `array<float>`).
    #[arg(long)]
    list: bool,
    /// Partitions (DoPut streams).
    #[arg(long, default_value_t = 16, value_parser = at_least_one::<usize>())]
    partitions: usize,
    /// Concurrent writers for put.
    #[arg(long, default_value_t = 4, value_parser = at_least_one::<usize>())]
    writers: usize,
    /// Concurrent ranks for get.
    #[arg(long, default_value_t = 8, value_parser = at_least_one::<u32>())]
    ranks: u32,
    /// Rows per record batch, written and read.
    #[arg(long, default_value_t = 16_384, value_parser = at_least_one::<u32>())]
    batch_rows: u32,
    /// Shuffle modes for get: none, global, block.
    #[arg(long, value_delimiter = ',', default_value = "none,global,block")]
    shuffle: Vec<String>,
    /// Phases: put, get, e2e, limit, h2d (GPU only: host-to-device
    /// bandwidth from the arena vs pinned and pageable memory), cluster,
    /// filter (a global read of the rows a 50 % filter selects against
    /// one of every row, and the first plan's selection cost), gather
    /// (every rank's shard in each --shuffle order gathered in this
    /// process, without a server or a socket, on 1, 2, 4, … threads a
    /// batch), and small (200 reads of 16 rows one after another, each
    /// planned: what a short read costs, by its p50 and p99).
    #[arg(long, value_delimiter = ',', default_value = "put,get,e2e,limit")]
    phases: Vec<String>,
    /// Bytes copied per h2d repetition.
    #[arg(long, default_value_t = 1 << 30)]
    h2d_bytes: usize,
    /// Baselines: pyarrow, parquet (empty for none).
    #[arg(long, value_delimiter = ',', default_value = "pyarrow,parquet")]
    baseline: Vec<String>,
    /// Repetitions of every phase; medians are reported. The `get` and
    /// `cluster` reads run two more epochs first, reported apart as
    /// `…/first` (a shuffled read packs rows from its second epoch on).
    #[arg(long, default_value_t = 3, value_parser = at_least_one::<usize>())]
    reps: usize,
    /// Seed of the data.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Use a running flightdeck server instead of starting one.
    #[arg(long)]
    server: Option<String>,
    /// The flightdeck binary to start (default: next to this one).
    #[arg(long)]
    server_bin: Option<PathBuf>,
    /// One more argument for every server process this tool starts (repeat for
    /// several: `--server-arg=--gather-threads --server-arg=1`).
    #[arg(long = "server-arg", allow_hyphen_values = true)]
    server_args: Vec<String>,
    /// Run the server inside this process instead (no peak RSS figure).
    #[arg(long)]
    in_process: bool,
    /// Serve the started server also on a Unix domain socket and read and
    /// write it there (`grpc+unix://`); `limit` then measures a Unix socket
    /// beside loopback TCP. (Baselines stay on TCP.)
    #[arg(long)]
    unix: bool,
    /// Also read each `get` phase through the server's shared memory (the
    /// target `flightdeck-shm`), beside the reads over the connection that
    /// the ratios and targets use.
    #[arg(long)]
    shm: bool,
    /// Python with pyarrow for the pyarrow baseline (default: .venv's, else python3).
    #[arg(long)]
    python: Option<PathBuf>,
    /// Write every figure here as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Members of a cluster for the `cluster` phase (each its own server
    /// process, partition p on member p mod N): one node's ranks reading
    /// LOCALITY_NODE and all ranks reading LOCALITY_GLOBAL, against a
    /// single server holding every partition.
    #[arg(long, default_value_t = 3, value_parser = at_least_one::<usize>())]
    members: usize,
    /// Serve the started server over TLS with this certificate (PEM); the
    /// bench's clients trust the file `FLIGHTDECK_TLS_ROOT_CERTS` names.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key of `--tls-cert` (PEM).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Start the server with this `--auth-token-file`; the bench's clients
    /// send the token `FLIGHTDECK_TOKEN` holds.
    #[arg(long)]
    auth_token_file: Option<PathBuf>,
}

/// A count flag's parser: a whole number, 1 or more (no phase runs on 0
/// rows, partitions, writers, ranks, repetitions or members).
fn at_least_one<T>() -> clap::builder::RangedU64ValueParser<T>
where
    T: TryFrom<u64> + Clone + Send + Sync + 'static,
    <T as TryFrom<u64>>::Error: std::error::Error + Send + Sync + 'static,
{
    clap::builder::RangedU64ValueParser::<T>::new().range(1..)
}

/// Reads of the `small` phase a repetition.
const SMALL_READS: u64 = 200;
/// Rows each read of the `small` phase asks for.
const SMALL_ROWS: u64 = 16;

/// The `small` phase: what one short read costs however large its
/// dataset — a plan and a stream of [`SMALL_ROWS`] rows of one rank's global
/// shuffle, from a place spread over the epoch, [`SMALL_READS`] of them one
/// after another (`small/global`; the table's p50 and p99 are each read's
/// time, plan included). Spark's reads of a dataset (a stream per task),
/// a DataLoader's workers and evaluation samples are such reads.
async fn small_phase(run: &mut Run, uri: &str, reps: usize) -> Result<(), BoxError> {
    progress("small: writing the dataset");
    phases::drop_dataset(uri, "small").await?;
    phases::put(uri, "small", &run.shape, &run.parts, run.args.writers).await?;
    let step = (run.shape.rows / SMALL_READS).max(1);
    let mut client = Client::connect(uri).await?.with_shared_memory(false);
    for rep in 0..WARM_UP + reps {
        let first = if rep < WARM_UP { "/first" } else { "" };
        let start = std::time::Instant::now();
        let (mut latencies, mut rows) = (Vec::new(), 0u64);
        for i in 0..SMALL_READS {
            let read = std::time::Instant::now();
            let plan = flightdeck_client::ReadPlan {
                start_sample: (i * step) % run.shape.rows.max(1),
                max_rows: SMALL_ROWS,
                ..phases::read_plan("small", 1, Shuffle::Global, SMALL_ROWS as u32)
            };
            let planned = client.plan(plan).await?;
            let shard = planned.shards.first().ok_or("a plan without a shard")?;
            let mut batches = client.read_shard(shard).await?;
            while let Some(batch) = batches.next().await {
                rows += batch?.num_rows() as u64;
            }
            latencies.push(read.elapsed());
        }
        let sample = Sample {
            elapsed: start.elapsed(),
            latencies,
        };
        let bytes = rows * run.shape.row_bytes();
        run.record(
            &format!("small/global{first}"),
            "flightdeck",
            rows,
            bytes,
            sample,
        );
    }
    Ok(())
}

/// The filter phase: one dataset, read globally shuffled by every rank
/// whole and through a filter that selects about half its rows (`f0` is
/// uniform in [0, 1)); each repetition first plans a filter not seen
/// before, which is the selection's one-off cost.
async fn filter_phase(run: &mut Run, uri: &str, reps: usize) -> Result<(), BoxError> {
    let (ranks, batch_rows) = (run.args.ranks, run.args.batch_rows);
    if run.args.vector || run.args.list || run.shape.features == 0 {
        return Err("the filter phase needs scalar features (f0): drop --vector and --list".into());
    }
    progress("filter: writing the dataset");
    phases::drop_dataset(uri, "filtered").await?;
    phases::put(uri, "filtered", &run.shape, &run.parts, run.args.writers).await?;
    let payload = run.shape.payload_bytes();
    // Warm-up epochs first, as in the cluster phase: a shuffled read's
    // first epochs gather column by column and build the packed rows.
    for rep in 0..WARM_UP + reps {
        let first = if rep < WARM_UP { "/first" } else { "" };
        progress(&format!("filter: repetition {}", rep + 1));
        let fresh = format!("f0 < 0.5 AND {rep} = {rep}");
        let mut plan = phases::read_plan("filtered", ranks, Shuffle::Global, batch_rows);
        plan.filter = fresh;
        let t = std::time::Instant::now();
        let planned = Client::connect(uri).await?.plan(plan).await?;
        let selected: u64 = planned.shards.iter().map(|s| s.rows).sum();
        let sample = Sample {
            elapsed: t.elapsed(),
            latencies: vec![],
        };
        run.record(
            &format!("filter/select{first}"),
            "flightdeck",
            run.shape.rows,
            payload,
            sample,
        );

        let plan = phases::read_plan("filtered", ranks, Shuffle::Global, batch_rows);
        let (s, rows) = phases::get_ranks(uri, plan.clone(), None).await?;
        run.record(
            &format!("filter/global-all{first}"),
            "flightdeck",
            rows,
            rows * run.shape.row_bytes(),
            s,
        );
        let filtered = flightdeck_client::ReadPlan {
            filter: "f0 < 0.5".to_string(),
            ..plan
        };
        let (s, rows) = phases::get_ranks(uri, filtered, None).await?;
        run.record(
            &format!("filter/global-selected{first}"),
            "flightdeck",
            rows,
            rows * run.shape.row_bytes(),
            s,
        );
        if rows.abs_diff(selected) > u64::from(ranks) {
            return Err(format!("the filter read {rows} rows; its plan said {selected}").into());
        }
    }
    phases::drop_dataset(uri, "filtered").await?;
    Ok(())
}

/// `bin serve` on a free loopback port with `limit` bytes of memory and the
/// `--server-arg`s.
fn serve_command(bin: &Path, limit: u64, extra: &[String]) -> Command {
    let mut cmd = Command::new(bin);
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--memory-limit"])
        .arg(limit.to_string())
        .args(extra);
    cmd
}

/// A server child process, killed on drop.
struct ChildServer {
    child: Child,
    uri: String,
}

impl ChildServer {
    fn start(mut cmd: Command, what: &str) -> Result<Self, BoxError> {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start {what}: {e}"))?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        let addr = line
            .trim()
            .rsplit(' ')
            .next()
            .filter(|_| line.contains("listening on"))
            .ok_or_else(|| format!("{what} did not report its address: {line:?}"))?;
        Ok(Self {
            uri: format!("http://{addr}"),
            child,
        })
    }

    /// Peak resident memory of the process so far (VmHWM), in bytes.
    fn peak_rss(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    }
}

impl Drop for ChildServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

fn progress(msg: &str) {
    let mut err = std::io::stderr();
    if err.is_terminal() {
        let _ = write!(err, "\r\x1b[2K{msg}");
    } else {
        let _ = writeln!(err, "{msg}");
    }
    let _ = err.flush();
}

fn shuffle_of(name: &str) -> Result<Shuffle, BoxError> {
    match name {
        "none" => Ok(Shuffle::None),
        "global" => Ok(Shuffle::Global),
        "block" => Ok(Shuffle::Block),
        other => Err(format!("unknown shuffle '{other}': use none, global or block").into()),
    }
}

struct Run {
    args: Args,
    shape: Shape,
    parts: Arc<Vec<Vec<arrow::array::RecordBatch>>>,
    results: Vec<Measured>,
}

impl Run {
    fn record(&mut self, phase: &str, target: &str, rows: u64, bytes: u64, sample: Sample) {
        progress(&format!(
            "{phase} {target}: {}",
            phases::secs(sample.elapsed)
        ));
        match self
            .results
            .iter_mut()
            .find(|m| m.phase == phase && m.target == target)
        {
            Some(m) => m.samples.push(sample),
            None => self.results.push(Measured {
                phase: phase.to_string(),
                target: target.to_string(),
                rows,
                bytes,
                samples: vec![sample],
            }),
        }
    }

    fn median(&self, phase: &str, target: &str) -> Option<f64> {
        self.results
            .iter()
            .find(|m| m.phase == phase && m.target == target)
            .map(|m| m.median().as_secs_f64())
    }
}

/// Phases the tool knows.
const PHASES: [&str; 9] = [
    "put", "get", "e2e", "limit", "h2d", "cluster", "filter", "gather", "small",
];

async fn run(args: Args) -> Result<(), BoxError> {
    if let Some(p) = args.phases.iter().find(|p| !PHASES.contains(&p.as_str())) {
        return Err(format!("unknown phase '{p}': use {}", PHASES.join(", ")).into());
    }
    let shape = Shape {
        rows: args.rows,
        features: args.features,
        vector: args.vector,
        list: args.list,
        partitions: args.partitions.max(1),
        batch_rows: args.batch_rows.max(1) as usize,
        seed: args.seed,
    };
    let shuffles = args
        .shuffle
        .iter()
        .map(|s| shuffle_of(s).map(|m| (s.clone(), m)))
        .collect::<Result<Vec<_>, _>>()?;
    let payload = shape.payload_bytes();
    progress(&format!(
        "generating {} rows x {} features ({:.2} GB payload)",
        shape.rows,
        shape.features,
        payload as f64 / 1e9
    ));
    let parts = Arc::new(
        (0..shape.partitions)
            .map(|p| shape.partition(p))
            .collect::<Vec<_>>(),
    );

    // flightdeck: a running server, or a child we can measure.
    let mut child = None;
    let socket = args.unix.then(|| {
        std::env::temp_dir().join(format!("flightdeck-bench-{}.sock", std::process::id()))
    });
    if socket.is_some() && args.server.is_some() {
        return Err(
            "--unix starts a server on a socket; with --server, name the socket in it \
                    (--server grpc+unix:///PATH)"
                .into(),
        );
    }
    let fd_uri = match &args.server {
        Some(uri) => uri.clone(),
        None if args.in_process => {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let addr = listener.local_addr()?;
            let config = flightdeck_server::ServerConfig {
                memory_limit: (payload * 3).max(1 << 30),
                unix_socket: socket.clone(),
                ..Default::default()
            };
            tokio::spawn(flightdeck_server::serve(
                listener,
                config,
                std::future::pending(),
            ));
            format!("http://{addr}")
        }
        None => {
            let bin = match &args.server_bin {
                Some(b) => b.clone(),
                None => std::env::current_exe()?.with_file_name("flightdeck"),
            };
            let limit = (payload * 3).max(1 << 30);
            let mut cmd = serve_command(&bin, limit, &args.server_args);
            if let (Some(cert), Some(key)) = (&args.tls_cert, &args.tls_key) {
                if std::env::var_os("FLIGHTDECK_TLS_ROOT_CERTS").is_none() {
                    return Err(
                        "--tls-cert: set FLIGHTDECK_TLS_ROOT_CERTS to a certificate the \
                                clients trust (the same file, for a self-signed one)"
                            .into(),
                    );
                }
                cmd.arg("--tls-cert").arg(cert).arg("--tls-key").arg(key);
            }
            if let Some(tokens) = &args.auth_token_file {
                if std::env::var_os("FLIGHTDECK_TOKEN").is_none() {
                    return Err(
                        "--auth-token-file: set FLIGHTDECK_TOKEN to a writer token of \
                                that file"
                            .into(),
                    );
                }
                cmd.arg("--auth-token-file").arg(tokens);
            }
            if let Some(path) = &socket {
                cmd.arg("--unix-socket").arg(path);
            }
            let mut server =
                ChildServer::start(cmd, &format!("flightdeck server {}", bin.display()))?;
            if args.tls_cert.is_some() {
                server.uri = server.uri.replacen("http://", "https://", 1);
            }
            let uri = server.uri.clone();
            child = Some(server);
            uri
        }
    };
    let fd_uri = match &socket {
        Some(path) => format!("grpc+unix://{}", path.display()),
        None => fd_uri,
    };
    let pyarrow = if args.baseline.iter().any(|b| b == "pyarrow") {
        let python = args.python.clone().unwrap_or_else(|| {
            let venv = repo_root().join(".venv/bin/python");
            if venv.exists() {
                venv
            } else {
                PathBuf::from("python3")
            }
        });
        let mut cmd = Command::new(python);
        cmd.arg(repo_root().join("bench/baselines/pyarrow_server.py"));
        Some(ChildServer::start(cmd, "the pyarrow baseline server")?)
    } else {
        None
    };
    let parquet = args.baseline.iter().any(|b| b == "parquet");
    let mut run = Run {
        shape,
        parts,
        results: Vec::new(),
        args,
    };
    let reps = run.args.reps.max(1);
    let has = |p: &str| run.args.phases.iter().any(|x| x == p);
    let (do_limit, do_e2e, do_put, do_get) = (has("limit"), has("e2e"), has("put"), has("get"));
    let do_cluster = has("cluster");
    let do_filter = has("filter");
    let do_gather = has("gather");
    let do_small = has("small");
    let mut peak_rss_e2e = None;

    if has("h2d") {
        progress("h2d: host-to-device copies from the arena, pinned and pageable memory");
        let bytes = run.args.h2d_bytes;
        for rep in h2d::run(bytes, reps)? {
            run.record("h2d/arena", "flightdeck", 0, bytes as u64, rep.arena);
            run.record("h2d/pinned", "limit", 0, bytes as u64, rep.pinned);
            run.record("h2d/pageable", "pageable", 0, bytes as u64, rep.pageable);
        }
    }
    if do_limit {
        let bytes = payload.min(2 << 30);
        let message = (run.shape.row_bytes() * u64::from(run.args.batch_rows)) as usize;
        for _ in 0..reps {
            let s = phases::limit_tcp(run.args.ranks as usize, bytes, message)?;
            run.record("limit/tcp", "limit", 0, bytes, s);
            if run.args.unix {
                let s = phases::limit_unix(run.args.ranks as usize, bytes, message)?;
                run.record("limit/unix", "limit", 0, bytes, s);
            }
            run.record(
                "limit/memcpy",
                "limit",
                0,
                bytes,
                phases::limit_memcpy(bytes),
            );
        }
    }
    if do_e2e {
        for rep in 0..reps {
            let ds = format!("e2e-{rep}");
            let t = std::time::Instant::now();
            phases::put(&fd_uri, &ds, &run.shape, &run.parts, run.args.writers).await?;
            let (_, rows) = phases::get(
                &fd_uri,
                &ds,
                run.args.ranks,
                Shuffle::Global,
                run.args.batch_rows,
                false,
            )
            .await?;
            let sample = Sample {
                elapsed: t.elapsed(),
                latencies: vec![],
            };
            run.record("e2e", "flightdeck", rows, payload, sample);
            phases::drop_dataset(&fd_uri, &ds).await?;
            if parquet {
                let dir = std::env::temp_dir()
                    .join(format!("flightdeck-bench-{}-{rep}", std::process::id()));
                std::fs::create_dir_all(&dir)?;
                let (shape, parts, writers, ranks) = (
                    run.shape,
                    run.parts.clone(),
                    run.args.writers,
                    run.args.ranks as usize,
                );
                let d = dir.clone();
                let (w, r) = tokio::task::spawn_blocking(move || {
                    phases::parquet_path(&d, &shape, &parts, writers, ranks)
                })
                .await??;
                std::fs::remove_dir_all(&dir)?;
                let total = Sample {
                    elapsed: w.elapsed + r.elapsed,
                    latencies: vec![],
                };
                run.record("e2e/write", "parquet", run.shape.rows, payload, w);
                run.record("e2e/read", "parquet", run.shape.rows, payload, r);
                run.record("e2e", "parquet", run.shape.rows, payload, total);
            }
        }
        peak_rss_e2e = child.as_ref().and_then(ChildServer::peak_rss);
    }
    if do_put {
        for rep in 0..reps {
            let ds = format!("put-{rep}");
            let s = phases::put(&fd_uri, &ds, &run.shape, &run.parts, run.args.writers).await?;
            run.record("put", "flightdeck", run.shape.rows, payload, s);
            phases::drop_dataset(&fd_uri, &ds).await?;
            if let Some(pa) = &pyarrow {
                let s = phases::put(&pa.uri, &ds, &run.shape, &run.parts, run.args.writers).await?;
                run.record("put", "pyarrow", run.shape.rows, payload, s);
                phases::drop_dataset(&pa.uri, &ds).await?;
            }
        }
    }
    if do_get {
        // (target, where, through shared memory)
        let mut targets = vec![("flightdeck", fd_uri.clone(), false)];
        if run.args.shm {
            targets.push(("flightdeck-shm", fd_uri.clone(), true));
        }
        if let Some(pa) = &pyarrow {
            targets.push(("pyarrow", pa.uri.clone(), false));
        }
        for (_, uri, shm) in &targets {
            if *shm {
                continue;
            }
            phases::drop_dataset(uri, "bench").await?;
            phases::put(uri, "bench", &run.shape, &run.parts, run.args.writers).await?;
        }
        for (name, mode) in &shuffles {
            for rep in 0..WARM_UP + reps {
                let phase = match rep < WARM_UP {
                    true => format!("get/{name}/first"),
                    false => format!("get/{name}"),
                };
                for (target, uri, shm) in &targets {
                    let (s, rows) = phases::get(
                        uri,
                        "bench",
                        run.args.ranks,
                        *mode,
                        run.args.batch_rows,
                        *shm,
                    )
                    .await?;
                    let bytes = rows * run.shape.row_bytes();
                    run.record(&phase, target, rows, bytes, s);
                }
            }
        }
        for (_, uri, shm) in &targets {
            if !*shm {
                phases::drop_dataset(uri, "bench").await?;
            }
        }
    }
    if do_cluster {
        cluster_phase(&mut run, &fd_uri, reps).await?;
    }
    if do_filter {
        filter_phase(&mut run, &fd_uri, reps).await?;
    }
    if do_gather {
        gather_phase(&mut run, reps)?;
    }
    if do_small {
        small_phase(&mut run, &fd_uri, reps).await?;
    }
    if std::io::stderr().is_terminal() {
        eprintln!();
    }

    // Ratios against the targets of the benchmark issue.
    let ratio = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(a, b)| a / b);
    let get_none = run.median("get/none", "flightdeck");
    let limit_gbps = |phase: &str| {
        run.results
            .iter()
            .find(|m| m.phase == phase)
            .map(Measured::gbps)
    };
    let (tcp_gbps, unix_gbps) = (limit_gbps("limit/tcp"), limit_gbps("limit/unix"));
    let none_gbps = run
        .results
        .iter()
        .find(|m| m.phase == "get/none" && m.target == "flightdeck")
        .map(Measured::gbps);
    let gbps = |phase: &str| {
        run.results
            .iter()
            .find(|m| m.phase == phase && m.target == "flightdeck")
            .map(Measured::gbps)
    };
    let rows_per_s = |phase: &str| {
        run.results
            .iter()
            .find(|m| m.phase == phase && m.target == "flightdeck")
            .map(|m| m.rows as f64 / m.median().as_secs_f64())
    };
    let ratios = json!({
        "filter_selected_rows_vs_unfiltered_rows": ratio(rows_per_s("filter/global-selected"), rows_per_s("filter/global-all")),
        "cluster_node_vs_single_none": ratio(gbps("cluster/node"), gbps("cluster/single-node-ranks")),
        "cluster_node_vs_single_same_rows": ratio(gbps("cluster/node"), gbps("cluster/single-node-rows")),
        "cluster_node_vs_single_global": ratio(gbps("cluster/node"), gbps("cluster/single-node-ranks-global")),
        "cluster_node_all_vs_single_none": ratio(gbps("cluster/node-all"), gbps("cluster/single-none")),
        "cluster_global_none_vs_single_none": ratio(gbps("cluster/global-none"), gbps("cluster/single-none")),
        "cluster_global_vs_single_none": ratio(gbps("cluster/global-global"), gbps("cluster/single-none")),
        "get_none_vs_pyarrow": ratio(run.median("get/none", "pyarrow"), get_none),
        "get_none_vs_loopback_limit": ratio(none_gbps, tcp_gbps),
        "get_none_vs_unix_limit": ratio(none_gbps, unix_gbps),
        "get_global_vs_none": ratio(get_none, run.median("get/global", "flightdeck")),
        "put_vs_pyarrow": ratio(run.median("put", "pyarrow"), run.median("put", "flightdeck")),
        "e2e_vs_parquet": ratio(run.median("e2e", "parquet"), run.median("e2e", "flightdeck")),
        "h2d_arena_vs_pinned": ratio(run.median("h2d/pinned", "limit"), run.median("h2d/arena", "flightdeck")),
        "peak_rss_e2e_bytes": peak_rss_e2e,
        "peak_rss_bound_bytes": (payload as f64 * 1.2) as u64 + (256u64 << 20),
    });

    print!("{}", report::table(&run.results));
    println!(
        "dataset: {} rows x {} features{}, {:.3} GB payload, {} partitions, {} writers, {} ranks, {} rows/batch, {} reps (medians)",
        run.shape.rows,
        run.shape.features,
        match (run.shape.vector, run.shape.list) {
            (true, _) => " (vector)",
            (_, true) => " (list)",
            _ => "",
        },
        payload as f64 / 1e9,
        run.shape.partitions,
        run.args.writers,
        run.args.ranks,
        run.args.batch_rows,
        reps
    );
    let show = |name: &str, v: &serde_json::Value| {
        if let Some(x) = v.as_f64() {
            println!("{name}: {x:.2}x");
        }
    };
    show(
        "get none, flightdeck vs pyarrow (higher is faster)",
        &ratios["get_none_vs_pyarrow"],
    );
    show(
        "get none vs loopback TCP limit",
        &ratios["get_none_vs_loopback_limit"],
    );
    show(
        "get none vs Unix socket limit",
        &ratios["get_none_vs_unix_limit"],
    );
    show("get global vs get none", &ratios["get_global_vs_none"]);
    show("put, flightdeck vs pyarrow", &ratios["put_vs_pyarrow"]);
    show(
        "cluster: one node's NODE read vs one server's unshuffled read, same ranks",
        &ratios["cluster_node_vs_single_none"],
    );
    show(
        "cluster: one node's NODE read vs one server's unshuffled read of the node's rows",
        &ratios["cluster_node_vs_single_same_rows"],
    );
    show(
        "cluster: every node's NODE read at once vs one server's unshuffled read, same rows and ranks",
        &ratios["cluster_node_all_vs_single_none"],
    );
    show(
        "cluster: one node's NODE read vs one server's shuffled read, same ranks",
        &ratios["cluster_node_vs_single_global"],
    );
    show(
        "cluster: GLOBAL unshuffled vs one server's unshuffled read",
        &ratios["cluster_global_none_vs_single_none"],
    );
    show(
        "cluster: GLOBAL shuffled vs one server's unshuffled read",
        &ratios["cluster_global_vs_single_none"],
    );
    show("e2e, flightdeck vs parquet", &ratios["e2e_vs_parquet"]);
    show(
        "h2d from the arena vs pinned cudaMemcpy",
        &ratios["h2d_arena_vs_pinned"],
    );
    if let Some(rss) = peak_rss_e2e {
        println!(
            "server peak RSS through e2e: {:.3} GB (bound 1.2 x payload + 256 MiB = {:.3} GB)",
            rss as f64 / 1e9,
            ((payload as f64 * 1.2) + (256u64 << 20) as f64) / 1e9
        );
    }
    if let Some(path) = &run.args.json {
        let doc = json!({
            "command": std::env::args()
                .map(|a| if a.is_empty() || a.contains(' ') { format!("'{a}'") } else { a })
                .collect::<Vec<_>>()
                .join(" "),
            "machine": machine(),
            "commit": commit(),
            "date": command_output("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"]),
            "rows": run.shape.rows,
            "features": run.shape.features,
            "vector": run.args.vector,
            "list": run.args.list,
            "payload_bytes": payload,
            "results": run.results.iter().map(Measured::to_json).collect::<Vec<_>>(),
            "ratios": ratios,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")?;
    }
    Ok(())
}

/// Epochs of every read phase run before the timed repetitions and
/// reported apart (`…/first`): a dataset's shuffled reads gather from packed
/// rows from its second epoch on, and the copy is built during that epoch.
const WARM_UP: usize = 2;

/// The `gather` phase: one epoch of every rank's shard in each of the
/// `--shuffle` orders (`--ranks`, `--batch-rows`) gathered from packed rows
/// in this process — no server, no socket — each batch split among 1, 2,
/// 4, … threads up to the machine's cores (`gather/ORDER/threads-N`): what
/// a read costs the server before it is sent, and how far the scattered
/// gather, the part a shuffled read adds to an unshuffled one, scales with
/// the threads a stream is given.
fn gather_phase(run: &mut Run, reps: usize) -> Result<(), BoxError> {
    use flightdeck_server::catalog::SealedData;
    use flightdeck_server::memory::Budget;
    use flightdeck_server::memory::arena::{Arena, HostMemory};
    use flightdeck_server::order::{ReadPlan, Shuffle as Order};
    use flightdeck_server::read::Shard;
    let batches: Vec<_> = run.parts.iter().flatten().cloned().collect();
    let schema = batches.first().ok_or("no rows to gather")?.schema();
    let data = Arc::new(SealedData::from_batches(schema, vec![], batches));
    // Room for the packed copy beside the rows.
    let budget = Budget::new(run.shape.payload_bytes() * 2 + (256 << 20));
    let arena = Arc::new(Arena::new(budget, 64 << 20, HostMemory::Heap));
    let (ranks, batch_rows) = (run.args.ranks.max(1), run.args.batch_rows.max(1));
    let orders = run
        .args
        .shuffle
        .iter()
        .map(|name| {
            let order = match shuffle_of(name)? {
                Shuffle::None => Order::None,
                Shuffle::Global => Order::Global,
                Shuffle::Block => Order::Block {
                    block_rows: flightdeck_server::config::DEFAULT_BLOCK_ROWS.into(),
                },
            };
            Ok::<_, BoxError>((name.clone(), order))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads: Vec<usize> = std::iter::successors(Some(1), |&t| Some(t * 2))
        .take_while(|&t| t <= cores.clamp(1, 8))
        .collect();
    let row_bytes = run.shape.row_bytes();
    progress(&format!(
        "gather: {ranks} ranks, {threads:?} threads a batch"
    ));
    for rep in 0..WARM_UP + reps {
        let first = if rep < WARM_UP { "/first" } else { "" };
        for (name, order) in &orders {
            for &t in &threads {
                let plan = ReadPlan {
                    epoch: 1,
                    seed: 7,
                    ..ReadPlan::new("gather", ranks, *order, batch_rows)
                };
                let start = std::time::Instant::now();
                let mut rows = 0u64;
                for rank in 0..plan.world_size {
                    let shard = Shard::new(data.clone(), &plan, rank)?
                        .packing(arena.clone(), Arc::default())
                        .split(t);
                    for batch in shard.batches() {
                        rows += batch?.num_rows() as u64;
                    }
                }
                let sample = Sample {
                    elapsed: start.elapsed(),
                    latencies: vec![],
                };
                let phase = format!("gather/{name}/threads-{t}{first}");
                run.record(&phase, "flightdeck", rows, rows * row_bytes, sample);
            }
        }
    }
    Ok(())
}

/// The `cluster` phase: `--members` member processes hold the partitions
/// (p on member p mod N) and the single server `single` holds them all.
/// Figures are GB/s of the rows the ranks received:
/// - `cluster/node`: the ranks of one node (ranks / N of them) read their
///   LOCALITY_NODE shards (shuffled within the node) while the other nodes
///   are idle, node by node, one sample being the round of every node (all
///   rows over the sum of the nodes' times: nodes of unequal size weigh as
///   their rows do); against `cluster/single-node-ranks`: as many ranks
///   reading the single server unshuffled, and
///   `cluster/single-node-ranks-global`: the same, globally shuffled; and
///   against `cluster/single-node-rows`: as many ranks reading, unshuffled,
///   a dataset that holds just one member's partitions on a server of its
///   own, member by member, timed as a round the same way (the same rows,
///   and reads of the same size). Each node's part of both rounds is
///   recorded too (`cluster/node/nG`, `cluster/single-node-rows/nG`,
///   measured repetitions only), to show which node's read is slower.
/// - `cluster/node-all`: every node's ranks reading their LOCALITY_NODE
///   shards at once (every member serving its node and the transfers
///   together, as on a cluster, but on this machine's cores); against
///   `cluster/single-none`.
/// - `cluster/global-none` and `cluster/global-global`: every rank reads
///   LOCALITY_GLOBAL (rows held elsewhere cross between members); against
///   `cluster/single-none`: every rank reading the single server unshuffled.
async fn cluster_phase(run: &mut Run, single: &str, reps: usize) -> Result<(), BoxError> {
    let n = run.args.members.max(2);
    let bin = match &run.args.server_bin {
        Some(b) => b.clone(),
        None => std::env::current_exe()?.with_file_name("flightdeck"),
    };
    let payload = run.shape.payload_bytes();
    let limit = (payload * 3 / n as u64).max(1 << 30);
    let mut members = Vec::new();
    for _ in 0..n {
        let cmd = serve_command(&bin, limit, &run.args.server_args);
        members.push(ChildServer::start(cmd, "a cluster member")?);
    }
    let uris: Vec<String> = members.iter().map(|m| m.uri.clone()).collect();
    progress(&format!(
        "cluster: writing to {n} members and to one server"
    ));
    let (shape, parts, writers) = (run.shape, run.parts.clone(), run.args.writers);
    phases::put_cluster(&uris, "cluster", &shape, &parts, writers).await?;
    phases::drop_dataset(single, "cluster").await?;
    phases::put(single, "cluster", &shape, &parts, writers).await?;
    // A server of its own holding just the partitions of each member: the
    // rows one node's `NODE` read takes (a short node's transfer aside),
    // read by as many ranks, with the fixed costs of a read of that size.
    let cmd = serve_command(&bin, limit, &run.args.server_args);
    let rows_server = ChildServer::start(cmd, "a server of each member's rows")?;
    let single_rows = rows_server.uri.clone();
    let node_rows = |g: usize| format!("cluster-node-{g}");
    for g in 0..n {
        let own: Vec<Vec<_>> = parts
            .iter()
            .enumerate()
            .filter(|(p, _)| p % n == g)
            .map(|(_, b)| b.clone())
            .collect();
        phases::put(&single_rows, &node_rows(g), &shape, &Arc::new(own), writers).await?;
    }
    let (w, batch_rows) = (run.args.ranks, run.args.batch_rows);
    let per_node = (w / n as u32).max(1);
    let plan = |shuffle| phases::read_plan("cluster", w, shuffle, batch_rows);
    let row_bytes = run.shape.row_bytes();
    let record = |run: &mut Run, phase: &str, rows: u64, s: Sample| {
        run.record(phase, "flightdeck", rows, rows * row_bytes, s);
    };
    for rep in 0..WARM_UP + reps {
        let first = if rep < WARM_UP { "/first" } else { "" };
        let node_plan = phases::node_plan(plan(Shuffle::Global), per_node);
        let mut round = Default::default();
        for node in 0..n as u32 {
            let ranks = node * per_node..(node + 1) * per_node;
            let one = phases::get_ranks(&uris[0], node_plan.clone(), Some(ranks)).await?;
            if first.is_empty() {
                record(run, &format!("cluster/node/n{node}"), one.1, one.0.clone());
            }
            round = phases::then(round, one);
        }
        let (s, rows) = round;
        record(run, &format!("cluster/node{first}"), rows, s);
        let (s, rows) = phases::get_ranks(&uris[0], node_plan.clone(), None).await?;
        record(run, &format!("cluster/node-all{first}"), rows, s);
        let mut round = Default::default();
        for g in 0..n {
            let one = phases::read_plan(&node_rows(g), per_node, Shuffle::None, batch_rows);
            let one = phases::get_ranks(&single_rows, one, None).await?;
            if first.is_empty() {
                record(
                    run,
                    &format!("cluster/single-node-rows/n{g}"),
                    one.1,
                    one.0.clone(),
                );
            }
            round = phases::then(round, one);
        }
        let (s, rows) = round;
        record(run, &format!("cluster/single-node-rows{first}"), rows, s);
        for (phase, shuffle) in [
            ("cluster/single-node-ranks", Shuffle::None),
            ("cluster/single-node-ranks-global", Shuffle::Global),
        ] {
            let one = phases::read_plan("cluster", per_node, shuffle, batch_rows);
            let (s, rows) = phases::get_ranks(single, one, None).await?;
            record(run, &format!("{phase}{first}"), rows, s);
        }
        let (s, rows) = phases::get_ranks(single, plan(Shuffle::None), None).await?;
        record(run, &format!("cluster/single-none{first}"), rows, s);
        for (name, shuffle) in [("none", Shuffle::None), ("global", Shuffle::Global)] {
            let (s, rows) = phases::get_ranks(&uris[0], plan(shuffle), None).await?;
            record(run, &format!("cluster/global-{name}{first}"), rows, s);
        }
    }
    phases::drop_dataset(single, "cluster").await?;
    drop(rows_server);
    Ok(())
}

/// The machine a run was measured on: cores, architecture, CPU model (with
/// its family and model numbers and widest vector extension, since hosts
/// sold under one model name differ) and memory.
fn machine() -> serde_json::Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    // The first processor's `key : value` lines.
    let field = |key: &str| {
        cpuinfo
            .lines()
            .take_while(|l| !l.trim().is_empty())
            .filter_map(|l| l.split_once(':'))
            .find(|(k, _)| k.trim() == key)
            .map(|(_, v)| v.trim().to_string())
    };
    let model = field("model name");
    let flags = field("flags").unwrap_or_default();
    let has = |flag: &str| flags.split_whitespace().any(|f| f == flag);
    let vector = if has("avx512f") {
        Some("AVX-512")
    } else if has("avx2") {
        Some("AVX2")
    } else {
        None
    };
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let memory_kib = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|l| l.trim().trim_end_matches("kB").trim().parse::<u64>().ok());
    json!({
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "arch": std::env::consts::ARCH,
        "cpu": model,
        "cpu_family": field("cpu family"),
        "cpu_model": field("model"),
        "vector": vector,
        "memory_bytes": memory_kib.map(|k| k * 1024),
    })
}

/// The commit the bench was built from, with `+dirty` when the tree had
/// changes (recorded by `build.rs`).
fn commit() -> Option<String> {
    Some(env!("FLIGHTDECK_BUILD_COMMIT").to_string()).filter(|c| !c.is_empty())
}

/// The trimmed standard output of a command that succeeded.
fn command_output(program: &str, args: &[&str]) -> Option<String> {
    let out = std::process::Command::new(program)
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("flightdeck-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
