//! Many nodes, one dataset, end to end: three members, each its own server
//! process on loopback, hold 12 partitions spread unevenly (6/4/2) and are
//! sealed as one dataset.
//!
//! - `LOCALITY_GLOBAL`: for W = 1, 4, 6, 12 × every shuffle × 2 epochs, each
//!   rank's `DoGet` bytes equal those of a single server holding the same
//!   partitions; `drop_last`, and resume at another world size.
//! - `LOCALITY_NODE`: 3 nodes × 2 ranks read equal counts, every row once per
//!   epoch, epochs differ, and the rows that cross nodes (the members'
//!   `stats` counters) equal the imbalance — none for balanced members.
//! - A member killed mid-epoch: the rank's stream fails `UNAVAILABLE` naming
//!   it; restarted with `--persist`, the epoch completes from
//!   `start_sample`, every remaining row once.
//! - A rank's stream split among workers (`split_count`) carries, split by
//!   split, exactly the whole stream's batches, over both localities; a
//!   peer streams batches of one row of many columns.
//! - Spark's `array<float>` (a list of one length on every member) is
//!   packed on every member beside the fixed-width columns, and a list of
//!   another length on one member is not; both read as one server, and
//!   over `NODE` every row once with its own features.
//! - Members with tokens: an operator's `flightdeck datasets`, `describe`,
//!   `stats`, `place`, `evict` and `drop` see and drop the cluster dataset
//!   whole, and are refused without the right token.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow::array::{
    ArrayRef, AsArray, FixedSizeListArray, Float32Array, Int8Array, Int64Array, ListArray,
    RecordBatch,
};
use arrow::buffer::OffsetBuffer;
use arrow::datatypes::{DataType, Field, Int64Type, Schema};
use flightdeck_client::{
    Client, Code, DatasetState, Locality, MemberPartitions, PartitionAttempt, ReadPlan,
    SealDataset, ServerStats, Shard, Shuffle,
};
use flightdeck_tests::{
    CutProxy, MemberProcess, TestServer, batch, check_batch, layout, partition_batches, raw_bytes,
    read_all, schema, temp_dir, timed,
};
use futures::{StreamExt, TryStreamExt, stream};

/// Rows of partition `p`: uneven sizes.
fn sizes() -> Vec<i64> {
    (0..12).map(|p| 40 + 13 * p).collect()
}

/// Member index (0..3) that holds partition `p`: 6 / 4 / 2 partitions.
fn owner(p: usize) -> usize {
    [0, 0, 0, 1, 1, 2][p % 6]
}

/// Rows each member holds, by [`owner`].
fn member_rows() -> Vec<u64> {
    (0..3)
        .map(|m| {
            (0..12)
                .filter(|&p| owner(p) == m)
                .map(|p| sizes()[p] as u64)
                .sum()
        })
        .collect()
}

/// Partition 5 runs twice: attempt 0 on member 0 (a loser), attempt 1 (the
/// winner) on its owner.
const SPECULATIVE: u32 = 5;

async fn put(c: &mut Client, ds: &str, p: u32, attempt: u32, ids: std::ops::Range<i64>) -> String {
    let batches = partition_batches(ids, attempt, 23);
    let ack = timed(
        "put",
        c.put_partition(
            ds,
            p,
            attempt,
            schema(),
            stream::iter(batches.into_iter().map(Ok)),
        ),
    )
    .await
    .expect("put");
    ack.location
}

/// Writes the 12 partitions to `members` (by `owner`) and to `single`,
/// seals both; returns the cluster's `describe` from every member.
async fn write_both(members: &[MemberProcess], single: &mut Client, ds: &str) {
    let parts = layout(&sizes());
    let mut clients = Vec::new();
    for m in members {
        clients.push(m.client().await);
    }
    let mut by_location: HashMap<String, Vec<PartitionAttempt>> = HashMap::new();
    for (p, ids) in parts.iter().enumerate() {
        let p32 = p as u32;
        let winner = u32::from(p32 == SPECULATIVE);
        if p32 == SPECULATIVE {
            put(&mut clients[0], ds, p32, 0, ids.clone()).await;
        }
        let location = put(&mut clients[owner(p)], ds, p32, winner, ids.clone()).await;
        assert_eq!(
            location,
            members[owner(p)].location(),
            "PutAck names the member"
        );
        by_location
            .entry(location)
            .or_default()
            .push(PartitionAttempt {
                partition: p32,
                attempt: winner,
            });
        put(single, ds, p32, winner, ids.clone()).await;
    }
    let winners = vec![PartitionAttempt {
        partition: SPECULATIVE,
        attempt: 1,
    }];
    timed(
        "single seal",
        single.seal(SealDataset {
            dataset: ds.into(),
            partitions: 12,
            attempts: winners,
            ..Default::default()
        }),
    )
    .await
    .expect("single seal");
    let seal_members: Vec<MemberPartitions> = by_location
        .into_iter()
        .map(|(location, partitions)| MemberPartitions {
            location,
            partitions,
        })
        .collect();
    // A layout naming partition 0 on a member that lacks it fails, naming
    // the member and the partition, and seals nothing anywhere.
    let mut wrong = seal_members.clone();
    let from = wrong
        .iter()
        .position(|m| m.partitions.iter().any(|p| p.partition == 0))
        .expect("partition 0 is held");
    let moved = wrong[from].partitions.remove(0);
    let to = (from + 1) % wrong.len();
    wrong[to].partitions.push(moved);
    let err = clients[1]
        .seal_cluster(ds, 12, wrong.clone())
        .await
        .expect_err("partition 0 is not there");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    assert!(
        err.message().contains(&wrong[to].location)
            && err
                .message()
                .contains("lacks 1 of its partitions on this member (the first: 0"),
        "{err}"
    );
    // Any member coordinates; sealing twice is a no-op.
    for _ in 0..2 {
        let info = timed(
            "cluster seal",
            clients[1].seal_cluster(ds, 12, seal_members.clone()),
        )
        .await
        .expect("cluster seal");
        assert_eq!(info.state, DatasetState::Sealed as i32);
    }
    let total: i64 = sizes().iter().sum();
    for c in &mut clients {
        let info = c.describe(ds).await.expect("describe");
        assert_eq!(info.rows, total as u64, "describe shows the whole dataset");
        let l = info.layout.expect("a layout");
        assert_eq!(l.members.len(), 3);
        let mut rows: Vec<u64> = l.members.iter().map(|m| m.rows).collect();
        let mut want = member_rows();
        rows.sort_unstable();
        want.sort_unstable();
        assert_eq!(rows, want, "rows per member");
        let named: Vec<(u32, u32)> = l
            .members
            .iter()
            .flat_map(|m| m.partitions.iter().map(|p| (p.partition, p.attempt)))
            .collect();
        assert_eq!(named.len(), 12, "each winner named once");
        assert!(named.contains(&(SPECULATIVE, 1)));
    }
}

fn start_members(extra: &[&str]) -> Vec<MemberProcess> {
    (0..3)
        .map(|_| MemberProcess::start("127.0.0.1:0", extra))
        .collect()
}

fn plan(ds: &str, world_size: u32, shuffle: Shuffle, epoch: u64) -> ReadPlan {
    ReadPlan {
        dataset: ds.into(),
        world_size,
        epoch,
        seed: 17,
        shuffle: shuffle.into(),
        batch_rows: 37,
        block_rows: 7,
        ..Default::default()
    }
}

