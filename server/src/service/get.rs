//! Reading: `GetFlightInfo` plans one endpoint per rank, `DoGet` streams a
//! rank's shard, `GetSchema` and `ListFlights` describe datasets.

use std::collections::HashMap;
use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::ipc::writer::IpcWriteOptions;
use arrow_flight::{
    FlightData, FlightDescriptor, FlightEndpoint, FlightInfo, SchemaAsIpc, SchemaResult, Ticket,
};
use bytes::Bytes;
use flightdeck_protos as pb;
use futures::StreamExt;
use prost::Message;
use tokio::sync::mpsc;
use tonic::Status;

use super::Stream;
use super::ipc::{IpcMessage, Messages};
use super::outbox::{self, Account};
use crate::catalog::{ClusterState, DatasetState, DatasetSummary, SealedData};
use crate::cluster::peer::{PeerBatch, batches_tag};
use crate::cluster::{self, Layout, Nodes, RankRows};
use crate::convert::{self, ShardTicket};
use crate::error::{Error, Result, panic_message};
use crate::order::{Locality, ReadPlan, Shuffle};
use crate::query::Selection;
use crate::read::{self, Gather, Picks, Shard};
use crate::state::{State, Tally, Traffic, unfinished_seal};

/// Batches (the schema counted as one) a stream queues ahead of the one
/// being sent.
const READ_AHEAD: usize = 2;
/// Batches received ahead of the merge from each member.
const PEER_AHEAD: usize = 2;

/// Where a sealed dataset's rows are, as a reader needs them.
struct Source {
    /// The row space: the cluster's layout, or one member (this server).
    layout: Arc<Layout>,
    /// This server's index in it.
    index: usize,
    /// Sealed across members (tickets carry the layout id).
    cluster: bool,
    /// What identifies this seal of the dataset: the layout id of a cluster,
    /// else the generation (`DatasetInfo`'s `layout.id` and `generation`);
    /// held, since a one-server layout of no partitions has no member to
    /// carry the generation.
    sealed_as: u64,
}

impl Source {
    fn of(state: &State, s: &DatasetSummary) -> Result<Self> {
        match &s.cluster {
            Some(ClusterState::Member { layout, index }) => Ok(Self {
                layout: layout.clone(),
                index: *index,
                cluster: true,
                sealed_as: layout.id,
            }),
            Some(ClusterState::Pending) => Err(unfinished_seal(&s.name)),
            None => Ok(Self {
                layout: Arc::new(Layout::single(
                    &state.location,
                    s.generation,
                    s.partitions.clone(),
                )),
                index: 0,
                cluster: false,
                sealed_as: s.generation,
            }),
        }
    }

    /// Refuses a plan that expects the dataset as sealed another time
    /// (`expected` 0: any).
    fn check_sealed_as(&self, dataset: &str, expected: u64) -> Result<()> {
        if expected == 0 || expected == self.sealed_as {
            return Ok(());
        }
        Err(Error::FailedPrecondition(format!(
            "dataset '{dataset}' was dropped or written again since this read began (the read \
             expects it as sealed_as {expected}, it is now {}); start the read again",
            self.sealed_as
        )))
    }

    /// Rows `selection` takes from each of this member's partitions.
    fn own_counts(&self, selection: &Selection) -> Vec<u64> {
        selection.counts(&self.layout.partition_rows(self.index))
    }

