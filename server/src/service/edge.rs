//! The HTTP/2 edge in front of the generated Flight service: `DoGet` is
//! answered here, every other call goes to tonic's generated server.
//!
//! A `DoGet` response is written by hand (see `ipc.rs`): each record batch
//! leaves as its gRPC framing followed by the gathered Arrow buffers
//! themselves, which the HTTP/2 layer writes to the socket without copying.
//! Through the generated service the same batch would be copied twice more:
//! into the IPC body, then into the protobuf encoder's buffer.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use arrow::ipc::MessageHeader;
use arrow_flight::Ticket;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use futures::future::BoxFuture;
use http_body::{Body as HttpBody, Frame};
use prost::Message;
use tonic::Status;
use tonic::body::Body;
use tonic::codegen::Service;
use tonic::server::NamedService;

use super::get;
use super::ipc::IpcMessage;
use super::outbox;
use super::shm;
use super::sql::PutKind;
use crate::auth;
use crate::metrics::CallGuard;
use crate::state::State;

/// The path of `DoGet`.
const DO_GET: &str = "/arrow.flight.protocol.FlightService/DoGet";
/// The path of `DoPut`.
const DO_PUT: &str = "/arrow.flight.protocol.FlightService/DoPut";

/// Marks a `DoPut` whose first message names a Flight SQL command (binding
/// a prepared statement's parameters): the service passes it to Flight SQL.
#[derive(Debug, Clone, Copy)]
pub struct SqlPut;
/// Marks a `DoPut` whose first message names a Flight SQL bulk ingestion:
/// the service writes it as a dataset.
#[derive(Debug, Clone, Copy)]
pub struct SqlIngest;
/// Largest `DoGet` request (a ticket) read.
const MAX_TICKET_BYTES: usize = 1 << 20;
/// The message encodings this server accepts: uncompressed only, which
/// every response says (`grpc-accept-encoding`), as gRPC's compression
/// negotiation asks.
const ACCEPT_ENCODING: &str = "identity";

/// Tells the client which message encodings this server accepts.
fn advertise(mut response: http::Response<Body>) -> http::Response<Body> {
    response
        .headers_mut()
        .entry("grpc-accept-encoding")
        .or_insert(http::HeaderValue::from_static(ACCEPT_ENCODING));
    response
}

/// `UNIMPLEMENTED` when the request says its messages are compressed (as
/// tonic answers for its own calls).
fn check_encoding(headers: &http::HeaderMap) -> std::result::Result<(), Status> {
    match headers.get("grpc-encoding").map(|v| v.as_bytes()) {
        None | Some(b"identity") => Ok(()),
        Some(other) => {
            let shown: String = String::from_utf8_lossy(other).chars().take(64).collect();
            Err(Status::unimplemented(format!(
                "the DoGet request is compressed with `{shown}`, which this server does not \
                 accept; send it uncompressed (grpc-accept-encoding: {ACCEPT_ENCODING})"
            )))
        }
    }
}

/// The generated Flight service `S`, with `DoGet` answered by hand.
#[derive(Debug, Clone)]
pub struct Edge<S> {
    inner: S,
    state: Arc<State>,
    max_message: usize,
    /// Where local readers' rings are made, and the budget they share
    /// (`None`: no shared memory; see `shm`).
    shm: Option<shm::Rings>,
}

impl<S> Edge<S> {
    /// `inner` behind this edge; `DoGet` messages above `max_message` bytes
    /// are refused like the generated service refuses them. Local readers
    /// may read through shared memory, in `shm`'s rings.
    pub fn new(inner: S, state: Arc<State>, max_message: usize, shm: Option<shm::Rings>) -> Self {
        Self {
            inner,
            state,
            max_message,
            shm,
        }
    }
}

