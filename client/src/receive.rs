//! `DoGet` with one copy of each record batch body.
//!
//! tonic assembles every gRPC message from its HTTP/2 frames into one
//! buffer, and Arrow then copies a body that is not 64-byte aligned (it
//! rarely is inside that buffer) into an aligned one: two copies of every
//! byte a shard brings. Here the response body's frames are split into
//! `FlightData` messages as they come (`Deframer`): the small fields
//! (header, app metadata) are gathered and decoded with prost, and the
//! `data_body` is copied once, straight from the frames, into a 64-byte
//! aligned buffer that Arrow then uses as it is.
//!
//! The deframer is pure (chunks in, messages out) and tested on every way of
//! cutting a stream; [`do_get`] is the thin edge over a tonic [`Channel`].

use std::collections::VecDeque;

use arrow::buffer::{Buffer, MutableBuffer};
use arrow_flight::{FlightData, Ticket};
use bytes::{Buf, Bytes};
use futures::stream::BoxStream;
use futures::{StreamExt, future::poll_fn};
use http_body::Body as _;
use prost::Message;
use tonic::codegen::Service;
use tonic::codegen::http;
use tonic::metadata::MetadataMap;
use tonic::transport::Channel;
use tonic::{Code, Status};

/// The `DoGet` method's path.
const DO_GET: &str = "/arrow.flight.protocol.FlightService/DoGet";
/// `FlightData.data_body`'s field number.
const BODY_FIELD: u64 = 1000;
/// Longest protobuf key and length (two varints).
const KEY_BYTES: usize = 20;

/// Calls `DoGet` for `ticket` over `channel`, sending `metadata`; streams
/// the `FlightData` messages, each body 64-byte aligned. Messages longer
/// than `max_message` bytes are refused (`OUT_OF_RANGE`), as tonic does.
pub async fn do_get(
    channel: &Channel,
    metadata: &MetadataMap,
    ticket: Ticket,
    max_message: usize,
) -> Result<BoxStream<'static, Result<FlightData, Status>>, Status> {
    let ticket = ticket.encode_to_vec();
    let mut framed = Vec::with_capacity(5 + ticket.len());
    framed.push(0);
    framed.extend_from_slice(&(ticket.len() as u32).to_be_bytes());
    framed.extend_from_slice(&ticket);
    let mut request = http::Request::builder()
        .method(http::Method::POST)
        .uri(DO_GET)
        .version(http::Version::HTTP_2)
        .header(http::header::TE, "trailers")
        .header(http::header::CONTENT_TYPE, "application/grpc")
        .body(tonic::body::Body::new(http_body_util::Full::new(
            Bytes::from(framed),
        )))
        .map_err(|e| Status::internal(format!("cannot build a DoGet request: {e}")))?;
    request
        .headers_mut()
        .extend(metadata.clone().into_headers());
    let mut channel = channel.clone();
    poll_fn(|cx| channel.poll_ready(cx))
        .await
        .map_err(|e| Status::from_error(e.into()))?;
    let response = channel
        .call(request)
        .await
        .map_err(|e| Status::from_error(e.into()))?;
    // An error before any message comes in the headers ("trailers only").
    if let Some(status) = Status::from_header_map(response.headers()) {
        if status.code() != Code::Ok {
            return Err(status);
        }
        return Ok(futures::stream::empty().boxed());
    }
    if response.status() != http::StatusCode::OK {
        return Err(Status::unknown(format!(
            "DoGet answered HTTP status {}, not a gRPC stream",
            response.status()
        )));
    }
    let body = response.into_body();
    let state = (body, Deframer::new(max_message), false);
    Ok(futures::stream::unfold(Some(state), |state| async move {
        let (mut body, mut deframer, mut trailed) = state?;
        loop {
            match deframer.next_message() {
                Some(Ok(message)) => return Some((Ok(message), Some((body, deframer, trailed)))),
                // A malformed stream ends at its first error.
                Some(Err(status)) => return Some((Err(status), None)),
                None => {}
            }
            match poll_fn(|cx| std::pin::Pin::new(&mut body).poll_frame(cx)).await {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => deframer.push(data),
                    Err(frame) => {
                        let Some(trailers) = frame.trailers_ref() else {
                            continue;
                        };
                        match Status::from_header_map(trailers) {
                            Some(s) if s.code() != Code::Ok => return Some((Err(s), None)),
                            _ => trailed = true,
                        }
                    }
                },
                Some(Err(status)) => return Some((Err(status), None)),
                None if deframer.is_between_messages() && trailed => return None,
                None => {
                    let status = Status::internal(
                        "the server ended the DoGet stream without finishing it (a message cut \
                         short, or no status)",
                    );
                    return Some((Err(status), None));
                }
            }
        }
    })
    .boxed())
}