    /// The plan's node map over this layout.
    fn nodes(&self, plan: &ReadPlan) -> Result<Nodes> {
        let nodes = plan
            .nodes
            .iter()
            .map(|n| {
                if n.is_empty() {
                    return Ok(None);
                }
                self.layout.member_at(n).map(Some).ok_or_else(|| {
                    Error::invalid(format!(
                        "node location '{n}' is not a member of dataset '{}'; its members are \
                         {}; use \"\" for a node whose server holds none of it",
                        plan.dataset,
                        self.layout
                            .members
                            .iter()
                            .map(|m| m.location.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Nodes::new(
            plan.world_size,
            plan.ranks_per_node,
            nodes,
            self.layout.members.len(),
        )
    }
}

/// The rows a plan reads: the source's whole row space, or — for a plan
/// with a filter — the row space of the rows the filter selects on every
/// member, numbered in the same partition order.
struct Space {
    layout: Arc<Layout>,
    /// This member's selected rows; `None`: all of them.
    selection: Option<Arc<Selection>>,
    /// Rows selected per partition of the layout (members in order); empty
    /// without a filter.
    selected: Vec<u64>,
}

impl Space {
    fn whole(source: &Source) -> Self {
        Self {
            layout: source.layout.clone(),
            selection: None,
            selected: Vec::new(),
        }
    }

    fn of(source: &Source, selection: Arc<Selection>, selected: Vec<u64>) -> Result<Self> {
        Ok(Self {
            layout: Arc::new(source.layout.selected(&selected)?),
            selection: Some(selection),
            selected,
        })
    }
}

/// Where member `index`'s partitions start in a flattened selection.
fn member_offset(layout: &Layout, index: usize) -> usize {
    layout.partition_counts()[..index].iter().sum()
}

/// The row space of `plan` over `data` (this member's rows of `source`):
/// with a filter, every member's selection, asked of the others.
async fn plan_space(
    state: &State,
    plan: &ReadPlan,
    source: &Source,
    data: &Arc<crate::catalog::SealedData>,
) -> Result<Space> {
    let Some(selection) = plan_selection(state, plan, data).await? else {
        return Ok(Space::whole(source));
    };
    let own = source.own_counts(&selection);
    if !source.cluster {
        return Space::of(source, selection, own);
    }
    let layout = &source.layout;
    let replies =
        futures::future::join_all(layout.members.iter().enumerate().map(|(m, member)| {
            let own = own.clone();
            async move {
                if m == source.index {
                    return Ok(own);
                }
                let reply: pb::SelectedRows = state
                    .peers
                    .action(
                        &member.location,
                        &plan.dataset,
                        flightdeck_protos::actions::MEMBER_SELECT,
                        pb::SelectRows {
                            dataset: plan.dataset.clone(),
                            layout: layout.id,
                            filter: plan.filter.clone(),
                        },
                    )
                    .await?;
                if reply.partition_rows.len() != member.partitions.len() {
                    return Err(Error::Internal(format!(
                        "member {} counted its selection over {} partitions; it holds {}",
                        member.location,
                        reply.partition_rows.len(),
                        member.partitions.len()
                    )));
                }
                Ok(reply.partition_rows)
            }
        }))
        .await;
    let mut selected = Vec::new();
    for r in replies {
        selected.extend(r?);
    }
    Space::of(source, selection, selected)
}

/// This member's selection of a plan's filter (evaluated off the reactor
/// the first time); `None` without a filter.
async fn plan_selection(
    state: &State,
    plan: &ReadPlan,
    data: &Arc<crate::catalog::SealedData>,
) -> Result<Option<Arc<Selection>>> {
    state.selection(data, &plan.filter, &plan.dataset).await
}

/// Action `member_select`: the rows a filter selects in each of this
/// member's partitions of cluster dataset `name`, laid out as `layout`.
pub(super) async fn member_select(
    state: &State,
    name: &str,
    layout: u64,
    plan: &ReadPlan,
) -> Result<pb::SelectedRows> {
    let summary = sealed_summary(state, name)?;
    let source = Source::of(state, &summary)?;
    if !source.cluster || source.layout.id != layout {
        return Err(Error::FailedPrecondition(format!(
            "this member does not hold the layout of dataset '{name}' the plan was made for (it \
             was dropped or written again here, or its seal is unfinished); seal the cluster \
             again, or drop the dataset and write it again"
        )));
    }
    let (_, data) = state.resident(name).await?;
    let selection = plan_selection(state, plan, &data).await?;
    let lengths = source.layout.partition_rows(source.index);
    Ok(pb::SelectedRows {
        partition_rows: match selection {
            Some(s) => s.counts(&lengths),
            None => lengths,
        },
    })
}

/// The endpoints of a plan over the sealed dataset `s` (resident or
/// spilled), one per rank in rank order; on a cluster each names the member
/// that serves the rank.
fn plan_info(
    plan: &ReadPlan,
    s: &DatasetSummary,
    source: &Source,
    space: &Space,
    descriptor: FlightDescriptor,
) -> Result<FlightInfo> {
    let schema = read::plan_schema(plan, &s.schema)?;
    let n = space.layout.rows();
    let nodes = source.nodes(plan)?;
    if plan.locality == Locality::Node {
        // Refuses a resume it cannot make exact, before any ticket exists.
        cluster::node_order(plan, &space.layout, nodes.clone())?;
    }
    let shares = plan.shares(n)?;
    let (rows, batches) = plan.stream_size(shares.per_rank());
    let mut info = FlightInfo::new()
        .try_with_schema(&schema)
        .map_err(|e| Error::Internal(format!("cannot encode schema: {e}")))?
        .with_descriptor(descriptor)
        .with_total_records(i64::try_from(rows * shares.world_size()).unwrap_or(i64::MAX))
        .with_ordered(true)
        .with_app_metadata(
            pb::PlanInfo {
                partition_rows: space.layout.part_rows(),
            }
            .encode_to_vec(),
        );
    for rank in 0..plan.world_size {
        let ticket = convert::encode_ticket(&ShardTicket {
            plan: plan.clone(),
            rank,
            generation: if source.cluster { 0 } else { s.generation },
            layout: if source.cluster { source.layout.id } else { 0 },
            peer: None,
            selected: if source.cluster {
                space.selected.clone()
            } else {
                Vec::new()
            },
        });
        let meta = pb::ShardInfo {
            rank,
            rows,
            batches,
        };
        let mut endpoint = FlightEndpoint::new()
            .with_ticket(Ticket::new(ticket))
            .with_app_metadata(meta.encode_to_vec());
        if source.cluster {
            let member = nodes.serving_member(u64::from(rank));
            endpoint = endpoint.with_location(source.layout.members[member].location.clone());
        }
        info = info.with_endpoint(endpoint);
    }
    Ok(info)
}

/// `GetFlightInfo`: validate the plan against the sealed dataset and hand out
/// one ticket per rank; on a cluster, only once every member holds the
/// same layout.
pub(super) async fn flight_info(state: &State, descriptor: FlightDescriptor) -> Result<FlightInfo> {
    let (plan, sealed_as) = convert::plan_request(&descriptor, &state.config)?;
    let summary = sealed_summary(state, &plan.dataset)?;
    check_batch_bytes(&plan, &summary, state.config.max_message_bytes)?;
    let source = Source::of(state, &summary)?;
    source.check_sealed_as(&plan.dataset, sealed_as)?;
    if plan.filter.is_empty() {
        if source.cluster {
            state
                .check_members(&plan.dataset, &source.layout, source.index)
                .await?;
        }
        return plan_info(&plan, &summary, &source, &Space::whole(&source), descriptor);
    }
    // A filter is checked before anything is restored or asked of others.
    read::plan_filter(&plan, &summary.schema)?;
    read::plan_schema(&plan, &summary.schema)?;
    let (generation, data) = state.resident(&plan.dataset).await?;
    let expected = if source.cluster {
        source.layout.members[source.index].generation
    } else {
        summary.generation
    };
    if generation != expected {
        return Err(Error::FailedPrecondition(format!(
            "dataset '{}' was dropped and written again while the plan was made; plan again",
            plan.dataset
        )));
    }
    // Members answering `member_select` also confirm they hold the layout.
    let space = plan_space(state, &plan, &source, &data).await?;
    plan_info(&plan, &summary, &source, &space, descriptor)
}

/// Refuses a plan whose record batches would not fit in one message:
/// `batch_rows` rows of the dataset's mean row size. Caught here, it is an
/// answer to the plan, not a stream that fails halfway.
fn check_batch_bytes(plan: &ReadPlan, summary: &DatasetSummary, max_message: usize) -> Result<()> {
    if summary.rows == 0 {
        return Ok(());
    }
    let row = row_bytes(summary);
    let batch = batch_bytes(plan, summary);
    let max = max_message as u64;
    if batch <= max {
        return Ok(());
    }
    Err(Error::invalid(format!(
        "batch_rows {} makes record batches of about {batch} bytes (rows of dataset '{}' are \
         about {row} bytes), more than one message may carry (--max-message-size {max}); use \
         batch_rows of at most {}",
        plan.batch_rows,
        plan.dataset,
        (max / row).max(1)
    )))
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
    let projected = read::plan_schema(&plan, &schema)?;
    SchemaAsIpc::new(&projected, &IpcWriteOptions::default())
        .try_into()
        .map_err(|e| Error::Internal(format!("cannot encode schema: {e}")))
}

/// `ListFlights`: every dataset whose name starts with the criteria's
/// expression (all of them when it is empty), with its path descriptor;
/// sealed ones carry one endpoint reading everything unshuffled.
pub(super) fn list_flights(state: &State, criteria: &[u8]) -> Result<Vec<FlightInfo>> {
    let prefix = name_prefix(criteria)?;
    let summaries = state.catalog().list();
    let mut infos = Vec::with_capacity(summaries.len());
    for s in summaries.into_iter().filter(|s| s.name.starts_with(prefix)) {
        let descriptor = FlightDescriptor::new_path(vec![s.name.clone()]);
        let sealed =
            s.state == DatasetState::Sealed && !matches!(s.cluster, Some(ClusterState::Pending));
        let info = if sealed {
            let plan = convert::read_plan(&descriptor, &state.config)?;
            let source = Source::of(state, &s)?;
            plan_info(&plan, &s, &source, &Space::whole(&source), descriptor)?
        } else {
            FlightInfo::new()
                .try_with_schema(&s.schema)
                .map_err(|e| Error::Internal(format!("cannot encode schema: {e}")))?
                .with_descriptor(descriptor)
                .with_total_records(i64::try_from(s.rows).unwrap_or(i64::MAX))
        };
        infos.push(info.with_total_bytes(i64::try_from(s.bytes).unwrap_or(i64::MAX)));
    }
    Ok(infos)
}

/// The dataset name prefix a `ListFlights` criteria expression holds: UTF-8
/// text, empty for every dataset.
fn name_prefix(criteria: &[u8]) -> Result<&str> {
    std::str::from_utf8(criteria).map_err(|_| {
        Error::invalid(
            "ListFlights criteria is a dataset name prefix in UTF-8; send an empty expression to \
             list every dataset",
        )
    })
}

type Sender = outbox::Sender;

/// What a `DoGet` stream is, and what it has sent so far.
#[derive(Debug, Clone)]
pub(super) struct StreamInfo {
    /// The dataset read.
    pub dataset: String,
    /// The rank whose stream it is.
    pub rank: u32,
    /// A member's part of another member's rank stream.
    pub for_peer: bool,
    /// Rows and batch bytes encoded for it.
    pub tally: Arc<Tally>,
}

/// The IPC messages of `batch`, the record batch tagged with `tag` (the
/// batch's index, on streams between members); its rows and body bytes are
/// added to `rows` and `bytes` and to the stream's `stream` tally.
fn encode(
    messages: &mut Messages,
    batch: &RecordBatch,
    tag: Option<Bytes>,
    rows: &std::sync::atomic::AtomicU64,
    bytes: &std::sync::atomic::AtomicU64,
    stream: &Tally,
) -> Result<Vec<IpcMessage>> {
    let mut m = messages.batch(batch)?;
    if let (Some(tag), Some(last)) = (tag, m.last_mut()) {
        last.app_metadata = tag;
    }
    let body = m.iter().map(|x| x.body_len as u64).sum();
    let n = batch.num_rows() as u64;
    Traffic::add(rows, bytes, n, body);
    Traffic::add(&stream.rows, &stream.bytes, n, body);
    Ok(m)
}

/// The messages of a rank's shard (or of a peer's part of it): the schema,
/// then each batch's IPC messages as it is gathered. Rows are gathered and
/// encoded on a blocking thread into the stream's small outbox, charged to
/// the server's read-ahead allowance, so a slow reader holds back the
/// gather; dropping the receiver (the client hung up) stops it.
///
/// Also returns what the stream is (dataset, rank, whether for another
/// member) and its tally of rows and bytes, for metrics and the call's log.
pub(super) async fn shard_messages(
    state: &State,
    ticket: &Ticket,
) -> Result<(outbox::Receiver, StreamInfo)> {
    let t = convert::decode_ticket(&ticket.ticket, &state.config)?;
    let info = StreamInfo {
        dataset: t.plan.dataset.clone(),
        rank: t.rank,
        for_peer: t.peer.is_some(),
        tally: Arc::new(Tally::default()),
    };
    let tally = info.tally.clone();
    let name = t.plan.dataset.clone();
    let summary = sealed_summary(state, &name)?;
    check_batch_bytes(&t.plan, &summary, state.config.max_message_bytes)?;
    let source = Source::of(state, &summary)?;
    let stale = || {
        Error::FailedPrecondition(format!(
            "dataset '{name}' was dropped and written again after this ticket was issued; call \
             GetFlightInfo again for fresh tickets"
        ))
    };
    if source.cluster && t.layout != source.layout.id {
        return Err(stale());
    }
    if !source.cluster && (t.layout != 0 || t.peer.is_some()) {
        return Err(Error::FailedPrecondition(format!(
            "this ticket reads dataset '{name}' as a cluster dataset, but this server holds it \
             on its own (dropped and written again?); call GetFlightInfo again"
        )));
    }
    let (generation, data) = state.resident(&name).await?;
    let expected = if source.cluster {
        source.layout.members[source.index].generation
    } else {
        t.generation
    };
    if generation != expected {
        return Err(stale());
    }
    let space = match plan_selection(state, &t.plan, &data).await? {
        None => Space::whole(&source),
        Some(selection) => {
            let own = source.own_counts(&selection);
            if !source.cluster {
                Space::of(&source, selection, own)?
            } else {
                let at = member_offset(&source.layout, source.index);
                if t.selected.get(at..at + own.len()) != Some(own.as_slice()) {
                    return Err(Error::FailedPrecondition(format!(
                        "this ticket's selection of dataset '{name}' is not what the filter \
                         selects on this member now; call GetFlightInfo again"
                    )));
                }
                Space::of(&source, selection, t.selected.clone())?
            }
        }
    };
    let traffic = state.traffic.clone();
    let (tx, rx) = outbox::outbox(READ_AHEAD);
    let mut run = Run {
        account: Some(Account::new(state.read_ahead.clone())),
        idle: state.config.stream_idle_timeout,
        dataset: name.clone(),
        // Settled to the batch's size once it is gathered.
        estimate: batch_bytes(&t.plan, &summary),
    };
    if !source.cluster && t.plan.locality == Locality::Global {
        let mut shard = Shard::selecting(data, &t.plan, t.rank, space.selection)?;
        if packing(&t.plan, shard.data(), u64::from(t.plan.world_size)) {
            shard = shard.packing(state.arena().clone(), state.metrics.clone());
        }
        if let Some(threads) = state.config.gather_threads {
            shard = shard.split(threads);
        }
        let messages = Messages::new(&shard.schema())?;
        start(&tx, &messages)?;
        let stream = ShardStream {
            shard,
            next: 0,
            messages,
            traffic,
            tally,
        };
        spawn_stream(tx, stream, run);
        return Ok((rx, info));
    }
    let nodes = source.nodes(&t.plan)?;
    let rows = RankRows::new(&t.plan, space.layout.clone(), &nodes, t.rank)?;
    let fixed = source.cluster.then_some(source.layout.fixed.as_slice());
    let mut gather = Gather::for_plan(data, &t.plan, fixed, space.selection.clone())?;
    // A member begins about one stream per rank of an epoch over GLOBAL
    // (its ranks' own and its part of the others'), one per rank of its
    // node over NODE.
    let ranks = match t.plan.locality {
        Locality::Node => nodes.ranks_per_node(),
        Locality::Global => u64::from(t.plan.world_size),
    };
    if packing(&t.plan, gather.data(), ranks) {
        gather = gather.packing(state.arena().clone(), state.metrics.clone());
    }
    if let Some(threads) = state.config.gather_threads {
        gather = gather.split(threads);
    }
    // Members send each other the gathered columns (or their packed
    // records, decided at a member's first message: see `PeerStream`); the
    // rank's member derives the plan's `select` columns from them.
    let messages = if t.peer.is_some() {
        Messages::new(&gather.gathered_schema())?
    } else {
        let messages = Messages::new(&gather.schema())?;
        start(&tx, &messages)?;
        messages
    };
    let read = MergedRead {
        gather,
        rows,
        plan: t.plan.clone(),
        index: source.index,
        messages,
        traffic,
        tally,
    };
    if let Some(peer) = t.peer {
        if peer as usize != source.index {
            return Err(Error::invalid(format!(
                "this ticket asks member {peer} of dataset '{name}' for its rows, but this \
                 server is member {}",
                source.index
            )));
        }
        // A member's part of another member's rank stream is not charged:
        // that rank stream holds its own charge while it waits for this
        // part, and two members whose allowances were full of such waiting
        // streams would wait for each other. Its outbox still bounds it, and
        // it ends when the rank stream does.
        run.account = None;
        spawn_stream(
            tx,
            PeerStream {
                read,
                next: 0,
                held: None,
                pending: None,
                group: 1,
                records: None,
            },
            run,
        );
        return Ok((rx, info));
    }
    let mut feeds = HashMap::new();
    let wanted: Vec<usize> = read
        .rows
        .sources()
        .into_iter()
        .filter(|&m| m != source.index)
        .collect();
    let opened = futures::future::join_all(wanted.iter().map(|&m| {
        let ticket = convert::encode_ticket(&ShardTicket {
            plan: t.plan.clone(),
            rank: t.rank,
            generation: 0,
            layout: source.layout.id,
            peer: Some(m as u32),
            selected: t.selected.clone(),
        });
        state
            .peers
            .fetch(&source.layout.members[m].location, &name, ticket)
    }))
    .await;
    for (&m, stream) in wanted.iter().zip(opened) {
        let (ftx, frx) = mpsc::channel(PEER_AHEAD);
        let mut stream = Box::pin(stream?);
        tokio::spawn(async move {
            while let Some(item) = stream.next().await {
                let failed = item.is_err();
                if ftx.send(item).await.is_err() || failed {
                    break;
                }
            }
        });
        feeds.insert(m, (source.layout.members[m].location.clone(), frx));
    }
    let stream = RankStream {
        read,
        feeds,
        next: 0,
    };
    spawn_stream(tx, stream, run);
    Ok((rx, info))
}

/// Whether a stream of `plan` over `data`, one of the `ranks` streams an
/// epoch begins here, gathers scattered rows from the packed copy
/// ([`crate::read::packed::PackedCache::worth_packing`]): rows are
/// scattered when the order is shuffled or when several ranks stride
/// through an unshuffled one; a single rank's unshuffled stream reads runs
/// of neighbouring rows and never does.
fn packing(plan: &ReadPlan, data: &SealedData, ranks: u64) -> bool {
    let scattered =
        plan.shuffle != Shuffle::None || plan.locality == Locality::Node || plan.world_size > 1;
    scattered && data.packed().worth_packing(ranks)
}

/// One stream's work, a batch at a time.
trait Batches: Send + 'static {
    /// The messages of the stream's next batch; `None` at its end.
    fn next_messages(&mut self) -> Option<Result<Vec<IpcMessage>>>;
}

/// How a stream is run: its allowance account, idle timeout and dataset.
struct Run {
    /// `None`: the stream is not charged (a peer's part of a rank stream).
    account: Option<Account>,
    idle: std::time::Duration,
    dataset: String,
    /// Bytes the next batch is expected to take (the last batch's size once
    /// there is one).
    estimate: u64,
}

/// Runs a stream. It gathers batches on a blocking thread while its outbox
/// has room and the read-ahead allowance has room for the next batch, and
/// waits, on no thread, otherwise: a client that stops reading holds no
/// thread, so slow readers cannot starve others (or spills and training,
/// which share the pool), and what all streams hold ahead of their sockets
/// stays within the allowance (`outbox.rs`). A gather that panics fails the
/// stream with `INTERNAL`; a client that takes nothing for `idle` has what
/// was queued for it dropped and gets `ABORTED`. Neither ends the stream as
/// if it were complete.
fn spawn_stream(tx: Sender, mut work: impl Batches, mut run: Run) {
    let tx = Arc::new(tx);
    tokio::spawn(async move {
        let _counted = crate::read::Streaming::begin();
        let dataset = run.dataset.clone();
        let idle = run.idle;
        let stalled = || {
            tracing::info!(dataset = %dataset, ?idle, "ending a stream whose reader stopped reading");
            tx.purge(Error::Aborted(format!(
                "this stream of dataset '{dataset}' was ended after its reader took nothing \
                 for {idle:?} (--stream-idle-timeout); read again from the next start_sample"
            )));
        };
        loop {
            tokio::select! {
                room = tx.room() => if !room {
                    // The client hung up.
                    return;
                },
                () = tx.stalled(idle) => return stalled(),
            }
            let next = match &run.account {
                Some(account) => tokio::select! {
                    c = account.charge(run.estimate) => Some(c),
                    () = tx.gone() => return,
                    () = tx.stalled(idle) => return stalled(),
                },
                None => None,
            };
            let sender = tx.clone();
            let account = run.account.clone();
            let estimate = run.estimate;
            // Gathers while there is room, as one thread; gives the thread
            // back when the outbox or the allowance is full.
            let gathered = tokio::task::spawn_blocking(move || {
                let mut charge = next;
                let mut estimate = estimate;
                loop {
                    let next = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        work.next_messages()
                    }));
                    let item = match next {
                        Ok(Some(item)) => item,
                        Ok(None) => return (work, estimate, Gathered::Ended),
                        Err(panic) => {
                            let what = panic_message(&*panic);
                            return (work, estimate, Gathered::Panicked(what));
                        }
                    };
                    let item = item.map(|mut messages| {
                        if let Some(c) = charge.take() {
                            c.attach(&mut messages);
                        }
                        let bytes: usize = messages.iter().map(|m| m.body_len).sum();
                        estimate = (bytes as u64).max(1);
                        messages
                    });
                    let failed = item.is_err();
                    sender.push(item);
                    if failed {
                        return (work, estimate, Gathered::Ended);
                    }
                    match sender.has_room() {
                        None => return (work, estimate, Gathered::Ended),
                        Some(false) => return (work, estimate, Gathered::Full),
                        Some(true) => {}
                    }
                    if let Some(account) = &account {
                        match account.try_charge(estimate) {
                            Some(c) => charge = Some(c),
                            None => return (work, estimate, Gathered::Full),
                        }
                    }
                }
            })
            .await;
            match gathered {
                Ok((back, estimate, Gathered::Full)) => {
                    work = back;
                    run.estimate = estimate;
                }
                Ok((_, _, Gathered::Ended)) => return,
                Ok((_, _, Gathered::Panicked(what))) => {
                    tracing::error!(dataset = %dataset, panic = %what, "a read stream's gather panicked");
                    return tx.push(Err(Error::Internal(format!(
                        "this stream of dataset '{dataset}' failed inside the server ({what}) and \
                         is incomplete; read the shard again, and report the failure with the \
                         server's log"
                    ))));
                }
                Err(e) => {
                    return tx.push(Err(Error::Internal(format!(
                        "this stream of dataset '{dataset}' lost its gather ({e}) and is \
                         incomplete; read the shard again"
                    ))));
                }
            }
        }
    });
}

/// How a run of gathering on a blocking thread ended.
enum Gathered {
    /// The outbox or the allowance is full: wait.
    Full,
    /// The stream is over (done, failed and told, or the client left).
    Ended,
    /// A gather panicked, with this message.
    Panicked(String),
}

/// A rank's stream from a server that holds the whole dataset.
struct ShardStream {
    shard: Shard,
    next: u64,
    messages: Messages,
    traffic: Arc<Traffic>,
    tally: Arc<Tally>,
}

impl Batches for ShardStream {
    fn next_messages(&mut self) -> Option<Result<Vec<IpcMessage>>> {
        let batch = self.shard.batch(self.next)?;
        self.next += 1;
        let t = &self.traffic;
        Some(batch.and_then(|b| {
            encode(
                &mut self.messages,
                &b,
                None,
                &t.rows_served,
                &t.bytes_served,
                &self.tally,
            )
        }))
    }
}

/// A member's samples of a rank as `(k, member row)`, ascending in `k`.
type Held = std::iter::Peekable<std::vec::IntoIter<(u64, u64)>>;

/// This member's rows of another member's rank stream.
struct PeerStream {
    read: MergedRead,
    next: u64,
    /// This member's samples of the rank as `(k, member row)`, found once
    /// at the first batch ([`RankRows::held_by`]); inner `None`: walk each
    /// batch's samples instead.
    held: Option<Option<Held>>,
    /// A batch's rows found for a message they did not fit.
    pending: Option<(u64, Vec<u64>)>,
    /// Most batches the next message may hold.
    group: usize,
    /// Whether the rows go as packed records (`crate::read::records`);
    /// `None` until the first message, which decides it and sends the
    /// schema.
    records: Option<bool>,
}

impl PeerStream {
    /// The next of the rank's batches and this member's rows of it.
    fn next_batch(&mut self) -> Option<(u64, Vec<u64>)> {
        let (rows, index) = (&self.read.rows, self.read.index);
        let held = self
            .held
            .get_or_insert_with(|| rows.held_by(index).map(|h| h.into_iter().peekable()));
        let b = self.next;
        let samples = self.read.plan.stream_batch(rows.len(), b)?;
        self.next += 1;
        let mine = match held {
            Some(held) => {
                // A split stream skips the batches of the other splits.
                while held.next_if(|&(k, _)| k < samples.start).is_some() {}
                std::iter::from_fn(|| held.next_if(|&(k, _)| k < samples.end))
                    .map(|(_, row)| row)
                    .collect()
            }
            None => rows.samples_from(samples, index),
        };
        Some((b, mine))
    }
}

impl Batches for PeerStream {
    /// This member's rows of the rank's next batches that have any, at
    /// most a rank batch's rows a message. The first message holds one
    /// batch's and each later one at most twice as many batches as the one
    /// before, so the rank never waits on a large gather for its next batch
    /// while a member supplying a few rows of each batch soon sends a few
    /// messages, not one per batch.
    fn next_messages(&mut self) -> Option<Result<Vec<IpcMessage>>> {
        let mut schema = None;
        if self.records.is_none() {
            // Records pay where the rank's batches mix members' rows
            // (shuffled, or a node's order); an unshuffled rank batch is
            // mostly one member's run of rows, which the rank copies column
            // by column as it came.
            let plan = &self.read.plan;
            let mixed = plan.shuffle != Shuffle::None || plan.locality == Locality::Node;
            let records = mixed.then(|| self.read.gather.records_schema()).flatten();
            if let Some(records) = &records {
                match Messages::new(records) {
                    Ok(messages) => self.read.messages = messages,
                    Err(e) => return Some(Err(e)),
                }
            }
            self.records = Some(records.is_some());
            schema = Some(self.read.messages.schema());
        }
        let limit = self.read.plan.batch_rows.max(1) as usize;
        let mut batches = Vec::new();
        let mut rows = Vec::new();
        while let Some((b, mine)) = self.pending.take().or_else(|| self.next_batch()) {
            if mine.is_empty() {
                continue;
            }
            if !batches.is_empty() && rows.len() + mine.len() > limit {
                self.pending = Some((b, mine));
                break;
            }
            batches.push((b, mine.len()));
            rows.extend(mine);
            if rows.len() >= limit || batches.len() >= self.group {
                break;
            }
        }
        if batches.is_empty() {
            return schema.map(|m| Ok(vec![m]));
        }
        self.group = self.group.saturating_mul(2);
        let records = self.records == Some(true);
        let message = self.read.peer_message(&batches, &rows, records);
        Some(match schema {
            Some(schema) => message.map(|m| std::iter::once(schema).chain(m).collect()),
            None => message,
        })
    }
}

/// A rank's stream over a layout, read at its own member.
struct RankStream {
    read: MergedRead,
    feeds: Feeds,
    next: u64,
}

impl Batches for RankStream {
    fn next_messages(&mut self) -> Option<Result<Vec<IpcMessage>>> {
        let b = self.next;
        let samples = self.read.plan.stream_batch(self.read.rows.len(), b)?;
        self.next += 1;
        Some(self.read.rank_batch(b, samples, &mut self.feeds))
    }
}

/// Queues the schema message, the first of every stream.
fn start(tx: &Sender, messages: &Messages) -> Result<()> {
    tx.push(Ok(vec![messages.schema()]));
    Ok(())
}

/// The dataset's bytes per row, rounded up (at least 1).
fn row_bytes(summary: &DatasetSummary) -> u64 {
    summary.bytes.div_ceil(summary.rows.max(1)).max(1)
}

/// What one batch of `plan` is expected to take: its rows at the dataset's
/// bytes per row (a projection takes less).
fn batch_bytes(plan: &ReadPlan, summary: &DatasetSummary) -> u64 {
    u64::from(plan.batch_rows.max(1)).saturating_mul(row_bytes(summary))
}

/// A rank's stream over a layout: this member's rows gathered here, other
/// members' rows fetched from them.
struct MergedRead {
    gather: Gather,
    rows: RankRows,
    plan: ReadPlan,
    index: usize,
    messages: Messages,
    traffic: Arc<Traffic>,
    tally: Arc<Tally>,
}

/// Per member: its location and the batches it streams.
type Feeds = HashMap<usize, (String, mpsc::Receiver<Result<PeerBatch>>)>;

impl MergedRead {
    /// For another member's rank: this member's `rows` of the rank's
    /// `batches` (`(batch, rows)`, in order), tagged with them; as packed
    /// records or as the gathered columns.
    fn peer_message(
        &mut self,
        batches: &[(u64, usize)],
        rows: &[u64],
        records: bool,
    ) -> Result<Vec<IpcMessage>> {
        let picks = Picks::new(self.gather.locate_all(rows.iter().copied()));
        let t = &self.traffic;
        let batch = if records {
            self.gather.gathered_records(&picks)
        } else {
            self.gather.gathered(&picks, &[])
        };
        batch.and_then(|batch| {
            encode(
                &mut self.messages,
                &batch,
                Some(batches_tag(batches)),
                &t.rows_to_peers,
                &t.bytes_to_peers,
                &self.tally,
            )
        })
    }

    /// For a rank reading here: batch `b`, merging this member's rows with
    /// those fetched from the others.
    fn rank_batch(
        &mut self,
        b: u64,
        samples: std::ops::Range<u64>,
        feeds: &mut Feeds,
    ) -> Result<Vec<IpcMessage>> {
        let batch = self.merge(b, samples, feeds)?;
        let t = &self.traffic;
        encode(
            &mut self.messages,
            &batch,
            None,
            &t.rows_served,
            &t.bytes_served,
            &self.tally,
        )
    }

    fn merge(
        &self,
        b: u64,
        samples: std::ops::Range<u64>,
        feeds: &mut Feeds,
    ) -> Result<RecordBatch> {
        let data = self.gather.data();
        let local_batches = data.batches().len();
        let mut extra: Vec<RecordBatch> = Vec::new();
        // Per member (by index): (index into `extra`, next row of it).
        let mut taken: Vec<Option<(usize, usize)>> = Vec::new();
        let mut picks = Vec::with_capacity((samples.end - samples.start) as usize);
        for (m, row) in self.rows.samples(samples) {
            if m == self.index {
                picks.push(self.gather.locate(row));
                continue;
            }
            if taken.len() <= m {
                taken.resize(m + 1, None);
            }
            let (e, next) = match &mut taken[m] {
                Some(t) => t,
                slot => {
                    let batch = self.receive(feeds, m, b)?;
                    extra.push(batch);
                    slot.insert((extra.len() - 1, 0))
                }
            };
            picks.push((local_batches + *e, *next));
            *next += 1;
        }
        for (m, t) in taken.iter().enumerate() {
            let Some((e, used)) = *t else { continue };
            if extra[e].num_rows() != used {
                return Err(Error::Internal(format!(
                    "member {m} sent {} rows for batch {b} of the stream, {used} expected",
                    extra[e].num_rows()
                )));
            }
        }
        self.gather.batch(&Picks::new(picks), &extra)
    }

    /// Member `m`'s rows of batch `b`.
    fn receive(&self, feeds: &mut Feeds, m: usize, b: u64) -> Result<RecordBatch> {
        let (location, feed) = feeds.get_mut(&m).ok_or_else(|| {
            Error::Internal(format!(
                "the stream needs rows of member {m}, which it did not ask"
            ))
        })?;
        match feed.blocking_recv() {
            Some(Ok((got, batch, bytes))) if got == b => {
                let t = &self.traffic;
                Traffic::add(
                    &t.rows_from_peers,
                    &t.bytes_from_peers,
                    batch.num_rows() as u64,
                    bytes,
                );
                Ok(batch)
            }
            Some(Ok((got, ..))) => Err(Error::Internal(format!(
                "member {location} sent rows of batch {got} where batch {b} was due"
            ))),
            Some(Err(e)) => Err(e),
            None => Err(Error::Unavailable(format!(
                "member {location} ended its stream of dataset '{}' before batch {b}; resume \
                 the read from its start_sample, or run the query again",
                self.plan.dataset
            ))),
        }
    }
}

/// `DoGet` through the generated service (the network edge answers it in
/// `edge.rs` instead): the same messages as `FlightData`.
pub(super) async fn do_get(state: &State, ticket: &Ticket) -> Result<Stream<FlightData>> {
    let (rx, _) = shard_messages(state, ticket).await?;
    let items = futures::stream::unfold(rx, |mut rx| async move {
        let item = rx.recv().await?;
        Some((item, rx))
    });
    let stream = items.flat_map(|item| {
        let items: Vec<std::result::Result<FlightData, Status>> = match item {
            Ok(messages) => messages.iter().map(|m| Ok(m.to_flight_data())).collect(),
            Err(e) => vec![Err(Status::from(e))],
        };
        futures::stream::iter(items)
    });
    Ok(stream.boxed())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::outbox::ReadAhead;
    use std::time::Duration;

    /// One empty batch, then a panic.
    struct PanicsSecond(u32);

    impl Batches for PanicsSecond {
        fn next_messages(&mut self) -> Option<Result<Vec<IpcMessage>>> {
            self.0 += 1;
            assert!(self.0 < 2, "gather bug");
            Some(Ok(Vec::new()))
        }
    }

    /// Endless batches of one message with a body of this many bytes.
    struct Sized(usize);

    impl Batches for Sized {
        fn next_messages(&mut self) -> Option<Result<Vec<IpcMessage>>> {
            Some(Ok(vec![IpcMessage {
                header: Bytes::from_static(b"h"),
                body: vec![Bytes::from(vec![1u8; self.0])],
                body_len: self.0,
                app_metadata: Bytes::new(),
            }]))
        }
    }

    /// A run whose batches are expected to take 1000 bytes.
    fn run(pool: &Arc<ReadAhead>, idle: Duration) -> Run {
        Run {
            account: Some(Account::new(pool.clone())),
            idle,
            dataset: "d".into(),
            estimate: 1000,
        }
    }

    #[tokio::test]
    async fn a_gather_that_panics_fails_its_stream_with_internal() {
        let pool = ReadAhead::new(1 << 20);
        let (tx, mut rx) = outbox::outbox(READ_AHEAD);
        spawn_stream(tx, PanicsSecond(0), run(&pool, Duration::from_secs(60)));
        assert!(matches!(rx.recv().await, Some(Ok(_))));
        match rx.recv().await {
            Some(Err(Error::Internal(m))) => assert!(m.contains("gather bug"), "{m}"),
            other => panic!("expected INTERNAL, got {other:?}"),
        }
        assert!(rx.recv().await.is_none(), "then the stream ends");
    }

    #[tokio::test]
    async fn a_reader_that_takes_nothing_loses_what_was_queued_and_is_aborted() {
        let pool = ReadAhead::new(1 << 20);
        let (tx, mut rx) = outbox::outbox(READ_AHEAD);
        spawn_stream(tx, Sized(1000), run(&pool, Duration::from_millis(100)));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while pool.used() < READ_AHEAD as u64 * 1000 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the outbox never filled"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(pool.used(), 0, "the stalled stream's batches were dropped");
        match rx.recv().await {
            Some(Err(Error::Aborted(m))) => assert!(m.contains("--stream-idle-timeout"), "{m}"),
            other => panic!("expected ABORTED, got {other:?}"),
        }
        assert!(rx.recv().await.is_none(), "then the stream ends");
    }

    #[tokio::test]
    async fn streams_wait_for_the_allowance_and_go_when_it_is_freed() {
        let pool = ReadAhead::new(1500);
        let idle = Duration::from_secs(60);
        let (tx_a, mut rx_a) = outbox::outbox(READ_AHEAD);
        spawn_stream(tx_a, Sized(1000), run(&pool, idle));
        let first = rx_a.recv().await.expect("a batch").expect("ok");
        let (tx_b, mut rx_b) = outbox::outbox(READ_AHEAD);
        spawn_stream(tx_b, Sized(1000), run(&pool, idle));
        let quiet = tokio::time::timeout(Duration::from_millis(200), rx_b.recv()).await;
        assert!(
            quiet.is_err(),
            "the second stream waits while the first holds the allowance"
        );
        assert_eq!(
            pool.used(),
            1000,
            "one batch, taken by the first stream's reader"
        );
        drop(first);
        let second = tokio::time::timeout(Duration::from_secs(10), rx_b.recv()).await;
        assert!(
            matches!(second, Ok(Some(Ok(_)))),
            "room made, the second stream goes"
        );
        assert!(pool.used() <= 1500 + 1000, "{}", pool.used());
    }
}