impl<S: NamedService> NamedService for Edge<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<http::Request<Body>> for Edge<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, std::result::Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<std::result::Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<Body>) -> Self::Future {
        let path = req.uri().path();
        let method = path.rsplit('/').next().unwrap_or(path).to_string();
        let mut guard = self
            .state
            .metrics
            .call(method_label(path), remote_addr(&req));
        let refuse = |guard: CallGuard, status: Status| -> Self::Future {
            guard.end(status.code());
            Box::pin(async move { Ok(advertise(status.into_http())) })
        };
        if self.state.draining() {
            return refuse(
                guard,
                Status::unavailable(
                    "this server is shutting down: it finishes the calls in flight and takes no \
                     new ones; call again once it is back (or read from another member)",
                ),
            );
        }
        // Every call, DoGet here included, proves its role first.
        let mut role = None;
        if let Some(tokens) = self.state.credentials.tokens() {
            let header = req
                .headers()
                .get(http::header::AUTHORIZATION)
                .map(|v| v.as_bytes());
            // A DoPut's role depends on what it carries: checked below.
            let allowed = tokens.role_of(header).and_then(|role| {
                if path == DO_PUT {
                    return Ok(role);
                }
                auth::check(role, auth::needed(path, None), &method).map(|()| role)
            });
            match allowed {
                Ok(r) => {
                    req.extensions_mut().insert(r);
                    role = Some(r);
                }
                Err(e) => return refuse(guard, Status::from(e)),
            }
        }
        if req.uri().path() == DO_PUT {
            let inner = self.inner.clone();
            return Box::pin(async move {
                let (mut parts, body) = req.into_parts();
                let (first, body) = match peek_first(body).await {
                    Ok(peeked) => peeked,
                    Err(status) => {
                        guard.end(status.code());
                        return Ok(advertise(status.into_http()));
                    }
                };
                let kind = first
                    .and_then(|m| arrow_flight::FlightData::decode(m).ok())
                    .and_then(|d| d.flight_descriptor)
                    .map_or(PutKind::Partition, |d| super::sql::put_kind(&d.cmd));
                if let Some(role) = role {
                    // Binding a query's parameters reads; everything else
                    // (a Flight SQL bulk ingestion too) writes.
                    let need = if kind == PutKind::SqlParameters {
                        auth::Role::Reader
                    } else {
                        auth::needed(DO_PUT, None)
                    };
                    if let Err(e) = auth::check(role, need, "DoPut") {
                        let status = Status::from(e);
                        guard.end(status.code());
                        return Ok(advertise(status.into_http()));
                    }
                }
                match kind {
                    PutKind::SqlIngest => {
                        parts.extensions.insert(SqlIngest);
                    }
                    PutKind::SqlParameters => {
                        parts.extensions.insert(SqlPut);
                    }
                    PutKind::Partition => {}
                }
                parts.extensions.insert(guard.detail());
                let req = http::Request::from_parts(parts, body);
                let mut inner = inner;
                let response = inner.call(req).await;
                response.map(|r| advertise(tracked(r, guard)))
            });
        }
        if req.uri().path() != DO_GET {
            req.extensions_mut().insert(guard.detail());
            let fut = self.inner.call(req);
            return Box::pin(async move { fut.await.map(|r| advertise(tracked(r, guard))) });
        }
        if let Err(status) = check_encoding(req.headers()) {
            return refuse(guard, status);
        }
        let state = self.state.clone();
        let max_message = self.max_message;
        let inner = self.inner.clone();
        let shm = match &self.shm {
            Some(shm) if req.headers().contains_key(shm::REQUEST_HEADER) && is_local(&req) => {
                Some(shm.clone())
            }
            _ => None,
        };
        Box::pin(async move {
            let (mut parts, body) = req.into_parts();
            let (ticket, raw) = match read_ticket(body).await {
                Ok(read) => read,
                Err(status) => {
                    guard.end(status.code());
                    return Ok(advertise(status.into_http()));
                }
            };
            if super::sql::is_sql_command(&ticket.ticket) {
                // A Flight SQL result: through the generated service.
                parts.extensions.insert(guard.detail());
                let req = http::Request::from_parts(parts, Body::new(Replay::of(raw)));
                let mut inner = inner;
                let response = inner.call(req).await;
                return response.map(|r| advertise(tracked(r, guard)));
            }
            let body = async { Ok::<_, Status>(get::shard_messages(&state, &ticket).await?) };
            Ok(advertise(match body.await {
                Ok((messages, info)) => {
                    guard.reading(&info.dataset, info.rank, info.for_peer, info.tally);
                    let idle = state.config.stream_idle_timeout;
                    let body = ShardBody {
                        messages,
                        max_message,
                        done: false,
                        guard: Some(guard),
                        shm: shm.and_then(|rings| ShmSend::open(&rings.dir, &rings.budget, idle)),
                    };
                    let mut response = http::Response::new(Body::new(body));
                    response.headers_mut().insert(
                        http::header::CONTENT_TYPE,
                        http::HeaderValue::from_static("application/grpc"),
                    );
                    response
                }
                Err(status) => {
                    guard.end(status.code());
                    status.into_http()
                }
            }))
        })
    }
}

