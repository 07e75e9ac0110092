//! The `flightdeck` binary: `serve` parses flags into a [`ServerConfig`],
//! binds the listener and serves until SIGINT or SIGTERM; `train` submits a
//! training job to a running server and shows its progress; `datasets`,
//! `describe`, `drop`, `place`, `evict`, `stats` and `jobs` show (or
//! change) what a running server holds.

mod admin_cli;
mod train_cli;

use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use flightdeck_server::config::{self, ServerConfig, parse_size};
use tokio::net::TcpListener;
use tracing::{error, info};

/// flightdeck: moves data from Apache Spark into multi-GPU training over Arrow
/// Flight, without files in between.
#[derive(Debug, Parser)]
#[command(name = "flightdeck", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the server (one per GPU node).
    Serve(ServeArgs),
    /// Train a model on a sealed dataset of a running server.
    Train(train_cli::TrainArgs),
    /// List a running server's datasets: state, rows, partitions, memory,
    /// and where each is held.
    Datasets(admin_cli::DatasetsArgs),
    /// Show one dataset of a running server: its schema, partitions (with
    /// their winning attempts) and, for a cluster dataset, every member.
    Describe(admin_cli::DatasetArgs),
    /// Drop a dataset from a running server (from every member, for a
    /// cluster dataset) and free its memory.
    Drop(admin_cli::DropArgs),
    /// Copy numeric columns of a sealed dataset to GPUs of a running server
    /// (the device tier).
    Place(admin_cli::PlaceArgs),
    /// Free a dataset's GPU copies on a running server.
    Evict(admin_cli::EvictArgs),
    /// Show a running server's memory per tier, datasets and traffic.
    Stats(admin_cli::StatsArgs),
    /// Show the training jobs a running server has run since it started.
    Jobs(admin_cli::JobsArgs),
    /// Ask a running server's health service whether it serves (exit 0) or
    /// not (exit 1): a probe that also works over TLS and Unix sockets.
    Health(admin_cli::HealthArgs),
    /// Run a read-only SQL query over a running server's sealed datasets
    /// (each a table by its name) and print its rows.
    Sql(admin_cli::SqlArgs),
    /// Keep the result of a SQL query over a running server's sealed
    /// datasets as a new sealed dataset (a split, a sample, derived
    /// columns).
    Derive(admin_cli::DeriveArgs),
}

