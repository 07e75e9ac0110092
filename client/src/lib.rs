//! Typed async Rust client for the flightdeck server.
//!
//! A thin layer over [`arrow_flight::FlightClient`] that speaks the
//! `flightdeck.v1` protocol: write partition attempts, seal, plan an epoch for
//! `W` ranks and stream a rank's shard as [`RecordBatch`]es; and query the
//! cache with SQL ([`Client::sql`], [`Client::derive`]).
//!
//! ```no_run
//! # async fn tour() -> Result<(), flightdeck_client::ClientError> {
//! use std::sync::Arc;
//! use arrow::array::{ArrayRef, Int64Array, RecordBatch};
//! use flightdeck_client::{Client, ReadPlan, SealDataset, Shuffle};
//! use futures::{TryStreamExt, stream};
//!
//! let values: ArrayRef = Arc::new(Int64Array::from(vec![1, 2, 3]));
//! let batch = RecordBatch::try_from_iter([("x", values)]).expect("valid batch");
//! let mut client = Client::connect("http://127.0.0.1:50051").await?;
//! client
//!     .put_partition("events", 0, 0, batch.schema(), stream::iter([Ok(batch)]))
//!     .await?;
//! client
//!     .seal(SealDataset { dataset: "events".into(), partitions: 1, ..Default::default() })
//!     .await?;
//! let plan = client
//!     .plan(ReadPlan {
//!         dataset: "events".into(),
//!         world_size: 2,
//!         shuffle: Shuffle::Global.into(),
//!         ..Default::default()
//!     })
//!     .await?;
//! let rank0: Vec<RecordBatch> = client.read_shard(&plan.shards[0]).await?.try_collect().await?;
//! # Ok(()) }
//! ```

pub mod receive;
pub mod shm;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arrow::array::RecordBatch;
use arrow::datatypes::{Schema, SchemaRef};
use arrow_flight::decode::FlightRecordBatchStream;
use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::error::FlightError;
use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_flight::sql::{CommandStatementQuery, ProstMessageExt};
use arrow_flight::{
    Action, FlightClient, FlightData, FlightDescriptor, FlightInfo, PutResult, Ticket,
};
use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt, TryStreamExt};
use prost::Message;
pub use tonic::Code;

/// Makes aws-lc-rs rustls' provider for the process (once; a provider
/// already chosen is kept). tonic's TLS uses it, but other crates in a
/// program (object stores' HTTP clients) may enable ring too, and with two
/// providers compiled in rustls cannot pick one by itself. Called before
/// any TLS connection this crate or the server makes.
pub fn use_aws_lc_crypto() {
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
}
use tonic::codec::{Codec, EncodeBuf, Encoder};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::{Channel, Endpoint};

pub use flightdeck_protos::{
    ClusterLayout, DatasetInfo, DatasetState, JobList, JobStatus, Locality, MemberPartitions,
    OptimizerKind, PartitionAttempt, PlanInfo, PutAck, PutPartition, ReadPlan, SealDataset,
    ServerStats, ShardInfo, Shuffle, StagedWrite, Task, TrainJob, TrainProgress, actions,
};

/// Largest message the client accepts: shards stream whole batches of
/// `batch_rows` rows, which can be large.
const MAX_MESSAGE_BYTES: usize = 1 << 30;

/// Longest wait for a server to take a connection (a host that drops the
/// packets, rather than refusing them, would otherwise hold a caller for
/// the two minutes TCP gives up after).
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// HTTP/2 pings on a connection, and how long an answer may take: a server
/// that stops answering fails the calls waiting on it within both.
const KEEPALIVE: std::time::Duration = std::time::Duration::from_secs(10);
const KEEPALIVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// What can go wrong talking to a flightdeck server.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server answered with an error status: its message (its advice
    /// said in this client's calls, see [`RUST_TERMS`]), then the code's
    /// name, e.g. `dataset 'd' does not exist; … (NotFound)`.
    #[error("{}", status_text(.0, RUST_TERMS))]
    Status(Box<tonic::Status>),
    /// The connection could not be set up.
    #[error("cannot connect: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// The Flight stream could not be encoded or decoded, or the server
    /// ended it with an error status (shown as [`ClientError::Status`] is).
    #[error("{}", flight_text(.0))]
    Flight(FlightError),
    /// The server's reply does not follow the protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
}

/// The port a flightdeck server listens on when a name gives none.
pub const DEFAULT_PORT: u16 = 50051;

/// The location a server name names, `grpc://HOST:PORT`,
/// `grpc+tls://HOST:PORT` or `grpc+unix:///PATH`: `local` (this node's
/// server: the location `FLIGHTDECK_URI` holds where it is set, else
/// `127.0.0.1`), `local:PORT`, `HOST`, `HOST:PORT`, IPv6 literals
/// (`[::1]:PORT`, or `::1` without a port), and `grpc://`, `grpc+tcp://`,
/// `http://`, `grpc+tls://` or `https://` followed by any of those;
/// [`DEFAULT_PORT`] wherever none is given; `grpc+unix://` or `unix://`
/// followed by the absolute path of a server's `--unix-socket`. The
/// Python client reads names the same way (one table of cases tests both:
/// `tests/server_names.tsv`).
pub fn server_location(name: &str) -> Result<String> {
    let local = std::env::var("FLIGHTDECK_URI").ok();
    server_location_with(name, local.as_deref())
}