/// The Flight methods, as metrics label them.
const FLIGHT_METHODS: [&str; 10] = [
    "Handshake",
    "ListFlights",
    "GetFlightInfo",
    "PollFlightInfo",
    "GetSchema",
    "DoGet",
    "DoPut",
    "DoExchange",
    "DoAction",
    "ListActions",
];

/// The method a metric names for `path`: a Flight method, or `other` (any
/// path a client makes up), so that labels stay bounded.
fn method_label(path: &str) -> &'static str {
    path.strip_prefix("/arrow.flight.protocol.FlightService/")
        .and_then(|m| FLIGHT_METHODS.iter().find(|&&k| k == m))
        .copied()
        .unwrap_or("other")
}

/// Whether the caller is on this machine: over loopback, or the Unix
/// socket (the one transport without a peer address).
fn is_local<B>(req: &http::Request<B>) -> bool {
    remote_addr(req).is_none_or(|a| a.ip().to_canonical().is_loopback())
}

/// The caller's address, over TCP or TLS.
fn remote_addr<B>(req: &http::Request<B>) -> Option<std::net::SocketAddr> {
    use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
    let ext = req.extensions();
    ext.get::<TcpConnectInfo>()
        .and_then(TcpConnectInfo::remote_addr)
        .or_else(|| {
            ext.get::<TlsConnectInfo<TcpConnectInfo>>()
                .and_then(|i| i.get_ref().remote_addr())
        })
}

/// `response` with its call ended when its status is known: at once for a
/// status-only response, else when its body's trailers pass.
fn tracked(response: http::Response<Body>, guard: CallGuard) -> http::Response<Body> {
    if let Some(status) = Status::from_header_map(response.headers()) {
        guard.end(status.code());
        return response;
    }
    response.map(|inner| {
        Body::new(Tracked {
            inner,
            guard: Some(guard),
        })
    })
}

