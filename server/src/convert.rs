//! Wire (prost) ↔ domain conversions: the one place where a malformed
//! message fails, with one error.
//!
//! Requests are decoded and validated here into plain domain types
//! (`AttemptKey`, `order::ReadPlan`, `SealRequest`); replies are encoded from
//! domain summaries. Nothing here touches the catalog or the network.

use arrow::datatypes::Schema;
use arrow::ipc::writer::IpcWriteOptions;
use arrow_flight::flight_descriptor::DescriptorType;
use arrow_flight::{FlightDescriptor, IpcMessage, SchemaAsIpc};
use bytes::Bytes;
use flightdeck_protos as pb;
use prost::Message;

use crate::catalog::{
    AttemptKey, ClusterState, DatasetState, DatasetSummary, PartitionSummary, SealRequest,
};
use crate::cluster::{Layout, Member};
use crate::config::{MAX_BATCH_ROWS, MAX_WORLD_SIZE, ServerConfig};
use crate::error::{Error, Result};
use crate::order::{Locality, ReadPlan, Shuffle, Split};

/// Longest accepted member location, in bytes.
pub const MAX_LOCATION: usize = 1024;

/// Longest accepted dataset name, in bytes.
pub const MAX_DATASET_NAME: usize = 256;
/// Longest filter and select list of a read plan, in bytes of SQL together.
pub const MAX_SQL_BYTES: usize = 64 << 10;
/// Most expressions in a read plan's select list.
pub const MAX_SELECT: usize = 1024;

/// Checks a dataset name: non-empty, at most [`MAX_DATASET_NAME`] bytes, no
/// control characters.
pub fn dataset_name(name: &str) -> Result<String> {
    if name.is_empty() {
        return Err(Error::invalid("dataset name is empty; name the dataset"));
    }
    if name.len() > MAX_DATASET_NAME {
        return Err(Error::invalid(format!(
            "dataset name is {} bytes long; the limit is {MAX_DATASET_NAME}",
            name.len()
        )));
    }
    if name.chars().any(char::is_control) {
        return Err(Error::invalid(format!(
            "dataset name {name:?} contains control characters"
        )));
    }
    Ok(name.to_string())
}

/// The positions `(first, second)` of the first item that `items` holds
/// twice, for errors that name both.
pub fn first_repeat<T: PartialEq>(items: &[T]) -> Option<(usize, usize)> {
    items.iter().enumerate().find_map(|(i, x)| {
        items[..i]
            .iter()
            .position(|y| y == x)
            .map(|first| (first, i))
    })
}

/// Decodes `what`, which must be a `flightdeck.v1.<message>`.
fn decode<M: Message + Default>(bytes: &[u8], what: &str, message: &str) -> Result<M> {
    M::decode(bytes).map_err(|e| {
        Error::invalid(format!(
            "{what} is not a valid flightdeck.v1.{message} ({e}); encode it from \
             protos/flightdeck.proto"
        ))
    })
}

/// What a `DoPut` stream writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutTarget {
    /// The dataset.
    pub dataset: String,
    /// Partition and attempt.
    pub key: AttemptKey,
    /// Commit only on a matching `PutCommit` in the last message.
    pub explicit_commit: bool,
    /// Bytes the writer says it will send; 0 = unknown.
    pub expected_bytes: u64,
    /// The write this attempt belongs to ("" = none).
    pub write_id: String,
    /// The write replaces the dataset: the attempt is staged beside it.
    pub replace: bool,
}

impl PutTarget {
    /// The catalog entry the attempt goes to: the dataset, or what its
    /// replacing write stages.
    pub fn entry(&self) -> String {
        if self.replace {
            crate::catalog::staged_key(&self.dataset, &self.write_id)
        } else {
            self.dataset.clone()
        }
    }
}

/// A write id that a replacing write (or its seal or drop) must name.
fn replacing_write(dataset: &str, write_id: &str, what: &str) -> Result<()> {
    if write_id.is_empty() {
        return Err(Error::invalid(format!(
            "{what} of dataset '{dataset}' replaces it but names no write; send the id its \
             writers share (PutPartition.write_id)"
        )));
    }
    if write_id.len() > MAX_DATASET_NAME || write_id.chars().any(char::is_control) {
        return Err(Error::invalid(format!(
            "{what} of dataset '{dataset}' names a write id longer than {MAX_DATASET_NAME} bytes \
             or holding control characters"
        )));
    }
    Ok(())
}

