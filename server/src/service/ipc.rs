//! Arrow IPC messages of a `DoGet` stream without copying their bodies.
//!
//! Arrow's `StreamEncoder` hands out a record batch as the IPC stream's
//! pieces: the continuation marker and length, the flatbuffer header, and
//! the batch's own Arrow buffers (shared, not copied) with padding between.
//! [`Messages`] splits those pieces back into messages, and each
//! [`IpcMessage`] becomes either a `FlightData` (one copy of the body, for
//! the generated service) or the bytes of one gRPC message — five bytes of
//! gRPC framing, the protobuf tags and lengths of `FlightData`'s
//! `data_header` and `data_body`, then the body's buffers as they are — for
//! the hand-written `DoGet` response (`edge.rs`), so the only copies left on
//! the way to the socket are the gather and the kernel's. Neighbouring
//! buffers of one allocation — a batch's fixed-width columns, which the
//! gather writes back to back as the body lays them out — are one piece
//! ([`Span`]): each piece is an HTTP/2 DATA frame, and each frame a write.

use std::collections::VecDeque;

use arrow::array::RecordBatch;
use arrow::buffer::Buffer;
use arrow::datatypes::Schema;
use arrow::ipc::writer::{DictionaryTracker, IpcDataGenerator, IpcWriteOptions, StreamEncoder};
use arrow::ipc::{MessageHeader, root_as_message};
use arrow_flight::FlightData;
use bytes::{BufMut, Bytes, BytesMut};

use crate::error::{Error, Result};

/// Tag of `FlightData.data_header` (field 2, length-delimited).
const HEADER_TAG: u8 = 0x12;
/// Tag of `FlightData.app_metadata` (field 3, length-delimited).
const METADATA_TAG: u8 = 0x1A;
/// Tag of `FlightData.data_body` (field 1000, length-delimited) as a varint.
const BODY_TAG: [u8; 2] = [0xC2, 0x3E];

/// One IPC message: its flatbuffer header and its body's pieces.
#[derive(Debug, Clone)]
pub struct IpcMessage {
    /// The flatbuffer `Message`, as `FlightData.data_header` carries it.
    pub header: Bytes,
    /// The body, in pieces (Arrow buffers and padding), `body_len` bytes.
    pub body: Vec<Bytes>,
    /// Bytes of the body.
    pub body_len: usize,
    /// `FlightData.app_metadata` (empty: none).
    pub app_metadata: Bytes,
}

impl IpcMessage {
    /// The message as `FlightData` (the body copied into one buffer, the
    /// header padded as [`Self::to_grpc_frame`] pads it).
    pub fn to_flight_data(&self) -> FlightData {
        let mut body = BytesMut::with_capacity(self.body_len);
        for piece in &self.body {
            body.extend_from_slice(piece);
        }
        let padded = self.padded_header_len();
        let mut header = BytesMut::with_capacity(padded);
        header.extend_from_slice(&self.header);
        header.resize(padded, 0);
        FlightData {
            data_header: header.freeze(),
            data_body: body.freeze(),
            app_metadata: self.app_metadata.clone(),
            ..Default::default()
        }
    }

    /// What the message is (a schema, a dictionary, a record batch), from
    /// its header; `None` where the header does not parse.
    pub fn kind(&self) -> Option<MessageHeader> {
        root_as_message(&self.header).ok().map(|h| h.header_type())
    }

    /// A gRPC message holding a `FlightData` with `app_metadata` alone (no
    /// header, no body): what Flight calls a metadata-only message.
    pub fn metadata_frame(app_metadata: &[u8]) -> Bytes {
        let meta = app_metadata.len();
        let len = 1 + varint_len(meta) + meta;
        let mut out = BytesMut::with_capacity(5 + len);
        out.put_u8(0); // not compressed
        out.put_u32(u32::try_from(len).unwrap_or(u32::MAX));
        out.put_u8(METADATA_TAG);
        put_varint(&mut out, meta);
        out.extend_from_slice(app_metadata);
        out.freeze()
    }