/// A response body that ends its call with the status of its trailers.
struct Tracked {
    inner: Body,
    guard: Option<CallGuard>,
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<std::result::Result<Frame<Bytes>, Status>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        let code = match &polled {
            Poll::Ready(Some(Ok(frame))) => frame
                .trailers_ref()
                .map(|t| Status::from_header_map(t).map_or(tonic::Code::Ok, |s| s.code())),
            Poll::Ready(Some(Err(e))) => Some(e.code()),
            Poll::Ready(None) => Some(tonic::Code::Ok),
            Poll::Pending => None,
        };
        if let Some(code) = code
            && let Some(guard) = this.guard.take()
        {
            guard.end(code);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A request body that yields bytes already read, then the rest of the
/// original body.
struct Replay {
    head: Option<Bytes>,
    rest: Option<Body>,
}

impl Replay {
    /// A body of `bytes` alone.
    fn of(bytes: Bytes) -> Self {
        Self {
            head: Some(bytes),
            rest: None,
        }
    }
}

impl HttpBody for Replay {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<std::result::Result<Frame<Bytes>, Status>>> {
        if let Some(head) = self.head.take()
            && !head.is_empty()
        {
            return Poll::Ready(Some(Ok(Frame::data(head))));
        }
        match self.rest.as_mut() {
            Some(rest) => Pin::new(rest).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.head.as_ref().is_none_or(Bytes::is_empty)
            && self.rest.as_ref().is_none_or(HttpBody::is_end_stream)
    }
}

/// The first gRPC message of a request body (`None` when the body ends
/// first, or the message is larger than a ticket may be, so it is no
/// Flight SQL command), and a body that yields the whole request again.
async fn peek_first(mut body: Body) -> std::result::Result<(Option<Bytes>, Body), Status> {
    let mut buf = BytesMut::new();
    let first = loop {
        if buf.len() >= 5 {
            let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
            if len > MAX_TICKET_BYTES {
                break None;
            }
            if buf.len() >= 5 + len {
                break Some(Bytes::copy_from_slice(&buf[5..5 + len]));
            }
        }
        match std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
            None => break None,
            Some(frame) => {
                if let Ok(data) = frame?.into_data() {
                    buf.put(data);
                }
            }
        }
    };
    let replay = Replay {
        head: Some(buf.freeze()),
        rest: Some(body),
    };
    Ok((first, Body::new(replay)))
}

/// Reads the request: one uncompressed gRPC message holding a `Ticket`;
/// also the bytes read, to hand the request on whole.
async fn read_ticket(mut body: Body) -> std::result::Result<(Ticket, Bytes), Status> {
    let mut buf = BytesMut::new();
    while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
        if let Ok(data) = frame?.into_data() {
            if buf.len() + data.remaining() > MAX_TICKET_BYTES {
                return Err(Status::invalid_argument(format!(
                    "a DoGet request holds one ticket of at most {MAX_TICKET_BYTES} bytes"
                )));
            }
            buf.put(data);
        }
    }
    let raw = buf.freeze();
    Ok((parse_ticket_request(&raw)?, raw))
}

/// The `Ticket` of a whole `DoGet` request body: one uncompressed gRPC
/// message (a flag byte, a 4-byte length, the protobuf). A message marked
/// compressed (the request named no encoding, or it would have been refused
/// before) is a protocol error, `INTERNAL` as gRPC's compression spec says.
pub fn parse_ticket_request(buf: &[u8]) -> std::result::Result<Ticket, Status> {
    if buf.len() < 5 {
        return Err(Status::invalid_argument(
            "the DoGet request holds no ticket; send the ticket of a FlightInfo endpoint",
        ));
    }
    match buf[0] {
        0 => {}
        1 => {
            return Err(Status::internal(
                "protocol error: the DoGet message is marked compressed but the request names \
                 no grpc-encoding; send it uncompressed",
            ));
        }
        flag => {
            return Err(Status::internal(format!(
                "protocol error: the DoGet message has compression flag {flag} (valid flags are 0 \
                 and 1)"
            )));
        }
    }
    let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
    if buf.len() != 5 + len {
        return Err(Status::invalid_argument(
            "the DoGet request must hold exactly one ticket message",
        ));
    }
    Ticket::decode(&buf[5..])
        .map_err(|e| Status::invalid_argument(format!("the DoGet ticket does not decode: {e}")))
}

/// The response body: the shard's messages as gRPC frames, then the status
/// as trailers. Dropping it (the client hung up) closes the outbox, which
/// stops the gather.
struct ShardBody {
    messages: outbox::Receiver,
    max_message: usize,
    done: bool,
    /// The call, ended with the status the trailers carry.
    guard: Option<CallGuard>,
    /// Record batches go through this shared-memory ring (`None`: all
    /// through the socket).
    shm: Option<Box<ShmSend>>,
}

/// A stream whose record batches go through a shared-memory ring (see
/// `shm`); every other message, a small batch and a batch larger than the
/// ring go through the socket in their places in the stream. It frames the
/// outbox's messages (`outbox::Receiver::poll_piece`): a record batch as
/// the descriptor of where the ring holds it.
struct ShmSend {
    ring: shm::Ring,
    /// When the ring was announced (`None`: not yet).
    announced: Option<Instant>,
    /// A dictionary went through the socket: the batches that use it
    /// follow it there (a reader decodes them with the dictionaries its
    /// stream reader holds).
    socket_only: bool,
    /// How long the reader may take to map the ring.
    attach_within: Duration,
    /// Wakes the body to look at the ring again while the reader has yet to
    /// make room in it.
    timer: Pin<Box<tokio::time::Sleep>>,
}

impl ShmSend {
    /// How often a full ring is looked at again.
    const POLL: Duration = Duration::from_millis(1);