/// [`server_location`] with `local` standing for the location in `local`.
fn server_location_with(name: &str, local: Option<&str>) -> Result<String> {
    let bad = || {
        ClientError::Protocol(format!(
            "'{name}' does not name a server: give host[:port], grpc://host[:port], \
             grpc+tls://host[:port], grpc+unix:///path or local (the default port is \
             {DEFAULT_PORT})"
        ))
    };
    let name = name.trim();
    if name == "local" {
        return match local.map(str::trim) {
            Some(at) if !at.is_empty() && at != "local" && !at.starts_with("local:") => {
                server_location_with(at, None)
            }
            _ => Ok(format!("grpc://127.0.0.1:{DEFAULT_PORT}")),
        };
    }
    if let Some(port) = name.strip_prefix("local:") {
        let port = parse_port(port).ok_or_else(bad)?;
        return Ok(format!("grpc://127.0.0.1:{port}"));
    }
    let (scheme, rest) = name.split_once("://").unwrap_or(("grpc", name));
    if matches!(scheme, "grpc+unix" | "unix") {
        // A socket's absolute path, nothing that could be read as a host.
        let absolute = rest.starts_with('/') && rest.len() > 1 && !rest.ends_with('/');
        return match absolute && !rest.contains(char::is_whitespace) {
            true => Ok(format!("grpc+unix://{rest}")),
            false => Err(bad()),
        };
    }
    let scheme = match scheme {
        "grpc" | "grpc+tcp" | "http" => "grpc",
        "grpc+tls" | "https" => "grpc+tls",
        _ => return Err(bad()),
    };
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    let (host, port) = split_authority(authority).ok_or_else(bad)?;
    Ok(format!("{scheme}://{host}:{port}"))
}

/// Whether the server a location (as [`server_location`] gives it) names
/// is on this machine: its Unix socket, `localhost` or a loopback address.
fn on_this_machine(location: &str) -> bool {
    if location.starts_with("grpc+unix://") {
        return true;
    }
    let authority = location
        .split_once("://")
        .map_or(location, |(_, rest)| rest);
    let host = authority
        .rsplit_once(':')
        .map_or(authority, |(host, _)| host);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.to_canonical().is_loopback())
}

/// A port number: digits only, 1 to 65535.
fn parse_port(s: &str) -> Option<u16> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok().filter(|&p| p > 0)
}

/// `HOST[:PORT]` (IPv6 hosts in brackets, or bare without a port) as the
/// host to put in a URI and the port.
fn split_authority(a: &str) -> Option<(String, u16)> {
    if a.is_empty() || a.contains(['/', '?', '#', '@']) || a.contains(char::is_whitespace) {
        return None;
    }
    if let Some(rest) = a.strip_prefix('[') {
        let (host, after) = rest.split_once(']')?;
        host.parse::<std::net::Ipv6Addr>().ok()?;
        let port = match after {
            "" => DEFAULT_PORT,
            p => parse_port(p.strip_prefix(':')?)?,
        };
        return Some((format!("[{host}]"), port));
    }
    if a.matches(':').count() > 1 {
        a.parse::<std::net::Ipv6Addr>().ok()?;
        return Some((format!("[{a}]"), DEFAULT_PORT));
    }
    match a.split_once(':') {
        Some(("", _)) => None,
        Some((host, port)) => Some((host.to_string(), parse_port(port)?)),
        None => Some((a.to_string(), DEFAULT_PORT)),
    }
}

/// A Flight error for a person: a server status as its message and code.
fn flight_text(e: &FlightError) -> String {
    match e {
        FlightError::Tonic(s) => status_text(s, RUST_TERMS),
        other => format!("flight error: {other}"),
    }
}

/// A server status for a person: its message, advice said in `terms`, then
/// the code's name.
fn status_text(s: &tonic::Status, terms: &[(&str, &str)]) -> String {
    // A status the transport made (the connection failed, no answer to its
    // pings) says why in its causes: "http2 error" alone tells no one.
    let text = with_causes(in_terms(s.message(), terms), std::error::Error::source(s));
    format!("{text} ({:?})", s.code())
}