/// The raw bytes of every rank of `plan`, each read where its endpoint says.
async fn ranks_bytes(c: &mut Client, plan: ReadPlan) -> Vec<Vec<u8>> {
    let p = timed("plan", c.plan(plan)).await.expect("plan");
    let mut out = Vec::new();
    for shard in &p.shards {
        let mut reader = match &shard.location {
            Some(at) => timed("connect", Client::connect(at)).await.expect("member"),
            None => c.clone(),
        };
        out.push(raw_bytes(&mut reader, shard.ticket.clone()).await);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn global_shards_are_byte_identical_to_one_server() {
    let members = start_members(&[]);
    let single_server = TestServer::start().await;
    let mut single = single_server.client().await;
    write_both(&members, &mut single, "g").await;
    let mut c = members[2].client().await;
    for w in [1u32, 4, 6, 12] {
        for shuffle in [Shuffle::None, Shuffle::Global, Shuffle::Block] {
            for epoch in [0, 1] {
                let p = plan("g", w, shuffle, epoch);
                let cluster = ranks_bytes(&mut c, p.clone()).await;
                let one = ranks_bytes(&mut single, p).await;
                assert_eq!(cluster.len(), w as usize);
                for (r, (a, b)) in cluster.iter().zip(&one).enumerate() {
                    assert!(
                        a == b,
                        "W={w} {shuffle:?} epoch {epoch} rank {r}: bytes differ"
                    );
                }
            }
        }
    }
    // drop_last, projections, and a resume at another world size.
    let fixed: Vec<String> = ["vec", "x", "id", "attempt"].map(String::from).into();
    let variants = [
        ReadPlan {
            drop_last: true,
            ..plan("g", 12, Shuffle::Global, 3)
        },
        ReadPlan {
            columns: vec!["name".into(), "vec".into(), "id".into()],
            start_sample: 2 * 37 * 4,
            ..plan("g", 6, Shuffle::Global, 1)
        },
        ReadPlan {
            start_sample: 5 * 37 * 6 + 3,
            drop_last: true,
            ..plan("g", 4, Shuffle::Block, 2)
        },
        // Every fixed-width column, out of order: members send each other
        // their packed records for the shuffled read (the dataset is packed
        // by now), columns for the unshuffled one.
        ReadPlan {
            columns: fixed.clone(),
            ..plan("g", 6, Shuffle::Global, 4)
        },
        ReadPlan {
            columns: fixed.clone(),
            start_sample: 3,
            ..plan("g", 4, Shuffle::None, 4)
        },
        // Streams cut short: the same bytes as one server cuts them.
        ReadPlan {
            max_rows: 100,
            ..plan("g", 4, Shuffle::Global, 1)
        },
        ReadPlan {
            max_rows: 2 * 37 + 5,
            start_sample: 5 * 37 * 6 + 3,
            ..plan("g", 6, Shuffle::None, 0)
        },
    ];
    for p in variants {
        let cluster = ranks_bytes(&mut c, p.clone()).await;
        assert!(
            cluster == ranks_bytes(&mut single, p.clone()).await,
            "{p:?}"
        );
    }
    // The rows themselves: every row of the winners, exactly once.
    let p = timed("plan", c.plan(plan("g", 4, Shuffle::Global, 0)))
        .await
        .expect("plan");
    let mut ids = Vec::new();
    for batches in read_all(&mut c, &p).await {
        for b in &batches {
            ids.extend(check_batch(b, &|id| {
                let p = layout(&sizes())
                    .iter()
                    .position(|r| r.contains(&id))
                    .expect("a partition");
                u32::from(p as u32 == SPECULATIVE)
            }));
        }
    }
    let total: i64 = sizes().iter().sum();
    let unique: HashSet<i64> = ids.iter().copied().collect();
    assert_eq!(unique.len() as i64, total);

    // `max_rows` cuts every rank's stream to a prefix of its share.
    let whole = read_all(&mut c, &p).await;
    let cut_plan = ReadPlan {
        max_rows: 100,
        ..plan("g", 4, Shuffle::Global, 0)
    };
    let cut = timed("plan", c.plan(cut_plan)).await.expect("plan");
    let cut_rows = read_all(&mut c, &cut).await;
    let parts = layout(&sizes());
    let speculative = parts[SPECULATIVE as usize].clone();
    let attempt_of = |id: i64| u32::from(speculative.contains(&id));
    let ids_of = |batches: &[RecordBatch]| -> Vec<i64> {
        batches
            .iter()
            .flat_map(|b| check_batch(b, &attempt_of))
            .collect()
    };
    for (r, (a, b)) in whole.iter().zip(&cut_rows).enumerate() {
        let (a, b) = (ids_of(a), ids_of(b));
        assert_eq!(b.len(), 100, "rank {r}");
        assert_eq!(cut.shards[r].rows, 100);
        assert_eq!(b, a[..100], "rank {r}: the start of its share");
    }

    // One stored partition read where it is held (the node map naming its
    // member, the stream ending with it): its rows, and nothing fetched
    // from the other members.
    for p in [0usize, 4, 5, 11] {
        let holder = members[owner(p)].location();
        let before = stats(&members).await;
        let one = ReadPlan {
            start_sample: parts[p].start as u64,
            max_rows: (parts[p].end - parts[p].start) as u64,
            ranks_per_node: 1,
            nodes: vec![holder.clone()],
            ..plan("g", 1, Shuffle::None, 0)
        };
        let planned = timed("plan", c.plan(one)).await.expect("plan");
        assert_eq!(planned.shards[0].location.as_deref(), Some(holder.as_str()));
        let got = ids_of(&read_all(&mut c, &planned).await[0]);
        assert_eq!(got, parts[p].clone().collect::<Vec<_>>(), "partition {p}");
        assert_eq!(
            fetched(&before, &stats(&members).await),
            (0, 0),
            "partition {p}"
        );
    }
    // The plan tells each stored partition's rows of its row space, the
    // same on a cluster as on one server: with a filter, where a
    // partition's selected rows start, so each is read where it is held
    // too, nothing fetched from the others.
    let whole_plan = timed("plan", c.plan(plan("g", 2, Shuffle::Global, 0)))
        .await
        .expect("plan");
    let stored: Vec<u64> = sizes().iter().map(|&n| n as u64).collect();
    assert_eq!(whole_plan.partition_rows, stored);
    let thirds = |p: usize| parts[p].clone().filter(|id| id % 3 == 0);
    let filtered = |start_sample, max_rows, nodes: Vec<String>| ReadPlan {
        filter: "id % 3 = 0".into(),
        start_sample,
        max_rows,
        ranks_per_node: u32::from(!nodes.is_empty()),
        nodes,
        ..plan("g", 1, Shuffle::None, 0)
    };
    let selected = timed("plan", c.plan(filtered(0, 0, Vec::new())))
        .await
        .expect("plan");
    let want: Vec<u64> = (0..parts.len()).map(|p| thirds(p).count() as u64).collect();
    assert_eq!(selected.partition_rows, want);
    let on_one = timed("plan", single.plan(filtered(0, 0, Vec::new())))
        .await
        .expect("plan");
    assert_eq!(on_one.partition_rows, want);
    for p in [0usize, 4, 5, 11] {
        let holder = members[owner(p)].location();
        let start: u64 = want[..p].iter().sum();
        let before = stats(&members).await;
        let one = filtered(start, want[p], vec![holder.clone()]);
        let planned = timed("plan", c.plan(one)).await.expect("plan");
        assert_eq!(planned.shards[0].location.as_deref(), Some(holder.as_str()));
        let got = ids_of(&read_all(&mut c, &planned).await[0]);
        assert_eq!(got, thirds(p).collect::<Vec<_>>(), "partition {p}");
        assert_eq!(
            fetched(&before, &stats(&members).await),
            (0, 0),
            "filtered partition {p}"
        );
    }
    // Not with a NODE plan, which is read whole.
    let node = ReadPlan {
        max_rows: 10,
        locality: Locality::Node.into(),
        ..plan("g", 3, Shuffle::Global, 0)
    };
    let err = c.plan(node).await.expect_err("max_rows with NODE");
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    assert!(err.message().contains("max_rows"), "{err}");
}

/// Rows of each member in a balanced or 6/4/2 layout of 50-row partitions;
/// returns the ids each member holds.
async fn write_node_dataset(
    members: &[MemberProcess],
    ds: &str,
    owner_of: &dyn Fn(usize) -> usize,
    parts: usize,
) -> Vec<HashSet<i64>> {
    let mut held = vec![HashSet::new(); members.len()];
    let mut seal: HashMap<usize, Vec<PartitionAttempt>> = HashMap::new();
    for p in 0..parts {
        let m = owner_of(p);
        let ids = (p as i64 * 50)..(p as i64 + 1) * 50;
        held[m].extend(ids.clone());
        let mut c = members[m].client().await;
        c.put_partition(ds, p as u32, 0, schema(), stream::iter([Ok(batch(ids, 0))]))
            .await
            .expect("put");
        seal.entry(m).or_default().push(PartitionAttempt {
            partition: p as u32,
            attempt: 0,
        });
    }
    let members_seal = seal
        .into_iter()
        .map(|(m, partitions)| MemberPartitions {
            location: members[m].location(),
            partitions,
        })
        .collect();
    let mut c = members[0].client().await;
    timed("seal", c.seal_cluster(ds, parts as u32, members_seal))
        .await
        .expect("seal");
    held
}

async fn stats(members: &[MemberProcess]) -> Vec<ServerStats> {
    let mut out = Vec::new();
    for m in members {
        out.push(m.client().await.stats().await.expect("stats"));
    }
    out
}

/// Rows fetched from peers and rows served to peers between two readings
/// of every member's stats; the bytes both ways must agree.
fn fetched(before: &[ServerStats], after: &[ServerStats]) -> (u64, u64) {
    let sum = |s: &[ServerStats], f: fn(&ServerStats) -> u64| s.iter().map(f).sum::<u64>();
    let delta = |f: fn(&ServerStats) -> u64| sum(after, f) - sum(before, f);
    assert_eq!(
        delta(|s| s.bytes_fetched_from_peers),
        delta(|s| s.bytes_served_to_peers),
        "bytes fetched from peers and served to them"
    );
    (
        delta(|s| s.rows_fetched_from_peers),
        delta(|s| s.rows_served_to_peers),
    )
}

/// The ids of every rank of a NODE epoch (3 nodes × 2 ranks), in the node
/// order the members sort in (node i = member i of the layout).
async fn node_epoch(c: &mut Client, ds: &str, epoch: u64) -> (Vec<Vec<i64>>, Vec<String>) {
    let p = c
        .plan(ReadPlan {
            locality: Locality::Node.into(),
            ranks_per_node: 2,
            ..plan(ds, 6, Shuffle::Global, epoch)
        })
        .await
        .expect("node plan");
    let mut ranks = Vec::new();
    for batches in read_all(c, &p).await {
        ranks.push(
            batches
                .iter()
                .flat_map(|b| {
                    b.column_by_name("id")
                        .expect("id")
                        .as_primitive::<Int64Type>()
                        .values()
                        .to_vec()
                })
                .collect(),
        );
    }
    let served_by = p
        .shards
        .iter()
        .map(|s| s.location.clone().expect("a member per rank"))
        .collect();
    (ranks, served_by)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn members_gathering_on_several_threads_serve_the_bytes_of_one_server() {
    // Each 37-row batch in parts of 16, 16 and 5 rows, on three threads:
    // a rank's own rows, and a member's rows of another's rank (as columns
    // and, every fixed-width column read, as packed records).
    let members = start_members(&["--gather-threads", "3"]);
    let single_server = TestServer::start().await;
    let mut single = single_server.client().await;
    write_both(&members, &mut single, "t").await;
    let mut c = members[0].client().await;
    let fixed: Vec<String> = ["vec", "x", "id", "attempt"].map(String::from).into();
    for epoch in 0..3 {
        for (w, shuffle) in [
            (4, Shuffle::Global),
            (6, Shuffle::None),
            (6, Shuffle::Block),
        ] {
            for columns in [vec![], fixed.clone()] {
                let p = ReadPlan {
                    columns,
                    ..plan("t", w, shuffle, epoch)
                };
                let cluster = ranks_bytes(&mut c, p.clone()).await;
                assert!(
                    cluster == ranks_bytes(&mut single, p.clone()).await,
                    "{p:?}"
                );
            }
        }
    }
    // NODE: equal counts, every row of the winners an epoch.
    for epoch in 0..3 {
        let (ranks, _) = node_epoch(&mut c, "t", epoch).await;
        let counts: HashSet<usize> = ranks.iter().map(Vec::len).collect();
        assert_eq!(counts.len(), 1, "epoch {epoch}: {counts:?}");
        let unique: HashSet<i64> = ranks.iter().flatten().copied().collect();
        assert_eq!(
            unique.len() as i64,
            sizes().iter().sum::<i64>(),
            "epoch {epoch}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn node_locality_reads_its_node_and_moves_only_the_imbalance() {
    let members = start_members(&[]);
    let mut c = members[1].client().await;
    // Node i is member i of the layout, ordered by location.
    let mut sorted: Vec<usize> = (0..3).collect();
    sorted.sort_by_key(|&m| members[m].location());

    // Balanced: 4 partitions of 50 rows on each member; 6 ranks take 100 each.
    let held = write_node_dataset(&members, "balanced", &|p| sorted[p % 3], 12).await;
    let before = stats(&members).await;
    let (e0, served_by) = node_epoch(&mut c, "balanced", 0).await;
    assert_eq!(
        fetched(&before, &stats(&members).await),
        (0, 0),
        "nothing crosses nodes"
    );
    for (r, ids) in e0.iter().enumerate() {
        assert_eq!(ids.len(), 100);
        let node = r / 2;
        assert_eq!(served_by[r], members[sorted[node]].location());
        assert!(
            ids.iter().all(|id| held[sorted[node]].contains(id)),
            "rank {r} reads its node"
        );
    }
    let all: Vec<i64> = e0.concat();
    assert_eq!(all.iter().copied().collect::<HashSet<_>>().len(), 600);
    let (e1, _) = node_epoch(&mut c, "balanced", 1).await;
    assert_ne!(e0, e1, "epochs differ");
    // A plan expecting the dataset as sealed (its layout id, as `describe`
    // on any member gives it) is served by every member.
    let sealed_as = c
        .describe("balanced")
        .await
        .expect("describe")
        .layout
        .expect("a cluster layout")
        .id;
    for m in &members {
        let pinned = ReadPlan {
            sealed_as,
            ..plan("balanced", 2, Shuffle::Global, 0)
        };
        m.client().await.plan(pinned).await.expect("as sealed");
    }

    // Uneven 6/4/2 (300/200/100 rows): node 0 has 100 rows too many, node 2
    // 100 too few; exactly those cross.
    let heavy = |p: usize| sorted[owner(p)];
    write_node_dataset(&members, "uneven", &heavy, 12).await;
    for epoch in [0, 1] {
        let before = stats(&members).await;
        let (ranks, _) = node_epoch(&mut c, "uneven", epoch).await;
        assert_eq!(fetched(&before, &stats(&members).await), (100, 100));
        assert!(ranks.iter().all(|r| r.len() == 100), "equal counts");
        let all: Vec<i64> = ranks.concat();
        assert_eq!(
            all.iter().copied().collect::<HashSet<_>>().len(),
            600,
            "each row once"
        );
    }

    // The embedded trainer refuses a dataset spread over several members.
    let training = c
        .train(flightdeck_client::TrainJob {
            dataset: "uneven".into(),
            features: vec!["x".into()],
            label: "id".into(),
            task: flightdeck_client::Task::Regression.into(),
            batch_size: 60,
            epochs: 1,
            ..Default::default()
        })
        .await;
    let err = match training {
        Ok(mut stream) => stream.next().await.expect("a result").expect_err("refused"),
        Err(e) => e,
    };
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    assert!(err.message().contains("spread over 3 members"), "{err}");

    // A ticket issued before a member dropped its part reads nothing.
    let ticket_plan = c
        .plan(plan("uneven", 2, Shuffle::Global, 0))
        .await
        .expect("plan before the drop");

    // A NODE epoch resumes at its own world size only.
    let err = c
        .plan(ReadPlan {
            locality: Locality::Node.into(),
            ranks_per_node: 2,
            start_sample: 60,
            resume_world_size: 4,
            ..plan("uneven", 6, Shuffle::Global, 0)
        })
        .await
        .expect_err("another world size");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");

    // Dropped on one member: the others refuse to plan; drop cascades.
    let mut m2 = members[sorted[2]].client().await;
    let body = flightdeck_protos::DropDataset {
        dataset: "uneven".into(),
        member_only: true,
        ..Default::default()
    };
    use prost::Message;
    m2.flight()
        .do_action(arrow_flight::Action::new("drop", body.encode_to_vec()))
        .await
        .expect("member drop")
        .try_collect::<Vec<_>>()
        .await
        .expect("dropped");
    let mut other = members[sorted[0]].client().await;
    let err = other
        .plan(plan("uneven", 2, Shuffle::Global, 0))
        .await
        .expect_err("a member dropped it");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    for shard in &ticket_plan.shards {
        if shard.location.as_deref() == Some(members[sorted[2]].location().as_str()) {
            continue; // served by the member that dropped it: NOT_FOUND there
        }
        let read = async {
            let mut stream = c.read_shard(shard).await?;
            while let Some(b) = stream.next().await {
                b?;
            }
            Ok::<_, flightdeck_client::ClientError>(())
        };
        let err = read.await.expect_err("no partial data");
        assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    }
    assert!(
        err.message().contains(&members[sorted[2]].location()),
        "{err}"
    );
    c.drop_dataset("balanced").await.expect("drop everywhere");
    for m in &members {
        let err = m
            .client()
            .await
            .describe("balanced")
            .await
            .expect_err("gone");
        assert_eq!(err.code(), Code::NotFound);
    }
    // Written again, it is another seal: a read begun on the first is refused.
    write_node_dataset(&members, "balanced", &|p| sorted[p % 3], 12).await;
    let err = c
        .plan(ReadPlan {
            sealed_as,
            ..plan("balanced", 2, Shuffle::Global, 0)
        })
        .await
        .expect_err("written again");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    assert!(err.message().contains("since this read began"), "{err}");
}

/// Each rank's batches as their ids, read where each endpoint says.
async fn rank_batches(c: &mut Client, plan: ReadPlan) -> Vec<Vec<Vec<i64>>> {
    let p = timed("plan", c.plan(plan)).await.expect("plan");
    read_all(c, &p)
        .await
        .iter()
        .map(|batches| {
            let ids = |b: &RecordBatch| {
                let id = b.column_by_name("id").expect("id");
                id.as_primitive::<Int64Type>().values().to_vec()
            };
            batches.iter().map(ids).collect()
        })
        .collect()
}

/// A rank's stream split among DataLoader workers (`split_count`) on a
/// 6/4/2 layout: split `i` carries batches `i`, `i + count`, … of the whole
/// stream, exactly, for both localities — over `NODE` too, where a member
/// sends the rank's member only its moved rows of the split's batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn split_streams_carry_their_batches_of_the_whole_stream() {
    let members = start_members(&[]);
    let mut sorted: Vec<usize> = (0..3).collect();
    sorted.sort_by_key(|&m| members[m].location());
    write_node_dataset(&members, "split", &|p| sorted[owner(p)], 12).await;
    let mut c = members[0].client().await;
    // One rank a node: a member sends a node's rank fewer rows than the
    // rank reads (node 2 takes 100 of its 200 from node 0), found once up
    // front; two a node: as many, found batch by batch.
    let cases = [Locality::Global, Locality::Node]
        .into_iter()
        .flat_map(|l| [(l, 1), (l, 2)])
        .flat_map(|c| [(c, Shuffle::None), (c, Shuffle::Global)]);
    for ((locality, ranks_per_node), shuffle) in cases {
        {
            let whole_plan = ReadPlan {
                locality: locality.into(),
                ranks_per_node,
                batch_rows: 7,
                ..plan("split", 3 * ranks_per_node, shuffle, 1)
            };
            let whole = rank_batches(&mut c, whole_plan.clone()).await;
            assert!(whole.iter().all(|r| r.len() > 3), "several batches a rank");
            for count in [2, 3] {
                let mut rebuilt = vec![Vec::new(); whole.len()];
                for index in 0..count {
                    let split = ReadPlan {
                        split_count: count,
                        split_index: index,
                        ..whole_plan.clone()
                    };
                    for (r, batches) in rank_batches(&mut c, split).await.into_iter().enumerate() {
                        for (j, ids) in batches.into_iter().enumerate() {
                            rebuilt[r].push((j * count as usize + index as usize, ids));
                        }
                    }
                }
                for (r, mut batches) in rebuilt.into_iter().enumerate() {
                    batches.sort();
                    let ids: Vec<Vec<i64>> = batches.into_iter().map(|(_, ids)| ids).collect();
                    assert_eq!(
                        ids, whole[r],
                        "rank {r}, {locality:?} × {ranks_per_node}, {shuffle:?}, {count} splits"
                    );
                }
            }
        }
    }
}

/// Rows `ids` with forty nullable one-byte columns beside the id: a batch
/// of one row is eighty buffers of a few bytes.
fn narrow_columns(ids: std::ops::Range<i64>) -> RecordBatch {
    let mut columns: Vec<(String, ArrayRef)> = vec![(
        "id".into(),
        Arc::new(Int64Array::from_iter_values(ids.clone())),
    )];
    for c in 0..40i64 {
        let values = ids
            .clone()
            .map(|i| ((i + c) % 7 != 0).then_some((i % 100) as i8));
        columns.push((format!("c{c}"), Arc::new(Int8Array::from_iter(values))));
    }
    RecordBatch::try_from_iter(columns).expect("batch")
}

/// Batches of one row of many small columns, fetched from a peer faster
/// than the rank's member merges them: each message leaves in one piece,
/// not a frame per buffer, which an HTTP/2 receiver would take for a flood
/// of tiny frames (`ENHANCE_YOUR_CALM`, the read failing `RESOURCE_EXHAUSTED`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_peer_streams_batches_of_one_row_of_many_columns() {
    let members = start_members(&[]);
    let mut seal = Vec::new();
    for (p, (m, ids)) in [(0, 0..8_000), (1, 8_000..30_000)].into_iter().enumerate() {
        let b = narrow_columns(ids);
        let mut c = members[m].client().await;
        c.put_partition("narrow", p as u32, 0, b.schema(), stream::iter([Ok(b)]))
            .await
            .expect("put");
        seal.push(MemberPartitions {
            location: members[m].location(),
            partitions: vec![PartitionAttempt {
                partition: p as u32,
                attempt: 0,
            }],
        });
    }
    let mut c = members[0].client().await;
    timed("seal", c.seal_cluster("narrow", 2, seal))
        .await
        .expect("seal");
    let node = ReadPlan {
        locality: Locality::Node.into(),
        ranks_per_node: 2,
        batch_rows: 1,
        ..plan("narrow", 4, Shuffle::None, 0)
    };
    let ranks = rank_batches(&mut c, node).await;
    assert!(ranks.iter().all(|r| r.len() == 7_500), "a row a batch");
    let ids: HashSet<i64> = ranks.into_iter().flatten().flatten().collect();
    assert_eq!(ids.len(), 30_000, "every row once");
}

/// A batch as Spark writes an `array<float>` feature column: rows `ids`,
/// each an id, a label and a list of `width` floats.
fn spark_rows(ids: std::ops::Range<i64>, width: i32) -> RecordBatch {
    let values = Float32Array::from_iter_values(
        ids.clone()
            .flat_map(|id| (0..i64::from(width)).map(move |j| (id * 100 + j) as f32 + 0.5)),
    );
    let item = Arc::new(Field::new("element", DataType::Float32, true));
    let features = ListArray::new(
        item.clone(),
        OffsetBuffer::from_lengths(ids.clone().map(|_| width as usize)),
        Arc::new(values),
        None,
    );
    let schema = Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("label", DataType::Float32, false),
        Field::new("features", DataType::List(item), true),
    ]);
    let columns: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from_iter_values(ids.clone())),
        Arc::new(Float32Array::from_iter_values(
            ids.map(|id| (id % 10) as f32),
        )),
        Arc::new(features),
    ];
    RecordBatch::try_new(Arc::new(schema), columns).expect("batch")
}