#[derive(Debug, clap::Args)]
struct ServeArgs {
    /// Address to listen on, HOST:PORT (`0.0.0.0:50051` for every
    /// interface; a host name such as `localhost:50051` is resolved); port 0
    /// picks a free port (the bound address is printed on stdout).
    #[arg(long, default_value = "127.0.0.1:50051", value_parser = config::parse_listen)]
    listen: SocketAddr,
    /// Hard limit on cached bytes (e.g. 8GiB); default: half the machine's RAM.
    #[arg(long, value_parser = parse_size)]
    memory_limit: Option<u64>,
    /// Largest gRPC message accepted or sent (e.g. 1GiB).
    #[arg(long, value_parser = parse_size, default_value = "1GiB")]
    max_message_size: u64,
    /// Rows per streamed record batch when a read plan says 0.
    #[arg(long, default_value_t = config::DEFAULT_BATCH_ROWS)]
    default_batch_rows: u32,
    /// Folder for the server's files; the default spill store is
    /// DATA_DIR/store. Nothing is written until a dataset spills or is
    /// persisted (with --persist, the record that this server persists
    /// into the store, at start).
    #[arg(long, default_value = config::DEFAULT_DATA_DIR)]
    data_dir: std::path::PathBuf,
    /// Where datasets spill when memory is full (and are persisted with
    /// --persist): a local directory, file:///path, memory://,
    /// s3://bucket/prefix, gs://bucket/prefix or az://container/prefix
    /// (credentials from the usual AWS_*, GOOGLE_*, AZURE_* variables).
    #[arg(long)]
    spill_url: Option<String>,
    /// Write each sealed dataset to the spill store at seal, and serve the
    /// stored datasets again after a restart. One server a store: a store
    /// another running server persists into is refused at start.
    #[arg(long)]
    persist: bool,
    /// Size of the host arena's slabs (default 64MiB, less for small limits).
    #[arg(long, value_parser = parse_size)]
    slab_size: Option<u64>,
    /// Do not use a CUDA driver even if one is present (heap slabs, no `place`).
    #[arg(long)]
    no_cuda: bool,
    /// The location other members and training ranks reach this server at,
    /// e.g. grpc://node-7.cluster:50051, grpc+tls://… with --tls-cert; the
    /// listen port when it names none (default: grpc:// and the listen
    /// address, the host name when listening on 0.0.0.0).
    #[arg(long)]
    advertise: Option<String>,
    /// How long a writer that said its size up front, a read bringing a
    /// spilled dataset back, or a filter's selection waits for memory
    /// before it is refused (e.g. 5s, 500ms, 0 to refuse at once).
    #[arg(long, value_parser = config::parse_duration, default_value = "5s")]
    admission_wait: std::time::Duration,
    /// How long a writer may send nothing, or a reader take nothing, before
    /// the server ends its stream (ABORTED) and frees what it holds.
    #[arg(long, value_parser = config::parse_duration, default_value = "10m")]
    stream_idle_timeout: std::time::Duration,
    /// How long a dataset may stay unsealed with no attempt committed or
    /// begun before the server drops it and refuses its writes' later
    /// attempts (what a job that died without sealing or dropping it left,
    /// holding memory that cannot spill); 0 keeps it until dropped.
    #[arg(long, value_parser = config::parse_duration, default_value = "6h")]
    unsealed_timeout: std::time::Duration,
    /// What all read streams together may hold gathered ahead of their
    /// sockets, beside --memory-limit (e.g. 512MiB); readers wait for room
    /// rather than grow it. Default: an eighth of --memory-limit, between
    /// 64 MiB and 4 GiB.
    #[arg(long, value_parser = parse_size)]
    read_ahead_memory: Option<u64>,
    /// The shared-memory folder (a tmpfs) where readers on this machine
    /// that ask for it get their record batches through a ring of 16 MiB a
    /// stream instead of the socket; rings together take at most half the
    /// read-ahead allowance. `none`: every reader over the socket.
    #[arg(long, default_value = "/dev/shm")]
    shm_dir: String,
    /// Threads each read stream gathers a batch of shuffled rows on (1 to
    /// 64). Default: half the machine's cores shared among the open
    /// streams, at most 4 — one a stream on a machine with few cores.
    #[arg(long)]
    gather_threads: Option<usize>,
    /// The folder training jobs write checkpoints to and resume from
    /// (default DATA_DIR/checkpoints); a job's relative checkpoint path is
    /// taken under it, and paths outside it are refused.
    #[arg(long)]
    checkpoint_root: Option<std::path::PathBuf>,
    /// An object-store URL prefix jobs may also use for checkpoints (e.g.
    /// s3://models/checkpoints, memory://); repeat for several.
    #[arg(long = "checkpoint-prefix")]
    checkpoint_prefixes: Vec<String>,
    /// A file of bearer tokens, one 'reader TOKEN' or 'writer TOKEN' per
    /// line: every call then needs one (readers plan, read, describe; writers
    /// also put, seal, drop, place, evict, train). Members of a cluster share
    /// the file and send its first writer token to each other.
    #[arg(long)]
    auth_token_file: Option<std::path::PathBuf>,
    /// Serve over TLS with this PEM certificate (chain); needs --tls-key.
    /// The server then advertises grpc+tls://. An expired certificate is
    /// refused; one that expires within 14 days is warned of daily.
    #[arg(long)]
    tls_cert: Option<std::path::PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long)]
    tls_key: Option<std::path::PathBuf>,
    /// PEM root certificates to trust in other members (default: the
    /// server's own --tls-cert, for members that share one certificate).
    #[arg(long)]
    tls_ca: Option<std::path::PathBuf>,
    /// Serve Prometheus metrics (OpenMetrics text) on http://ADDR/metrics,
    /// e.g. 0.0.0.0:9090; port 0 picks a free port (printed on stdout).
    #[arg(long, value_parser = config::parse_listen)]
    metrics_listen: Option<SocketAddr>,
    /// Also serve on this Unix domain socket (an absolute path), for ranks
    /// and writers on this machine: `grpc+unix:///run/flightdeck.sock`
    /// reaches the same datasets without the TCP stack. Who may connect is
    /// the socket file's permissions (--unix-socket-mode) and tokens, with
    /// --auth-token-file; never TLS. A socket left by a server that is gone
    /// is replaced.
    #[arg(long)]
    unix_socket: Option<std::path::PathBuf>,
    /// The --unix-socket file's permission bits, in octal as chmod takes
    /// them: 660 lets the server's user and group connect; 666 everyone
    /// who can reach the folder.
    #[arg(long, value_parser = config::parse_mode, default_value = "660")]
    unix_socket_mode: u32,
    /// Log lines as text for people or as JSON objects for log collectors.
    #[arg(long, value_enum, default_value = "text")]
    log_format: LogFormat,
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    /// One human-readable line per event.
    Text,
    /// One JSON object per line.
    Json,
}