/// `text`, then each error of the chain from `cause` on that it does not
/// already say, `: ` apart.
pub fn with_causes(mut text: String, mut cause: Option<&dyn std::error::Error>) -> String {
    while let Some(c) = cause {
        let said = c.to_string();
        if !text.contains(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        cause = c.source();
    }
    text
}

/// The advice a server gives in Flight's words (left) as a Rust caller acts
/// on it (right). The server speaks the protocol every client shares; each
/// client says the advice in its own calls (the Python client's table is
/// `flightdeck.errors.in_python_terms`).
pub const RUST_TERMS: &[(&str, &str)] = &[
    (
        "write it with DoPut, or list datasets with ListFlights",
        "write it with Client::put_partition, or list datasets with Client::list_datasets",
    ),
    ("call GetFlightInfo again", "plan again (Client::plan)"),
    (
        "get tickets from GetFlightInfo",
        "get tickets from Client::plan",
    ),
    (
        "read the dataset with DoGet instead",
        "read the dataset with Client::read_shard instead",
    ),
    (
        "read it with DoGet (FlightDeckIterableDataset)",
        "read it with Client::read_shard (Python: FlightDeckIterableDataset)",
    ),
];

/// `message` with each left phrase of `terms` replaced by its right one.
pub fn in_terms(message: &str, terms: &[(&str, &str)]) -> String {
    terms.iter().fold(message.to_string(), |m, (flight, ours)| {
        m.replace(flight, ours)
    })
}

impl ClientError {
    /// The gRPC code of a server error; `Unknown` for local failures.
    pub fn code(&self) -> Code {
        self.status().map_or(Code::Unknown, tonic::Status::code)
    }

    /// The server's message (its advice in this client's calls), or this
    /// error's text.
    pub fn message(&self) -> String {
        self.message_in(RUST_TERMS)
    }

    /// The server's message with its advice said in `terms` (a program
    /// built on this client, such as a command line, says it in its own),
    /// or this error's text.
    pub fn message_in(&self, terms: &[(&str, &str)]) -> String {
        match self.status() {
            Some(s) => in_terms(s.message(), terms),
            None => self.to_string(),
        }
    }

    /// This error as [`Display`](std::fmt::Display) shows it, with the
    /// server's advice said in `terms`.
    pub fn text_in(&self, terms: &[(&str, &str)]) -> String {
        match self.status() {
            Some(s) => status_text(s, terms),
            None => self.to_string(),
        }
    }

    /// Whether the connection failed, rather than the server answering:
    /// no connection could be made, or one broke or went silent (its
    /// HTTP/2 pings unanswered) during the call.
    pub fn is_transport(&self) -> bool {
        match self {
            Self::Transport(_) => true,
            _ => self
                .status()
                .is_some_and(|s| std::error::Error::source(s).is_some()),
        }
    }

    /// The server's status, when the server answered with one.
    fn status(&self) -> Option<&tonic::Status> {
        match self {
            Self::Status(s) | Self::Flight(FlightError::Tonic(s)) => Some(s),
            _ => None,
        }
    }
}

impl From<FlightError> for ClientError {
    fn from(e: FlightError) -> Self {
        match e {
            FlightError::Tonic(s) => Self::Status(s),
            other => Self::Flight(other),
        }
    }
}

impl From<tonic::Status> for ClientError {
    fn from(s: tonic::Status) -> Self {
        Self::Status(Box::new(s))
    }
}

/// Result with [`ClientError`].
pub type Result<T, E = ClientError> = std::result::Result<T, E>;

/// One rank's part of a plan.
#[derive(Debug, Clone)]
pub struct Shard {
    /// The rank.
    pub rank: u32,
    /// Exact rows the rank receives.
    pub rows: u64,
    /// Record batches the stream carries.
    pub batches: u64,
    /// Opaque ticket for `read_shard`.
    pub ticket: Bytes,
    /// The member that serves this rank (cluster datasets); `None` = the
    /// server that planned it.
    pub location: Option<String>,
}

/// The answer to [`Client::plan`]: the projected schema and one shard per
/// rank, in rank order.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Schema of every batch of every shard.
    pub schema: SchemaRef,
    /// Shards in rank order.
    pub shards: Vec<Shard>,
    /// Rows over all shards (padding included).
    pub total_rows: u64,
    /// Rows of the plan's row space (its filter's selection, else every
    /// row) in each stored partition, in partition order (see `PlanInfo`).
    pub partition_rows: Vec<u64>,
}

/// The answer to [`Client::sql`].
pub struct SqlResult {
    /// The result's schema (also that of a result without rows).
    pub schema: SchemaRef,
    /// The result's batches, as the server streams them.
    pub batches: BoxStream<'static, Result<RecordBatch>>,
}

impl std::fmt::Debug for SqlResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlResult")
            .field("schema", &self.schema)
            .finish_non_exhaustive()
    }
}

/// What an attempt will send, told to the server up front so that it
/// admits the attempt whole or refuses it before any of it is sent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Expected {
    /// Bytes of the batches' buffers; 0 = unknown.
    pub bytes: u64,
    /// Rows; 0 = unknown.
    pub rows: u64,
}

impl Expected {
    /// What `batches` hold.
    pub fn of(batches: &[RecordBatch]) -> Self {
        Self {
            bytes: batches
                .iter()
                .map(|b| b.get_array_memory_size() as u64)
                .sum(),
            rows: batches.iter().map(|b| b.num_rows() as u64).sum(),
        }
    }
}

/// A connection to one flightdeck server. Cheap to clone; clones share the
/// connection.
#[derive(Debug)]
pub struct Client {
    channel: Channel,
    inner: FlightClient,
    /// The location this client connected to, when known.
    uri: Option<String>,
    /// The root certificates it checks servers' TLS certificates with.
    tls_roots: Option<Vec<u8>>,
    /// The write its attempts belong to ([`Client::with_write_id`]).
    write_id: String,
    /// Whether that write replaces its dataset ([`Client::with_replacing_write`]).
    replace: bool,
    /// The network location the server advertises, once asked (a client
    /// on its Unix socket compares shards' locations with it).
    advertised: Option<String>,
    /// Whether shards are asked for through the server's shared memory
    /// ([`Client::with_shared_memory`]).
    shared_memory: bool,
}

impl Clone for Client {
    fn clone(&self) -> Self {
        let mut clone = Self {
            uri: self.uri.clone(),
            tls_roots: self.tls_roots.clone(),
            write_id: self.write_id.clone(),
            replace: self.replace,
            advertised: self.advertised.clone(),
            shared_memory: self.shared_memory,
            ..Self::from_channel(self.channel.clone())
        };
        clone.share_headers(self);
        clone
    }
}