/// The partition of [`sizes`] that row `id` is in.
fn partition_of(id: i64) -> usize {
    layout(&sizes())
        .iter()
        .position(|ids| ids.contains(&id))
        .expect("a row of the dataset")
}

/// Writes the 12 partitions of [`sizes`] as [`spark_rows`] to `members`
/// (by [`owner`]; member `m`'s lists hold `widths[m]` values a row) and to
/// `single`, and seals both.
async fn write_spark_rows(
    members: &[MemberProcess],
    single: &mut Client,
    ds: &str,
    widths: [i32; 3],
) {
    let mut seal: HashMap<String, Vec<PartitionAttempt>> = HashMap::new();
    for (p, ids) in layout(&sizes()).into_iter().enumerate() {
        let batches: Vec<RecordBatch> = ids
            .clone()
            .step_by(50)
            .map(|start| spark_rows(start..(start + 50).min(ids.end), widths[owner(p)]))
            .collect();
        let schema = batches[0].schema();
        let mut c = members[owner(p)].client().await;
        for client in [&mut c, &mut *single] {
            let batches = batches.clone().into_iter().map(Ok);
            timed(
                "put",
                client.put_partition(ds, p as u32, 0, schema.clone(), stream::iter(batches)),
            )
            .await
            .expect("put");
        }
        seal.entry(members[owner(p)].location())
            .or_default()
            .push(PartitionAttempt {
                partition: p as u32,
                attempt: 0,
            });
    }
    let seal = seal
        .into_iter()
        .map(|(location, partitions)| MemberPartitions {
            location,
            partitions,
        })
        .collect();
    let mut c = members[0].client().await;
    timed("seal", c.seal_cluster(ds, 12, seal))
        .await
        .expect("seal");
    timed("single seal", single.seal_cluster(ds, 12, Vec::new()))
        .await
        .expect("single seal");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn spark_array_columns_are_packed_on_members_that_agree_and_read_as_one_server() {
    let members = start_members(&[]);
    let single_server = TestServer::start().await;
    let mut single = single_server.client().await;
    let mut c = members[1].client().await;
    let held = member_rows();
    // Lists of 16 values on every member: packed beside id and label (76
    // bytes a record). Lists of 16 on two members and 8 on the third: read
    // column by column, only id and label packed (12 bytes a record).
    for (ds, widths, record) in [("spark", [16, 16, 16], 76), ("mixed", [16, 16, 8], 12)] {
        write_spark_rows(&members, &mut single, ds, widths).await;
        let before = stats(&members).await;
        // Shuffled and strided reads: the first epoch column by column,
        // later ones from the packed copy, every one the bytes of a server
        // holding every partition.
        for epoch in 0..3 {
            for (w, shuffle) in [
                (4, Shuffle::Global),
                (6, Shuffle::None),
                (6, Shuffle::Block),
            ] {
                let p = plan(ds, w, shuffle, epoch);
                let cluster = ranks_bytes(&mut c, p.clone()).await;
                let one = ranks_bytes(&mut single, p).await;
                assert!(
                    cluster == one,
                    "{ds}: W={w} {shuffle:?} epoch {epoch}: bytes differ"
                );
            }
            // NODE (3 nodes × 2 ranks), which no one server reads alike:
            // every row once, each with its own features.
            let node = ReadPlan {
                locality: Locality::Node.into(),
                ranks_per_node: 2,
                ..plan(ds, 6, Shuffle::Global, epoch)
            };
            let node = c.plan(node).await.expect("node plan");
            let mut seen = HashSet::new();
            for batch in read_all(&mut c, &node).await.iter().flatten() {
                let ids = batch.column(0).as_primitive::<Int64Type>();
                let features = batch.column(2).as_list::<i32>();
                for (r, id) in ids.values().iter().enumerate() {
                    let width = widths[owner(partition_of(*id))];
                    let got = features.value(r);
                    let want = spark_rows(*id..*id + 1, width);
                    assert_eq!(
                        &got,
                        want.column(2).as_list::<i32>().values(),
                        "{ds}: NODE epoch {epoch}, row {id}"
                    );
                    assert!(seen.insert(*id), "{ds}: row {id} twice");
                }
            }
            assert_eq!(seen.len() as u64, held.iter().sum::<u64>());
        }
        let after = stats(&members).await;
        for (m, rows) in held.iter().enumerate() {
            let packed = after[m].packed_bytes - before[m].packed_bytes;
            assert!(
                packed >= rows * record && packed < rows * (record + 32),
                "{ds}: member {m} packed {packed} bytes for {rows} rows of {record} bytes"
            );
        }
    }
}

/// Floats in a row of [`wide`]: 4 KiB a row.
const WIDTH: i32 = 1024;

/// A batch of rows `ids`: an id and a [`WIDTH`]-float feature vector, so a
/// rank's stream is far larger than what the transport buffers.
fn wide(ids: std::ops::Range<i64>) -> RecordBatch {
    let n = (ids.end - ids.start) as usize;
    let values = Float32Array::from_iter_values(
        ids.clone()
            .flat_map(|id| (0..WIDTH as i64).map(move |j| (id * WIDTH as i64 + j) as f32)),
    );
    let item = Arc::new(Field::new("item", DataType::Float32, false));
    let columns: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from_iter_values(ids)),
        Arc::new(FixedSizeListArray::new(
            item.clone(),
            WIDTH,
            Arc::new(values),
            None,
        )),
    ];
    let schema = Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("x", DataType::FixedSizeList(item, WIDTH), false),
    ]);
    assert_eq!(columns[0].len(), n);
    RecordBatch::try_new(Arc::new(schema), columns).expect("batch")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_member_is_unavailable_and_a_restart_resumes_the_epoch() {
    const PARTS: i64 = 6;
    const PER_PART: i64 = 8_000;
    const BATCH: u32 = 500;
    let dirs: Vec<_> = (0..3).map(|i| temp_dir(&format!("persist-{i}"))).collect();
    let mut members: Vec<MemberProcess> = dirs
        .iter()
        .map(|d| {
            let url = d.display().to_string();
            MemberProcess::start("127.0.0.1:0", &["--persist", "--spill-url", url.as_str()])
        })
        .collect();
    // Two ranks, each served by its own member (members sort by port); the
    // third member serves no rank and dies. It holds 4 of the 6 partitions,
    // so each rank needs 64 MiB from it: far more than a peer stream and the
    // sockets under it can hold ahead (8 MiB windows each way plus kernel
    // buffers), so its death is always met mid-stream.
    let mut order: Vec<usize> = (0..3).collect();
    order.sort_by_key(|&m| members[m].location());
    let victim = order[2];
    let holder = |p: i64| match p {
        0..4 => order[2],
        4 => order[0],
        _ => order[1],
    };
    let mut seal: Vec<MemberPartitions> = Vec::new();
    for (m, member) in members.iter().enumerate() {
        let mut c = member.client().await;
        let mut partitions = Vec::new();
        for p in (0..PARTS).filter(|&p| holder(p) == m) {
            let b = wide(p * PER_PART..(p + 1) * PER_PART);
            let batches: Vec<_> = (0..PER_PART as usize)
                .step_by(2_000)
                .map(|o| Ok(b.slice(o, 2_000)))
                .collect();
            c.put_partition("wide", p as u32, 0, b.schema(), stream::iter(batches))
                .await
                .expect("put");
            partitions.push(PartitionAttempt {
                partition: p as u32,
                attempt: 0,
            });
        }
        seal.push(MemberPartitions {
            location: member.location(),
            partitions,
        });
    }
    let mut c = members[0].client().await;
    c.seal_cluster("wide", PARTS as u32, seal)
        .await
        .expect("seal");
    let read_plan = ReadPlan {
        batch_rows: BATCH,
        ..plan("wide", 2, Shuffle::Global, 0)
    };
    let p = c.plan(read_plan.clone()).await.expect("plan");
    let mut streams = Vec::new();
    for shard in &p.shards {
        let mut reader = Client::connect(shard.location.clone().expect("location"))
            .await
            .expect("connect");
        streams.push(reader.read_shard(shard).await.expect("stream"));
    }
    // Both ranks take 3 steps, then a member dies.
    let ids_of =
        |b: &RecordBatch| -> Vec<i64> { b.column(0).as_primitive::<Int64Type>().values().to_vec() };
    let mut seen = HashSet::new();
    for _ in 0..3 {
        for s in &mut streams {
            let b = s.next().await.expect("a batch").expect("rows");
            seen.extend(ids_of(&b));
        }
    }
    members[victim].kill();
    let victim_location = members[victim].location();
    let died = Instant::now();
    let err = loop {
        match timed("next batch", streams[0].next()).await {
            Some(Ok(_)) => continue,
            Some(Err(e)) => break e,
            None => panic!("the stream ended cleanly without the dead member's rows"),
        }
    };
    assert!(
        died.elapsed() < flightdeck_tests::scaled(Duration::from_secs(10)),
        "{:?}",
        died.elapsed()
    );
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    assert!(err.message().contains(&victim_location), "{err}");
    drop(streams);
    let err = c
        .plan(read_plan.clone())
        .await
        .expect_err("a member is down");
    assert_eq!(err.code(), Code::Unavailable, "{err}");

    // Restarted with --persist: resume from the 3 steps both ranks took.
    members[victim].restart();
    let resumed = ReadPlan {
        start_sample: 3 * u64::from(BATCH) * 2,
        ..read_plan
    };
    let p = timed("plan", c.plan(resumed))
        .await
        .expect("plan after restart");
    let rest: Vec<i64> = read_all(&mut c, &p)
        .await
        .iter()
        .flatten()
        .flat_map(&ids_of)
        .collect();
    let total = (PARTS * PER_PART) as usize;
    assert_eq!(rest.len() + seen.len(), total);
    let rest: HashSet<i64> = rest.into_iter().collect();
    assert!(rest.is_disjoint(&seen), "no row read twice");
    assert_eq!(rest.len() + seen.len(), total, "every remaining row once");
}