/// The target of a `DoPut` descriptor: a `PutPartition` command, or the path
/// `[dataset, "<partition>"]` (attempt 0).
pub fn put_target(descriptor: &FlightDescriptor) -> Result<PutTarget> {
    match descriptor.r#type() {
        DescriptorType::Cmd => {
            let cmd: pb::PutPartition =
                decode(&descriptor.cmd, "DoPut descriptor command", "PutPartition")?;
            let dataset = dataset_name(&cmd.dataset)?;
            if cmd.replace {
                replacing_write(&dataset, &cmd.write_id, "a DoPut")?;
            }
            Ok(PutTarget {
                dataset,
                key: AttemptKey {
                    partition: cmd.partition,
                    attempt: cmd.attempt,
                },
                explicit_commit: cmd.explicit_commit,
                expected_bytes: cmd.expected_bytes,
                write_id: cmd.write_id,
                replace: cmd.replace,
            })
        }
        DescriptorType::Path => match descriptor.path.as_slice() {
            [dataset, partition] => {
                let partition = partition.parse::<u32>().map_err(|_| {
                    Error::invalid(format!(
                        "DoPut path [{dataset:?}, {partition:?}]: the second element must be a \
                         partition number"
                    ))
                })?;
                Ok(PutTarget {
                    dataset: dataset_name(dataset)?,
                    key: AttemptKey {
                        partition,
                        attempt: 0,
                    },
                    explicit_commit: false,
                    expected_bytes: 0,
                    write_id: String::new(),
                    replace: false,
                })
            }
            other => Err(Error::invalid(format!(
                "DoPut path descriptor must be [dataset, partition], got {other:?}"
            ))),
        },
        DescriptorType::Unknown => Err(Error::invalid(
            "DoPut descriptor has an unknown type; send a PutPartition command or a path",
        )),
    }
}

/// The read plan of a `GetFlightInfo` / `GetSchema` descriptor: a `ReadPlan`
/// command, or the path `[dataset]` (one rank, unshuffled, everything).
pub fn read_plan(descriptor: &FlightDescriptor, config: &ServerConfig) -> Result<ReadPlan> {
    plan_request(descriptor, config).map(|(plan, _)| plan)
}

/// [`read_plan`] and the plan's `sealed_as`: the generation (on a cluster,
/// the layout id) the reader expects the dataset at; 0 = any.
pub fn plan_request(
    descriptor: &FlightDescriptor,
    config: &ServerConfig,
) -> Result<(ReadPlan, u64)> {
    match descriptor.r#type() {
        DescriptorType::Cmd => {
            let plan: pb::ReadPlan = decode(&descriptor.cmd, "descriptor command", "ReadPlan")?;
            Ok((read_plan_from_proto(&plan, config)?, plan.sealed_as))
        }
        DescriptorType::Path => match descriptor.path.as_slice() {
            [dataset] => read_plan_from_proto(
                &pb::ReadPlan {
                    dataset: dataset.clone(),
                    world_size: 1,
                    ..Default::default()
                },
                config,
            )
            .map(|plan| (plan, 0)),
            other => Err(Error::invalid(format!(
                "path descriptor must be [dataset], got {other:?}"
            ))),
        },
        DescriptorType::Unknown => Err(Error::invalid(
            "descriptor has an unknown type; send a ReadPlan command or a path [dataset]",
        )),
    }
}

/// Validates a wire plan, filling the server's defaults for zero fields.
pub fn read_plan_from_proto(p: &pb::ReadPlan, config: &ServerConfig) -> Result<ReadPlan> {
    let dataset = dataset_name(&p.dataset)?;
    if p.world_size == 0 || p.world_size > MAX_WORLD_SIZE {
        return Err(Error::invalid(format!(
            "world_size {} for dataset '{dataset}' is out of range; it must be between 1 and \
             {MAX_WORLD_SIZE}",
            p.world_size
        )));
    }
    if p.batch_rows > MAX_BATCH_ROWS {
        return Err(Error::invalid(format!(
            "batch_rows {} is larger than the limit {MAX_BATCH_ROWS}",
            p.batch_rows
        )));
    }
    let block_rows = if p.block_rows == 0 {
        config.default_block_rows
    } else {
        p.block_rows
    };
    let shuffle = shuffle_of(p.shuffle, block_rows)?;
    let split = match (p.split_count, p.split_index) {
        (0 | 1, 0) => Split::WHOLE,
        (count, index) if count > 1 && index < count => Split { count, index },
        (count, index) => {
            return Err(Error::invalid(format!(
                "split_index {index} must be below split_count {count}"
            )));
        }
    };
    let mut seen = std::collections::HashSet::new();
    if let Some(dup) = p.columns.iter().find(|c| !seen.insert(c.as_str())) {
        return Err(Error::invalid(format!(
            "column '{dup}' is requested more than once"
        )));
    }
    let locality = match pb::Locality::try_from(p.locality) {
        Ok(pb::Locality::Global) => Locality::Global,
        Ok(pb::Locality::Node) => Locality::Node,
        Err(_) => {
            return Err(Error::invalid(format!(
                "unknown locality {}; use LOCALITY_GLOBAL or LOCALITY_NODE",
                p.locality
            )));
        }
    };
    if p.nodes.len() > MAX_WORLD_SIZE as usize || p.nodes.iter().any(|n| n.len() > MAX_LOCATION) {
        return Err(Error::invalid(format!(
            "the plan's node list is too long: at most {MAX_WORLD_SIZE} locations of at most \
             {MAX_LOCATION} bytes"
        )));
    }
    if p.max_rows > 0 && locality == Locality::Node {
        return Err(Error::invalid(format!(
            "the plan for dataset '{dataset}' sets max_rows with LOCALITY_NODE; a NODE epoch is \
             read whole: drop max_rows, or read with LOCALITY_GLOBAL"
        )));
    }
    if !p.select.is_empty() && !p.columns.is_empty() {
        return Err(Error::invalid(format!(
            "the plan for dataset '{dataset}' names both columns and a select list; put the \
             columns in the select list instead"
        )));
    }
    let sql_bytes = p.filter.len() + p.select.iter().map(String::len).sum::<usize>();
    if sql_bytes > MAX_SQL_BYTES || p.select.len() > MAX_SELECT {
        return Err(Error::invalid(format!(
            "the plan's filter and select list are too long: at most {MAX_SQL_BYTES} bytes of \
             SQL and {MAX_SELECT} expressions"
        )));
    }
    Ok(ReadPlan {
        dataset,
        world_size: p.world_size,
        epoch: p.epoch,
        seed: p.seed,
        shuffle,
        batch_rows: if p.batch_rows == 0 {
            config.default_batch_rows
        } else {
            p.batch_rows
        },
        drop_last: p.drop_last,
        columns: p.columns.clone(),
        start_sample: p.start_sample,
        split,
        locality,
        ranks_per_node: p.ranks_per_node,
        nodes: p.nodes.clone(),
        resume_world_size: p.resume_world_size,
        filter: p.filter.trim().to_string(),
        select: p.select.clone(),
        max_rows: p.max_rows,
    })
}

