//! Calls between members: sealing each member's part, checking that every
//! member holds a layout, dropping a cluster dataset everywhere, and
//! fetching the rows of a rank's stream that another member holds.
//!
//! Every call has a bounded time to connect, and connections carry HTTP/2
//! keepalives, so a member that dies or vanishes turns into `UNAVAILABLE`
//! naming it, never a hang. Errors name the member and the dataset.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arrow::array::RecordBatch;
use arrow_flight::decode::{DecodedPayload, FlightDataDecoder};
use arrow_flight::error::FlightError;
use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_flight::{Action, Ticket};
use bytes::Bytes;
use flightdeck_client::receive;
use futures::{Stream, TryStreamExt};
use prost::Message;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

use crate::credentials::Credentials;
use crate::error::{Error, Result};

/// Longest wait for a connection to a member.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// HTTP/2 pings on member connections, and how long an answer may take.
const KEEPALIVE: Duration = Duration::from_secs(2);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(3);
/// Longest wait for a control call (prepare, commit, describe, drop): a
/// prepare may persist the member's part to the store.
const ACTION_TIMEOUT: Duration = Duration::from_secs(120);
/// Largest message from a member.
const MAX_MESSAGE_BYTES: usize = 1 << 30;

/// A batch of a peer's rows: the index of the rank's batch it belongs to,
/// the rows, and the bytes of its IPC body.
pub type PeerBatch = (u64, RecordBatch, u64);

/// Bytes of one `(rank batch, rows)` entry of a peer message's tag.
const TAG_ENTRY: usize = 12;

/// The `app_metadata` of a peer message holding a member's rows of several
/// of the rank's batches, in order: `(batch index, rows)` per batch, as
/// little-endian u64 and u32. (A tag of 8 bytes, a lone batch index, names
/// one batch taking the whole message.)
pub fn batches_tag(batches: &[(u64, usize)]) -> Bytes {
    let mut tag = Vec::with_capacity(batches.len() * TAG_ENTRY);
    for &(b, rows) in batches {
        tag.extend_from_slice(&b.to_le_bytes());
        tag.extend_from_slice(&(rows as u32).to_le_bytes());
    }
    tag.into()
}

/// The `(batch index, rows)` a peer message's tag names for a message of
/// `rows` rows; `None` when it is malformed or does not add up to `rows`.
pub fn tag_batches(tag: &[u8], rows: usize) -> Option<Vec<(u64, usize)>> {
    if let Ok(b) = <[u8; 8]>::try_from(tag) {
        return Some(vec![(u64::from_le_bytes(b), rows)]);
    }
    if tag.is_empty() || !tag.len().is_multiple_of(TAG_ENTRY) {
        return None;
    }
    let out: Vec<(u64, usize)> = tag
        .chunks_exact(TAG_ENTRY)
        .map(|e| {
            let (b, n) = e.split_at(8);
            let b = u64::from_le_bytes(b.try_into().unwrap_or_default());
            let n = u32::from_le_bytes(n.try_into().unwrap_or_default());
            (b, n as usize)
        })
        .collect();
    (out.iter().map(|&(_, n)| n).sum::<usize>() == rows).then_some(out)
}

/// Connections to other members, opened on first use and shared; every
/// call carries the cluster's token and checks TLS members against the
/// roots, both as the server's credentials hold them now (rotated ones
/// included, [`crate::credentials`]).
pub struct Peers {
    channels: Mutex<Channels>,
    credentials: Arc<Credentials>,
}

/// Open connections, and the roots those over TLS were opened with.
#[derive(Default)]
struct Channels {
    roots: Option<Arc<Vec<u8>>>,
    open: HashMap<String, Channel>,
}

impl std::fmt::Debug for Peers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peers")
            .field("token", &self.credentials.needs_tokens())
            .finish_non_exhaustive()
    }
}