/// Where the deframer is in the current message.
#[derive(Debug)]
enum State {
    /// Waiting for the 5-byte gRPC message prefix.
    Prefix,
    /// At a protobuf field's key (and length); `left` bytes of the message
    /// remain.
    Key { left: usize },
    /// Copying a field's `value` bytes: the body into the aligned buffer,
    /// any other field into the message's fields.
    Copy {
        left: usize,
        value: usize,
        body: bool,
    },
}

/// Splits a gRPC stream of `FlightData` messages, given as chunks of any
/// size, into messages; each message's `data_body` is copied once, into a
/// 64-byte aligned buffer.
#[derive(Debug)]
pub(crate) struct Deframer {
    max_message: usize,
    chunks: Chunks,
    state: State,
    /// The current message's fields other than the body, as sent.
    fields: Vec<u8>,
    body: Option<MutableBuffer>,
    ready: VecDeque<Result<FlightData, Status>>,
    failed: bool,
}

impl Deframer {
    /// A deframer refusing messages over `max_message` bytes.
    pub(crate) fn new(max_message: usize) -> Self {
        Self {
            max_message,
            chunks: Chunks::default(),
            state: State::Prefix,
            fields: Vec::new(),
            body: None,
            ready: VecDeque::new(),
            failed: false,
        }
    }

    /// Takes the next chunk of the stream.
    pub(crate) fn push(&mut self, chunk: Bytes) {
        if self.failed || chunk.is_empty() {
            return;
        }
        self.chunks.push(chunk);
        if let Err(status) = self.run() {
            self.failed = true;
            self.ready.push_back(Err(status));
        }
    }

    /// The next whole message (or the error that ends the stream).
    pub(crate) fn next_message(&mut self) -> Option<Result<FlightData, Status>> {
        self.ready.pop_front()
    }

    /// Whether the stream may end here: no message begun and none waiting.
    pub(crate) fn is_between_messages(&self) -> bool {
        matches!(self.state, State::Prefix) && self.chunks.len == 0 && self.ready.is_empty()
    }

    /// Consumes what the chunks hold, as far as it goes.
    fn run(&mut self) -> Result<(), Status> {
        loop {
            match self.state {
                State::Prefix => {
                    let mut prefix = [0u8; 5];
                    if self.chunks.len < prefix.len() {
                        return Ok(());
                    }
                    self.chunks.peek_into(&mut prefix);
                    self.chunks.take(prefix.len(), |_| {});
                    if prefix[0] != 0 {
                        return Err(Status::internal(
                            "the server sent a compressed message, which was not asked for",
                        ));
                    }
                    let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]);
                    let len = len as usize;
                    if len > self.max_message {
                        return Err(Status::out_of_range(format!(
                            "a DoGet message of {len} bytes is over the limit of {} bytes",
                            self.max_message
                        )));
                    }
                    self.fields.clear();
                    self.body = None;
                    self.state = State::Key { left: len };
                }
                State::Key { left: 0 } => {
                    self.finish()?;
                    self.state = State::Prefix;
                }
                State::Key { left } => {
                    let Some((field, wire, value, used)) = self.key(left)? else {
                        return Ok(());
                    };
                    if value > left - used {
                        return Err(malformed("a field runs past its message"));
                    }
                    let left = left - used;
                    if field == BODY_FIELD && wire == 2 {
                        self.chunks.take(used, |_| {});
                        self.body = Some(MutableBuffer::with_capacity(value));
                        self.state = State::Copy {
                            left,
                            value,
                            body: true,
                        };
                        continue;
                    }
                    self.chunks.take(used, |b| self.fields.extend_from_slice(b));
                    self.state = State::Copy {
                        left,
                        value,
                        body: false,
                    };
                }
                State::Copy { left, value, body } => {
                    let n = value.min(self.chunks.len);
                    if n == 0 && value > 0 {
                        return Ok(());
                    }
                    if body {
                        let out = self.body.get_or_insert_default();
                        self.chunks.take(n, |b| out.extend_from_slice(b));
                    } else {
                        self.chunks.take(n, |b| self.fields.extend_from_slice(b));
                    }
                    self.state = match value - n {
                        0 => State::Key { left: left - n },
                        rest => State::Copy {
                            left: left - n,
                            value: rest,
                            body,
                        },
                    };
                }
            }
        }
    }

    /// The field number and wire type at the front, the bytes of the
    /// field's value after them, and the bytes the key (and a length)
    /// take; `None` when more bytes are needed.
    fn key(&self, left: usize) -> Result<Option<(u64, u64, usize, usize)>, Status> {
        let mut bytes = [0u8; KEY_BYTES];
        let have = self.chunks.len.min(left).min(KEY_BYTES);
        self.chunks.peek_into(&mut bytes[..have]);
        let complete = have == left.min(KEY_BYTES);
        let more = |what: &str| {
            if complete {
                Err(malformed(&format!("{what} is cut short")))
            } else {
                Ok(None)
            }
        };
        let Some((key, k)) = varint(&bytes[..have]) else {
            return more("a field key");
        };
        let (field, wire) = (key >> 3, key & 7);
        let value = match wire {
            // A varint value is copied as it is: find how long it is.
            0 => match varint(&bytes[k..have]) {
                Some((_, n)) => n,
                None => return more("a varint field"),
            },
            1 => 8,
            5 => 4,
            2 => match varint(&bytes[k..have]) {
                Some((length, n)) => {
                    let length = usize::try_from(length)
                        .map_err(|_| malformed("a field length is out of range"))?;
                    return Ok(Some((field, wire, length, k + n)));
                }
                None => return more("a field length"),
            },
            _ => return Err(malformed("a field of an unknown wire type")),
        };
        Ok(Some((field, wire, value, k)))
    }

    /// The message is whole: its fields decoded, the body set.
    fn finish(&mut self) -> Result<(), Status> {
        let mut data = FlightData::decode(self.fields.as_slice())
            .map_err(|e| malformed(&format!("a message does not decode: {e}")))?;
        if let Some(body) = self.body.take() {
            data.data_body = aligned_bytes(body);
        }
        self.ready.push_back(Ok(data));
        Ok(())
    }
}