/// The wire form of a validated plan, every default made explicit, so a
/// ticket means the same on any server whatever its defaults.
pub fn read_plan_to_proto(plan: &ReadPlan) -> pb::ReadPlan {
    let (shuffle, block_rows) = match plan.shuffle {
        Shuffle::None => (pb::Shuffle::None, 0),
        Shuffle::Global => (pb::Shuffle::Global, 0),
        Shuffle::Block { block_rows } => (
            pb::Shuffle::Block,
            u32::try_from(block_rows).unwrap_or(u32::MAX),
        ),
    };
    pb::ReadPlan {
        dataset: plan.dataset.clone(),
        world_size: plan.world_size,
        epoch: plan.epoch,
        seed: plan.seed,
        shuffle: shuffle.into(),
        batch_rows: plan.batch_rows,
        drop_last: plan.drop_last,
        columns: plan.columns.clone(),
        start_sample: plan.start_sample,
        block_rows,
        split_count: plan.split.count,
        split_index: plan.split.index,
        locality: match plan.locality {
            Locality::Global => pb::Locality::Global,
            Locality::Node => pb::Locality::Node,
        }
        .into(),
        ranks_per_node: plan.ranks_per_node,
        nodes: plan.nodes.clone(),
        resume_world_size: plan.resume_world_size,
        filter: plan.filter.clone(),
        select: plan.select.clone(),
        // Tickets pin the generation (or layout) themselves.
        sealed_as: 0,
        max_rows: plan.max_rows,
    }
}

/// A `DoGet` ticket: the plan, the rank and the dataset generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardTicket {
    /// The validated plan.
    pub plan: ReadPlan,
    /// The rank whose shard to stream.
    pub rank: u32,
    /// Generation of the dataset the plan was made for.
    pub generation: u64,
    /// Id of the cluster layout the plan was made for; 0 = none.
    pub layout: u64,
    /// A request between members: only member `peer`'s rows.
    pub peer: Option<u32>,
    /// Cluster plans with a filter: the rows selected in each partition of
    /// the layout (members in order, each one's partitions in order).
    pub selected: Vec<u64>,
}

/// Encodes a ticket.
pub fn encode_ticket(t: &ShardTicket) -> Bytes {
    pb::ShardTicket {
        plan: Some(read_plan_to_proto(&t.plan)),
        rank: t.rank,
        generation: t.generation,
        layout: t.layout,
        peer: t.peer,
        selected_rows: t.selected.clone(),
    }
    .encode_to_vec()
    .into()
}

/// Decodes and validates a ticket.
pub fn decode_ticket(bytes: &[u8], config: &ServerConfig) -> Result<ShardTicket> {
    let t: pb::ShardTicket = decode(bytes, "ticket", "ShardTicket").map_err(|_| {
        Error::invalid("ticket is not one this server issued; get tickets from GetFlightInfo")
    })?;
    let plan = t.plan.ok_or_else(|| {
        Error::invalid("ticket carries no read plan; get tickets from GetFlightInfo")
    })?;
    let plan = read_plan_from_proto(&plan, config)?;
    if t.rank >= plan.world_size {
        return Err(Error::invalid(format!(
            "ticket rank {} is not below its world_size {}; get tickets from GetFlightInfo",
            t.rank, plan.world_size
        )));
    }
    Ok(ShardTicket {
        plan,
        rank: t.rank,
        generation: t.generation,
        layout: t.layout,
        peer: t.peer,
        selected: t.selected_rows,
    })
}