/// `http://…` for a member location (`grpc://`, `grpc+tcp://`, `http://`),
/// `https://…` for one served over TLS (`grpc+tls://`, `https://`).
fn endpoint_uri(location: &str) -> String {
    if let Some(rest) = location
        .strip_prefix("grpc+tls://")
        .or_else(|| location.strip_prefix("https://"))
    {
        return format!("https://{rest}");
    }
    let rest = location
        .strip_prefix("grpc+tcp://")
        .or_else(|| location.strip_prefix("grpc://"))
        .or_else(|| location.strip_prefix("http://"))
        .unwrap_or(location);
    format!("http://{rest}")
}

/// An error a member answered (or a failure to reach it), as this server's
/// error naming the member and the dataset.
pub fn from_peer(status: &Status, location: &str, dataset: &str) -> Error {
    let msg = status.message();
    match status.code() {
        Code::NotFound => Error::FailedPrecondition(format!(
            "member {location} no longer holds its part of dataset '{dataset}' ({msg}); the \
             cluster does not hold the dataset whole: drop it and write it again"
        )),
        // The caller's own token passed here: this server's to the member
        // did not, and no restart of the member changes that.
        Code::Unauthenticated | Code::PermissionDenied => Error::FailedPrecondition(format!(
            "member {location} holding rows of dataset '{dataset}' refused this server's call \
             ({msg}): members send each other the first writer token of their \
             --auth-token-file, so every member needs the same file; after changing it, read it \
             again on every member (SIGHUP, or wait 10 s)"
        )),
        // rustls's refusal, as the transport reports it: no restart helps.
        _ if msg.contains("invalid peer certificate") => Error::FailedPrecondition(format!(
            "member {location} holding rows of dataset '{dataset}' presents a certificate this \
             server does not trust ({msg}): give every member --tls-ca with the authority that \
             signed the members' certificates (without it a member trusts only its own \
             certificate)"
        )),
        Code::InvalidArgument => Error::InvalidArgument(format!("member {location}: {msg}")),
        Code::FailedPrecondition => Error::FailedPrecondition(format!("member {location}: {msg}")),
        Code::ResourceExhausted => Error::ResourceExhausted(format!("member {location}: {msg}")),
        Code::Internal => Error::Internal(format!("member {location}: {msg}")),
        Code::DataLoss => Error::DataLoss(format!("member {location}: {msg}")),
        _ => Error::Unavailable(format!(
            "member {location} holding rows of dataset '{dataset}' is unavailable ({msg}); \
             restart it (with --persist it serves the same rows again), then resume a read \
             from its start_sample or run a query again"
        )),
    }
}

impl Peers {
    /// Connections that send the first writer token of `credentials`
    /// (if it has tokens) on every call and check members served over TLS
    /// against its member roots.
    pub fn new(credentials: Arc<Credentials>) -> Self {
        Self {
            channels: Mutex::default(),
            credentials,
        }
    }

    /// `message` as a request carrying the cluster's token.
    fn request<T>(&self, message: T) -> tonic::Request<T> {
        tonic::Request::from_parts(self.metadata(), Default::default(), message)
    }

    /// What every call to a member sends: its token, if any. A token that
    /// is not valid header text is left out (members then answer
    /// `UNAUTHENTICATED`, naming the problem).
    fn metadata(&self) -> tonic::metadata::MetadataMap {
        let mut metadata = tonic::metadata::MetadataMap::new();
        if let Some(value) = self
            .credentials
            .peer_token()
            .and_then(|t| format!("Bearer {t}").parse().ok())
        {
            metadata.insert("authorization", value);
        }
        metadata
    }

