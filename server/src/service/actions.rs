//! `DoAction` and `ListActions`: seal, drop, describe, stats.

use arrow_flight::{Action, ActionType};
use bytes::Bytes;
use flightdeck_protos::{self as pb, actions};
use prost::Message;
use tracing::info;

use super::State;
use crate::convert;
use crate::error::{Error, Result};

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
            "(empty) -> ServerStats: memory used and limit, datasets, rows, bytes",
        ),
    ]
    .into_iter()
    .map(|(t, d)| ActionType {
        r#type: t.to_string(),
        description: d.to_string(),
    })
    .collect()
}

/// Runs one action and returns the encoded reply.
pub(super) fn do_action(state: &State, action: &Action) -> Result<Bytes> {
    match action.r#type.as_str() {
        actions::SEAL => {
            let req = convert::seal_request(&action.body)?;
            let (summary, freed) = state.catalog().seal(&req)?;
            state.budget.release(freed);
            info!(
                dataset = %summary.name,
                partitions = summary.partitions.len(),
                rows = summary.rows,
                bytes = summary.bytes,
                freed,
                "sealed dataset"
            );
            Ok(convert::dataset_info(&summary)?.encode_to_vec().into())
        }
        actions::DROP => {
            let name = convert::drop_request(&action.body)?;
            let (summary, freed) = state.catalog().drop_dataset(&name)?;
            state.budget.release(freed);
            info!(dataset = %name, rows = summary.rows, freed, "dropped dataset");
            Ok(convert::dataset_info(&summary)?.encode_to_vec().into())
        }
        actions::DESCRIBE => {
            let name = convert::describe_request(&action.body)?;
            let summary = state.catalog().describe(&name)?;
            Ok(convert::dataset_info(&summary)?.encode_to_vec().into())
        }
        actions::STATS => {
            let totals = state.catalog().totals();
            Ok(pb::ServerStats {
                memory_used: state.budget.used(),
                memory_limit: state.budget.limit(),
                datasets: totals.datasets,
                rows: totals.rows,
                bytes: totals.bytes,
                sealed_datasets: totals.sealed,
            }
            .encode_to_vec()
            .into())
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