/// The writer's commit marker in the `app_metadata` of a stream's last message.
pub fn put_commit(app_metadata: &[u8]) -> Result<pb::PutCommit> {
    decode(
        app_metadata,
        "app_metadata of the last DoPut message",
        "PutCommit",
    )
}

/// A seal request from its wire form.
pub fn seal_request(body: &[u8]) -> Result<SealRequest> {
    let s: pb::SealDataset = decode(body, "body of action 'seal'", "SealDataset")?;
    let dataset = dataset_name(&s.dataset)?;
    if !s.members.is_empty() && !s.attempts.is_empty() {
        return Err(Error::invalid(format!(
            "seal of dataset '{dataset}' names both attempts and members; name each member's \
             winning attempts in its entry of 'members'"
        )));
    }
    let members = s
        .members
        .iter()
        .map(|m| {
            if m.location.is_empty() || m.location.len() > MAX_LOCATION {
                return Err(Error::invalid(format!(
                    "seal of dataset '{dataset}' names a member without a location (or one \
                     longer than {MAX_LOCATION} bytes); use each writer's PutAck.location"
                )));
            }
            Ok((m.location.clone(), attempt_keys(&m.partitions)))
        })
        .collect::<Result<Vec<_>>>()?;
    if !s.replace_write.is_empty() {
        replacing_write(&dataset, &s.replace_write, "a seal")?;
    }
    Ok(SealRequest {
        dataset,
        partitions: s.partitions,
        winners: attempt_keys(&s.attempts),
        members,
        replace_write: s.replace_write,
    })
}

fn attempt_keys(attempts: &[pb::PartitionAttempt]) -> Vec<AttemptKey> {
    attempts
        .iter()
        .map(|a| AttemptKey {
            partition: a.partition,
            attempt: a.attempt,
        })
        .collect()
}

fn partition_infos(parts: &[PartitionSummary]) -> Vec<pb::PartitionInfo> {
    parts
        .iter()
        .map(|p| pb::PartitionInfo {
            partition: p.key.partition,
            attempt: p.key.attempt,
            rows: p.rows,
            bytes: p.bytes,
            committed_attempts: p.committed_attempts,
        })
        .collect()
}

fn partition_summaries(parts: &[pb::PartitionInfo]) -> Vec<PartitionSummary> {
    parts
        .iter()
        .map(|p| PartitionSummary {
            key: AttemptKey {
                partition: p.partition,
                attempt: p.attempt,
            },
            rows: p.rows,
            bytes: p.bytes,
            committed_attempts: p.committed_attempts,
        })
        .collect()
}

/// What action `member_prepare` asks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrepareRequest {
    /// The dataset.
    pub dataset: String,
    /// This member's winners.
    pub winners: Vec<AttemptKey>,
    /// Only check that this member could seal them.
    pub check_only: bool,
    /// Prepare what this write staged to replace the dataset ("" = the
    /// dataset itself).
    pub replace_write: String,
}

/// The body of `member_prepare`.
pub fn prepare_request(body: &[u8]) -> Result<PrepareRequest> {
    let p: pb::PrepareMember = decode(body, "body of action 'member_prepare'", "PrepareMember")?;
    let dataset = dataset_name(&p.dataset)?;
    if !p.replace_write.is_empty() {
        replacing_write(&dataset, &p.replace_write, "a member_prepare")?;
    }
    Ok(PrepareRequest {
        dataset,
        winners: attempt_keys(&p.partitions),
        check_only: p.check_only,
        replace_write: p.replace_write,
    })
}

/// The body of `member_prepare` for `winners` of `dataset` (as staged by
/// `replace_write`, unless "").
pub fn prepare_body(
    dataset: &str,
    winners: &[AttemptKey],
    check_only: bool,
    replace_write: &str,
) -> pb::PrepareMember {
    pb::PrepareMember {
        check_only,
        replace_write: replace_write.to_string(),
        dataset: dataset.to_string(),
        partitions: winners
            .iter()
            .map(|k| pb::PartitionAttempt {
                partition: k.partition,
                attempt: k.attempt,
            })
            .collect(),
    }
}

/// The reply of `member_prepare`: this member's part, and per column
/// whether it is gathered as bytes here and the values a row of such a
/// list (see [`crate::read::Gather::byte_columns`]).
pub fn member_prepared(
    s: &DatasetSummary,
    (fixed, list_widths): (Vec<bool>, Vec<u32>),
) -> Result<pb::MemberPrepared> {
    Ok(pb::MemberPrepared {
        generation: s.generation,
        schema: schema_to_ipc(&s.schema)?,
        partitions: partition_infos(&s.partitions),
        fixed_columns: fixed,
        replaces: Vec::new(),
        writes: Vec::new(),
        list_widths,
    })
}