    fn client(&self, location: &str, dataset: &str) -> Result<FlightServiceClient<Channel>> {
        Ok(FlightServiceClient::new(self.channel(location, dataset)?)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES))
    }

    /// The connection to the member at `location`, opened on first use.
    /// New roots close the connections opened with the old ones once their
    /// calls end: the next call opens one checked against the new.
    fn channel(&self, location: &str, dataset: &str) -> Result<Channel> {
        let tls_roots = self.credentials.peer_roots();
        let mut channels = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        let same = match (&channels.roots, &tls_roots) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (None, None) => true,
            _ => false,
        };
        if !same {
            channels.open.clear();
            channels.roots = tls_roots.clone();
        }
        let channel = match channels.open.get(location) {
            Some(c) => c.clone(),
            None => {
                let uri = endpoint_uri(location);
                let mut endpoint = Endpoint::from_shared(uri.clone()).map_err(|e| {
                    Error::invalid(format!(
                        "member location '{location}' of dataset '{dataset}' is not a URI: {e}"
                    ))
                })?;
                if uri.starts_with("https://") {
                    let roots = tls_roots.as_ref().ok_or_else(|| {
                        Error::FailedPrecondition(format!(
                            "member {location} of dataset '{dataset}' serves over TLS, but this \
                             server has no certificates to check it with: start it with \
                             --tls-cert/--tls-key (and --tls-ca)"
                        ))
                    })?;
                    let tls = tonic::transport::ClientTlsConfig::new()
                        .ca_certificate(tonic::transport::Certificate::from_pem(roots.as_slice()));
                    endpoint = endpoint.tls_config(tls).map_err(|e| {
                        Error::invalid(format!("TLS settings for member {location}: {e}"))
                    })?;
                }
                let c = endpoint
                    .connect_timeout(CONNECT_TIMEOUT)
                    .tcp_nodelay(true)
                    .http2_keep_alive_interval(KEEPALIVE)
                    .keep_alive_timeout(KEEPALIVE_TIMEOUT)
                    .keep_alive_while_idle(true)
                    .initial_stream_window_size(Some(8 << 20))
                    .initial_connection_window_size(Some(32 << 20))
                    // A member's rows arrive in MiB-sized messages: fewer,
                    // larger frames (as a client's shards do).
                    .max_frame_size(Some(1 << 20))
                    .connect_lazy();
                channels.open.insert(location.to_string(), c.clone());
                c
            }
        };
        Ok(channel)
    }

    /// Runs action `kind` with `body` on the member at `location`; decodes
    /// its one result.
    pub async fn action<M: Message + Default>(
        &self,
        location: &str,
        dataset: &str,
        kind: &str,
        body: impl Message,
    ) -> Result<M> {
        let mut client = self.client(location, dataset)?;
        let call = async {
            let mut results = client
                .do_action(self.request(Action::new(kind, body.encode_to_vec())))
                .await?
                .into_inner();
            results.message().await
        };
        let reply = match tokio::time::timeout(ACTION_TIMEOUT, call).await {
            Ok(reply) => reply.map_err(|s| from_peer(&s, location, dataset))?,
            Err(_) => {
                return Err(from_peer(
                    &Status::deadline_exceeded(format!("no answer within {ACTION_TIMEOUT:?}")),
                    location,
                    dataset,
                ));
            }
        };
        let body = reply.map(|r| r.body).unwrap_or_default();
        M::decode(body).map_err(|e| {
            Error::Internal(format!(
                "member {location} answered '{kind}' with something that does not decode: {e}"
            ))
        })
    }

    /// The batches member `location` streams for `ticket` (a peer ticket),
    /// each tagged with the rank's batch it belongs to (a message holding
    /// several of them is sliced into one per batch, without copying).
    pub async fn fetch(
        &self,
        location: &str,
        dataset: &str,
        ticket: Bytes,
    ) -> Result<impl Stream<Item = Result<PeerBatch>> + Send + 'static> {
        let channel = self.channel(location, dataset)?;
        let messages = tokio::time::timeout(
            ACTION_TIMEOUT,
            receive::do_get(
                &channel,
                &self.metadata(),
                Ticket::new(ticket),
                MAX_MESSAGE_BYTES,
            ),
        )
        .await
        .map_err(|_| {
            from_peer(
                &Status::deadline_exceeded("no answer to DoGet"),
                location,
                dataset,
            )
        })?
        .map_err(|s| from_peer(&s, location, dataset))?;
        let (location, dataset) = (location.to_string(), dataset.to_string());
        let messages = messages.map_err(|s| FlightError::Tonic(Box::new(s)));
        Ok(FlightDataDecoder::new(messages)
            .map_err(move |e| match e {
                FlightError::Tonic(s) => from_peer(&s, &location, &dataset),
                other => Error::Internal(format!(
                    "member {location} sent rows of dataset '{dataset}' that do not decode: {other}"
                )),
            })
            .try_filter_map(|d| async move {
                let DecodedPayload::RecordBatch(batch) = d.payload else {
                    return Ok(None);
                };
                let batches =
                    tag_batches(&d.inner.app_metadata, batch.num_rows()).ok_or_else(|| {
                        Error::Internal(
                            "a member sent rows without the batches they belong to".into(),
                        )
                    })?;
                let bytes = d.inner.data_body.len() as u64;
                let total = batch.num_rows() as u64;
                // A batch given no rows is not one the merge asks for. Each
                // part is counted its share of the body's bytes, rounded
                // so that the parts add up to the body.
                let mut at = 0;
                let parts: Vec<Result<PeerBatch>> = batches
                    .into_iter()
                    .filter(|&(_, n)| n > 0)
                    .map(|(b, n)| {
                        let part = batch.slice(at, n);
                        let counted = bytes * (at + n) as u64 / total - bytes * at as u64 / total;
                        at += n;
                        Ok((b, part, counted))
                    })
                    .collect();
                Ok(Some(futures::stream::iter(parts)))
            })
            .try_flatten())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_tags_round_trip_and_must_add_up() {
        let batches = [(3, 10), (4, 0), (7, 5)];
        let tag = batches_tag(&batches);
        assert_eq!(tag_batches(&tag, 15), Some(batches.to_vec()));
        assert_eq!(tag_batches(&tag, 14), None, "rows that do not add up");
        assert_eq!(tag_batches(&tag[..20], 15), None, "a cut tag");
        assert_eq!(tag_batches(&[], 0), None);
        assert_eq!(tag_batches(&9u64.to_le_bytes(), 4), Some(vec![(9, 4)]));
    }

    #[test]
    fn locations_become_http_uris() {
        assert_eq!(
            endpoint_uri("grpc://10.0.0.1:50051"),
            "http://10.0.0.1:50051"
        );
        assert_eq!(endpoint_uri("grpc+tcp://h:1"), "http://h:1");
        assert_eq!(endpoint_uri("http://h:1"), "http://h:1");
        assert_eq!(endpoint_uri("grpc+tls://h:1"), "https://h:1");
    }

    #[test]
    fn peer_errors_name_the_member_and_say_what_to_do() {
        let e = from_peer(
            &Status::unavailable("connection refused"),
            "grpc://b:1",
            "d",
        );
        assert_eq!(e.code(), Code::Unavailable);
        assert!(e.to_string().contains("grpc://b:1") && e.to_string().contains("'d'"));
        assert!(e.to_string().contains("run a query again"), "{e}");
        let e = from_peer(&Status::not_found("gone"), "grpc://b:1", "d");
        assert_eq!(e.code(), Code::FailedPrecondition);
        assert!(e.to_string().contains("drop it and write it again"), "{e}");
        // A member's lost copy is lost: not a member down to wait for.
        let lost =
            "dataset 'd' cannot be brought back from the store: …; drop it and write it again";
        let e = from_peer(&Status::data_loss(lost), "grpc://b:1", "d");
        assert_eq!(e.code(), Code::DataLoss);
        assert_eq!(e.to_string(), format!("member grpc://b:1: {lost}"));
        let e = from_peer(
            &Status::unavailable("invalid peer certificate: UnknownIssuer"),
            "grpc+tls://b:1",
            "d",
        );
        assert_eq!(e.code(), Code::FailedPrecondition);
        assert!(e.to_string().contains("--tls-ca"), "{e}");
        // Members that do not share a token file: not a member to restart.
        for refused in [
            Status::unauthenticated("the token is not one this server accepts"),
            Status::permission_denied("a reader token may not call DoGet"),
        ] {
            let e = from_peer(&refused, "grpc://b:1", "d");
            assert_eq!(e.code(), Code::FailedPrecondition);
            assert!(
                e.to_string().contains("every member needs the same file")
                    && e.to_string().contains(refused.message()),
                "{e}"
            );
        }
    }
}