impl Client {
    /// Connects to `uri` (`http://host:port`; `grpc://` and `grpc+tcp://`
    /// are accepted as aliases). The token in `FLIGHTDECK_TOKEN`, if set, is
    /// sent on every call ([`Client::with_token`]).
    /// Over TLS (`grpc+tls://`), the server is checked against the PEM
    /// file `FLIGHTDECK_TLS_ROOT_CERTS` names.
    pub async fn connect(uri: impl AsRef<str>) -> Result<Self> {
        let roots = match std::env::var_os("FLIGHTDECK_TLS_ROOT_CERTS") {
            Some(path) => Some(std::fs::read(&path).map_err(|e| {
                ClientError::Protocol(format!(
                    "FLIGHTDECK_TLS_ROOT_CERTS {}: {e}",
                    std::path::Path::new(&path).display()
                ))
            })?),
            None => None,
        };
        Self::connect_with(uri, roots.as_deref()).await
    }

    /// Connects to the server `uri` names (any name [`server_location`]
    /// takes); `grpc+tls://` and `https://` connect over TLS, checking the
    /// server's certificate against `tls_root_certs` (PEM).
    pub async fn connect_with(uri: impl AsRef<str>, tls_root_certs: Option<&[u8]>) -> Result<Self> {
        let given = uri.as_ref().trim().to_string();
        let location = server_location(&given)?;
        let (tls, uri) = match (
            location.strip_prefix("grpc+tls://"),
            location.strip_prefix("grpc+unix://"),
        ) {
            (Some(rest), _) => (true, format!("https://{rest}")),
            // tonic reads `unix://PATH` as a Unix domain socket.
            (_, Some(path)) => (false, format!("unix://{path}")),
            _ => (false, location.replacen("grpc://", "http://", 1)),
        };
        let mut endpoint = Endpoint::from_shared(uri)?;
        if tls {
            use_aws_lc_crypto();
            let roots = tls_root_certs.ok_or_else(|| {
                ClientError::Protocol(format!(
                    "{given} is served over TLS: pass its root certificates (tls_root_certs, \
                     or the file FLIGHTDECK_TLS_ROOT_CERTS names)"
                ))
            })?;
            endpoint = endpoint.tls_config(
                tonic::transport::ClientTlsConfig::new()
                    .ca_certificate(tonic::transport::Certificate::from_pem(roots)),
            )?;
        }
        let channel = endpoint
            .connect_timeout(CONNECT_TIMEOUT)
            // A server that stops answering (or a port that never spoke
            // gRPC) fails the calls waiting on it instead of holding them.
            .http2_keep_alive_interval(KEEPALIVE)
            .keep_alive_timeout(KEEPALIVE_TIMEOUT)
            .keep_alive_while_idle(true)
            .tcp_nodelay(true)
            .initial_stream_window_size(Some(8 << 20))
            .initial_connection_window_size(Some(32 << 20))
            // Shards arrive in MiB-sized messages: fewer, larger frames.
            .max_frame_size(Some(1 << 20))
            .connect()
            .await?;
        let client = Self {
            shared_memory: on_this_machine(&location)
                && std::env::var_os("FLIGHTDECK_SHM").is_none_or(|v| v != "0"),
            uri: Some(location),
            tls_roots: tls_root_certs.map(<[u8]>::to_vec),
            ..Self::from_channel(channel)
        };
        match std::env::var("FLIGHTDECK_TOKEN") {
            Ok(token) if !token.is_empty() => client.with_token(&token),
            _ => Ok(client),
        }
    }

    /// This client, sending `token` as its bearer token on every call (and
    /// on its connections to the other members of a cluster): servers
    /// started with `--auth-token-file` need one.
    pub fn with_token(mut self, token: &str) -> Result<Self> {
        self.inner
            .add_header("authorization", &format!("Bearer {token}"))
            .map_err(|_| {
                ClientError::Protocol("a token must be printable ASCII without spaces".into())
            })?;
        Ok(self)
    }

    /// This client, naming `write_id` as the write (a job of many tasks,
    /// any id its writers share) every attempt it puts belongs to. Once
    /// [`Client::abort_write`] names it, the servers refuse its attempts
    /// with `ABORTED`, so a task still running when its job failed cannot
    /// bring a dropped dataset back.
    pub fn with_write_id(mut self, write_id: &str) -> Self {
        self.write_id = write_id.to_string();
        self
    }

    /// This client, naming `write_id` as a write that replaces its dataset
    /// (an overwrite): the attempts it puts are staged beside the dataset,
    /// which readers keep reading until a seal with
    /// `SealDataset::replace_write` set to `write_id` puts the new rows in
    /// its place at once. [`Client::abort_replacing_write`] drops only what
    /// the write staged.
    pub fn with_replacing_write(mut self, write_id: &str) -> Self {
        self.write_id = write_id.to_string();
        self.replace = true;
        self
    }

    /// Sends what `other` sends with every call (its token).
    fn share_headers(&mut self, other: &Client) {
        *self.inner.metadata_mut() = other.inner.metadata().clone();
    }

    /// A client over an existing channel.
    pub fn from_channel(channel: Channel) -> Self {
        let inner = FlightServiceClient::new(channel.clone())
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        Self {
            channel,
            inner: FlightClient::new_from_inner(inner),
            uri: None,
            tls_roots: None,
            write_id: String::new(),
            replace: false,
            advertised: None,
            shared_memory: false,
        }
    }