/// A member as a prepare reply describes it.
pub fn member_from_prepared(location: &str, p: &pb::MemberPrepared) -> Member {
    Member {
        location: location.to_string(),
        generation: p.generation,
        partitions: partition_summaries(&p.partitions),
    }
}

/// The schema of an IPC schema message.
pub fn schema_from_ipc(bytes: &[u8], what: &str) -> Result<Schema> {
    Schema::try_from(IpcMessage(Bytes::copy_from_slice(bytes)))
        .map_err(|e| Error::invalid(format!("{what} carries no valid Arrow schema: {e}")))
}

/// The wire form of a layout, with the dataset's schema.
pub fn layout_to_proto(layout: &Layout, schema: &Schema) -> Result<pb::ClusterLayout> {
    Ok(pb::ClusterLayout {
        id: layout.id,
        members: layout
            .members
            .iter()
            .map(|m| pb::ClusterMember {
                location: m.location.clone(),
                generation: m.generation,
                partitions: partition_infos(&m.partitions),
                rows: m.rows(),
            })
            .collect(),
        schema: schema_to_ipc(schema)?,
        fixed_columns: layout.fixed.clone(),
    })
}

/// A layout from its wire form; its id must match its content.
pub fn layout_from_proto(l: &pb::ClusterLayout) -> Result<Layout> {
    let members = l
        .members
        .iter()
        .map(|m| Member {
            location: m.location.clone(),
            generation: m.generation,
            partitions: partition_summaries(&m.partitions),
        })
        .collect();
    let layout = Layout::new(members, l.fixed_columns.clone())?;
    if layout.id != l.id {
        return Err(Error::invalid(format!(
            "cluster layout {:016x} does not match its content ({:016x}); seal the cluster again",
            l.id, layout.id
        )));
    }
    Ok(layout)
}

/// The body of `member_commit`: dataset, layout, this member's index, and
/// the write whose staged replacement adopts it ("" = the dataset itself).
pub fn commit_request(body: &[u8]) -> Result<(String, Layout, usize, String)> {
    let c: pb::CommitLayout = decode(body, "body of action 'member_commit'", "CommitLayout")?;
    let layout = c
        .layout
        .as_ref()
        .ok_or_else(|| Error::invalid("member_commit carries no layout"))?;
    let dataset = dataset_name(&c.dataset)?;
    if !c.replace_write.is_empty() {
        replacing_write(&dataset, &c.replace_write, "a member_commit")?;
    }
    Ok((
        dataset,
        layout_from_proto(layout)?,
        c.member as usize,
        c.replace_write,
    ))
}

/// The dataset named by a `drop` body, and whether only this member's part
/// is to go.
pub fn drop_request(body: &[u8]) -> Result<DropRequest> {
    let d: pb::DropDataset = decode(body, "body of action 'drop'", "DropDataset")?;
    let dataset = dataset_name(&d.dataset)?;
    if d.staged {
        replacing_write(&dataset, &d.abort_write, "a drop of what a write staged")?;
    }
    if !d.keep_write.is_empty() {
        replacing_write(
            &dataset,
            &d.keep_write,
            "a drop that keeps a write's dataset",
        )?;
    }
    Ok(DropRequest {
        dataset,
        member_only: d.member_only,
        abort_write: d.abort_write,
        staged: d.staged,
        keep_write: d.keep_write,
    })
}

/// What action `drop` asks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DropRequest {
    /// The dataset.
    pub dataset: String,
    /// Only this member's part of a cluster dataset.
    pub member_only: bool,
    /// A failed write whose attempts are refused from now on ("" = none).
    pub abort_write: String,
    /// Drop only what `abort_write` staged to replace the dataset.
    pub staged: bool,
    /// Leave the dataset alone where this write swapped it in ("" = drop
    /// whatever it is).
    pub keep_write: String,
}

/// The dataset named by a `describe` body.
pub fn describe_request(body: &[u8]) -> Result<String> {
    let d: pb::DescribeDataset = decode(body, "body of action 'describe'", "DescribeDataset")?;
    dataset_name(&d.dataset)
}

/// A `derive` request: its target named validly and its SQL non-empty.
pub fn derive_request(body: &[u8]) -> Result<pb::DeriveDataset> {
    let d: pb::DeriveDataset = decode(body, "body of action 'derive'", "DeriveDataset")?;
    dataset_name(&d.target)?;
    if !d.source.is_empty() {
        dataset_name(&d.source)?;
    }
    if d.sql.trim().is_empty() || d.sql.len() > MAX_SQL_BYTES {
        return Err(Error::invalid(format!(
            "action 'derive' needs a SQL query of at most {MAX_SQL_BYTES} bytes"
        )));
    }
    Ok(d)
}

