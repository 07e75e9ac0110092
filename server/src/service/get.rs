//! Reading: `GetFlightInfo` plans one endpoint per rank, `DoGet` streams a
//! rank's shard, `GetSchema` and `ListFlights` describe datasets.

use arrow::ipc::writer::IpcWriteOptions;
use arrow_flight::{
    FlightData, FlightDescriptor, FlightEndpoint, FlightInfo, SchemaAsIpc, SchemaResult, Ticket,
};
use flightdeck_protos as pb;
use futures::StreamExt;
use prost::Message;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use super::Stream;
use super::ipc::{IpcMessage, Messages};
use crate::catalog::{DatasetState, DatasetSummary};
use crate::convert::{self, ShardTicket};
use crate::error::{Error, Result};
use crate::order::ReadPlan;
use crate::read::{Shard, project};
use crate::state::State;

/// Batches gathered ahead of the socket per stream.
const READ_AHEAD: usize = 2;

/// The endpoints of a plan over the sealed dataset `s` (resident or
/// spilled), one per rank in rank order.
fn plan_info(
    plan: &ReadPlan,
    s: &DatasetSummary,
    descriptor: FlightDescriptor,
) -> Result<FlightInfo> {
    let generation = s.generation;
    let (_, schema) = project(&s.schema, &plan.columns, &plan.dataset)?;
    let shares = plan.shares(s.rows)?;
    let (rows, batches) = plan.stream_size(shares.per_rank());
    let mut info = FlightInfo::new()
        .try_with_schema(&schema)
        .map_err(|e| Error::Internal(format!("cannot encode schema: {e}")))?
        .with_descriptor(descriptor)
        .with_total_records(i64::try_from(rows * shares.world_size()).unwrap_or(i64::MAX))
        .with_ordered(true);
    for rank in 0..plan.world_size {
        let ticket = convert::encode_ticket(&ShardTicket {
            plan: plan.clone(),
            rank,
            generation,
        });
        let meta = pb::ShardInfo {
            rank,
            rows,
            batches,
        };
        info = info.with_endpoint(
            FlightEndpoint::new()
                .with_ticket(Ticket::new(ticket))
                .with_app_metadata(meta.encode_to_vec()),
        );
    }
    Ok(info)
}

/// `GetFlightInfo`: validate the plan against the sealed dataset and hand out
/// one ticket per rank.
pub(super) fn flight_info(state: &State, descriptor: FlightDescriptor) -> Result<FlightInfo> {
    let plan = convert::read_plan(&descriptor, &state.config)?;
    let summary = sealed_summary(state, &plan.dataset)?;
    plan_info(&plan, &summary, descriptor)
}

/// The summary of a dataset that must be sealed.
fn sealed_summary(state: &State, name: &str) -> Result<DatasetSummary> {
    let summary = state.catalog().describe(name)?;
    if summary.state != DatasetState::Sealed {
        return Err(Error::DatasetNotSealed {
            dataset: name.to_string(),
        });
    }
    Ok(summary)
}

/// `GetSchema`: the (projected) schema of a dataset, open or sealed.
pub(super) fn schema(state: &State, descriptor: &FlightDescriptor) -> Result<SchemaResult> {
    let plan = convert::read_plan(descriptor, &state.config)?;
    let schema = state.catalog().schema(&plan.dataset)?;
    let (_, projected) = project(&schema, &plan.columns, &plan.dataset)?;
    SchemaAsIpc::new(&projected, &IpcWriteOptions::default())
        .try_into()
        .map_err(|e| Error::Internal(format!("cannot encode schema: {e}")))
}

/// `ListFlights`: every dataset with its path descriptor; sealed ones carry
/// one endpoint reading everything unshuffled.
pub(super) fn list_flights(state: &State) -> Result<Vec<FlightInfo>> {
    let summaries = state.catalog().list();
    let mut infos = Vec::with_capacity(summaries.len());
    for s in summaries {
        let descriptor = FlightDescriptor::new_path(vec![s.name.clone()]);
        let info = match s.state {
            DatasetState::Sealed => {
                let plan = convert::read_plan(&descriptor, &state.config)?;
                plan_info(&plan, &s, descriptor)?
            }
            DatasetState::Open => FlightInfo::new()
                .try_with_schema(&s.schema)
                .map_err(|e| Error::Internal(format!("cannot encode schema: {e}")))?
                .with_descriptor(descriptor)
                .with_total_records(i64::try_from(s.rows).unwrap_or(i64::MAX)),
        };
        infos.push(info.with_total_bytes(i64::try_from(s.bytes).unwrap_or(i64::MAX)));
    }
    Ok(infos)
}

/// The messages of a rank's shard: the schema, then each batch's IPC
/// messages as it is gathered. Rows are gathered and encoded on a blocking
/// thread into a small bounded channel, so a slow reader holds back the
/// gather; dropping the receiver (the client hung up) stops it.
pub(super) async fn shard_messages(
    state: &State,
    ticket: &Ticket,
) -> Result<mpsc::Receiver<Result<Vec<IpcMessage>>>> {
    let t = convert::decode_ticket(&ticket.ticket, &state.config)?;
    let (generation, data) = state.resident(&t.plan.dataset).await?;
    if generation != t.generation {
        return Err(Error::FailedPrecondition(format!(
            "dataset '{}' was dropped and written again after this ticket was issued; call \
             GetFlightInfo again for fresh tickets",
            t.plan.dataset
        )));
    }
    let shard = Shard::new(data, &t.plan, t.rank)?;
    let mut messages = Messages::new(&shard.schema())?;
    let (tx, rx) = mpsc::channel(READ_AHEAD);
    tx.try_send(Ok(vec![messages.schema()])).map_err(|_| {
        Error::Internal("the shard channel is full before the first message".into())
    })?;
    tokio::task::spawn_blocking(move || {
        for batch in shard.batches() {
            let encoded = batch.and_then(|b| messages.batch(&b));
            let failed = encoded.is_err();
            // The receiver is gone when the client hung up: stop gathering.
            if tx.blocking_send(encoded).is_err() || failed {
                break;
            }
        }
    });
    Ok(rx)
}

/// `DoGet` through the generated service (the network edge answers it in
/// `edge.rs` instead): the same messages as `FlightData`.
pub(super) async fn do_get(state: &State, ticket: &Ticket) -> Result<Stream<FlightData>> {
    let rx = shard_messages(state, ticket).await?;
    let stream = ReceiverStream::new(rx).flat_map(|item| {
        let items: Vec<std::result::Result<FlightData, Status>> = match item {
            Ok(messages) => messages.iter().map(|m| Ok(m.to_flight_data())).collect(),
            Err(e) => vec![Err(Status::from(e))],
        };
        futures::stream::iter(items)
    });
    Ok(stream.boxed())
}