/// Writes partition `p` of `ds` (ids `p*1000..(p+1)*1000`) through
/// `clients[p]`; returns the seal's layout, naming `locations[p]` for it.
async fn one_partition_each(
    clients: &mut [Client],
    locations: &[String],
    ds: &str,
) -> Vec<MemberPartitions> {
    let mut seal = Vec::new();
    for (p, (c, location)) in clients.iter_mut().zip(locations).enumerate() {
        let ids = (p as i64) * 1_000..(p as i64 + 1) * 1_000;
        c.put_partition(
            ds,
            p as u32,
            0,
            schema(),
            stream::iter(partition_batches(ids, 0, 100).into_iter().map(Ok)),
        )
        .await
        .expect("put");
        seal.push(MemberPartitions {
            location: location.clone(),
            partitions: vec![PartitionAttempt {
                partition: p as u32,
                attempt: 0,
            }],
        });
    }
    seal
}

/// The ids of every row of every shard of a two-rank plan of `ds`.
async fn ids_of_two_ranks(c: &mut Client, ds: &str) -> HashSet<i64> {
    let plan = c
        .plan(ReadPlan {
            dataset: ds.into(),
            world_size: 2,
            ..Default::default()
        })
        .await
        .expect("plan");
    read_all(c, &plan)
        .await
        .iter()
        .flatten()
        .flat_map(|b| check_batch(b, &|_| 0))
        .collect()
}