/// A `member_select` request: dataset, layout id and filter.
pub fn select_request(body: &[u8], config: &ServerConfig) -> Result<(String, u64, ReadPlan)> {
    let r: pb::SelectRows = decode(body, "body of action 'member_select'", "SelectRows")?;
    let plan = read_plan_from_proto(
        &pb::ReadPlan {
            dataset: r.dataset,
            world_size: 1,
            filter: r.filter,
            ..Default::default()
        },
        config,
    )?;
    Ok((plan.dataset.clone(), r.layout, plan))
}

/// A schema as an encapsulated IPC schema message (as in `FlightInfo.schema`).
pub fn schema_to_ipc(schema: &Schema) -> Result<Bytes> {
    let options = IpcWriteOptions::default();
    let IpcMessage(bytes) = SchemaAsIpc::new(schema, &options)
        .try_into()
        .map_err(|e| Error::Internal(format!("cannot encode schema: {e}")))?;
    Ok(bytes)
}

/// The wire form of a dataset summary; a cluster member describes the whole
/// dataset (rows and partitions of every member) with its layout.
pub fn dataset_info(s: &DatasetSummary) -> Result<pb::DatasetInfo> {
    let mut info = local_dataset_info(s)?;
    if let Some(ClusterState::Member { layout, .. }) = &s.cluster {
        let mut all: Vec<PartitionSummary> = layout
            .members
            .iter()
            .flat_map(|m| m.partitions.iter().cloned())
            .collect();
        all.sort_by_key(|p| p.key.partition);
        info.rows = layout.rows();
        info.committed_partitions = all.len() as u32;
        info.partitions = partition_infos(&all);
        info.layout = Some(layout_to_proto(layout, &s.schema)?);
    }
    Ok(info)
}

fn local_dataset_info(s: &DatasetSummary) -> Result<pb::DatasetInfo> {
    Ok(pb::DatasetInfo {
        dataset: s.name.clone(),
        state: match (s.state, &s.cluster) {
            (DatasetState::Open, _) => pb::DatasetState::Open,
            (DatasetState::Sealed, Some(ClusterState::Pending)) => pb::DatasetState::Sealing,
            (DatasetState::Sealed, _) => pb::DatasetState::Sealed,
        }
        .into(),
        rows: s.rows,
        bytes: s.bytes,
        committed_partitions: s.partitions.len() as u32,
        schema: schema_to_ipc(&s.schema)?,
        partitions: partition_infos(&s.partitions),
        generation: s.generation,
        spilled: !s.resident,
        persisted: s.stored.as_ref().is_some_and(|st| st.persisted),
        placements: Vec::new(),
        layout: None,
        written_seconds_ago: s.idle.as_secs_f64(),
        replacements: Vec::new(),
    })
}

/// What a replacing write staged, as `describe` and `stats` show it.
pub fn staged_write(s: &crate::catalog::StagedSummary) -> pb::StagedWrite {
    pb::StagedWrite {
        dataset: s.dataset.clone(),
        write_id: s.write_id.clone(),
        rows: s.summary.rows,
        bytes: s.summary.bytes,
        committed_partitions: s.summary.partitions.len() as u32,
        written_seconds_ago: s.summary.idle.as_secs_f64(),
    }
}

/// A `place` request in domain terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlaceRequest {
    /// Sealed dataset.
    pub dataset: String,
    /// Columns; empty = every numeric column.
    pub columns: Vec<String>,
    /// Device ordinals, at least one, no repeats.
    pub devices: Vec<u32>,
}

/// Decodes the body of action `place`.
pub fn place_request(body: &[u8]) -> Result<PlaceRequest> {
    let p: pb::PlaceColumns = decode(body, "body of action 'place'", "PlaceColumns")?;
    let mut devices = p.devices;
    if devices.is_empty() {
        devices.push(0);
    }
    let mut seen = devices.clone();
    seen.sort_unstable();
    seen.dedup();
    if seen.len() != devices.len() {
        return Err(Error::invalid(format!(
            "place names a device more than once: {devices:?}"
        )));
    }
    Ok(PlaceRequest {
        dataset: dataset_name(&p.dataset)?,
        columns: p.columns,
        devices,
    })
}

/// Decodes the body of action `evict`: the dataset and its devices (empty =
/// all).
pub fn evict_request(body: &[u8]) -> Result<(String, Vec<u32>)> {
    let e: pb::EvictColumns = decode(body, "body of action 'evict'", "EvictColumns")?;
    Ok((dataset_name(&e.dataset)?, e.devices))
}