    /// This client, reading shards through the server's shared memory
    /// (`on`) or over the connection. A client connected to a server on
    /// its own machine (a loopback address or its Unix socket) does by
    /// default, unless `FLIGHTDECK_SHM=0`: each record batch is then copied
    /// once into a ring the server shares and once out of it, instead of
    /// through gRPC and the socket; the batches are the same. A server
    /// that offers none, or whose ring cannot be mapped here, is read over
    /// the connection.
    pub fn with_shared_memory(mut self, on: bool) -> Self {
        self.shared_memory = on;
        self
    }

    /// The connection this client calls over, for other gRPC services the
    /// server offers on it (the standard health service).
    pub fn channel(&self) -> Channel {
        self.channel.clone()
    }

    /// The underlying Flight client, for plain Flight calls.
    pub fn flight(&mut self) -> &mut FlightClient {
        &mut self.inner
    }

    /// Writes one attempt of one partition; returns the server's ack once the
    /// attempt is committed.
    ///
    /// An error in `batches` (or in encoding them) resets the HTTP/2 stream
    /// instead of ending it, so the server sees a broken stream and keeps
    /// nothing of the attempt; that error is returned. (A plain Flight
    /// `DoPut` would end the stream cleanly and commit a partial attempt.)
    pub async fn put_partition<S>(
        &mut self,
        dataset: &str,
        partition: u32,
        attempt: u32,
        schema: SchemaRef,
        batches: S,
    ) -> Result<PutAck>
    where
        S: Stream<Item = Result<RecordBatch, FlightError>> + Send + 'static,
    {
        self.put_partition_expecting(
            dataset,
            partition,
            attempt,
            schema,
            Expected::default(),
            batches,
        )
        .await
    }

    /// [`Client::put_partition`] saying up front what the attempt will
    /// send ([`Expected::of`] the batches): the server sets its memory
    /// aside before reading any of it, so the attempt is admitted whole
    /// (after waiting for room up to the server's `--admission-wait`) or
    /// refused with `RESOURCE_EXHAUSTED` at once, never half-way.
    pub async fn put_partition_expecting<S>(
        &mut self,
        dataset: &str,
        partition: u32,
        attempt: u32,
        schema: SchemaRef,
        expected: Expected,
        batches: S,
    ) -> Result<PutAck>
    where
        S: Stream<Item = Result<RecordBatch, FlightError>> + Send + 'static,
    {
        let cmd = flightdeck_protos::PutPartition {
            dataset: dataset.to_string(),
            partition,
            attempt,
            explicit_commit: true,
            expected_bytes: expected.bytes,
            expected_rows: expected.rows,
            write_id: self.write_id.clone(),
            replace: self.replace,
        };
        // Count rows as they go; the last message carries the count as the
        // commit marker, so the server commits only a complete attempt.
        let rows = Arc::new(AtomicU64::new(0));
        let counted = rows.clone();
        let batches = batches.inspect_ok(move |b| {
            counted.fetch_add(b.num_rows() as u64, Ordering::Relaxed);
        });
        let data = FlightDataEncoderBuilder::new()
            .with_schema(schema)
            .with_flight_descriptor(Some(FlightDescriptor::new_cmd(cmd.encode_to_vec())))
            .with_max_flight_data_size(MAX_MESSAGE_BYTES / 2)
            .build(batches)
            .chain(futures::stream::once(async move {
                let commit = flightdeck_protos::PutCommit {
                    rows: Some(rows.load(Ordering::Relaxed)),
                };
                Ok(FlightData::new().with_app_metadata(commit.encode_to_vec()))
            }));
        let (err_tx, mut err_rx) = futures::channel::oneshot::channel::<FlightError>();
        let mut err_tx = Some(err_tx);
        // After the first error the stream yields it to the codec (which
        // fails the body and resets the stream) and then ends.
        let request = data
            .map(move |item| match item {
                Ok(d) => Ok(d),
                Err(e) => {
                    let status = tonic::Status::aborted(format!("client stream failed: {e}"));
                    if let Some(tx) = err_tx.take() {
                        let _ = tx.send(e);
                    }
                    Err(status)
                }
            })
            .scan(false, |failed, item| {
                let out = (!*failed).then_some(item);
                *failed = out.as_ref().is_some_and(|i| i.is_err());
                futures::future::ready(out)
            });
        let mut grpc = tonic::client::Grpc::new(self.channel.clone())
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        let outcome = async {
            grpc.ready()
                .await
                .map_err(|e| tonic::Status::unavailable(format!("connection not ready: {e}")))?;
            let mut request = tonic::Request::new(request);
            *request.metadata_mut() = self.inner.metadata().clone();
            let response = grpc
                .streaming(
                    request,
                    PathAndQuery::from_static("/arrow.flight.protocol.FlightService/DoPut"),
                    AbortingCodec,
                )
                .await?;
            let mut results = response.into_inner();
            results.message().await
        }
        .await;
        if let Ok(Some(e)) = err_rx.try_recv() {
            return Err(ClientError::Flight(e));
        }
        let result =
            outcome?.ok_or_else(|| ClientError::Protocol("DoPut returned no PutResult".into()))?;
        decode(&result.app_metadata, "PutAck")
    }

    async fn action<M: Message + Default>(&mut self, kind: &str, body: Bytes) -> Result<M> {
        let results: Vec<Bytes> = self
            .inner
            .do_action(Action::new(kind, body))
            .await?
            .try_collect()
            .await?;
        let body = results
            .into_iter()
            .next()
            .ok_or_else(|| ClientError::Protocol(format!("action '{kind}' returned no result")))?;
        decode(&body, kind)
    }