impl ServeArgs {
    fn into_config(self) -> ServerConfig {
        let defaults = ServerConfig::default();
        ServerConfig {
            listen: self.listen,
            memory_limit: self.memory_limit.unwrap_or(defaults.memory_limit),
            max_message_bytes: usize::try_from(self.max_message_size).unwrap_or(usize::MAX),
            default_batch_rows: self.default_batch_rows,
            data_dir: self.data_dir,
            spill_url: self.spill_url,
            persist: self.persist,
            slab_bytes: self
                .slab_size
                .map(|b| usize::try_from(b).unwrap_or(usize::MAX)),
            use_cuda: !self.no_cuda,
            advertise: self.advertise,
            admission_wait: self.admission_wait,
            stream_idle_timeout: self.stream_idle_timeout,
            unsealed_timeout: (!self.unsealed_timeout.is_zero()).then_some(self.unsealed_timeout),
            read_ahead_bytes: self.read_ahead_memory,
            shm_dir: (self.shm_dir != "none").then(|| self.shm_dir.into()),
            gather_threads: self.gather_threads,
            checkpoint_root: self.checkpoint_root,
            checkpoint_prefixes: self.checkpoint_prefixes,
            auth_token_file: self.auth_token_file,
            tls_cert: self.tls_cert,
            tls_key: self.tls_key,
            tls_ca: self.tls_ca,
            metrics_listen: self.metrics_listen,
            unix_socket: self.unix_socket,
            unix_socket_mode: self.unix_socket_mode,
            ..defaults
        }
    }
}

/// A future that completes on SIGINT (Ctrl-C) or SIGTERM. The signals are
/// taken over here, before the server says it listens, so that a stop sent
/// the moment it is up (while it loads persisted datasets) drains it rather
/// than killing it.
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    let signals = {
        use tokio::signal::unix::{SignalKind, signal};
        [
            (SignalKind::interrupt(), "SIGINT"),
            (SignalKind::terminate(), "SIGTERM"),
        ]
        .map(|(kind, name)| {
            let stream = signal(kind)
                .map_err(|e| error!("cannot listen for {name}: {e}"))
                .ok();
            (stream, name)
        })
    };
    async move {
        #[cfg(unix)]
        {
            let [(int, int_name), (term, term_name)] = signals;
            tokio::select! {
                () = received(int) => info!("{int_name} received, shutting down"),
                () = received(term) => info!("{term_name} received, shutting down"),
            }
        }
        #[cfg(not(unix))]
        {
            if let Err(e) = tokio::signal::ctrl_c().await {
                error!("cannot listen for Ctrl-C: {e}");
                std::future::pending::<()>().await;
            }
            info!("Ctrl-C received, shutting down");
        }
    }
}