    /// Bytes of the encoded `app_metadata` field (none when empty).
    fn metadata_field_len(&self) -> usize {
        match self.app_metadata.len() {
            0 => 0,
            meta => 1 + varint_len(meta) + meta,
        }
    }

    /// Bytes of the `data_body` field before the body: its tag and length
    /// (none without a body).
    fn body_head_len(&self) -> usize {
        match self.body_len {
            0 => 0,
            body => BODY_TAG.len() + varint_len(body),
        }
    }

    /// The length `data_header` is sent with: the header, then zeros up to
    /// where the body starts a multiple of [`BODY_ALIGNMENT`] bytes into
    /// the message (no padding without a body).
    fn padded_header_len(&self) -> usize {
        if self.body_len == 0 {
            return self.header.len();
        }
        let after = self.metadata_field_len() + self.body_head_len();
        (self.header.len()..)
            .find(|&h| (1 + varint_len(h) + h + after).is_multiple_of(BODY_ALIGNMENT))
            .expect("a length within BODY_ALIGNMENT of any other fits")
    }

    /// The message as one length-prefixed gRPC message holding the
    /// protobuf encoding of its `FlightData`, in pieces: a small head, then
    /// the body's own buffers. Refuses messages above `max_bytes`.
    ///
    /// The header is padded with zeros (after the flatbuffer, as Arrow pads
    /// IPC metadata to 8 bytes) so that the body starts a multiple of
    /// [`BODY_ALIGNMENT`] bytes into the protobuf message: a client that
    /// reads the message into one allocated buffer (pyarrow does) then has
    /// every Arrow buffer of the body aligned as the allocation is, instead
    /// of at an odd address, which its numeric kernels read more slowly.
    pub fn to_grpc_frame(&self, max_bytes: usize) -> Result<Vec<Bytes>> {
        let meta = self.app_metadata.len();
        let meta_field = self.metadata_field_len();
        let body_field = self.body_head_len() + self.body_len;
        let padded = self.padded_header_len();
        let header_field = 1 + varint_len(padded) + padded;
        let len = header_field + meta_field + body_field;
        if len > max_bytes {
            return Err(Error::ResourceExhausted(format!(
                "a record batch of the shard encodes to {len} bytes, above this server's \
                 --max-message-size of {max_bytes} bytes; read with a smaller batch_rows"
            )));
        }
        let len32 = u32::try_from(len).map_err(|_| {
            Error::ResourceExhausted(format!("a {len}-byte message cannot be framed"))
        })?;
        // Room for the small buffers too (see below): one allocation.
        let small_bytes: usize = self
            .body
            .iter()
            .map(|p| p.len())
            .filter(|&n| n < SMALL_PIECE)
            .sum();
        let mut head = BytesMut::with_capacity(5 + header_field + meta_field + 12 + small_bytes);
        head.put_u8(0); // not compressed
        head.put_u32(len32);
        head.put_u8(HEADER_TAG);
        put_varint(&mut head, padded);
        head.extend_from_slice(&self.header);
        head.put_bytes(0, padded - self.header.len());
        if meta > 0 {
            head.put_u8(METADATA_TAG);
            put_varint(&mut head, meta);
            head.extend_from_slice(&self.app_metadata);
        }
        if self.body_len > 0 {
            head.extend_from_slice(&BODY_TAG);
            put_varint(&mut head, self.body_len);
        }
        // Small buffers are copied after the head (or the small ones
        // before them; `split` keeps the rest of the allocation for the
        // next): each piece leaves as an HTTP/2 DATA frame, and a
        // batch of a few rows of many columns would otherwise be dozens of
        // frames of a few bytes, which h2 receivers count as an attack
        // (GOAWAY `ENHANCE_YOUR_CALM`, "too_many_data_frames") once enough
        // of them wait unread — a member reading another's rows did.
        let mut out = Vec::with_capacity(1 + self.body.len());
        let mut small = head;
        for piece in self.body.iter().filter(|p| !p.is_empty()) {
            if piece.len() < SMALL_PIECE {
                small.extend_from_slice(piece);
                continue;
            }
            if !small.is_empty() {
                out.push(small.split().freeze());
            }
            out.push(piece.clone());
        }
        if !small.is_empty() {
            out.push(small.freeze());
        }
        Ok(out)
    }
}

