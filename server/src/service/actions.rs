//! `DoAction` and `ListActions`: seal, drop, describe, stats, place, evict.

use arrow_flight::{Action, ActionType};
use bytes::Bytes;
use flightdeck_protos::{self as pb, actions};
use prost::Message;

use crate::catalog::DatasetSummary;
use crate::convert;
use crate::error::{Error, Result};
use crate::state::State;

/// The actions this server offers, with one-line descriptions.
pub(super) fn list() -> Vec<ActionType> {
    [
        (
            actions::SEAL,
            "SealDataset -> DatasetInfo: make a dataset immutable and readable, choosing winning attempts",
        ),
        (
            actions::DROP,
            "DropDataset -> DatasetInfo: remove a dataset and free its memory",
        ),
        (
            actions::DESCRIBE,
            "DescribeDataset -> DatasetInfo: state, rows, bytes, partitions and schema",
        ),
        (
            actions::STATS,
            "(empty) -> ServerStats: memory per tier and limit, datasets, rows, bytes, spills",
        ),
        (
            actions::PLACE,
            "PlaceColumns -> DatasetInfo: copy numeric columns of a sealed dataset to GPUs",
        ),
        (
            actions::EVICT,
            "EvictColumns -> DatasetInfo: free a dataset's GPU copies",
        ),
    ]
    .into_iter()
    .map(|(t, d)| ActionType {
        r#type: t.to_string(),
        description: d.to_string(),
    })
    .collect()
}

/// The reply for a dataset: its summary and its device placements.
fn info(state: &State, summary: &DatasetSummary) -> Result<Bytes> {
    let mut info = convert::dataset_info(summary)?;
    info.placements = state
        .placements_of(&summary.name, summary.generation)
        .into_iter()
        .map(|(device, columns, bytes)| pb::DevicePlacement {
            device,
            columns,
            bytes,
        })
        .collect();
    Ok(info.encode_to_vec().into())
}

/// Runs one action and returns the encoded reply.
pub(super) async fn do_action(state: &State, action: &Action) -> Result<Bytes> {
    match action.r#type.as_str() {
        actions::SEAL => {
            let req = convert::seal_request(&action.body)?;
            let summary = state.seal(&req).await?;
            info(state, &summary)
        }
        actions::DROP => {
            let name = convert::drop_request(&action.body)?;
            let summary = state.drop_dataset(&name).await?;
            Ok(convert::dataset_info(&summary)?.encode_to_vec().into())
        }
        actions::DESCRIBE => {
            let name = convert::describe_request(&action.body)?;
            let summary = state.catalog().describe(&name)?;
            info(state, &summary)
        }
        actions::STATS => {
            let totals = state.catalog().totals();
            let tiers = state.tier_stats();
            Ok(pb::ServerStats {
                memory_used: tiers.budget_used,
                memory_limit: tiers.budget_limit,
                datasets: totals.datasets,
                rows: totals.rows,
                bytes: totals.bytes,
                sealed_datasets: totals.sealed,
                host_held_bytes: tiers.arena.held_bytes,
                host_live_bytes: tiers.arena.live_bytes,
                host_idle_bytes: tiers.arena.idle_bytes,
                host_pinned: tiers.arena.pinned,
                device_bytes: tiers.device_bytes,
                spilled_datasets: totals.spilled,
                spills: tiers.spills,
                restores: tiers.restores,
                spill_url: tiers.spill_url,
                persist: tiers.persist,
                cuda_devices: tiers.cuda_devices,
            }
            .encode_to_vec()
            .into())
        }
        actions::PLACE => {
            let req = convert::place_request(&action.body)?;
            let summary = state.place(&req).await?;
            info(state, &summary)
        }
        actions::EVICT => {
            let (name, devices) = convert::evict_request(&action.body)?;
            let summary = state.evict(&name, &devices)?;
            info(state, &summary)
        }
        other => Err(Error::Unimplemented(format!(
            "unknown action '{other}'; this server offers: {}",
            list()
                .iter()
                .map(|a| a.r#type.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}