/// The stream's bytes not yet consumed, as the chunks they came in.
#[derive(Debug, Default)]
struct Chunks {
    queue: VecDeque<Bytes>,
    /// Bytes held.
    len: usize,
}

impl Chunks {
    fn push(&mut self, chunk: Bytes) {
        self.len += chunk.len();
        self.queue.push_back(chunk);
    }

    /// Fills `out` from the front without consuming (`out` no longer than
    /// what is held).
    fn peek_into(&self, out: &mut [u8]) {
        let mut at = 0;
        for chunk in &self.queue {
            if at == out.len() {
                break;
            }
            let n = chunk.len().min(out.len() - at);
            out[at..at + n].copy_from_slice(&chunk[..n]);
            at += n;
        }
    }

    /// Hands the next `n` bytes (no more than are held) to `to`, slice by
    /// slice, consuming them.
    fn take(&mut self, mut n: usize, mut to: impl FnMut(&[u8])) {
        self.len -= n;
        while n > 0 {
            let Some(chunk) = self.queue.front_mut() else {
                return;
            };
            let k = chunk.len().min(n);
            to(&chunk[..k]);
            chunk.advance(k);
            n -= k;
            if chunk.is_empty() {
                self.queue.pop_front();
            }
        }
    }
}

/// `buffer` as [`Bytes`] that keep its alignment (Arrow takes slices of
/// them without copying).
pub(crate) fn aligned_bytes(buffer: MutableBuffer) -> Bytes {
    Bytes::from_owner(Aligned(Buffer::from(buffer)))
}

/// An aligned Arrow buffer as the owner of a [`Bytes`].
struct Aligned(Buffer);

impl AsRef<[u8]> for Aligned {
    fn as_ref(&self) -> &[u8] {
        self.0.as_slice()
    }
}

/// A protobuf varint at the front of `bytes` and its length; `None` when
/// it does not end within them (or runs past ten bytes).
fn varint(bytes: &[u8]) -> Option<(u64, usize)> {
    let mut value = 0u64;
    for (i, &b) in bytes.iter().enumerate().take(10) {
        value |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Some((value, i + 1));
        }
    }
    None
}