    /// A ring in `dir` for one stream, or `None` (the stream goes through
    /// the socket) where none can be made.
    fn open(
        dir: &std::path::Path,
        budget: &Arc<shm::Budget>,
        attach_within: Duration,
    ) -> Option<Box<Self>> {
        match shm::Ring::create(dir, budget) {
            Ok(ring) => Some(Box::new(Self {
                ring,
                announced: None,
                socket_only: false,
                attach_within,
                timer: Box::pin(tokio::time::sleep(Duration::ZERO)),
            })),
            Err(e) => {
                tracing::debug!(dir = %dir.display(), error = %e, "a local reader's stream goes through the socket: no shared-memory ring");
                None
            }
        }
    }

    /// The pieces that send `m`: through the socket, or written into the
    /// ring and described; `Pending` (the timer set) while the ring has no
    /// room for it or the reader has yet to map it.
    fn frame(
        &mut self,
        m: &IpcMessage,
        cx: &mut Context<'_>,
        max_message: usize,
    ) -> Poll<crate::error::Result<Vec<Bytes>>> {
        let kind = m.kind();
        let batch = kind == Some(MessageHeader::RecordBatch);
        let small = (m.body_len as u64) < shm::SMALL_BATCH;
        if self.socket_only || small || !batch || !m.app_metadata.is_empty() {
            let schema = kind == Some(MessageHeader::Schema);
            self.socket_only = self.socket_only || !(schema || batch);
            let mut pieces = m.to_grpc_frame(max_message)?;
            if schema && self.announced.is_none() {
                self.announced = Some(Instant::now());
                if let Some(path) = self.ring.path() {
                    let announce = shm::announce(path, self.ring.mapped());
                    pieces.push(IpcMessage::metadata_frame(&announce));
                }
            }
            return Poll::Ready(Ok(pieces));
        }
        let attached = self.ring.attached();
        let written = match attached {
            true => self.ring.try_write(m),
            false => shm::Written::NotYet,
        };
        match written {
            shm::Written::At(descriptor) => {
                Poll::Ready(Ok(vec![IpcMessage::metadata_frame(&descriptor)]))
            }
            shm::Written::Never | shm::Written::Held => Poll::Ready(m.to_grpc_frame(max_message)),
            shm::Written::NotYet
                if !attached
                    && self
                        .announced
                        .is_some_and(|t| t.elapsed() > self.attach_within) =>
            {
                Poll::Ready(Err(crate::error::Error::Aborted(format!(
                    "the reader did not map its shared-memory ring within {:?}; read again \
                     without the {} header to read over the socket",
                    self.attach_within,
                    shm::REQUEST_HEADER
                ))))
            }
            shm::Written::NotYet => {
                self.timer
                    .as_mut()
                    .reset(tokio::time::Instant::now() + Self::POLL);
                match self.timer.as_mut().poll(cx) {
                    // Already due: look again at once.
                    Poll::Ready(()) => {
                        cx.waker().wake_by_ref();
                        Poll::Pending
                    }
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }
}

impl ShardBody {
    fn trailers(&mut self, status: &Status) -> Frame<Bytes> {
        self.done = true;
        if let Some(guard) = self.guard.take() {
            guard.end(status.code());
        }
        let mut trailers = http::HeaderMap::new();
        if status.add_header(&mut trailers).is_err() {
            trailers.insert("grpc-status", http::HeaderValue::from_static("13"));
        }
        Frame::trailers(trailers)
    }
}

impl HttpBody for ShardBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<std::result::Result<Frame<Bytes>, Status>>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        let max_message = this.max_message;
        let polled = match &mut this.shm {
            Some(shm) => this
                .messages
                .poll_piece(cx, |m, cx| shm.frame(m, cx, max_message)),
            None => this
                .messages
                .poll_piece(cx, |m, _| Poll::Ready(m.to_grpc_frame(max_message))),
        };
        let status = match polled {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Some(Ok(piece))) => {
                if let Some(guard) = &mut this.guard {
                    guard.sent_data();
                }
                return Poll::Ready(Some(Ok(Frame::data(piece))));
            }
            Poll::Ready(Some(Err(e))) => Status::from(e),
            Poll::Ready(None) => Status::ok(""),
        };
        Poll::Ready(Some(Ok(this.trailers(&status))))
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }
}