    /// Seals a dataset: `partitions` is the expected count (0 = don't check),
    /// `attempts` the winners (empty = first committed wins).
    pub async fn seal(&mut self, seal: SealDataset) -> Result<DatasetInfo> {
        self.action(actions::SEAL, seal.encode_to_vec().into())
            .await
    }

    /// Drops a dataset and frees its memory.
    pub async fn drop_dataset(&mut self, dataset: &str) -> Result<DatasetInfo> {
        let body = flightdeck_protos::DropDataset {
            dataset: dataset.to_string(),
            ..Default::default()
        };
        self.action(actions::DROP, body.encode_to_vec().into())
            .await
    }

    /// Ends a failed write: drops `dataset` (on every member of a cluster
    /// dataset) and has the server refuse every attempt of write
    /// `write_id` ([`Client::with_write_id`]) from now on, with `ABORTED`.
    /// The refusal is recorded even when there is no dataset to drop.
    pub async fn abort_write(&mut self, dataset: &str, write_id: &str) -> Result<()> {
        self.abort(dataset, write_id, false).await
    }

    /// Ends a failed replacing write ([`Client::with_replacing_write`]):
    /// drops what write `write_id` staged to replace `dataset`, leaving the
    /// dataset as it was, and has the server refuse the write's attempts
    /// from now on.
    pub async fn abort_replacing_write(&mut self, dataset: &str, write_id: &str) -> Result<()> {
        self.abort(dataset, write_id, true).await
    }

    /// Drops what write `write_id` staged to replace `dataset` (a
    /// replacing write whose job is gone) and refuses the write's attempts
    /// from now on; the dataset stays as it is. `NOT_FOUND` when the write
    /// staged nothing on this server.
    pub async fn drop_replacement(&mut self, dataset: &str, write_id: &str) -> Result<DatasetInfo> {
        self.drop_for_write(dataset, write_id, true).await
    }

    async fn abort(&mut self, dataset: &str, write_id: &str, staged: bool) -> Result<()> {
        match self.drop_for_write(dataset, write_id, staged).await {
            Err(e) if e.code() != Code::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    async fn drop_for_write(
        &mut self,
        dataset: &str,
        write_id: &str,
        staged: bool,
    ) -> Result<DatasetInfo> {
        let body = flightdeck_protos::DropDataset {
            dataset: dataset.to_string(),
            abort_write: write_id.to_string(),
            staged,
            ..Default::default()
        };
        self.action(actions::DROP, body.encode_to_vec().into())
            .await
    }

    /// State, rows, bytes, partitions and schema of a dataset.
    pub async fn describe(&mut self, dataset: &str) -> Result<DatasetInfo> {
        let body = flightdeck_protos::DescribeDataset {
            dataset: dataset.to_string(),
        };
        self.action(actions::DESCRIBE, body.encode_to_vec().into())
            .await
    }

    /// Copies numeric columns of a sealed dataset to GPUs (`columns` empty =
    /// every numeric column: numbers, fixed-size lists of them, and lists
    /// whose rows all hold one number of them, as Spark's `array<float>`;
    /// `devices` empty = device 0). A server without a
    /// CUDA driver answers `FailedPrecondition`.
    pub async fn place(
        &mut self,
        dataset: &str,
        columns: &[&str],
        devices: &[u32],
    ) -> Result<DatasetInfo> {
        let body = flightdeck_protos::PlaceColumns {
            dataset: dataset.to_string(),
            columns: columns.iter().map(|c| c.to_string()).collect(),
            devices: devices.to_vec(),
        };
        self.action(actions::PLACE, body.encode_to_vec().into())
            .await
    }

    /// Frees a dataset's GPU copies on `devices` (empty = all).
    pub async fn evict(&mut self, dataset: &str, devices: &[u32]) -> Result<DatasetInfo> {
        let body = flightdeck_protos::EvictColumns {
            dataset: dataset.to_string(),
            devices: devices.to_vec(),
        };
        self.action(actions::EVICT, body.encode_to_vec().into())
            .await
    }

    /// Starts a training job on the server; the stream yields its progress
    /// reports and ends after the one with `done` set, or with the job's
    /// error. Dropping the stream cancels the job.
    pub async fn train(
        &mut self,
        job: TrainJob,
    ) -> Result<BoxStream<'static, Result<TrainProgress>>> {
        let results = self
            .inner
            .do_action(Action::new(actions::TRAIN, job.encode_to_vec()))
            .await?;
        Ok(results
            .map_err(ClientError::from)
            .and_then(|body| async move { decode(&body, "TrainProgress") })
            .boxed())
    }

    /// Status of training job `job` (0 = every job since the server started).
    pub async fn jobs(&mut self, job: u64) -> Result<JobList> {
        let body = flightdeck_protos::JobQuery { job };
        self.action(actions::JOB, body.encode_to_vec().into()).await
    }

    /// Memory per tier and dataset totals of the server.
    pub async fn stats(&mut self) -> Result<ServerStats> {
        self.action(actions::STATS, Bytes::new()).await
    }

    /// Runs a read-only SQL query over the server's sealed datasets (each
    /// a table named as the dataset; a cluster dataset's rows come from
    /// every member) through the server's Arrow Flight SQL endpoint, as
    /// ADBC's driver would: the result's schema, and its batches streamed.
    pub async fn sql(&mut self, query: &str) -> Result<SqlResult> {
        let command = CommandStatementQuery {
            query: query.to_string(),
            transaction_id: None,
        };
        let info = self
            .inner
            .get_flight_info(FlightDescriptor::new_cmd(command.as_any().encode_to_vec()))
            .await?;
        let schema: Schema = info
            .clone()
            .try_decode_schema()
            .map_err(|e| ClientError::Protocol(format!("cannot decode the query's schema: {e}")))?;
        let mut streams = Vec::with_capacity(info.endpoint.len());
        for endpoint in info.endpoint {
            let ticket = endpoint
                .ticket
                .ok_or_else(|| ClientError::Protocol("query endpoint without ticket".into()))?;
            streams.push(self.do_get(ticket).await?.map_err(ClientError::from));
        }
        Ok(SqlResult {
            schema: Arc::new(schema),
            batches: futures::stream::iter(streams).flatten().boxed(),
        })
    }

    /// Runs a read-only SQL query over the server's sealed datasets (each
    /// a table by its name; `source`, when not empty, is also the table
    /// `source`) and keeps its result as the new sealed dataset `target`:
    /// its info, or `FailedPrecondition` if `target` exists.
    pub async fn derive(&mut self, target: &str, sql: &str, source: &str) -> Result<DatasetInfo> {
        let body = flightdeck_protos::DeriveDataset {
            target: target.to_string(),
            sql: sql.to_string(),
            source: source.to_string(),
        };
        self.action(actions::DERIVE, body.encode_to_vec().into())
            .await
    }

    /// Plans one epoch for `plan.world_size` ranks.
    pub async fn plan(&mut self, plan: ReadPlan) -> Result<Plan> {
        let info = self
            .inner
            .get_flight_info(FlightDescriptor::new_cmd(plan.encode_to_vec()))
            .await?;
        plan_from_info(info)
    }

    /// Streams one rank's shard, from the member its endpoint names when
    /// that is another server (cluster datasets).
    pub async fn read_shard(
        &mut self,
        shard: &Shard,
    ) -> Result<BoxStream<'static, Result<RecordBatch>>> {
        let ticket = Ticket::new(shard.ticket.clone());
        let stream = match &shard.location {
            Some(at) if !self.serves(at).await? => {
                let mut member = Client::connect_with(at, self.tls_roots.as_deref()).await?;
                member.share_headers(self);
                member.do_get(ticket).await?
            }
            _ => self.do_get(ticket).await?,
        };
        Ok(stream.map_err(ClientError::from).boxed())
    }