/// Body buffers below this many bytes (HTTP/2's default frame size) are
/// copied into one piece with their neighbours rather than sent as frames
/// of their own (see [`IpcMessage::to_grpc_frame`]).
const SMALL_PIECE: usize = 16 << 10;

/// Bytes into a `DoGet` message (the protobuf `FlightData`, after gRPC's
/// five-byte prefix) at which a body starts.
pub const BODY_ALIGNMENT: usize = 64;

fn varint_len(mut v: usize) -> usize {
    let mut n = 1;
    while v >= 0x80 {
        v >>= 7;
        n += 1;
    }
    n
}

fn put_varint(out: &mut BytesMut, mut v: usize) {
    while v >= 0x80 {
        out.put_u8((v as u8) | 0x80);
        v >>= 7;
    }
    out.put_u8(v as u8);
}

/// Encodes a stream's schema and record batches into [`IpcMessage`]s.
pub struct Messages {
    schema: Schema,
    encoder: StreamEncoder,
}

impl std::fmt::Debug for Messages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Messages")
            .field("fields", &self.schema.fields().len())
            .finish()
    }
}

fn ipc_error(e: arrow::error::ArrowError) -> Error {
    Error::Internal(format!("encoding Arrow IPC: {e}"))
}

impl Messages {
    /// An encoder for batches of `schema`.
    pub fn new(schema: &Schema) -> Result<Self> {
        Ok(Self {
            schema: schema.clone(),
            encoder: StreamEncoder::try_new(schema).map_err(ipc_error)?,
        })
    }

    /// The schema message, sent first.
    pub fn schema(&self) -> IpcMessage {
        let encoded = IpcDataGenerator::default().schema_to_bytes_with_dictionary_tracker(
            &self.schema,
            &mut DictionaryTracker::new(false),
            &IpcWriteOptions::default(),
        );
        IpcMessage {
            header: Bytes::from(encoded.ipc_message),
            body: Vec::new(),
            body_len: 0,
            app_metadata: Bytes::new(),
        }
    }

    /// The messages of one batch: any dictionary batches, then the record
    /// batch. The bodies share the batch's buffers.
    pub fn batch(&mut self, batch: &RecordBatch) -> Result<Vec<IpcMessage>> {
        let pieces = self.encoder.encode(batch).map_err(ipc_error)?;
        let mut messages = split(pieces)?;
        // The encoder starts its stream with the schema, sent already.
        messages.retain(|m| {
            root_as_message(&m.header).map(|h| h.header_type()) != Ok(MessageHeader::Schema)
        });
        Ok(messages)
    }
}

/// Splits IPC stream pieces into messages.
fn split(pieces: Vec<Buffer>) -> Result<Vec<IpcMessage>> {
    let mut stream = Pieces {
        pieces: pieces.into(),
    };
    let mut out = Vec::new();
    while !stream.is_empty() {
        let prefix = stream.take_contiguous(8)?;
        if prefix[..4] != [0xFF; 4] {
            return Err(Error::Internal(
                "Arrow IPC stream without a continuation marker".into(),
            ));
        }
        let meta_len = u32::from_le_bytes([prefix[4], prefix[5], prefix[6], prefix[7]]) as usize;
        if meta_len == 0 {
            continue; // end of stream
        }
        let header = stream.take_header(meta_len)?;
        let body_len = root_as_message(&header)
            .map_err(|e| Error::Internal(format!("Arrow IPC header: {e}")))?
            .bodyLength();
        let body_len = usize::try_from(body_len)
            .map_err(|_| Error::Internal(format!("Arrow IPC body of {body_len} bytes")))?;
        let body = stream.take(body_len)?;
        out.push(IpcMessage {
            header,
            body,
            body_len,
            app_metadata: Bytes::new(),
        });
    }
    Ok(out)
}