fn shuffle_of(value: i32, block_rows: u32) -> Result<Shuffle> {
    match pb::Shuffle::try_from(value) {
        Ok(pb::Shuffle::None) => Ok(Shuffle::None),
        Ok(pb::Shuffle::Global) => Ok(Shuffle::Global),
        Ok(pb::Shuffle::Block) => Ok(Shuffle::Block {
            block_rows: u64::from(block_rows),
        }),
        Err(_) => Err(Error::invalid(format!(
            "unknown shuffle mode {value}; use SHUFFLE_NONE, SHUFFLE_GLOBAL or SHUFFLE_BLOCK"
        ))),
    }
}

/// Most CPU ranks one job may ask for.
pub const MAX_CPU_RANKS: u32 = 256;

/// Decodes the body of action `train`. Checks against the data come later
/// ([`crate::train::Job::prepare`]).
pub fn train_job(body: &[u8], config: &ServerConfig) -> Result<crate::train::JobSpec> {
    use crate::train::model::Optimizer;
    use crate::train::{Devices, JobSpec, TaskSpec};
    let j: pb::TrainJob = decode(body, "body of action 'train'", "TrainJob")?;
    let task = match pb::Task::try_from(j.task) {
        Ok(pb::Task::Classification) => TaskSpec::Classification(j.classes),
        Ok(pb::Task::Regression) => TaskSpec::Regression,
        Err(_) => {
            return Err(Error::invalid(format!(
                "unknown task {}; use TASK_CLASSIFICATION or TASK_REGRESSION",
                j.task
            )));
        }
    };
    let optimizer = match pb::OptimizerKind::try_from(j.optimizer) {
        Ok(pb::OptimizerKind::OptimizerAdamw) => Optimizer::AdamW,
        Ok(pb::OptimizerKind::OptimizerSgd) => Optimizer::Sgd {
            momentum: j.momentum as f32,
        },
        Err(_) => {
            return Err(Error::invalid(format!(
                "unknown optimizer {}; use OPTIMIZER_ADAMW or OPTIMIZER_SGD",
                j.optimizer
            )));
        }
    };
    let devices = if j.gpus.is_empty() {
        match j.cpu_ranks {
            0 => Devices::Cpu(1),
            n if n > MAX_CPU_RANKS => {
                return Err(Error::invalid(format!(
                    "{n} cpu ranks is more than the {MAX_CPU_RANKS} a job may use"
                )));
            }
            n => Devices::Cpu(n),
        }
    } else {
        Devices::Gpu(j.gpus)
    };
    let block_rows = if j.block_rows == 0 {
        config.default_block_rows
    } else {
        j.block_rows
    };
    let nonempty = |s: String| (!s.is_empty()).then_some(s);
    Ok(JobSpec {
        dataset: dataset_name(&j.dataset)?,
        features: j.features,
        label: j.label,
        task,
        hidden: j.hidden.iter().map(|&h| h as usize).collect(),
        optimizer,
        lr: j.learning_rate as f32,
        weight_decay: j.weight_decay as f32,
        global_batch: j.batch_size,
        epochs: j.epochs,
        seed: j.seed,
        shuffle: shuffle_of(j.shuffle, block_rows)?,
        devices,
        checkpoint_url: nonempty(j.checkpoint_url),
        checkpoint_every: j.checkpoint_every,
        resume_from: nonempty(j.resume_from),
        max_steps: j.max_steps,
        keep_checkpoints: match j.keep_checkpoints {
            0 => crate::train::DEFAULT_KEEP_CHECKPOINTS,
            n => n as usize,
        },
        filter: j.filter.trim().to_string(),
    })
}

/// The wire form of a progress report of job `job`.
pub fn train_progress(job: u64, p: &crate::train::Progress) -> pb::TrainProgress {
    pb::TrainProgress {
        job,
        epoch: p.epoch,
        step: p.step,
        total_steps: p.total_steps,
        loss: p.loss,
        samples_per_second: p.samples_per_second,
        data_stall_seconds: p.data_stall_seconds,
        data_stall_fraction: p.data_stall_fraction,
        accuracy: p.accuracy,
        checkpoint: p.checkpoint.clone().unwrap_or_default(),
        done: p.done,
    }
}