    /// Whether `location` (the member an endpoint names) is the server
    /// this client is connected to: the same server name, or, for a client
    /// on a Unix socket, the network location that server advertises
    /// (asked once).
    async fn serves(&mut self, location: &str) -> Result<bool> {
        let Some(uri) = self.uri.as_deref() else {
            return Ok(false);
        };
        let named = server_location(location).ok();
        if named.as_deref() == Some(uri) {
            return Ok(true);
        }
        if !uri.starts_with("grpc+unix://") {
            return Ok(false);
        }
        if self.advertised.is_none() {
            let advertised = self.stats().await?.location;
            self.advertised = Some(server_location(&advertised).unwrap_or(advertised));
        }
        Ok(self.advertised == named)
    }

    /// `DoGet` for `ticket`: its batches, each body received with one copy
    /// ([`receive`]).
    pub async fn do_get(&mut self, ticket: Ticket) -> Result<FlightRecordBatchStream> {
        if self.shared_memory {
            let mut metadata = self.inner.metadata().clone();
            metadata.insert(
                shm::REQUEST_HEADER,
                tonic::metadata::MetadataValue::from_static("1"),
            );
            let messages =
                receive::do_get(&self.channel, &metadata, ticket.clone(), MAX_MESSAGE_BYTES)
                    .await?;
            match shm::through_ring(messages).await {
                Ok(messages) => {
                    return Ok(FlightRecordBatchStream::new_from_flight_data(
                        messages.map_err(FlightError::from),
                    ));
                }
                Err(shm::Attach::Failed(status)) => return Err(status.into()),
                // Not this machine's shared memory after all (another
                // container's, another user's): over the connection from
                // now on. The call is cancelled as its stream is dropped.
                Err(shm::Attach::Cannot(_)) => self.shared_memory = false,
            }
        }
        let messages = receive::do_get(
            &self.channel,
            self.inner.metadata(),
            ticket,
            MAX_MESSAGE_BYTES,
        )
        .await?;
        Ok(FlightRecordBatchStream::new_from_flight_data(
            messages.map_err(FlightError::from),
        ))
    }

    /// Seals a dataset written to several servers: `members` names each
    /// server's location (its `PutAck.location`) and the winning attempts
    /// of the partitions it holds. Any server may receive it (it need not
    /// be a member); it seals every member and hands each the layout.
    pub async fn seal_cluster(
        &mut self,
        dataset: &str,
        partitions: u32,
        members: Vec<MemberPartitions>,
    ) -> Result<DatasetInfo> {
        self.seal(SealDataset {
            dataset: dataset.to_string(),
            partitions,
            members,
            ..Default::default()
        })
        .await
    }

    /// Names of the datasets on the server.
    pub async fn list_datasets(&mut self) -> Result<Vec<String>> {
        self.list_datasets_starting_with("").await
    }