/// Two members that need tokens (`writer w-secret`, `reader r-secret`),
/// each holding one partition of `ds`, not yet sealed: the folder of their
/// token file, the members, a writer's client of each, and the seal's
/// layout.
async fn guarded_members(
    ds: &str,
) -> (
    flightdeck_tests::TempDir,
    Vec<MemberProcess>,
    Vec<Client>,
    Vec<MemberPartitions>,
) {
    let dir = temp_dir("tokens");
    let file = dir.join("tokens");
    std::fs::write(&file, "writer w-secret\nreader r-secret\n").expect("token file");
    let file = file.display().to_string();
    let members: Vec<MemberProcess> = (0..2)
        .map(|_| MemberProcess::start("127.0.0.1:0", &["--auth-token-file", file.as_str()]))
        .collect();
    let mut writers = Vec::new();
    for m in &members {
        writers.push(m.client().await.with_token("w-secret").expect("token"));
    }
    let locations: Vec<String> = members.iter().map(MemberProcess::location).collect();
    let seal = one_partition_each(&mut writers, &locations, ds).await;
    (dir, members, writers, seal)
}

/// Members started with a token file send its writer token on their calls
/// to each other: a writer seals a cluster dataset through one member (which
/// prepares and commits the others), and a reader's ranks read their shards,
/// rows fetched from the other member included. Without a token nothing is
/// served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_with_tokens_call_each_other_with_the_clusters_token() {
    let ds = "guarded";
    let (_dir, members, mut writers, seal) = guarded_members(ds).await;
    let mut reader = members[0]
        .client()
        .await
        .with_token("r-secret")
        .expect("token");
    let err = reader
        .seal_cluster(ds, 2, seal.clone())
        .await
        .expect_err("a reader cannot seal");
    assert_eq!(err.code(), Code::PermissionDenied, "{err}");
    timed("seal", writers[0].seal_cluster(ds, 2, seal))
        .await
        .expect("seal");
    let mut reader = members[1]
        .client()
        .await
        .with_token("r-secret")
        .expect("token");
    assert_eq!(
        ids_of_two_ranks(&mut reader, ds).await,
        (0..2_000).collect::<HashSet<i64>>()
    );
    let err = members[1]
        .client()
        .await
        .plan(ReadPlan {
            dataset: ds.into(),
            world_size: 2,
            ..Default::default()
        })
        .await
        .expect_err("no token");
    assert_eq!(err.code(), Code::Unauthenticated, "{err}");
}

