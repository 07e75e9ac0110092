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
        (
            actions::TRAIN,
            "TrainJob -> stream of TrainProgress: train a model on a sealed dataset",
        ),
        (
            actions::JOB,
            "JobQuery -> JobList: status of training jobs",
        ),
        (
            actions::MEMBER_PREPARE,
            "PrepareMember -> MemberPrepared: seal this member's part of a cluster dataset (between members)",
        ),
        (
            actions::MEMBER_COMMIT,
            "CommitLayout -> DatasetInfo: adopt a cluster dataset's layout (between members)",
        ),
        (
            actions::DERIVE,
            "DeriveDataset -> DatasetInfo: keep a SQL query's result over the cache as a new sealed dataset",
        ),
        (
            actions::MEMBER_SELECT,
            "SelectRows -> SelectedRows: rows a read-plan filter selects in each of this member's partitions (between members)",
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
    info.replacements = state
        .catalog()
        .staged(Some(&summary.name))
        .iter()
        .map(convert::staged_write)
        .collect();
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
            let sealed = state.seal(&req).await?;
            state.metrics.sealed();
            Ok(sealed.encode_to_vec().into())
        }
        actions::DROP => {
            let req = convert::drop_request(&action.body)?;
            let summary = state.drop_dataset(&req).await?;
            Ok(convert::dataset_info(&summary)?.encode_to_vec().into())
        }
        actions::MEMBER_PREPARE => {
            let req = convert::prepare_request(&action.body)?;
            Ok(state.prepare_member(&req).await?.encode_to_vec().into())
        }
        actions::MEMBER_COMMIT => {
            let (name, layout, index, replace_write) = convert::commit_request(&action.body)?;
            let summary = state
                .commit_layout(&name, layout, index, &replace_write)
                .await?;
            info(state, &summary)
        }
        actions::MEMBER_SELECT => {
            let (name, layout, plan) = convert::select_request(&action.body, &state.config)?;
            Ok(super::get::member_select(state, &name, layout, &plan)
                .await?
                .encode_to_vec()
                .into())
        }
        actions::DESCRIBE => {
            let name = convert::describe_request(&action.body)?;
            let summary = state.catalog().describe(&name)?;
            info(state, &summary)
        }
        actions::STATS => {
            let totals = state.catalog().totals();
            let tiers = state.tier_stats();
            let t = &state.traffic;
            let load =
                |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
            let (queries_running, [queries_done, queries_failed, queries_given_up]) =
                state.metrics.query_counts();
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
                location: state.location.clone(),
                rows_served: load(&t.rows_served),
                bytes_served: load(&t.bytes_served),
                rows_served_to_peers: load(&t.rows_to_peers),
                bytes_served_to_peers: load(&t.bytes_to_peers),
                rows_fetched_from_peers: load(&t.rows_from_peers),
                bytes_fetched_from_peers: load(&t.bytes_from_peers),
                packed_bytes: totals.packed_bytes,
                memory_used_peak: tiers.budget_peak,
                resident_peak_bytes: resident_peak(),
                staged: state
                    .catalog()
                    .staged(None)
                    .iter()
                    .map(convert::staged_write)
                    .collect(),
                queries_running,
                queries_done,
                queries_failed,
                queries_given_up,
                tls_certificate_expires: state
                    .credentials
                    .certificate_expiry()
                    .map_or(0, |e| e.at.as_secs()),
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
        actions::JOB => {
            let id = convert::job_query(&action.body)?;
            let jobs = state
                .jobs(id)?
                .into_iter()
                .map(|s| pb::JobStatus {
                    job: s.id,
                    dataset: s.dataset,
                    state: s.state.to_string(),
                    step: s.last.step,
                    total_steps: s.last.total_steps,
                    loss: s.last.loss,
                    accuracy: s.last.accuracy,
                    error: s.error.unwrap_or_default(),
                    checkpoint: s.last.checkpoint.unwrap_or_default(),
                })
                .collect();
            Ok(pb::JobList { jobs }.encode_to_vec().into())
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

/// Action `train`: starts the job and streams its progress; the stream ends
/// with the final report, or with the job's error.
pub(super) async fn train(
    state: &std::sync::Arc<State>,
    action: &Action,
) -> Result<super::Stream<arrow_flight::Result>> {
    use futures::StreamExt;
    let spec = convert::train_job(&action.body, &state.config)?;
    let (id, rx) = state.train(spec).await?;
    let stream = tokio_stream::wrappers::UnboundedReceiverStream::new(rx).map(move |item| {
        item.map(|p| arrow_flight::Result {
            body: convert::train_progress(id, &p).encode_to_vec().into(),
        })
        .map_err(tonic::Status::from)
    });
    Ok(stream.boxed())
}

/// The most resident memory the process has had since start (Linux's
/// `VmHWM`); 0 where the system does not say.
fn resident_peak() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib * 1024)
        })
        .unwrap_or(0)
}
