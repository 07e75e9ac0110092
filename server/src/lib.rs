//! flightdeck server: an Arrow Flight data plane from Spark to multi-GPU
//! training.
//!
//! Spark tasks stream partitions in with `DoPut`; the Spark driver seals the
//! dataset naming the winning attempts; each training rank reads its equal,
//! shuffled shard of every epoch with `DoGet`. See `DESIGN.md` for the
//! protocol and the sample-order contract.
//!
//! # Layers
//!
//! ```text
//! main.rs   clap CLI -> ServerConfig (the only place that parses flags)
//! service   the Flight edge: decode, call the core, encode, map errors to gRPC codes;
//!           DoGet is written by hand (edge.rs, ipc.rs) so gathered buffers reach
//!           the socket without being copied into IPC and protobuf buffers
//!   ├── catalog   datasets, attempts, seal and winners: the commit protocol (pure)
//!   ├── cluster   many members, one dataset: layout, row space, NODE assignment (pure);
//!   │             peer.rs: sealing members and fetching rows from them
//!   ├── order     sample order: keyed permutation, equal shares, resume (pure)
//!   ├── read      gathering a shard's rows into record batches (synchronous)
//!   ├── query     read-plan filters and derived columns on DataFusion; SQL over the cache
//!   └── state     tier policy: arena copies, spill on pressure, restore on read,
//!       │         persist at seal, device placements (owns the catalog)
//!       ├── memory    budget, host arena (pinned with CUDA), device tier, spill store
//!       └── jobs      training jobs: start, progress, checkpoints, cancel
//!             └── train   the runtime: model, step, CPU and CUDA backends, checkpoints
//! metrics   what the server did (counted where it happens) and holds (read at
//!           scrape), served as OpenMetrics on --metrics-listen; the edge ends each
//!           call's count, duration and log line
//! convert   wire (prost) <-> domain types, the one place a malformed message fails
//! credentials  tokens and TLS files, read again on SIGHUP and every 10 s (auth: roles)
//! error     the error enum and its mapping to gRPC codes
//! ```
//!
//! Arrows run one way: `service` calls into the rest; nothing imports
//! `service`. The pure layers have no tokio and no I/O.
//!
//! Embedders and tests start a server with [`serve`] on a listener they bound
//! (port 0 for a free port).

pub mod auth;
pub mod catalog;
pub mod cluster;
pub mod config;
pub mod convert;
pub mod credentials;
pub mod error;
pub mod jobs;
pub mod memory;
pub mod metrics;
pub mod order;
pub mod query;
pub mod read;
pub mod service;
pub mod state;
pub mod train;

use std::future::Future;
use std::time::Duration;

use arrow_flight::flight_service_server::FlightServiceServer;
use futures::{FutureExt, StreamExt};
use tokio::net::{TcpListener, UnixListener};
use tokio_stream::wrappers::{TcpListenerStream, UnixListenerStream};
use tracing::info;

pub use config::ServerConfig;
pub use error::{Error, Result};
pub use service::FlightdeckService;

/// HTTP/2 flow-control windows: large enough that one stream can keep a
/// loopback or datacenter link busy (puts: 2 MiB and 8 MiB measured alike
/// on loopback, 1 MiB 25 % slower), and small because a writer waiting for
/// admission can have a whole stream window of data buffered here.
const STREAM_WINDOW_BYTES: u32 = 2 << 20;
const CONNECTION_WINDOW_BYTES: u32 = 32 << 20;
/// Largest HTTP/2 frame this server accepts (writers' DoPut data); the
/// default 16 KiB cuts a 4 MiB record batch into 256 frames.
const MAX_FRAME_BYTES: u32 = 1 << 20;