/// `flightdeck` run as `args`, with `FLIGHTDECK_TOKEN` set to `token`
/// (unset for `None`): its exit status, stdout and stderr.
async fn cli(args: &[&str], token: Option<&str>) -> (bool, String, String) {
    let mut command = std::process::Command::new(flightdeck_tests::server_binary());
    command.args(args).env_remove("FLIGHTDECK_URI");
    match token {
        Some(t) => command.env("FLIGHTDECK_TOKEN", t),
        None => command.env_remove("FLIGHTDECK_TOKEN"),
    };
    let out = timed(
        "flightdeck command",
        tokio::task::spawn_blocking(move || command.output()),
    )
    .await
    .expect("joined")
    .expect("the binary runs");
    let text = |b: Vec<u8>| String::from_utf8(b).expect("UTF-8");
    (out.status.success(), text(out.stdout), text(out.stderr))
}

/// An operator at the command line, on members that need tokens: without
/// one every command is refused and says so; with the reader's token
/// `datasets`, `describe` and `stats` on either member show the cluster
/// dataset whole (every member's location and partitions), and `drop` is
/// refused; without a GPU `place` is refused saying why; with the writer's
/// token `drop` through one member removes the dataset from both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_lists_describes_and_drops_a_cluster_dataset_from_the_command_line() {
    let ds = "clicks";
    let (_dir, members, mut writers, seal) = guarded_members(ds).await;
    let locations: Vec<String> = members.iter().map(MemberProcess::location).collect();
    timed("seal", writers[0].seal_cluster(ds, 2, seal))
        .await
        .expect("seal");
    let servers: Vec<String> = members.iter().map(|m| m.addr().to_string()).collect();

    let (ok, _, err) = cli(&["datasets", "--server", &servers[0]], None).await;
    assert!(!ok && err.contains("(Unauthenticated)"), "{err}");

    for server in &servers {
        let (ok, out, err) = cli(&["datasets", "--server", server], Some("r-secret")).await;
        assert!(ok, "{err}");
        let lines: Vec<Vec<&str>> = out
            .lines()
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert_eq!(lines.len(), 2, "{out}");
        assert_eq!(lines[1][..4], [ds, "sealed", "2000", "2"], "{out}");
        assert!(out.contains("2 members"), "{out}");

        let (ok, out, err) = cli(&["describe", ds, "--server", server], Some("r-secret")).await;
        assert!(ok, "{err}");
        assert!(out.lines().any(|l| l == "rows        2000"), "{out}");
        assert!(out.contains("  id: Int64"), "{out}");
        for (p, location) in locations.iter().enumerate() {
            let member = out
                .lines()
                .find(|l| l.trim_start().starts_with(&format!("{location} ")))
                .unwrap_or_else(|| panic!("no line for {location} in\n{out}"));
            let words: Vec<&str> = member.split_whitespace().collect();
            assert_eq!(words[1], "1000", "{member}");
            assert_eq!(words[3], p.to_string(), "{member}");
        }
    }

    let (ok, out, err) = cli(&["stats", "--server", &servers[1]], Some("r-secret")).await;
    assert!(ok, "{err}");
    let location = format!("location    {}", locations[1]);
    assert!(out.lines().any(|l| l == location), "{out}");
    assert!(
        out.contains("datasets    1 (1 sealed, 0 spilled): 1000 rows"),
        "{out}"
    );

    // `--json`: the same replies as one JSON document each, for scripts.
    let json = async |args: &[&str]| -> serde_json::Value {
        let (ok, out, err) = cli(args, Some("r-secret")).await;
        assert!(ok, "{err}");
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: not JSON:\n{out}"))
    };
    let listed = json(&["datasets", "--json", "--server", &servers[0]]).await;
    assert_eq!(listed.as_array().map(Vec::len), Some(1), "{listed:#}");
    assert_eq!(listed[0]["dataset"], ds, "{listed:#}");
    let described = json(&["describe", ds, "--json", "--server", &servers[1]]).await;
    assert_eq!(described["state"], "sealed", "{described:#}");
    assert_eq!(described["rows"], 2000, "{described:#}");
    let columns = described["schema"].as_array().expect("schema fields");
    assert!(
        columns
            .iter()
            .any(|c| c["name"] == "id" && c["type"] == "Int64"),
        "{described:#}"
    );
    let mut held: Vec<(String, u64)> = described["layout"]["members"]
        .as_array()
        .expect("members")
        .iter()
        .map(|m| {
            let at = m["location"].as_str().expect("location").to_string();
            (at, m["rows"].as_u64().expect("rows"))
        })
        .collect();
    held.sort();
    let mut want: Vec<(String, u64)> = locations.iter().map(|l| (l.clone(), 1000)).collect();
    want.sort();
    assert_eq!(held, want, "{described:#}");
    let stats = json(&["stats", "--json", "--server", &servers[1]]).await;
    assert_eq!(stats["location"], locations[1].as_str(), "{stats:#}");
    assert_eq!(stats["rows"], 1000, "{stats:#}");
    assert_eq!(
        json(&["jobs", "--json", "--server", &servers[1]]).await,
        serde_json::json!([])
    );

    // The device tier on members started with --no-cuda: `place` is
    // refused saying so and what to do instead; nothing is on a GPU to evict.
    let (ok, _, err) = cli(
        &["place", ds, "--devices", "0,1", "--server", &servers[0]],
        Some("w-secret"),
    )
    .await;
    assert!(!ok, "placed without a GPU");
    assert!(
        err.contains("--no-cuda")
            && err.contains("with the Python client's FlightDeckIterableDataset instead")
            && err.ends_with("(FailedPrecondition)\n"),
        "{err}"
    );
    let (ok, out, err) = cli(&["evict", ds, "--server", &servers[0]], Some("w-secret")).await;
    assert!(ok, "{err}");
    assert_eq!(out, "'clicks' has no columns on a GPU\n");

    let (ok, _, err) = cli(&["drop", ds, "--server", &servers[1]], Some("r-secret")).await;
    assert!(!ok && err.contains("(PermissionDenied)"), "{err}");
    let (ok, out, err) = cli(&["drop", ds, "--server", &servers[1]], Some("w-secret")).await;
    assert!(ok, "{err}");
    assert!(
        out.starts_with("dropped 'clicks' on all 2 members: 2000 rows"),
        "{out}"
    );
    for server in &servers {
        let (ok, out, err) = cli(&["datasets", "--server", server], Some("r-secret")).await;
        assert!(ok, "{err}");
        assert_eq!(out, "no datasets\n");
        let (ok, _, err) = cli(&["describe", ds, "--server", server], Some("r-secret")).await;
        assert!(!ok, "described a dropped dataset");
        assert!(
            err.contains("`flightdeck datasets` lists what the server holds (NotFound)"),
            "{err}"
        );
    }
}