/// The IPC stream's pieces, consumed from the front.
struct Pieces {
    pieces: VecDeque<Buffer>,
}

impl Pieces {
    fn is_empty(&self) -> bool {
        self.pieces.iter().all(|p| p.is_empty())
    }

    /// The next `n` bytes as shared pieces, neighbouring buffers of one
    /// allocation as one piece ([`Span`]).
    fn take(&mut self, mut n: usize) -> Result<Vec<Bytes>> {
        let mut out: Vec<Span> = Vec::new();
        while n > 0 {
            let Some(front) = self.pieces.pop_front() else {
                return Err(Error::Internal("Arrow IPC stream ended early".into()));
            };
            let piece = if front.len() > n {
                self.pieces.push_front(front.slice(n));
                front.slice_with_length(0, n)
            } else {
                front
            };
            n -= piece.len();
            if piece.is_empty() {
                continue;
            }
            match out.last_mut() {
                Some(last) if last.reaches(&piece) => last.len += piece.len(),
                _ => out.push(Span::of(piece)),
            }
        }
        Ok(out.into_iter().map(Span::bytes).collect())
    }

    /// The next `n` bytes in one buffer.
    fn take_contiguous(&mut self, n: usize) -> Result<Bytes> {
        let parts = self.take(n)?;
        if parts.len() == 1 {
            return Ok(parts.into_iter().next().unwrap_or_default());
        }
        let mut out = BytesMut::with_capacity(n);
        for p in parts {
            out.extend_from_slice(&p);
        }
        Ok(out.freeze())
    }

    /// A header of `padded` bytes: the flatbuffer, without the padding that
    /// follows it when the encoder wrote them as separate pieces.
    fn take_header(&mut self, padded: usize) -> Result<Bytes> {
        let exact = self
            .pieces
            .front()
            .map(|p| p.len())
            .filter(|&len| len > 0 && len <= padded);
        match exact {
            Some(len) => {
                let header = self.take_contiguous(len)?;
                self.take(padded - len)?;
                Ok(header)
            }
            None => self.take_contiguous(padded),
        }
    }
}

/// An Arrow buffer's bytes as `Bytes`, sharing its memory (no copy).
pub fn shared(buffer: Buffer) -> Bytes {
    Span::of(buffer).bytes()
}

/// Buffers of a message body back to back in one allocation — a batch's
/// fixed-width columns, which the gather writes into one buffer — as
/// one piece: `len` bytes from the start of `first`. Each piece leaves as
/// an HTTP/2 DATA frame and each frame as a write of its own, so a
/// 65-column batch sent as one piece is a few writes of up to the
/// client's frame size rather than 65 of one column each. The owner
/// `Bytes::from_owner` keeps alive.
struct Span {
    first: Buffer,
    len: usize,
}

impl Span {
    /// `buffer` alone.
    fn of(buffer: Buffer) -> Self {
        Self {
            len: buffer.len(),
            first: buffer,
        }
    }

    /// Whether `next` starts where this span ends, inside the allocation
    /// `first` keeps alive.
    fn reaches(&self, next: &Buffer) -> bool {
        let end = self.first.as_ptr() as usize + self.len;
        let allocation = self.first.data_ptr().as_ptr() as usize;
        next.data_ptr() == self.first.data_ptr()
            && next.as_ptr() as usize == end
            && end + next.len() <= allocation + self.first.capacity()
    }