    /// Names of the datasets on the server that start with `prefix`
    /// (`ListFlights` with `prefix` as its criteria).
    pub async fn list_datasets_starting_with(&mut self, prefix: &str) -> Result<Vec<String>> {
        let infos: Vec<FlightInfo> = self
            .inner
            .list_flights(Bytes::copy_from_slice(prefix.as_bytes()))
            .await?
            .try_collect()
            .await?;
        Ok(infos
            .into_iter()
            .filter_map(|i| i.flight_descriptor.and_then(|d| d.path.into_iter().next()))
            .collect())
    }
}

/// `DoPut` codec whose request items are fallible: an `Err` fails the
/// request body, which makes the transport reset the stream.
#[derive(Debug, Clone, Copy)]
struct AbortingCodec;

#[derive(Debug)]
struct AbortingEncoder(tonic_prost::ProstEncoder<FlightData>);

impl Encoder for AbortingEncoder {
    type Item = Result<FlightData, tonic::Status>;
    type Error = tonic::Status;

    fn encode(&mut self, item: Self::Item, dst: &mut EncodeBuf<'_>) -> Result<(), tonic::Status> {
        self.0.encode(item?, dst)
    }
}

impl Codec for AbortingCodec {
    type Encode = Result<FlightData, tonic::Status>;
    type Decode = PutResult;
    type Encoder = AbortingEncoder;
    type Decoder = tonic_prost::ProstDecoder<PutResult>;

    fn encoder(&mut self) -> Self::Encoder {
        AbortingEncoder(tonic_prost::ProstEncoder::default())
    }

    fn decoder(&mut self) -> Self::Decoder {
        tonic_prost::ProstDecoder::default()
    }
}

fn decode<M: Message + Default>(bytes: &[u8], what: &str) -> Result<M> {
    M::decode(bytes).map_err(|e| ClientError::Protocol(format!("cannot decode {what}: {e}")))
}

fn plan_from_info(info: FlightInfo) -> Result<Plan> {
    let schema: Schema = info
        .clone()
        .try_decode_schema()
        .map_err(|e| ClientError::Protocol(format!("cannot decode plan schema: {e}")))?;
    let shards = info
        .endpoint
        .iter()
        .map(|e| {
            let meta: ShardInfo = decode(&e.app_metadata, "ShardInfo")?;
            let ticket = e
                .ticket
                .as_ref()
                .ok_or_else(|| ClientError::Protocol("endpoint without ticket".into()))?;
            Ok(Shard {
                rank: meta.rank,
                rows: meta.rows,
                batches: meta.batches,
                ticket: ticket.ticket.clone(),
                location: e.location.first().map(|l| l.uri.clone()),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let partitions: PlanInfo = decode(&info.app_metadata, "PlanInfo")?;
    Ok(Plan {
        schema: Arc::new(schema),
        total_rows: shards.iter().map(|s| s.rows).sum(),
        shards,
        partition_rows: partitions.partition_rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_addresses_and_unix_sockets_are_this_machine() {
        for here in [
            "grpc://127.0.0.1:50051",
            "grpc://127.0.0.3:7",
            "grpc://localhost:50051",
            "grpc+tls://[::1]:50051",
            "grpc://[::ffff:127.0.0.1]:1",
            "grpc+unix:///tmp/fd.sock",
        ] {
            assert!(on_this_machine(here), "{here}");
        }
        for there in [
            "grpc://10.0.0.7:50051",
            "grpc://node-2:50051",
            "grpc://[2001:db8::1]:1",
        ] {
            assert!(!on_this_machine(there), "{there}");
        }
    }

    #[test]
    fn server_names_read_as_the_shared_table_says() {
        let table = include_str!("../../tests/server_names.tsv");
        let mut cases = 0;
        for line in table.lines().filter(|l| !l.starts_with('#')) {
            let fields: Vec<&str> = line.split('\t').collect();
            let [name, local, want] = fields[..] else {
                panic!("a case is three tab-separated fields: {line:?}");
            };
            let local = (local != "-").then_some(local);
            let got = server_location_with(name, local);
            match want {
                "error" => {
                    let err = got.expect_err(name);
                    assert!(err.to_string().contains("does not name a server"), "{err}");
                }
                want => assert_eq!(got.expect(name), want, "{name:?}"),
            }
            cases += 1;
        }
        assert!(cases >= 30, "{cases} cases");
    }

    #[test]
    fn errors_read_as_the_server_said_them_then_their_code() {
        let status = tonic::Status::not_found("no dataset 'd' on this server");
        let direct = ClientError::from(status.clone());
        assert_eq!(
            direct.to_string(),
            "no dataset 'd' on this server (NotFound)"
        );
        let streamed = ClientError::Flight(FlightError::Tonic(Box::new(status)));
        assert_eq!(streamed.to_string(), direct.to_string());
        assert_eq!(streamed.code(), Code::NotFound);
    }

    #[test]
    fn server_advice_is_said_in_this_clients_calls() {
        let status = tonic::Status::not_found(
            "dataset 'd' does not exist; write it with DoPut, or list datasets with ListFlights",
        );
        let err = ClientError::from(status);
        assert_eq!(
            err.to_string(),
            "dataset 'd' does not exist; write it with Client::put_partition, or list datasets \
             with Client::list_datasets (NotFound)"
        );
        assert_eq!(
            err.message_in(&[("with DoPut", "from Spark")]),
            "dataset 'd' does not exist; write it from Spark, or list datasets with ListFlights"
        );
        assert_eq!(
            err.text_in(&[]),
            "dataset 'd' does not exist; write it with DoPut, or list datasets with ListFlights \
             (NotFound)"
        );
    }
}