/// The data rows of a table `flightdeck sql` printed, each row's words
/// (the lines between the header and the row count).
fn table_rows(out: &str) -> Vec<Vec<String>> {
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines.len() >= 2, "{out}");
    lines[1..lines.len() - 1]
        .iter()
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect()
}

/// An operator's queries at the command line, through one member of a
/// cluster that needs tokens: `sql` reads every member's rows, prints the
/// first `--max-rows` as a table and says how many there were, and prints
/// JSON lines with `--json`; a table named but for case says how to quote
/// it, one that is no dataset names those there are, and a statement that
/// writes is refused pointing to `flightdeck derive`; `derive` needs the
/// writer's token and keeps a query's result as a dataset `sql` then reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_queries_a_cluster_dataset_and_derives_from_it_from_the_command_line() {
    let ds = "Clicks";
    let (_dir, members, mut writers, seal) = guarded_members(ds).await;
    timed("seal", writers[0].seal_cluster(ds, 2, seal))
        .await
        .expect("seal");
    let server = members[1].addr().to_string();
    let sql = async |args: &[&str], token: &str| {
        let mut all = vec!["sql", "--server", server.as_str()];
        all.extend_from_slice(args);
        cli(&all, Some(token)).await
    };

    let (ok, _, err) = cli(&["sql", "--server", &server, "SELECT 1"], None).await;
    assert!(!ok && err.contains("(Unauthenticated)"), "{err}");

    let count = r#"SELECT count(*) AS n, min(id) AS lo, max(id) AS hi FROM "Clicks""#;
    let (ok, out, err) = sql(&[count], "r-secret").await;
    assert!(ok, "{err}");
    assert_eq!(table_rows(&out), [["2000", "0", "1999"]], "{out}");
    assert!(out.ends_with("(1 row)\n"), "{out}");

    let first = r#"SELECT id, name FROM "Clicks" ORDER BY id DESC"#;
    let (ok, out, err) = sql(&[first, "--max-rows", "3"], "r-secret").await;
    assert!(ok, "{err}");
    let ids: Vec<String> = table_rows(&out).into_iter().map(|r| r[0].clone()).collect();
    assert_eq!(ids, ["1999", "1998", "1997"], "{out}");
    assert!(
        out.ends_with("(2000 rows, the first 3 shown; --max-rows 0 prints all)\n"),
        "{out}"
    );

    // JSON lines: every row, from both members.
    let some = r#"SELECT id, x FROM "Clicks" WHERE id % 500 = 0 ORDER BY id"#;
    let (ok, out, err) = sql(&[some, "--json"], "r-secret").await;
    assert!(ok, "{err}");
    let rows: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let ids: Vec<i64> = rows.iter().map(|r| r["id"].as_i64().expect("id")).collect();
    assert_eq!(ids, [0, 500, 1000, 1500], "{out}");
    assert!(rows.iter().all(|r| r["x"].is_number()), "{out}");
    // A null is a key with null, as in every other line.
    let nulls = r#"SELECT id, CASE WHEN id = 0 THEN NULL ELSE x END AS x FROM "Clicks" WHERE id < 2 ORDER BY id"#;
    let (ok, out, err) = sql(&[nulls, "--json"], "r-secret").await;
    assert!(ok, "{err}");
    let first: serde_json::Value = serde_json::from_str(out.lines().next().unwrap_or_default())
        .unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(first, serde_json::json!({"id": 0, "x": null}), "{out}");
    // Rows left out by --max-rows are counted on stderr; stdout stays JSON.
    let (ok, out, err) = sql(&[some, "--json", "--max-rows", "3"], "r-secret").await;
    assert!(ok, "{err}");
    assert_eq!(out.lines().count(), 3, "{out}");
    assert!(
        err.contains("(4 rows, the first 3 printed; --max-rows 0 prints all)"),
        "{err}"
    );

    for (query, words) in [
        (
            "SELECT * FROM clicks",
            r#"dataset 'Clicks' is a table, but SQL lowercases names not in double quotes: write "Clicks""#,
        ),
        (
            "SELECT * FROM views",
            "the tables (the sealed datasets) are: Clicks",
        ),
        (
            r#"DROP TABLE "Clicks""#,
            "read-only (use `flightdeck derive` to keep a result as a dataset)",
        ),
    ] {
        let (ok, out, err) = sql(&[query], "r-secret").await;
        assert!(!ok, "{query} ran:\n{out}");
        assert!(
            err.contains(words) && err.contains("(InvalidArgument)"),
            "{query}: {err}"
        );
    }

    let derive = |token| {
        let server = server.clone();
        async move {
            let args = [
                "derive",
                "--server",
                &server,
                "evens",
                "SELECT * FROM source WHERE id % 2 = 0",
                "--source",
                "Clicks",
            ];
            cli(&args, Some(token)).await
        }
    };
    let (ok, _, err) = derive("r-secret").await;
    assert!(!ok && err.contains("(PermissionDenied)"), "{err}");
    let (ok, out, err) = derive("w-secret").await;
    assert!(ok, "{err}");
    assert!(out.lines().any(|l| l == "rows        1000"), "{out}");
    assert!(out.lines().any(|l| l == "dataset     evens"), "{out}");
    let (ok, out, err) = sql(
        &["SELECT count(*) AS n, sum(id % 2) AS odd FROM evens"],
        "r-secret",
    )
    .await;
    assert!(ok, "{err}");
    assert_eq!(table_rows(&out), [["1000", "0"]], "{out}");
    let (ok, _, err) = derive("w-secret").await;
    assert!(
        !ok && err.contains("exists") && err.contains("(FailedPrecondition)"),
        "{err}"
    );
    let (ok, _, err) = sql(&["SELECT * FROM views"], "r-secret").await;
    assert!(
        !ok && err.contains("the tables (the sealed datasets) are: Clicks, evens"),
        "{err}"
    );
}