/// Why the server could not run.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The configuration is invalid, or the store it names cannot be read.
    #[error("cannot start: {0}")]
    Config(#[from] Error),
    /// The gRPC transport failed.
    #[error("transport failed: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// Binds a Unix domain socket at `path` for [`Listeners::unix`], its file
/// given the permission bits `mode` (connecting needs write permission; the
/// folder's permissions guard the moment between the bind and the change).
/// A socket file left there by a server that is gone is replaced; a live
/// server on it, or a file that is not a socket, is an error naming the
/// path.
pub fn bind_unix(path: &std::path::Path, mode: u32) -> std::result::Result<UnixListener, Error> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let shown = path.display();
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(Error::invalid(format!(
                "--unix-socket {shown} exists and is not a socket; remove it or name another path"
            )));
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(Error::Unavailable(format!(
                "--unix-socket {shown}: a server is already listening there; stop it or name \
                 another path"
            )));
        }
        std::fs::remove_file(path).map_err(|e| {
            Error::Unavailable(format!("cannot remove the stale socket {shown}: {e}"))
        })?;
    }
    let listener = UnixListener::bind(path)
        .map_err(|e| Error::Unavailable(format!("cannot listen on --unix-socket {shown}: {e}")))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(|e| {
        let _ = std::fs::remove_file(path);
        Error::Unavailable(format!(
            "cannot give --unix-socket {shown} the mode {mode:o} (--unix-socket-mode): {e}"
        ))
    })?;
    Ok(listener)
}

/// What a server listens on: the Flight service on TCP (what members,
/// Spark and remote clients reach) and, for clients on this machine,
/// optionally on a Unix domain socket; `/metrics` optionally.
#[derive(Debug)]
pub struct Listeners {
    /// The Flight service's TCP listener (its address is the location the
    /// server advertises unless `--advertise` says otherwise).
    pub flight: TcpListener,
    /// The same service on a Unix domain socket ([`bind_unix`]), never
    /// over TLS: file permissions and tokens guard it.
    pub unix: Option<UnixListener>,
    /// Where `/metrics` is served.
    pub metrics: Option<TcpListener>,
}

/// Serves the Flight service on `listener` until `shutdown` completes, then
/// drains: new calls are refused (`UNAVAILABLE`) and the gRPC health service
/// says `NOT_SERVING` while the calls in flight finish; then it stops and
/// returns. With `config.metrics_listen`, `/metrics` is served there; with
/// `config.unix_socket`, the service is served on that socket too.
pub async fn serve(
    listener: TcpListener,
    config: ServerConfig,
    shutdown: impl Future<Output = ()> + Send,
) -> std::result::Result<(), ServeError> {
    config.validate()?;
    let metrics = match config.metrics_listen {
        Some(addr) => Some(TcpListener::bind(addr).await.map_err(|e| {
            Error::Unavailable(format!("cannot listen on --metrics-listen {addr}: {e}"))
        })?),
        None => None,
    };
    let unix = config
        .unix_socket
        .as_deref()
        .map(|path| bind_unix(path, config.unix_socket_mode))
        .transpose()?;
    let listeners = Listeners {
        flight: listener,
        unix,
        metrics,
    };
    serve_with(listeners, config, shutdown, || {}).await
}

/// A background task, aborted when this is dropped.
struct Background(tokio::task::JoinHandle<()>);

impl Drop for Background {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Longest a client may take over its TLS handshake before its connection
/// is closed (a client that connects and says nothing holds no one up
/// meanwhile: each handshake runs on its own).
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Accepts TCP connections on `listener` and shakes hands over TLS on
/// each, concurrently, with the certificate `acceptor` resolves (the
/// newest); a connection whose handshake fails or takes longer than
/// [`TLS_HANDSHAKE_TIMEOUT`] is closed. Accepting stops when the returned
/// task is dropped.
fn tls_incoming(
    listener: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
) -> (
    Background,
    tokio_stream::wrappers::ReceiverStream<
        std::io::Result<tokio_rustls::server::TlsStream<tokio::net::TcpStream>>,
    >,
) {
    let (ready, incoming) = tokio::sync::mpsc::channel(64);
    let accepting = tokio::spawn(async move {
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors, or a connection reset before
                    // it was taken: the next one may do.
                    tracing::debug!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            };
            // Small messages (acks, actions) must not wait for Nagle.
            let _ = stream.set_nodelay(true);
            let (acceptor, ready) = (acceptor.clone(), ready.clone());
            tokio::spawn(async move {
                match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                    Ok(Ok(tls)) => {
                        let _ = ready.send(Ok(tls)).await;
                    }
                    Ok(Err(e)) => tracing::debug!(error = %e, "TLS handshake failed"),
                    Err(_) => tracing::debug!("TLS handshake took too long"),
                }
            });
        }
    });
    (
        Background(accepting),
        tokio_stream::wrappers::ReceiverStream::new(incoming),
    )
}

