//! `DoPut`: one partition attempt, staged until its stream ends cleanly, then
//! committed as its answer is sent — or nothing at all.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use arrow_flight::FlightData;
use arrow_flight::decode::{DecodedPayload, FlightDataDecoder};
use bytes::Bytes;
use flightdeck_protos as pb;
use futures::{FutureExt, StreamExt};
use tracing::info;

use crate::catalog::{AttemptData, AttemptKey};
use crate::convert;
use crate::error::{Error, Result};
use crate::memory::arena::Arena;
use crate::metrics::Metrics;
use crate::state::State;

/// Checks the writer's `PutCommit` against what arrived.
fn check_commit_marker(marker: &[u8], rows: u64, what: &str) -> Result<()> {
    if marker.is_empty() {
        return Err(Error::Aborted(format!(
            "DoPut stream of {what} ended without its commit marker (the writer stopped early); \
             nothing was stored, send the attempt again"
        )));
    }
    let commit = convert::put_commit(marker)?;
    let Some(sent) = commit.rows else {
        return Err(Error::invalid(format!(
            "the commit marker of {what} carries no row count; set PutCommit.rows"
        )));
    };
    if sent != rows {
        return Err(Error::Aborted(format!(
            "DoPut stream of {what}: the writer sent {sent} rows but {rows} arrived; nothing was \
             stored, send the attempt again"
        )));
    }
    Ok(())
}

/// Whether an IPC message header is a record batch's with uncompressed
/// buffers (one whose body can be decoded in place in the arena).
fn plain_record_batch(header: &[u8]) -> bool {
    arrow::ipc::root_as_message(header)
        .ok()
        .and_then(|m| m.header_as_record_batch())
        .is_some_and(|b| b.compression().is_none())
}

/// What to set aside for a writer that says it sends `bytes`: its buffers
/// are each padded to 64 bytes in the arena, so a little more.
fn with_padding(bytes: u64) -> u64 {
    bytes.saturating_add(bytes / 128).saturating_add(256 << 10)
}

/// `DoPut`: receives the attempt `input` carries (its first message names the
/// dataset and partition) and commits it whole, or stores nothing.
pub async fn do_put<S>(state: &State, input: S) -> Result<pb::PutAck>
where
    S: futures::Stream<Item = std::result::Result<FlightData, tonic::Status>>
        + Unpin
        + Send
        + 'static,
{
    receive(state, input).await?.commit(state)
}

/// An attempt received whole and checked, not yet committed: committing it
/// is the write; dropped, it stores nothing and its batches free what they
/// held. The service commits it as it sends the call's answer, because
/// hyper ends a request its client reset with `NO_ERROR` (as gRPC clients
/// in Go cancel a call) like one that finished: only a call whose answer
/// is taken really ended.
#[derive(Debug)]
pub struct Received {
    /// The catalog entry: the dataset, or what a replacing write stages.
    entry: String,
    key: AttemptKey,
    write_id: String,
    replace: bool,
    schema: SchemaRef,
    /// `None` once committed (or refused by the catalog).
    data: Option<AttemptData>,
    ack: pb::PutAck,
    metrics: Arc<Metrics>,
}

impl Received {
    /// What committing the attempt acknowledges.
    pub fn ack(&self) -> &pb::PutAck {
        &self.ack
    }

    /// Commits the attempt, or refuses it (a sealed or dropped dataset, a
    /// different schema) storing nothing.
    pub fn commit(mut self, state: &State) -> Result<pb::PutAck> {
        let data = self.data.take().ok_or_else(|| {
            Error::Internal("an attempt received once was committed twice".into())
        })?;
        let committed = state.catalog().commit_write(
            &self.entry,
            self.key,
            &self.write_id,
            self.schema.clone(),
            data,
        );
        if let Err(e) = committed {
            self.metrics.aborted();
            return Err(e);
        }
        let ack = &self.ack;
        info!(
            dataset = %ack.dataset,
            partition = ack.partition,
            attempt = ack.attempt,
            rows = ack.rows,
            bytes = ack.bytes,
            replace = self.replace,
            "committed attempt"
        );
        self.metrics.committed(&ack.dataset, ack.rows, ack.bytes);
        Ok(std::mem::take(&mut self.ack))
    }
}

