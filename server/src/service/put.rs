//! `DoPut`: one partition attempt, staged until its stream ends cleanly, then
//! committed — or nothing at all.

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use arrow_flight::FlightData;
use arrow_flight::decode::{DecodedPayload, FlightDataDecoder};
use arrow_flight::error::FlightError;
use bytes::Bytes;
use flightdeck_protos as pb;
use futures::{FutureExt, StreamExt, TryStreamExt, stream};
use tracing::info;

use crate::catalog::AttemptData;
use crate::convert;
use crate::error::{Error, Result};
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

/// Receives a whole attempt and commits it; any failure stores nothing.
/// What to set aside for a writer that says it sends `bytes`: its buffers
/// are each padded to 64 bytes in the arena, so a little more.
fn with_padding(bytes: u64) -> u64 {
    bytes.saturating_add(bytes / 128).saturating_add(256 << 10)
}

/// `DoPut`: receives the attempt `input` carries (its first message names the
/// dataset and partition) and commits it whole, or stores nothing.
pub async fn do_put<S>(state: &State, mut input: S) -> Result<pb::PutAck>
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
    let convert::PutTarget {
        dataset,
        key,
        explicit_commit,
        expected_bytes,
    } = convert::put_target(&descriptor)?;
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

    let rest = input.map_err(|status| FlightError::Tonic(Box::new(status)));
    // The app_metadata of the last message seen: the commit marker, if any.
    let last_metadata = Arc::new(Mutex::new(Bytes::new()));
    let seen = last_metadata.clone();
    // Messages without an IPC header only carry a descriptor or app metadata.
    let messages = stream::once(async { Ok(first) })
        .chain(rest)
        .inspect_ok(move |m| {
            *seen.lock().unwrap_or_else(|p| p.into_inner()) = m.app_metadata.clone();
        })
        .try_filter(|m| std::future::ready(!m.data_header.is_empty()));
    let mut decoder = FlightDataDecoder::new(messages);
    let mut schema: Option<SchemaRef> = None;
    let mut batches: Vec<RecordBatch> = Vec::new();
    let mut rows = 0u64;
    let mut bytes = 0u64;
    loop {
        // Arrow's IPC reader validates what it decodes, but some malformed
        // bodies (buffers past the body, misaligned or overflowing ones)
        // still panic inside it: those are the writer's fault, not ours.
        let next = AssertUnwindSafe(decoder.next()).catch_unwind();
        let item = match tokio::time::timeout(idle, next).await {
            Err(_) => return Err(stalled(what())),
            Ok(Ok(Some(item))) => item,
            Ok(Ok(None)) => break,
            Ok(Err(_)) => {
                return Err(Error::invalid(format!(
                    "DoPut stream of {} is malformed: a record batch's IPC body does not match \
                     its header (buffers past the body, misaligned or overflowing); nothing was \
                     stored",
                    what()
                )));
            }
        };
        let decoded = match item {
            Ok(decoded) => decoded,
            Err(FlightError::Tonic(status)) if status.code() == tonic::Code::OutOfRange => {
                // Sending it again would fail again.
                return Err(Error::invalid(format!(
                    "DoPut stream of {}: a message is larger than this server accepts ({}); \
                     nothing was stored, send the partition in smaller record batches",
                    what(),
                    status.message()
                )));
            }
            Err(FlightError::Tonic(status)) => {
                return Err(Error::Aborted(format!(
                    "DoPut stream of {} broke ({}); nothing was stored, send the attempt again",
                    what(),
                    status.message()
                )));
            }
            Err(e) => {
                return Err(Error::invalid(format!(
                    "DoPut stream of {} is malformed: {e}; nothing was stored",
                    what()
                )));
            }
        };
        match decoded.payload {
            DecodedPayload::Schema(s) => {
                if schema.is_some() {
                    return Err(Error::invalid(format!(
                        "DoPut stream of {} carries a second schema; send one schema per stream",
                        what()
                    )));
                }
                state.catalog().check_put(&dataset, key, &s)?;
                schema = Some(s);
            }
            DecodedPayload::RecordBatch(batch) => {
                let more = batch.num_rows() as u64;
                let total = crate::catalog::add_rows(rows, more, what)?;
                // Into the arena before it is kept; the decoded copy goes.
                let (kept, taken) = match reservation.as_mut() {
                    Some(r) => state.admit_reserved(&batch, r, &what).await?,
                    None => state.admit(&batch, None, &what).await?,
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
        let marker = last_metadata
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        check_commit_marker(&marker, rows, &what())?;
    }
    state.catalog().commit(
        &dataset,
        key,
        schema,
        AttemptData {
            batches,
            rows,
            bytes,
        },
    )?;
    info!(
        dataset = %dataset,
        partition = key.partition,
        attempt = key.attempt,
        rows,
        bytes,
        "committed attempt"
    );
    Ok(pb::PutAck {
        dataset,
        partition: key.partition,
        attempt: key.attempt,
        rows,
        bytes,
        location: state.location.clone(),
    })
}