/// Decodes the body of action `job`: a job id, 0 = all.
pub fn job_query(body: &[u8]) -> Result<u64> {
    let q: pb::JobQuery = decode(body, "body of action 'job'", "JobQuery")?;
    Ok(q.job)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cmd(m: impl Message) -> FlightDescriptor {
        FlightDescriptor::new_cmd(m.encode_to_vec())
    }

    #[test]
    fn first_repeat_names_both_positions_of_the_earliest_repeat() {
        assert_eq!(first_repeat::<u32>(&[]), None);
        assert_eq!(first_repeat(&[1, 2, 3]), None);
        assert_eq!(first_repeat(&[1, 0, 1, 0]), Some((0, 2)));
        assert_eq!(first_repeat(&["a", "b", "b", "a"]), Some((1, 2)));
    }

    #[test]
    fn put_targets_from_cmd_and_path() {
        let d = cmd(pb::PutPartition {
            dataset: "d".into(),
            partition: 3,
            attempt: 2,
            explicit_commit: false,
            expected_bytes: 1 << 20,
            expected_rows: 10,
            write_id: "job-7".into(),
            replace: false,
        });
        assert_eq!(
            put_target(&d).expect("valid"),
            PutTarget {
                dataset: "d".to_string(),
                key: AttemptKey {
                    partition: 3,
                    attempt: 2
                },
                explicit_commit: false,
                expected_bytes: 1 << 20,
                write_id: "job-7".into(),
                replace: false,
            }
        );
        // A replacing write is staged under its write id, which it must name.
        let staged = |write_id: &str| {
            put_target(&cmd(pb::PutPartition {
                dataset: "d".into(),
                write_id: write_id.into(),
                replace: true,
                ..Default::default()
            }))
        };
        let t = staged("job-8").expect("valid");
        assert_eq!(crate::catalog::public_name(&t.entry()), "d");
        assert_ne!(t.entry(), "d");
        let e = staged("").expect_err("no write id").to_string();
        assert!(e.contains("names no write"), "{e}");
        assert!(staged("a\u{1f}b").is_err());
        // Every body that names a replacing write checks its id.
        let bad = "a\u{1f}b".to_string();
        let seal = pb::SealDataset {
            dataset: "d".into(),
            replace_write: bad.clone(),
            ..Default::default()
        };
        assert!(seal_request(&seal.encode_to_vec()).is_err());
        let prepare = pb::PrepareMember {
            dataset: "d".into(),
            replace_write: bad.clone(),
            ..Default::default()
        };
        assert!(prepare_request(&prepare.encode_to_vec()).is_err());
        let drop = pb::DropDataset {
            dataset: "d".into(),
            staged: true,
            ..Default::default()
        };
        let e = drop_request(&drop.encode_to_vec()).expect_err("no write named");
        assert!(e.to_string().contains("names no write"), "{e}");
        let drop = pb::DropDataset {
            dataset: "d".into(),
            keep_write: bad.clone(),
            ..Default::default()
        };
        assert!(drop_request(&drop.encode_to_vec()).is_err());
        let d = FlightDescriptor::new_path(vec!["d".into(), "7".into()]);
        assert_eq!(put_target(&d).expect("valid").key.partition, 7);
        let d = FlightDescriptor::new_path(vec!["d".into(), "seven".into()]);
        assert!(put_target(&d).is_err());
        let d = FlightDescriptor::new_cmd(vec![0xff, 0xff, 0xff]);
        assert!(put_target(&d).is_err());
        let d = cmd(pb::PutPartition::default());
        assert!(
            put_target(&d)
                .expect_err("empty name")
                .to_string()
                .contains("empty")
        );
    }

    #[test]
    fn plans_validate_and_round_trip() {
        let config = ServerConfig::default();
        let wire = pb::ReadPlan {
            dataset: "d".into(),
            world_size: 4,
            shuffle: pb::Shuffle::Block.into(),
            columns: vec!["a".into()],
            ..Default::default()
        };
        let plan = read_plan_from_proto(&wire, &config).expect("valid");
        assert_eq!(plan.batch_rows, config.default_batch_rows);
        assert_eq!(
            plan.shuffle,
            Shuffle::Block {
                block_rows: u64::from(config.default_block_rows)
            }
        );
        let back = read_plan_from_proto(&read_plan_to_proto(&plan), &config).expect("valid");
        assert_eq!(back, plan);

        let zero = pb::ReadPlan {
            world_size: 0,
            ..wire.clone()
        };
        assert!(read_plan_from_proto(&zero, &config).is_err());
        let bad_shuffle = pb::ReadPlan {
            shuffle: 9,
            ..wire.clone()
        };
        assert!(read_plan_from_proto(&bad_shuffle, &config).is_err());
        let dup = pb::ReadPlan {
            columns: vec!["a".into(), "a".into()],
            ..wire
        };
        assert!(read_plan_from_proto(&dup, &config).is_err());
    }

    #[test]
    fn tickets_round_trip_and_garbage_is_refused() {
        let config = ServerConfig::default();
        let plan = read_plan_from_proto(
            &pb::ReadPlan {
                dataset: "d".into(),
                world_size: 2,
                ..Default::default()
            },
            &config,
        )
        .expect("valid");
        let t = ShardTicket {
            plan,
            rank: 1,
            generation: 9,
            layout: 0x1234,
            peer: Some(2),
            selected: vec![3, 0, 5],
        };
        assert_eq!(
            decode_ticket(&encode_ticket(&t), &config).expect("valid"),
            t
        );
        assert!(decode_ticket(b"\xff\x00garbage", &config).is_err());
        let bad_rank = ShardTicket { rank: 2, ..t };
        assert!(decode_ticket(&encode_ticket(&bad_rank), &config).is_err());
    }
}