impl Drop for Received {
    fn drop(&mut self) {
        if self.data.is_some() {
            self.metrics.aborted();
            info!(
                dataset = %self.ack.dataset,
                partition = self.ack.partition,
                attempt = self.ack.attempt,
                rows = self.ack.rows,
                "dropped attempt: its call ended before its answer was sent, nothing was stored"
            );
        }
    }
}

/// Receives the attempt `input` carries (its first message names the
/// dataset and partition), checked whole (its commit marker, if it said it
/// sends one), for the caller to commit. An attempt refused here, or not
/// committed, is counted aborted.
pub async fn receive<S>(state: &State, input: S) -> Result<Received>
where
    S: futures::Stream<Item = std::result::Result<FlightData, tonic::Status>>
        + Unpin
        + Send
        + 'static,
{
    let received = receive_whole(state, input).await;
    if received.is_err() {
        state.metrics.aborted();
    }
    received
}

async fn receive_whole<S>(state: &State, mut input: S) -> Result<Received>
where
    S: futures::Stream<Item = std::result::Result<FlightData, tonic::Status>>
        + Unpin
        + Send
        + 'static,
{
    let idle = state.config.stream_idle_timeout;
    let stalled = |what: String| {
        Error::Aborted(format!(
            "DoPut stream of {what} sent nothing for {idle:?} (--stream-idle-timeout); nothing \
             was stored, send the attempt again"
        ))
    };
    let first = tokio::time::timeout(idle, input.next())
        .await
        .map_err(|_| stalled("a partition".into()))?;
    let first = match first.transpose() {
        Ok(Some(first)) => first,
        Ok(None) => {
            return Err(Error::invalid(
                "DoPut stream is empty: its first message must carry the descriptor and schema",
            ));
        }
        Err(status) => {
            return Err(Error::Aborted(format!(
                "DoPut stream broke before its first message: {}",
                status.message()
            )));
        }
    };
    let descriptor = first.flight_descriptor.clone().ok_or_else(|| {
        Error::invalid(
            "the first DoPut message carries no flight descriptor; name the dataset and partition",
        )
    })?;
    let target = convert::put_target(&descriptor)?;
    // The catalog entry: the dataset, or what a replacing write stages.
    let entry = target.entry();
    let convert::PutTarget {
        dataset,
        key,
        explicit_commit,
        expected_bytes,
        write_id,
        replace,
    } = target;
    let what = || {
        format!(
            "attempt {} of partition {} of dataset '{dataset}'",
            key.attempt, key.partition
        )
    };

    // A writer that said its size is admitted whole, or refused before any
    // of its batches is read.
    let mut reservation = match expected_bytes {
        0 => None,
        bytes => Some(state.reserve(with_padding(bytes), &what).await?),
    };

    // Each record batch's body is copied once, into the arena, and decoded
    // there: the batch is then kept as it came (no second copy, and the
    // bytes being decoded are already in the budget). Batches that cannot
    // be kept so (compressed, dictionary-encoded, nulls in fixed-width
    // columns) are copied into the arena after decoding, and later bodies
    // of that stream are decoded where they arrived.
    let (feed, fed) = futures::channel::mpsc::unbounded();
    let mut decoder = FlightDataDecoder::new(fed);
    let mut land = true;
    let mut next_message = Some(first);
    // The app_metadata of the last message seen: the commit marker, if any.
    let mut last_metadata = Bytes::new();
    let mut schema: Option<SchemaRef> = None;
    let mut batches: Vec<RecordBatch> = Vec::new();
    let mut rows = 0u64;
    let mut bytes = 0u64;
    loop {
        let mut message = match next_message.take() {
            Some(message) => message,
            None => match tokio::time::timeout(idle, input.next()).await {
                Err(_) => return Err(stalled(what())),
                Ok(None) => break,
                Ok(Some(Ok(message))) => message,
                Ok(Some(Err(status))) if status.code() == tonic::Code::OutOfRange => {
                    // Sending it again would fail again.
                    return Err(Error::invalid(format!(
                        "DoPut stream of {}: a message is larger than this server accepts ({}); \
                         nothing was stored, send the partition in smaller record batches",
                        what(),
                        status.message()
                    )));
                }
                Ok(Some(Err(status))) => {
                    return Err(Error::Aborted(format!(
                        "DoPut stream of {} broke ({}); nothing was stored, send the attempt \
                         again",
                        what(),
                        status.message()
                    )));
                }
            },
        };
        last_metadata = message.app_metadata.clone();
        // Messages without an IPC header only carry a descriptor or app metadata.
        if message.data_header.is_empty() {
            continue;
        }
        let mut landed = None;
        if land && !message.data_body.is_empty() && plain_record_batch(&message.data_header) {
            let (body, taken) = state
                .land_body(&message.data_body, reservation.as_mut(), &what)
                .await?;
            message.data_body = super::ipc::shared(body.clone());
            landed = Some((body, taken));
        }
        // The decoder has nothing else to wait for: it decodes this message
        // now, or it was one (a dictionary) that yields no item.
        let _ = feed.unbounded_send(Ok(message));
        // Arrow's IPC reader validates what it decodes, but some malformed
        // bodies (buffers past the body, misaligned or overflowing ones)
        // still panic inside it: those are the writer's fault, not ours.
        let item = match AssertUnwindSafe(decoder.next())
            .catch_unwind()
            .now_or_never()
        {
            None => continue,
            Some(Ok(Some(item))) => item,
            Some(Ok(None)) => {
                return Err(Error::Internal(format!(
                    "the IPC decoder of {} ended before its stream",
                    what()
                )));
            }
            Some(Err(_)) => {
                return Err(Error::invalid(format!(
                    "DoPut stream of {} is malformed: a record batch's IPC body does not match \
                     its header (buffers past the body, misaligned or overflowing); nothing was \
                     stored",
                    what()
                )));
            }
        };
        let decoded = item.map_err(|e| {
            Error::invalid(format!(
                "DoPut stream of {} is malformed: {e}; nothing was stored",
                what()
            ))
        })?;
        match decoded.payload {
            DecodedPayload::Schema(s) => {
                if schema.is_some() {
                    return Err(Error::invalid(format!(
                        "DoPut stream of {} carries a second schema; send one schema per stream",
                        what()
                    )));
                }
                {
                    let mut catalog = state.catalog();
                    catalog.check_write(&dataset, &write_id)?;
                    catalog.check_writer(&entry, &write_id)?;
                    catalog.check_put(&entry, key, &s)?;
                    catalog.writing(&entry);
                }
                schema = Some(s);
            }
            DecodedPayload::RecordBatch(batch) => {
                let more = batch.num_rows() as u64;
                let total = crate::catalog::add_rows(rows, more, what)?;
                let (kept, taken) = match landed {
                    Some((body, taken)) if Arena::holds(&body, &batch) => (batch, taken),
                    landed => {
                        // Into the arena before it is kept; the decoded copy goes.
                        if landed.is_some() {
                            land = false;
                        }
                        drop(landed);
                        state
                            .admit(&batch, None, reservation.as_mut(), &what)
                            .await?
                    }
                };
                bytes += taken;
                rows = total;
                batches.push(kept);
            }
            DecodedPayload::None => {}
        }
    }
    let schema = schema.ok_or_else(|| {
        Error::invalid(format!(
            "DoPut stream of {} carried no schema; nothing was stored",
            what()
        ))
    })?;
    if explicit_commit {
        check_commit_marker(&last_metadata, rows, &what())?;
    }
    Ok(Received {
        entry,
        key,
        write_id,
        replace,
        schema,
        data: Some(AttemptData {
            batches,
            rows,
            bytes,
        }),
        ack: pb::PutAck {
            dataset,
            partition: key.partition,
            attempt: key.attempt,
            rows,
            bytes,
            location: state.location.clone(),
        },
        metrics: state.metrics.clone(),
    })
}