/// Members served over TLS reach each other over TLS (trusting `--tls-ca`):
/// a seal through one member seals the other, and ranks read rows that one
/// member fetches from the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_over_tls_call_each_other_over_tls() {
    let dir = temp_dir("cluster-tls");
    let certs = flightdeck_tests::TestCerts::make(&dir);
    let paths = [&certs.cert, &certs.key, &certs.ca].map(|p| p.display().to_string());
    let args = [
        "--tls-cert",
        paths[0].as_str(),
        "--tls-key",
        paths[1].as_str(),
        "--tls-ca",
        paths[2].as_str(),
    ];
    let members: Vec<MemberProcess> = (0..2)
        .map(|_| MemberProcess::start("127.0.0.1:0", &args))
        .collect();
    let ca = std::fs::read(&certs.ca).expect("ca");
    let locations: Vec<String> = members
        .iter()
        .map(|m| format!("grpc+tls://{}", m.addr()))
        .collect();
    let mut clients = Vec::new();
    for l in &locations {
        clients.push(Client::connect_with(l, Some(&ca)).await.expect("connect"));
    }
    let ds = "private";
    let seal = one_partition_each(&mut clients, &locations, ds).await;
    timed("seal", clients[0].seal_cluster(ds, 2, seal))
        .await
        .expect("seal");
    assert_eq!(
        ids_of_two_ranks(&mut clients[1], ds).await,
        (0..2_000).collect::<HashSet<i64>>()
    );
}

/// A member also serving on a Unix socket: a client on the socket writes,
/// seals and reads the cluster dataset. The shards its own member serves
/// stay on the socket — they still read after the member's advertised
/// network location (a proxy here) is cut — and every row is read once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_on_a_members_unix_socket_reads_its_shards_there() {
    let dir = temp_dir("cluster-unix");
    let socket = dir.join("fd.sock").display().to_string();
    let listen = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port");
    let proxy = CutProxy::start(listen).await;
    let near = MemberProcess::start(
        &listen.to_string(),
        &[
            "--unix-socket",
            socket.as_str(),
            "--advertise",
            proxy.uri().as_str(),
        ],
    );
    let far = MemberProcess::start("127.0.0.1:0", &[]);
    let mut local = Client::connect(format!("grpc+unix://{socket}"))
        .await
        .expect("connect to the socket");
    let mut clients = vec![local.clone(), far.client().await];
    let locations = vec![proxy.uri(), far.location()];
    let ds = "near";
    let seal = one_partition_each(&mut clients, &locations, ds).await;
    timed("seal", local.seal_cluster(ds, 2, seal))
        .await
        .expect("seal over the socket");
    let plan = |locality: Locality| ReadPlan {
        dataset: ds.into(),
        world_size: 2,
        locality: locality.into(),
        ranks_per_node: 1,
        ..Default::default()
    };
    for locality in [Locality::Global, Locality::Node] {
        let p = local.plan(plan(locality)).await.expect("plan");
        let ids: HashSet<i64> = read_all(&mut local, &p)
            .await
            .iter()
            .flatten()
            .flat_map(|b| check_batch(b, &|_| 0))
            .collect();
        assert_eq!(ids, (0..2_000).collect::<HashSet<i64>>(), "{locality:?}");
    }
    let p = local.plan(plan(Locality::Node)).await.expect("plan");
    proxy.cut();
    let own: Vec<&Shard> = p
        .shards
        .iter()
        .filter(|s| {
            s.location.as_deref().map(server_location_of) == Some(server_location_of(&locations[0]))
        })
        .collect();
    assert_eq!(own.len(), 1, "{:?}", p.shards);
    let batches: Vec<RecordBatch> = local
        .read_shard(own[0])
        .await
        .expect("the near member's shard, on the socket")
        .try_collect()
        .await
        .expect("batches");
    let ids: HashSet<i64> = batches
        .iter()
        .flat_map(|b| check_batch(b, &|_| 0))
        .collect();
    assert_eq!(ids, (0..1_000).collect::<HashSet<i64>>());
    drop(near);
}

/// A location as the client names it (`http://` and `grpc://` alike).
fn server_location_of(at: &str) -> String {
    flightdeck_client::server_location(at).expect("a location")
}