    fn bytes(self) -> Bytes {
        Bytes::from_owner(self)
    }
}

impl AsRef<[u8]> for Span {
    #[allow(unsafe_code)]
    fn as_ref(&self) -> &[u8] {
        if self.len == self.first.len() {
            return self.first.as_slice();
        }
        // SAFETY: the span is `first` and the buffers that followed it back
        // to back ([`Span::reaches`]): every byte lies in one allocation,
        // which `first` keeps alive, and in a buffer that was initialised
        // and is immutable while shared (a `Buffer` is never written
        // through once another holds it, and `first` does).
        unsafe { std::slice::from_raw_parts(self.first.as_ptr(), self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{
        ArrayRef, BooleanArray, DictionaryArray, Float32Array, Int64Array, StringArray,
    };
    use arrow::datatypes::Int32Type;
    use arrow_flight::utils::flight_data_to_arrow_batch;
    use prost::Message;
    use std::collections::HashMap;
    use std::sync::Arc;

    fn batch(start: i64, rows: i64) -> RecordBatch {
        let dict: DictionaryArray<Int32Type> = (start..start + rows)
            .map(|v| ["a", "bb", "ccc"][(v % 3) as usize])
            .collect();
        let columns: Vec<ArrayRef> = vec![
            Arc::new(Int64Array::from_iter_values(start..start + rows)),
            Arc::new(Float32Array::from_iter(
                (start..start + rows).map(|v| (v % 5 != 0).then_some(v as f32)),
            )),
            Arc::new(StringArray::from_iter_values(
                (start..start + rows).map(|v| format!("s{v}")),
            )),
            Arc::new(dict),
        ];
        RecordBatch::try_from_iter(["id", "x", "s", "d"].into_iter().zip(columns)).expect("batch")
    }

    /// Decodes a framed message the way a gRPC client does.
    fn unframe(pieces: &[Bytes]) -> FlightData {
        let all: Vec<u8> = pieces.iter().flat_map(|p| p.to_vec()).collect();
        assert_eq!(all[0], 0, "not compressed");
        let len = u32::from_be_bytes([all[1], all[2], all[3], all[4]]) as usize;
        assert_eq!(len, all.len() - 5, "the length prefix is the message");
        FlightData::decode(&all[5..]).expect("protobuf")
    }

    #[test]
    fn framed_messages_decode_to_the_batches_they_encode() {
        let b0 = batch(0, 1000);
        let schema = b0.schema();
        let mut m = Messages::new(&schema).expect("encoder");
        let schema_msg = m.schema();
        let decoded_schema =
            Schema::try_from(&unframe(&schema_msg.to_grpc_frame(1 << 20).expect("fits")))
                .expect("schema message");
        assert_eq!(&decoded_schema, schema.as_ref());
        let mut dictionaries = HashMap::new();
        // A sliced batch too: offsets and bitmaps that do not start at zero.
        for input in [b0, batch(1000, 3000).slice(17, 2000), batch(9, 1)] {
            let messages = m.batch(&input).expect("encodes");
            let mut got = None;
            for (i, msg) in messages.iter().enumerate() {
                // Tagged and untagged messages (peer batches carry a tag).
                let mut msg = msg.clone();
                msg.app_metadata = Bytes::from(vec![i as u8 + 1; 8 * (i % 2)]);
                let framed = unframe(&msg.to_grpc_frame(64 << 20).expect("fits"));
                assert_eq!(framed, msg.to_flight_data(), "framed = prost encoding");
                assert_eq!(framed.app_metadata, msg.app_metadata);
                let header = root_as_message(&framed.data_header).expect("header");
                match header.header_type() {
                    MessageHeader::DictionaryBatch => {
                        arrow::ipc::reader::read_dictionary(
                            &Buffer::from(framed.data_body.to_vec()),
                            header.header_as_dictionary_batch().expect("dictionary"),
                            &schema,
                            &mut dictionaries,
                            &header.version(),
                        )
                        .expect("dictionary batch");
                    }
                    MessageHeader::RecordBatch => {
                        got = Some(
                            flight_data_to_arrow_batch(&framed, schema.clone(), &dictionaries)
                                .expect("record batch"),
                        );
                    }
                    other => panic!("unexpected message {other:?}"),
                }
            }
            // (The stream's schema is the first batch's; a later batch may
            // differ in nullability only, so compare the columns.)
            let got = got.expect("a record batch");
            assert_eq!(got.num_rows(), input.num_rows());
            assert_eq!(got.columns(), input.columns());
        }
    }

    #[test]
    fn bodies_start_aligned_in_their_messages() {
        // Headers and metadata of many lengths (a varint crossing one byte
        // to two included): the body always starts a multiple of
        // BODY_ALIGNMENT bytes into the protobuf message, and the message
        // still decodes to the same batch.
        let mut m = Messages::new(&batch(0, 1).schema()).expect("encoder");
        for rows in [1, 7, 300] {
            let input = batch(0, rows);
            for meta in [0, 1, 5, 63, 64, 127, 128, 200] {
                for msg in m.batch(&input).expect("encodes") {
                    let mut msg = msg.clone();
                    msg.app_metadata = Bytes::from(vec![7u8; meta]);
                    let pieces = msg.to_grpc_frame(64 << 20).expect("fits");
                    let message_len: usize = pieces.iter().map(|p| p.len()).sum::<usize>() - 5;
                    let body_at = message_len - msg.body_len;
                    assert_eq!(body_at % BODY_ALIGNMENT, 0, "rows {rows}, metadata {meta}");
                    let framed = unframe(&pieces);
                    let padding = framed.data_header.len() - msg.header.len();
                    assert!(
                        padding < BODY_ALIGNMENT,
                        "padded {padding} bytes, more than needed"
                    );
                    assert_eq!(framed, msg.to_flight_data(), "framed = prost encoding");
                    assert_eq!(framed.data_body.len(), msg.body_len);
                    assert_eq!(&framed.data_header[..msg.header.len()], &msg.header[..]);
                    root_as_message(&framed.data_header).expect("a padded header reads");
                }
            }
        }
    }

    #[test]
    fn bodies_share_the_batch_buffers() {
        let values = Float32Array::from_iter_values((0..4096).map(|v| v as f32));
        let ptr = values.values().inner().as_ptr();
        let input =
            RecordBatch::try_from_iter([("x", Arc::new(values) as ArrayRef)]).expect("batch");
        let mut m = Messages::new(&input.schema()).expect("encoder");
        let messages = m.batch(&input).expect("encodes");
        assert_eq!(messages.len(), 1);
        assert!(
            messages[0].body.iter().any(|p| p.as_ptr() == ptr),
            "the values are sent from where they are, not copied"
        );
    }

    #[test]
    fn small_buffers_leave_together_and_large_ones_as_they_are() {
        // One row of four columns: one piece, not one per buffer.
        let mut m = Messages::new(&batch(0, 1).schema()).expect("encoder");
        let msg = m
            .batch(&batch(0, 1))
            .expect("encodes")
            .pop()
            .expect("the record batch");
        assert!(msg.body.len() > 4, "several buffers");
        let pieces = msg.to_grpc_frame(64 << 20).expect("fits");
        assert_eq!(pieces.len(), 1);
        assert_eq!(unframe(&pieces), msg.to_flight_data());

        // A large column between small ones is sent from where it is; the
        // small buffers around it travel in as few pieces as the order
        // allows.
        let big = Float32Array::from_iter_values((0..32_768).map(|v| v as f32));
        let ptr = big.values().inner().as_ptr();
        // 32 768 flags: a 4 KiB bitmap.
        let small = |v: usize| {
            Arc::new(BooleanArray::from_iter(
                (0..32_768).map(|i| Some(i % v == 0)),
            )) as ArrayRef
        };
        let input = RecordBatch::try_from_iter([
            ("a", small(2)),
            ("b", small(3)),
            ("big", Arc::new(big) as ArrayRef),
            ("c", small(5)),
            ("d", small(7)),
        ])
        .expect("batch");
        let mut m = Messages::new(&input.schema()).expect("encoder");
        let msg = m.batch(&input).expect("encodes").remove(0);
        let pieces = msg.to_grpc_frame(64 << 20).expect("fits");
        assert_eq!(pieces.len(), 3, "head and a, b; big; c, d");
        assert_eq!(pieces[1].as_ptr(), ptr, "the large buffer is not copied");
        assert_eq!(unframe(&pieces), msg.to_flight_data());
    }

    #[test]
    fn columns_back_to_back_in_one_buffer_leave_as_one_piece() {
        // Three 64 KiB columns in one allocation, laid out as the body
        // lays them out (as a packed gather writes them), then one of its
        // own: the first three are one piece, sent from where they are.
        let rows = 16_384;
        let values: Vec<f32> = (0..3 * rows).map(|v| v as f32).collect();
        let whole = Buffer::from_vec(values);
        let column = |k: usize| {
            let values = whole.slice_with_length(k * rows * 4, rows * 4);
            Arc::new(Float32Array::new(values.into(), None)) as ArrayRef
        };
        let apart = Float32Array::from_iter_values((0..rows).map(|v| -(v as f32)));
        let input = RecordBatch::try_from_iter([
            ("a", column(0)),
            ("b", column(1)),
            ("c", column(2)),
            ("d", Arc::new(apart) as ArrayRef),
        ])
        .expect("batch");
        let mut m = Messages::new(&input.schema()).expect("encoder");
        let msg = m.batch(&input).expect("encodes").remove(0);
        assert_eq!(msg.body.len(), 2, "a, b, c as one piece; d apart");
        assert_eq!(msg.body[0].as_ptr(), whole.as_ptr(), "not copied");
        assert_eq!(msg.body[0].len(), 3 * rows * 4);
        let pieces = msg.to_grpc_frame(64 << 20).expect("fits");
        assert_eq!(pieces.len(), 3, "head; a, b, c; d");
        let framed = unframe(&pieces);
        assert_eq!(framed, msg.to_flight_data());
        let got = flight_data_to_arrow_batch(&framed, input.schema(), &HashMap::new())
            .expect("record batch");
        assert_eq!(got.columns(), input.columns());

        // Two slices of one buffer with a gap between them stay apart.
        let gapped =
            RecordBatch::try_from_iter([("a", column(0)), ("c", column(2))]).expect("batch");
        let mut m = Messages::new(&gapped.schema()).expect("encoder");
        let msg = m.batch(&gapped).expect("encodes").remove(0);
        assert_eq!(msg.body.len(), 2, "a gap between them: two pieces");
    }

    #[test]
    fn oversized_messages_are_refused_with_advice() {
        let input = batch(0, 1000);
        let mut m = Messages::new(&input.schema()).expect("encoder");
        let messages = m.batch(&input).expect("encodes");
        let record = messages.last().expect("record batch");
        let err = record.to_grpc_frame(100).expect_err("too large");
        assert!(err.to_string().contains("batch_rows"), "{err}");
    }

    #[test]
    fn varints_match_protobuf() {
        for v in [
            0usize,
            1,
            127,
            128,
            300,
            16_383,
            16_384,
            1 << 21,
            usize::MAX >> 1,
        ] {
            let mut ours = BytesMut::new();
            put_varint(&mut ours, v);
            let mut theirs = Vec::new();
            prost::encoding::encode_varint(v as u64, &mut theirs);
            assert_eq!(&ours[..], &theirs[..], "{v}");
            assert_eq!(varint_len(v), theirs.len());
        }
    }
}