/// Reads the credential files again every [`credentials::CHECK_EVERY`] and
/// on `SIGHUP`, for as long as the server runs.
async fn refresh_credentials(state: std::sync::Arc<state::State>, mut warned: Said) {
    use tokio::signal::unix::{SignalKind, signal};
    let mut hangup = signal(SignalKind::hangup())
        .map_err(|e| tracing::warn!("cannot listen for SIGHUP: {e}"))
        .ok();
    let mut ticks = tokio::time::interval(credentials::CHECK_EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await;
    loop {
        let signalled = tokio::select! {
            _ = ticks.tick() => false,
            Some(()) = async {
                match &mut hangup {
                    Some(h) => h.recv().await,
                    None => std::future::pending().await,
                }
            } => true,
        };
        if state.credentials.is_empty() {
            if signalled {
                info!(
                    "SIGHUP received: this server reads no credential files (--auth-token-file, \
                     --tls-cert, --tls-ca), so there is nothing to read again"
                );
            }
            continue;
        }
        // File reads: off the runtime's threads (a hung network mount holds
        // up this loop alone).
        let reading = state.clone();
        let Ok(refreshed) =
            tokio::task::spawn_blocking(move || reading.refresh_credentials()).await
        else {
            continue;
        };
        if refreshed.identity
            && let Some(expiry) = state.credentials.certificate_expiry()
        {
            info!(expires = %expiry.text, "the new certificate's expiry");
        }
        warn_of_expiry(&state, &mut warned);
        if signalled {
            info!(
                tokens = refreshed.tokens,
                certificate = refreshed.identity,
                member_roots = refreshed.roots,
                refused = refreshed.refused.len(),
                "SIGHUP received: credential files read again"
            );
        }
    }
}

/// What the log last said of the validity of the certificate in use and of
/// the members' authorities (`--tls-ca`).
#[derive(Debug, Default)]
struct Said {
    certificate: Option<credentials::ExpiryWarning>,
    authorities: Option<credentials::ExpiryWarning>,
}

/// "in 3 days", "in 1 day", "within a day".
fn days_left(days: u64) -> String {
    match days {
        0 => "within a day".to_string(),
        1 => "in 1 day".to_string(),
        n => format!("in {n} days"),
    }
}

/// Warns that the certificate in use, or the first authority of
/// `--tls-ca`, is not valid yet, expires soon (once a day, from
/// [`credentials::WARN_BEFORE`] before) or has expired (once), when that
/// differs from what was said last; and says when one is valid again.
fn warn_of_expiry(state: &state::State, said: &mut Said) {
    use credentials::ExpiryWarning::{Expired, NotYetValid, Soon};
    let now = std::time::SystemTime::now();
    let every = credentials::CHECK_EVERY.as_secs();
    let changed = |expiry: &credentials::Expiry, said: &mut Option<_>| {
        let warning = expiry.warning(now);
        let valid_again = matches!(warning, None | Some(Soon { .. })) && *said == Some(NotYetValid);
        (warning != std::mem::replace(said, warning)).then_some((warning, valid_again))
    };
    if let Some(expiry) = state.credentials.certificate_expiry()
        && let Some((warning, valid_again)) = changed(&expiry, &mut said.certificate)
    {
        match warning {
            Some(Soon { days }) => tracing::warn!(
                expires = %expiry.text,
                "the certificate (--tls-cert) expires {}: install a renewed certificate and key at \
                 the same paths; the server reads them again on SIGHUP and every {every}s",
                days_left(days)
            ),
            Some(NotYetValid) => tracing::warn!(
                valid_from = %expiry.from_text(),
                "the certificate (--tls-cert) is not valid yet (its notBefore is ahead): clients \
                 that check it refuse new connections until then; check this node's clock against \
                 the issuer's, or install a certificate valid now (read again on SIGHUP and every \
                 {every}s)"
            ),
            Some(Expired) => tracing::error!(
                expires = %expiry.text,
                "the certificate (--tls-cert) has expired: clients that check it refuse new \
                 connections; install a renewed certificate and key at the same paths (read again \
                 on SIGHUP and every {every}s)"
            ),
            None => {}
        }
        if valid_again {
            info!(expires = %expiry.text, "the certificate (--tls-cert) is valid now");
        }
    }
    if let Some(expiry) = state.credentials.authority_expiry()
        && let Some((warning, valid_again)) = changed(&expiry, &mut said.authorities)
    {
        let authority = &expiry.subject;
        match warning {
            Some(Soon { days }) => tracing::warn!(
                %authority,
                expires = %expiry.text,
                "an authority of --tls-ca expires {}: this server's calls to the members whose \
                 certificates it signed fail from then on; add its successor to the file beside it \
                 and re-issue their certificates (read again on SIGHUP and every {every}s)",
                days_left(days)
            ),
            Some(NotYetValid) => tracing::warn!(
                %authority,
                valid_from = %expiry.from_text(),
                "an authority of --tls-ca is not valid yet (its notBefore is ahead): this server's \
                 calls to the members whose certificates it signed fail until then; check this \
                 node's clock against the issuer's"
            ),
            Some(Expired) => tracing::warn!(
                %authority,
                expires = %expiry.text,
                "an authority of --tls-ca has expired: this server's calls to the members whose \
                 certificates it signed fail; re-issue their certificates from a valid authority, \
                 and drop it from the file once no member's certificate needs it"
            ),
            None => {}
        }
        if valid_again {
            info!(%authority, "the authorities of --tls-ca are valid now");
        }
    }
}

/// Tends the spill store for as long as the server runs
/// ([`state::State::tend_store`]): a beat every
/// [`memory::heartbeat::Timing::beat`], and the files of stopped servers
/// looked for at start and every sixth beat. A failure is logged when it
/// starts or changes, and its end too.
async fn tend_store(state: std::sync::Arc<state::State>) {
    let every = state.tend_store_every();
    // Its records were written as it started (a claim, a first spill): the
    // first beat is one period on; the first clean is now.
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing: Option<String> = None;
    for n in 0u64.. {
        let beat = n > 0;
        if beat {
            ticks.tick().await;
        }
        match state.tend_store(beat, n % 6 == 0).await {
            Ok(()) => {
                if failing.take().is_some() {
                    info!("the spill store answers again");
                }
            }
            Err(e) => {
                let text = e.to_string();
                if failing.as_deref() != Some(text.as_str()) {
                    tracing::error!(error = %text, "could not tend the spill store");
                    failing = Some(text);
                }
            }
        }
    }
}

/// [`serve`] on listeners the caller bound (and can then say where),
/// instead of those `config.metrics_listen` and `config.unix_socket` name.
/// `ready` runs once the server can answer — its spill store opened,
/// persisted datasets reloaded, TLS configured — just before it serves: the
/// place to tell whoever started it (an error before then is returned and
/// `ready` never runs).
///
/// While it serves, the credential files (`--auth-token-file`, `--tls-cert`
/// and `--tls-key`, `--tls-ca`) are read again every
/// [`credentials::CHECK_EVERY`] and on `SIGHUP` (which this takes over for
/// the process), so tokens and certificates rotate without a restart.
pub async fn serve_with(
    listeners: Listeners,
    config: ServerConfig,
    shutdown: impl Future<Output = ()> + Send,
    ready: impl FnOnce() + Send,
) -> std::result::Result<(), ServeError> {
    let Listeners {
        flight: listener,
        unix,
        metrics,
    } = listeners;
    config.validate()?;
    let unix_path = unix
        .as_ref()
        .and_then(|l| l.local_addr().ok())
        .and_then(|a| a.as_pathname().map(std::path::Path::to_path_buf));
    let max_message = config.max_message_bytes;
    let bound = listener.local_addr().map_err(|e| {
        Error::Unavailable(format!(
            "cannot read the address the server is bound to: {e}"
        ))
    })?;
    let location = config.location(bound);
    // Peers and the spill store may speak TLS even when callers do not.
    flightdeck_client::use_aws_lc_crypto();
    let state = std::sync::Arc::new(state::State::open(config, location).await?);
    let (metrics_stop, metrics_stopped) = tokio::sync::oneshot::channel::<()>();
    let metrics_task = metrics.map(|listener| {
        let registry = state.metrics.registry(std::sync::Arc::downgrade(&state));
        if let Ok(addr) = listener.local_addr() {
            info!(%addr, "metrics on /metrics");
        }
        tokio::spawn(async move {
            let stopped = async {
                let _ = metrics_stopped.await;
            };
            if let Err(e) = metrics::serve(listener, registry, stopped).await {
                tracing::error!(error = %e, "the metrics listener failed");
            }
        })
    });
    // Stopped on every way out of this function.
    let _sweeper = state.config.unsealed_timeout.map(|idle| {
        let state = state.clone();
        Background(tokio::spawn(async move {
            // Often enough that nothing outlives the timeout by more than a
            // fraction of it.
            let every = (idle / 8).clamp(Duration::from_millis(50), Duration::from_secs(60));
            let mut ticks = tokio::time::interval(every);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                state.drop_abandoned(idle).await;
            }
        }))
    });
    let service = FlightServiceServer::new(FlightdeckService::new(state.clone()))
        .max_decoding_message_size(max_message)
        .max_encoding_message_size(max_message);
    // Persisted datasets are listed (State::open reloaded them): serving.
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_serving::<FlightServiceServer<FlightdeckService>>()
        .await;
    let drain = {
        let state = state.clone();
        // Awaited by the TCP and the Unix socket server alike; runs once.
        FutureExt::shared(async move {
            shutdown.await;
            health
                .set_not_serving::<FlightServiceServer<FlightdeckService>>()
                .await;
            health
                .set_service_status("", tonic_health::ServingStatus::NotServing)
                .await;
            state.drain();
            info!(
                in_flight = state.metrics.in_flight(),
                "draining: new calls are refused while the calls in flight finish"
            );
            while state.metrics.in_flight() > 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    // One set of shared-memory rings for every listener.
    let rings = service::shm::Rings::open(
        state.config.shm_dir.clone(),
        state.config.read_ahead_bytes() / 2,
    );
    let router = || {
        tonic::transport::Server::builder()
            .initial_stream_window_size(Some(STREAM_WINDOW_BYTES))
            .initial_connection_window_size(Some(CONNECTION_WINDOW_BYTES))
            .max_frame_size(Some(MAX_FRAME_BYTES))
            .http2_keepalive_interval(Some(Duration::from_secs(30)))
            .add_service(health_service.clone())
            .add_service(service::Edge::new(
                service.clone(),
                state.clone(),
                max_message,
                rings.clone(),
            ))
    };
    // TLS is accepted here rather than by tonic so that each handshake
    // takes the newest certificate (credentials.rs).
    let (tcp, _accepting) = match state.credentials.tls_acceptor()? {
        Some(acceptor) => {
            let (accepting, incoming) = tls_incoming(listener, acceptor);
            let served = router().serve_with_incoming_shutdown(incoming, drain.clone());
            (served.boxed(), Some(accepting))
        }
        None => {
            let incoming = TcpListenerStream::new(listener).map(|conn| {
                conn.inspect(|stream| {
                    // Small messages (acks, actions) must not wait for Nagle.
                    let _ = stream.set_nodelay(true);
                })
            });
            let served = router().serve_with_incoming_shutdown(incoming, drain.clone());
            (served.boxed(), None)
        }
    };
    let mut warned = Said::default();
    if let Some(expiry) = state.credentials.certificate_expiry() {
        info!(expires = %expiry.text, "serving TLS with --tls-cert");
    }
    warn_of_expiry(&state, &mut warned);
    let _refreshing = Background(tokio::spawn(refresh_credentials(state.clone(), warned)));
    let tending = Background(tokio::spawn(tend_store(state.clone())));
    info!(
        addr = %bound,
        location = %state.location,
        memory_limit = state.config.memory_limit,
        "flightdeck serving"
    );
    ready();
    let served = match unix {
        Some(unix) => {
            if let Some(path) = &unix_path {
                info!(path = %path.display(), "also serving on a Unix domain socket");
            }
            let local = router().serve_with_incoming_shutdown(UnixListenerStream::new(unix), drain);
            tokio::try_join!(tcp, local).map(|_| ())
        }
        None => tcp.await,
    };
    if let Some(path) = &unix_path {
        let _ = std::fs::remove_file(path);
    }
    served?;
    let _ = metrics_stop.send(());
    if let Some(task) = metrics_task {
        let _ = task.await;
    }
    // No beat after the session's files are gone.
    drop(tending);
    state.shutdown().await;
    if let Some(rings) = &rings {
        rings.budget.remove_linked();
    }
    info!("flightdeck stopped");
    Ok(())
}