fn malformed(what: &str) -> Status {
    Status::internal(format!("the server sent a malformed DoGet stream: {what}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_flight::FlightDescriptor;

    fn framed(messages: &[FlightData]) -> Vec<u8> {
        let mut out = Vec::new();
        for m in messages {
            let bytes = m.encode_to_vec();
            out.push(0);
            out.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
            out.extend_from_slice(&bytes);
        }
        out
    }

    fn messages() -> Vec<FlightData> {
        vec![
            FlightData {
                data_header: Bytes::from_static(b"schema header"),
                ..Default::default()
            },
            FlightData {
                flight_descriptor: Some(FlightDescriptor::new_path(vec!["a".into()])),
                data_header: Bytes::from(vec![7u8; 300]),
                app_metadata: Bytes::from_static(b"tag"),
                data_body: Bytes::from((0..5000u32).map(|i| i as u8).collect::<Vec<_>>()),
            },
            FlightData::default(),
            FlightData {
                data_header: Bytes::from_static(b"h"),
                data_body: Bytes::from(vec![1u8; 200]),
                ..Default::default()
            },
        ]
    }

    fn deframe(stream: &[u8], cuts: &[usize], max: usize) -> Vec<Result<FlightData, Status>> {
        let mut d = Deframer::new(max);
        let mut out = Vec::new();
        let mut at = 0;
        for &cut in cuts.iter().chain([&stream.len()]) {
            let cut = cut.clamp(at, stream.len());
            d.push(Bytes::copy_from_slice(&stream[at..cut]));
            at = cut;
            while let Some(m) = d.next_message() {
                out.push(m);
            }
        }
        out
    }

    #[test]
    fn every_cut_of_a_stream_gives_its_messages_with_aligned_bodies() {
        let sent = messages();
        let stream = framed(&sent);
        // Every single cut, and chunks of every size up to 41 bytes.
        let mut ways: Vec<Vec<usize>> = (0..=stream.len()).map(|c| vec![c]).collect();
        ways.extend((1..=41).map(|n| (n..stream.len()).step_by(n).collect()));
        for cuts in ways {
            let got: Vec<FlightData> = deframe(&stream, &cuts, 1 << 20)
                .into_iter()
                .collect::<Result<_, _>>()
                .expect("messages");
            assert_eq!(got, sent, "cuts {cuts:?}");
            for m in &got {
                if !m.data_body.is_empty() {
                    assert_eq!(m.data_body.as_ptr() as usize % 64, 0, "aligned body");
                }
            }
        }
    }

    #[test]
    fn fields_in_any_order_and_unknown_fields_decode_as_prost_does() {
        // Body first, then an unknown varint and a fixed32 field, then the
        // header: what another Flight server may send.
        let mut message = Vec::new();
        message.extend_from_slice(&[0xc2, 0x3e, 3, b'x', b'y', b'z']); // 1000: "xyz"
        message.extend_from_slice(&[0x20, 0x96, 0x01]); // 4: varint 150
        message.extend_from_slice(&[0x2d, 1, 2, 3, 4]); // 5: fixed32
        message.extend_from_slice(&[0x12, 2, b'h', b'i']); // 2: "hi"
        let mut stream = vec![0];
        stream.extend_from_slice(&(message.len() as u32).to_be_bytes());
        stream.extend_from_slice(&message);
        let expected = FlightData::decode(message.as_slice()).expect("prost");
        for cut in 0..=stream.len() {
            let got = deframe(&stream, &[cut], 1 << 20);
            assert_eq!(got.len(), 1);
            assert_eq!(got[0].as_ref().expect("message"), &expected, "cut {cut}");
        }
    }

    #[test]
    fn bad_streams_are_errors_not_panics() {
        let stream = framed(&messages());
        // Over the size limit.
        let got = deframe(&stream, &[], 10);
        assert_eq!(got[0].as_ref().expect_err("limit").code(), Code::OutOfRange);
        // Compressed.
        let mut compressed = stream.clone();
        compressed[0] = 1;
        let got = deframe(&compressed, &[], 1 << 20);
        assert_eq!(got[0].as_ref().expect_err("flag").code(), Code::Internal);
        // A body longer than its message.
        let bad = [0, 0, 0, 0, 4, 0xc2, 0x3e, 9, 1];
        let got = deframe(&bad, &[], 1 << 20);
        assert!(
            got[0]
                .as_ref()
                .expect_err("body")
                .message()
                .contains("past")
        );
        // A key that never ends within its message.
        let bad = [0, 0, 0, 0, 2, 0xff, 0xff];
        let got = deframe(&bad, &[], 1 << 20);
        assert!(got[0].as_ref().is_err());
        // A stream cut inside a message is not "between messages".
        let mut d = Deframer::new(1 << 20);
        d.push(Bytes::copy_from_slice(&stream[..stream.len() - 1]));
        while d.next_message().is_some() {}
        assert!(!d.is_between_messages());
        let mut d = Deframer::new(1 << 20);
        d.push(Bytes::copy_from_slice(&stream));
        while d.next_message().is_some() {}
        assert!(d.is_between_messages());
        // Every prefix of garbage: nothing panics.
        let garbage: Vec<u8> = (0..200u32).map(|i| (i * 97 + 13) as u8).collect();
        for n in 0..garbage.len() {
            let _ = deframe(&garbage[..n], &[n / 2], 1 << 20);
        }
    }
}