/// Completes when `signal` arrives; never where it could not be taken over.
#[cfg(unix)]
async fn received(signal: Option<tokio::signal::unix::Signal>) {
    match signal {
        Some(mut s) => {
            s.recv().await;
        }
        None => std::future::pending::<()>().await,
    }
}

async fn run(args: ServeArgs) -> Result<(), String> {
    let config = args.into_config();
    config.validate().map_err(|e| e.to_string())?;
    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", config.listen))?;
    let addr = listener
        .local_addr()
        .map_err(|e| format!("cannot read the bound address: {e}"))?;
    let metrics = match config.metrics_listen {
        Some(at) => Some(
            TcpListener::bind(at)
                .await
                .map_err(|e| format!("cannot listen on --metrics-listen {at}: {e}"))?,
        ),
        None => None,
    };
    let unix = match &config.unix_socket {
        Some(path) => Some(
            flightdeck_server::bind_unix(path, config.unix_socket_mode)
                .map_err(|e| e.to_string())?,
        ),
        None => None,
    };
    let stop = shutdown_signal();
    // SIGHUP has the credential files read again once the server serves.
    // Taken over here, so that one arriving while it starts (reloading
    // persisted datasets, waiting to take its store over) leaves it running.
    #[cfg(unix)]
    let _hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        .map_err(|e| error!("cannot listen for SIGHUP: {e}"));
    // Machine-readable lines for scripts and tests that start the server,
    // printed once it can answer: a spill store or TLS files it cannot use
    // end it before, with no "listening" line to mislead them.
    let socket = config.unix_socket.clone();
    let metrics_at = metrics.as_ref().and_then(|l| l.local_addr().ok());
    let ready = move || {
        let mut out = std::io::stdout();
        let _ = writeln!(out, "flightdeck listening on {addr}");
        if let Some(path) = &socket {
            let _ = writeln!(
                out,
                "flightdeck listening on grpc+unix://{}",
                path.display()
            );
        }
        if let Some(at) = metrics_at {
            let _ = writeln!(out, "flightdeck metrics on http://{at}/metrics");
        }
        let _ = out.flush();
    };
    let listeners = flightdeck_server::Listeners {
        flight: listener,
        unix,
        metrics,
    };
    flightdeck_server::serve_with(listeners, config, stop, ready)
        .await
        .map_err(|e| e.to_string())
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match &cli.command {
        Command::Serve(args) if args.log_format == LogFormat::Json => {
            logs.json().flatten_event(true).init();
        }
        _ => logs.with_ansi(std::io::stderr().is_terminal()).init(),
    }
    let result = match cli.command {
        Command::Serve(args) => run(args).await,
        Command::Train(args) => train_cli::run(args).await,
        Command::Datasets(args) => admin_cli::datasets(args).await,
        Command::Describe(args) => admin_cli::describe(args).await,
        Command::Drop(args) => admin_cli::drop(args).await,
        Command::Place(args) => admin_cli::place(args).await,
        Command::Evict(args) => admin_cli::evict(args).await,
        Command::Stats(args) => admin_cli::stats(args).await,
        Command::Jobs(args) => admin_cli::jobs(args).await,
        Command::Health(args) => admin_cli::health(args).await,
        Command::Sql(args) => admin_cli::sql(args).await,
        Command::Derive(args) => admin_cli::derive(args).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Once, for the person at the terminal (the log has the context).
            eprintln!("flightdeck: {e}");
            ExitCode::FAILURE
        }
    }
}
