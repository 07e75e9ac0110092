//! End to end over loopback: concurrent writers with duplicate and broken
//! attempts, seal naming winners, and balanced, shuffled shards read back by
//! 1, 3 and 8 ranks with every value checked; plain Flight clients and the
//! metadata calls (`ListFlights`, `GetSchema`) as the protocol table says.

use std::collections::{HashMap, HashSet};

use arrow::array::RecordBatch;
use arrow_flight::FlightDescriptor;
use flightdeck_client::{
    Client, DatasetState, PartitionAttempt, ReadPlan, SealDataset, Shard, Shuffle,
};
use flightdeck_server::ServerConfig;
use flightdeck_tests::{
    CutProxy, TestServer, attempts_by_id, check_batch, layout, partition_batches, put_ids,
    raw_bytes, schema, timed,
};
use futures::{StreamExt, TryStreamExt, stream};

/// Rows per partition: mixed sizes, one empty, one single row.
const SIZES: [i64; 16] = [
    1200, 0, 37, 3000, 1, 2500, 640, 999, 1500, 13, 2048, 777, 300, 4096, 5, 1111,
];
const DATASET: &str = "events";
/// Partition written twice; the seal names its second attempt.
const NAMED_TWICE: u32 = 3;
/// Partition written twice; first committed (attempt 0) wins.
const FIRST_WINS: u32 = 7;
/// Partition whose attempt 0 is cut off mid-stream; attempt 1 succeeds.
const CUT_OFF: u32 = 5;

async fn put(client: &mut Client, p: u32, attempt: u32, ids: std::ops::Range<i64>) -> u64 {
    let ack = put_ids(client, DATASET, p, attempt, ids.clone(), 500)
        .await
        .expect("put succeeds");
    assert_eq!((ack.partition, ack.attempt), (p, attempt));
    assert_eq!(ack.rows, (ids.end - ids.start) as u64);
    ack.bytes
}

async fn live_bytes(client: &mut Client) -> u64 {
    client.stats().await.expect("stats").host_live_bytes
}

async fn wait_for(client: &mut Client, what: &str, pred: impl Fn(u64) -> bool) {
    flightdeck_tests::eventually(what, || {
        let mut client = client.clone();
        let pred = &pred;
        async move {
            let used = live_bytes(&mut client).await;
            if pred(used) { Ok(()) } else { Err(used) }
        }
    })
    .await
}

/// An attempt whose connection is cut mid-stream (an executor dying): the
/// server must have staged bytes, then free them and keep nothing.
async fn cut_off_attempt(server: &TestServer, ids: std::ops::Range<i64>) {
    let mut probe = server.client().await;
    assert_eq!(live_bytes(&mut probe).await, 0);
    let proxy = CutProxy::start(server.addr()).await;
    let mut writer = timed("connect", Client::connect(proxy.uri()))
        .await
        .expect("connect through the proxy");
    let first = partition_batches(ids.start..ids.start + 1500, 0, 500);
    let task = tokio::spawn(async move {
        // A few batches, then the writer stalls as if its task hung.
        let batches = stream::iter(first.into_iter().map(Ok)).chain(stream::pending());
        writer
            .put_partition(DATASET, CUT_OFF, 0, schema(), batches)
            .await
    });
    wait_for(&mut probe, "staging the cut-off attempt", |used| used > 0).await;
    proxy.cut();
    let err = timed("the cut-off writer", task)
        .await
        .expect("writer task")
        .expect_err("a cut stream cannot succeed");
    // The connection broke under it (how tonic reports a broken pipe), not
    // a verdict of the server's.
    assert!(
        matches!(err.code(), tonic::Code::Unknown | tonic::Code::Unavailable),
        "{err:?}"
    );
    wait_for(&mut probe, "freeing the cut-off attempt", |used| used == 0).await;
    let err = probe
        .describe(DATASET)
        .await
        .expect_err("nothing committed");
    assert_eq!(err.code(), tonic::Code::NotFound, "{err}");
}

/// Writes the dataset: the cut-off attempt first, then 4 concurrent writers.
/// Returns the winner attempt of each partition.
async fn write_dataset(server: &TestServer) -> HashMap<u32, u32> {
    let parts = layout(&SIZES);
    cut_off_attempt(server, parts[CUT_OFF as usize].clone()).await;

    let mut writers = Vec::new();
    for w in 0..4u32 {
        let mut client = server.client().await;
        let parts = parts.clone();
        writers.push(tokio::spawn(async move {
            let mut bytes = 0;
            for p in (w..16).step_by(4) {
                let ids = parts[p as usize].clone();
                match p {
                    NAMED_TWICE | FIRST_WINS => {
                        bytes += put(&mut client, p, 0, ids.clone()).await;
                        bytes += put(&mut client, p, 1, ids).await;
                    }
                    CUT_OFF => bytes += put(&mut client, p, 1, ids).await,
                    _ => bytes += put(&mut client, p, 0, ids).await,
                }
            }
            bytes
        }));
    }
    let mut staged = 0;
    for w in writers {
        staged += timed("writer", w).await.expect("writer task");
    }
    let mut client = server.client().await;
    assert_eq!(live_bytes(&mut client).await, staged);

    let open = client.describe(DATASET).await.expect("describe");
    assert_eq!(open.state, DatasetState::Open as i32);
    assert_eq!(open.committed_partitions, 16);
    assert_eq!(open.bytes, staged);

    let sealed = client
        .seal(SealDataset {
            dataset: DATASET.into(),
            partitions: 16,
            attempts: vec![
                PartitionAttempt {
                    partition: NAMED_TWICE,
                    attempt: 1,
                },
                PartitionAttempt {
                    partition: CUT_OFF,
                    attempt: 1,
                },
            ],
            ..Default::default()
        })
        .await
        .expect("seal");
    assert_eq!(sealed.state, DatasetState::Sealed as i32);
    assert_eq!(sealed.rows, SIZES.iter().sum::<i64>() as u64);
    let by_partition: HashMap<u32, (u32, u32)> = sealed
        .partitions
        .iter()
        .map(|p| (p.partition, (p.attempt, p.committed_attempts)))
        .collect();
    assert_eq!(by_partition[&NAMED_TWICE], (1, 2));
    assert_eq!(by_partition[&FIRST_WINS], (0, 2));
    assert_eq!(by_partition[&CUT_OFF], (1, 1));
    // Losers were freed at seal.
    assert_eq!(live_bytes(&mut client).await, sealed.bytes);
    assert!(sealed.bytes < staged);

    HashMap::from([(NAMED_TWICE, 1), (FIRST_WINS, 0), (CUT_OFF, 1)])
}

/// Reads every shard of a plan concurrently, each rank on its own connection.
async fn read_all(server: &TestServer, shards: &[Shard]) -> Vec<Vec<RecordBatch>> {
    let mut tasks = Vec::new();
    for shard in shards {
        let shard = shard.clone();
        let mut client = server.client().await;
        tasks.push(tokio::spawn(async move {
            let s = client.read_shard(&shard).await?;
            s.try_collect::<Vec<_>>().await
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(timed("read shard", t).await.expect("task").expect("read"));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_ingest_then_balanced_shuffled_shards() {
    let server = TestServer::start().await;
    let winners = write_dataset(&server).await;
    let attempts = attempts_by_id(&layout(&SIZES), &winners);
    let attempt_of = |id: i64| attempts[&id];
    let n = SIZES.iter().sum::<i64>() as u64;
    let mut client = server.client().await;

    let modes = [
        ("none", Shuffle::None, 0),
        ("global", Shuffle::Global, 0),
        ("block", Shuffle::Block, 64),
    ];
    for world_size in [1u32, 3, 8] {
        for (mode, shuffle, block_rows) in modes {
            let mut orders = Vec::new();
            for epoch in [0u64, 1] {
                let ctx = format!("W={world_size} mode={mode} epoch={epoch}");
                let plan = client
                    .plan(ReadPlan {
                        dataset: DATASET.into(),
                        world_size,
                        epoch,
                        seed: 1234,
                        shuffle: shuffle.into(),
                        batch_rows: 700,
                        block_rows,
                        ..Default::default()
                    })
                    .await
                    .expect("plan");
                assert_eq!(plan.shards.len(), world_size as usize, "{ctx}");
                let per_rank = n.div_ceil(u64::from(world_size));
                assert_eq!(plan.total_rows, per_rank * u64::from(world_size), "{ctx}");
                let shards = read_all(&server, &plan.shards).await;

                // Equal counts, batches of the plan's size, values intact.
                let mut ids_by_rank = Vec::new();
                for (shard, batches) in plan.shards.iter().zip(&shards) {
                    assert_eq!(shard.rows, per_rank, "{ctx}");
                    assert_eq!(batches.len() as u64, shard.batches, "{ctx}");
                    let mut ids = Vec::new();
                    for (i, b) in batches.iter().enumerate() {
                        if i + 1 < batches.len() {
                            assert_eq!(b.num_rows(), 700, "{ctx}");
                        }
                        assert_eq!(b.schema(), schema(), "{ctx}");
                        ids.extend(check_batch(b, &attempt_of));
                    }
                    assert_eq!(ids.len() as u64, per_rank, "{ctx}");
                    ids_by_rank.push(ids);
                }

                // Strided global order: position q is rank q % W, step q / W.
                let w = world_size as usize;
                let global: Vec<i64> = (0..per_rank as usize * w)
                    .map(|q| ids_by_rank[q % w][q / w])
                    .collect();
                let (first, tail) = global.split_at(n as usize);
                let distinct: HashSet<i64> = first.iter().copied().collect();
                assert_eq!(distinct.len() as u64, n, "{ctx}: every row exactly once");
                assert_eq!(tail, &global[..tail.len()], "{ctx}: wrap-around");
                if shuffle == Shuffle::None {
                    assert!(first.windows(2).all(|p| p[0] < p[1]), "{ctx}: in order");
                }

                // Determinism: the same ticket gives identical bytes.
                let ticket = plan.shards[w - 1].ticket.clone();
                let a = raw_bytes(&mut client, ticket.clone()).await;
                let b = raw_bytes(&mut client, ticket).await;
                assert!(!a.is_empty());
                assert_eq!(a, b, "{ctx}: same ticket, same bytes");
                orders.push(global);
            }
            if shuffle == Shuffle::None {
                assert_eq!(
                    orders[0], orders[1],
                    "W={world_size}: none ignores the epoch"
                );
            } else {
                assert_ne!(orders[0], orders[1], "W={world_size} {mode}: epochs differ");
            }
        }
    }

    // drop_last: equal truncated shares, no row twice.
    let plan = client
        .plan(ReadPlan {
            dataset: DATASET.into(),
            world_size: 8,
            shuffle: Shuffle::Global.into(),
            drop_last: true,
            columns: vec!["vec".into(), "id".into()],
            ..Default::default()
        })
        .await
        .expect("plan");
    assert_eq!(
        plan.schema
            .fields()
            .iter()
            .map(|f| f.name().as_str())
            .collect::<Vec<_>>(),
        ["vec", "id"]
    );
    let shards = read_all(&server, &plan.shards).await;
    let mut seen = HashSet::new();
    for batches in &shards {
        let ids: Vec<i64> = batches
            .iter()
            .flat_map(|b| check_batch(b, &attempt_of))
            .collect();
        assert_eq!(ids.len() as u64, n / 8);
        assert!(ids.into_iter().all(|id| seen.insert(id)));
    }

    // Resume mid-epoch with another world size: exactly the unseen rows.
    let full = |ws: u32, start: u64| ReadPlan {
        dataset: DATASET.into(),
        world_size: ws,
        epoch: 4,
        seed: 9,
        shuffle: Shuffle::Global.into(),
        batch_rows: 100,
        start_sample: start,
        columns: vec!["id".into()],
        ..Default::default()
    };
    let before = read_all(
        &server,
        &client.plan(full(4, 0)).await.expect("plan").shards,
    )
    .await;
    let steps = 1000usize;
    let seen: HashSet<i64> = before
        .iter()
        .flat_map(|bs| {
            bs.iter()
                .flat_map(|b| check_batch(b, &attempt_of))
                .take(steps)
        })
        .collect();
    let resumed = client.plan(full(3, 4 * steps as u64)).await.expect("plan");
    let after = read_all(&server, &resumed.shards).await;
    let remaining = n as usize - 4 * steps;
    let after_ids: Vec<Vec<i64>> = after
        .iter()
        .map(|bs| {
            bs.iter()
                .flat_map(|b| check_batch(b, &attempt_of))
                .collect()
        })
        .collect();
    let rest: Vec<i64> = (0..remaining).map(|q| after_ids[q % 3][q / 3]).collect();
    let rest_set: HashSet<i64> = rest.iter().copied().collect();
    assert_eq!(rest_set.len(), remaining);
    assert!(rest_set.is_disjoint(&seen));
    assert_eq!(rest_set.len() + seen.len(), n as usize);

    // Drop frees everything.
    client.drop_dataset(DATASET).await.expect("drop");
    assert_eq!(live_bytes(&mut client).await, 0);
    server.stop().await;
}

#[tokio::test]
async fn plain_flight_clients_use_path_descriptors() {
    let server = TestServer::start().await;
    let mut client = server.client().await;
    let parts = layout(&[10, 20]);
    for (p, ids) in parts.iter().enumerate() {
        let batches = partition_batches(ids.clone(), 0, 7);
        let data = arrow_flight::encode::FlightDataEncoderBuilder::new()
            .with_flight_descriptor(Some(FlightDescriptor::new_path(vec![
                "plain".into(),
                p.to_string(),
            ])))
            .build(stream::iter(batches.into_iter().map(Ok)));
        let results: Vec<_> = client
            .flight()
            .do_put(data)
            .await
            .expect("do_put")
            .try_collect()
            .await
            .expect("ack");
        assert_eq!(results.len(), 1);
    }
    client
        .seal(SealDataset {
            dataset: "plain".into(),
            partitions: 2,
            ..Default::default()
        })
        .await
        .expect("seal");
    let info = client
        .flight()
        .get_flight_info(FlightDescriptor::new_path(vec!["plain".into()]))
        .await
        .expect("info");
    assert_eq!(info.endpoint.len(), 1);
    assert_eq!(info.total_records, 30);
    let ticket = info.endpoint[0].ticket.clone().expect("ticket");
    let batches: Vec<RecordBatch> = client
        .flight()
        .do_get(ticket)
        .await
        .expect("do_get")
        .try_collect()
        .await
        .expect("read");
    let ids: Vec<i64> = batches
        .iter()
        .flat_map(|b| check_batch(b, &|_| 0))
        .collect();
    assert_eq!(ids, (0..30).collect::<Vec<_>>());
    let schema_back = client
        .flight()
        .get_schema(FlightDescriptor::new_path(vec!["plain".into()]))
        .await
        .expect("schema");
    assert_eq!(&schema_back, schema().as_ref());
    assert_eq!(
        client.list_datasets().await.expect("list"),
        vec!["plain".to_string()]
    );
    server.stop().await;
}

/// Writes `ids` as partition `p`, attempt 0, of `ds`.
async fn put_rows(c: &mut Client, ds: &str, p: u32, ids: std::ops::Range<i64>) {
    put_ids(c, ds, p, 0, ids, 500).await.expect("put");
}

/// The metadata calls as the README's protocol table says: `ListFlights`
/// lists open and sealed datasets by path with their totals (sealed ones
/// with one unshuffled endpoint), those starting with its criteria; `GetSchema` answers on an open dataset
/// too, projected, and `NOT_FOUND` for a missing one; a split index not
/// below its count is refused; `SHUFFLE_BLOCK` without `block_rows` uses
/// blocks of 1024.
#[tokio::test]
async fn metadata_calls_answer_as_the_protocol_table_says() {
    use arrow_flight::FlightInfo;
    use prost::Message;

    let server = TestServer::start().await;
    let mut c = server.client().await;
    put_rows(&mut c, "open", 0, 0..10).await;
    put_rows(&mut c, "sealed", 0, 0..3000).await;
    put_rows(&mut c, "sealed", 1, 3000..5000).await;
    c.seal(SealDataset {
        dataset: "sealed".into(),
        partitions: 2,
        ..Default::default()
    })
    .await
    .expect("seal");

    let mut listed: Vec<FlightInfo> = c
        .flight()
        .list_flights(bytes::Bytes::new())
        .await
        .expect("list_flights")
        .try_collect()
        .await
        .expect("infos");
    listed.sort_by(|a, b| {
        a.flight_descriptor
            .as_ref()
            .map(|d| d.path.clone())
            .cmp(&b.flight_descriptor.as_ref().map(|d| d.path.clone()))
    });
    let paths: Vec<Vec<String>> = listed
        .iter()
        .map(|i| i.flight_descriptor.clone().expect("descriptor").path)
        .collect();
    assert_eq!(
        paths,
        [vec!["open".to_string()], vec!["sealed".to_string()]]
    );
    // The criteria is a name prefix; one that is not UTF-8 is refused.
    for (prefix, names) in [("se", &["sealed"][..]), ("open", &["open"]), ("x", &[])] {
        assert_eq!(
            c.list_datasets_starting_with(prefix).await.expect("list"),
            names,
            "datasets starting with {prefix:?}"
        );
    }
    let garbled = c
        .flight()
        .list_flights(bytes::Bytes::from_static(&[0xff, 0xfe]))
        .await
        .map(|_| ());
    let garbled =
        flightdeck_client::ClientError::from(garbled.expect_err("criteria that is not UTF-8"));
    assert_eq!(
        garbled.code(),
        flightdeck_client::Code::InvalidArgument,
        "{garbled}"
    );
    assert!(
        garbled.to_string().contains("dataset name prefix"),
        "{garbled}"
    );
    let (open, sealed) = (&listed[0], &listed[1]);
    let open_bytes = c.describe("open").await.expect("describe").bytes;
    assert_eq!(
        (open.total_records, open.total_bytes),
        (10, open_bytes as i64)
    );
    assert!(
        open.endpoint.is_empty(),
        "an open dataset cannot be read yet"
    );
    assert_eq!(open.clone().try_decode_schema().expect("schema"), *schema());
    assert_eq!(sealed.total_records, 5000);
    assert_eq!(sealed.endpoint.len(), 1);
    let ticket = sealed.endpoint[0].ticket.clone().expect("ticket");
    let ids: Vec<i64> = c
        .flight()
        .do_get(ticket)
        .await
        .expect("do_get")
        .try_collect::<Vec<RecordBatch>>()
        .await
        .expect("read")
        .iter()
        .flat_map(|b| check_batch(b, &|_| 0))
        .collect();
    assert_eq!(
        ids,
        (0..5000).collect::<Vec<_>>(),
        "one unshuffled endpoint"
    );

    // GetSchema: an open dataset, projected in the order asked.
    let projected = c
        .flight()
        .get_schema(FlightDescriptor::new_cmd(
            ReadPlan {
                dataset: "open".into(),
                world_size: 1,
                columns: vec!["x".into(), "id".into()],
                ..Default::default()
            }
            .encode_to_vec(),
        ))
        .await
        .expect("schema of an open dataset");
    let names: Vec<&str> = projected
        .fields()
        .iter()
        .map(|f| f.name().as_str())
        .collect();
    assert_eq!(names, ["x", "id"]);
    let missing = c
        .flight()
        .get_schema(FlightDescriptor::new_path(vec!["nope".into()]))
        .await
        .map(|_| ());
    let missing = flightdeck_client::ClientError::from(missing.expect_err("no such dataset"));
    assert_eq!(
        missing.code(),
        flightdeck_client::Code::NotFound,
        "{missing}"
    );
    assert!(missing.message().contains("'nope'"), "{missing}");

    // A split index must be below the split count.
    let err = c
        .plan(ReadPlan {
            dataset: "sealed".into(),
            world_size: 1,
            split_count: 2,
            split_index: 2,
            ..Default::default()
        })
        .await
        .expect_err("split 2 of 2");
    assert_eq!(
        err.code(),
        flightdeck_client::Code::InvalidArgument,
        "{err}"
    );
    assert!(
        err.message()
            .contains("split_index 2 must be below split_count 2"),
        "{err}"
    );

    // SHUFFLE_BLOCK's default block is 1024 rows.
    let mut block = async |block_rows| {
        let plan = c
            .plan(ReadPlan {
                dataset: "sealed".into(),
                world_size: 1,
                seed: 3,
                shuffle: Shuffle::Block.into(),
                block_rows,
                ..Default::default()
            })
            .await
            .expect("plan");
        raw_bytes(&mut c, plan.shards[0].ticket.clone()).await
    };
    let default = block(0).await;
    assert!(default == block(1024).await);
    assert!(default != block(512).await);
    server.stop().await;
}

/// A Rust writer names its write: after `abort_write` the server refuses
/// every attempt of that write with `ABORTED` (the dataset it had written
/// is dropped), while attempts of other writes, or of none, still land.
#[tokio::test]
async fn attempts_of_an_aborted_write_are_refused() {
    let server = TestServer::start().await;
    let mut job = server.client().await.with_write_id("job-7");
    put_ids(&mut job, "w", 0, 0, 0..100, 50)
        .await
        .expect("an attempt of a live write");
    let mut driver = server.client().await;
    driver.abort_write("w", "job-7").await.expect("abort");
    assert_eq!(
        driver.describe("w").await.expect_err("dropped").code(),
        flightdeck_client::Code::NotFound
    );
    // A clone keeps the write id: the straggler is refused.
    let mut straggler = job.clone();
    let err = put_ids(&mut straggler, "w", 1, 0, 100..200, 50)
        .await
        .expect_err("an attempt of the aborted write");
    assert_eq!(err.code(), flightdeck_client::Code::Aborted, "{err}");
    assert!(err.to_string().contains("job-7"), "{err}");
    // Another write, and a client without one, write as before; aborting a
    // write with nothing to drop is not an error.
    let mut next = server.client().await.with_write_id("job-8");
    put_ids(&mut next, "w", 1, 0, 100..200, 50)
        .await
        .expect("another write");
    put_ids(&mut driver, "w", 2, 0, 200..300, 50)
        .await
        .expect("no write id");
    driver
        .abort_write("none", "job-9")
        .await
        .expect("nothing to drop");
    server.stop().await;
}

/// A Rust writer that replaces a dataset (`with_replacing_write`) stages
/// its attempts: the old rows stay readable until the seal naming the write
/// swaps the new ones in; a replacing write aborted with
/// `abort_replacing_write` leaves the dataset as it was.
#[tokio::test]
async fn a_replacing_write_swaps_in_at_its_seal_or_leaves_the_dataset() {
    let server = TestServer::start().await;
    let mut driver = server.client().await;
    put_ids(&mut driver, "r", 0, 0, 0..100, 50)
        .await
        .expect("old");
    let seal = |replace_write: &str| SealDataset {
        dataset: "r".into(),
        replace_write: replace_write.into(),
        ..Default::default()
    };
    driver.seal(seal("")).await.expect("seal old");
    let rows = async |c: &mut Client| -> Vec<i64> {
        let plan = c
            .plan(ReadPlan {
                dataset: "r".into(),
                world_size: 1,
                ..Default::default()
            })
            .await
            .expect("plan");
        let mut ids: Vec<i64> = flightdeck_tests::read_all(c, &plan)
            .await
            .concat()
            .iter()
            .flat_map(|b| check_batch(b, &|_| 0))
            .collect();
        ids.sort_unstable();
        ids
    };
    let mut job = server.client().await.with_replacing_write("job-1");
    put_ids(&mut job, "r", 0, 0, 1000..1030, 10)
        .await
        .expect("staged");
    assert_eq!(rows(&mut driver).await, (0..100).collect::<Vec<_>>());
    let info = driver.seal(seal("job-1")).await.expect("swap in");
    assert_eq!(info.rows, 30);
    assert_eq!(rows(&mut driver).await, (1000..1030).collect::<Vec<_>>());

    let mut failed = server.client().await.with_replacing_write("job-2");
    put_ids(&mut failed, "r", 0, 0, 0..10, 10)
        .await
        .expect("staged");
    driver
        .abort_replacing_write("r", "job-2")
        .await
        .expect("abort");
    let err = put_ids(&mut failed, "r", 1, 0, 10..20, 10)
        .await
        .expect_err("an attempt of the aborted write");
    assert_eq!(err.code(), flightdeck_client::Code::Aborted, "{err}");
    let err = driver
        .seal(seal("job-2"))
        .await
        .expect_err("nothing staged");
    assert_eq!(
        err.code(),
        flightdeck_client::Code::FailedPrecondition,
        "{err}"
    );
    assert_eq!(rows(&mut driver).await, (1000..1030).collect::<Vec<_>>());
    assert_eq!(driver.list_datasets().await.expect("list"), ["r"]);
    server.stop().await;
}

/// `--unix-socket`: the same service on a Unix domain socket beside TCP.
/// A writer on the socket and one on TCP fill one dataset; every rank's
/// stream reads byte for byte the same over either; the socket file goes
/// when the server stops, a stale one is replaced, and a live server's
/// socket or a file that is not a socket is refused naming the path. The
/// socket file's mode is `--unix-socket-mode` (660 unless told), whatever
/// the process's umask.
#[tokio::test]
async fn a_unix_socket_serves_what_tcp_serves() {
    use std::os::unix::fs::PermissionsExt;
    let mode = |path: &std::path::Path| {
        std::fs::metadata(path)
            .expect("the socket file")
            .permissions()
            .mode()
            & 0o7777
    };
    let dir = flightdeck_tests::temp_dir("unix");
    let path = dir.join("fd.sock");
    let config = || ServerConfig {
        memory_limit: 1 << 30,
        unix_socket: Some(path.clone()),
        ..flightdeck_tests::test_config()
    };
    let server = TestServer::start_with(config()).await;
    let mut tcp = server.client().await;
    let local_uri = format!("grpc+unix://{}", path.display());
    let mut local = flightdeck_tests::eventually("the socket accepts", || async {
        Client::connect(&local_uri).await.map_err(|e| e.to_string())
    })
    .await;
    assert_eq!(
        mode(&path),
        0o660,
        "the server's user and group may connect"
    );
    let parts = layout(&[900, 1300, 40]);
    put_rows(&mut tcp, "both", 0, parts[0].clone()).await;
    put_rows(&mut local, "both", 1, parts[1].clone()).await;
    put_rows(&mut local, "both", 2, parts[2].clone()).await;
    local
        .seal(SealDataset {
            dataset: "both".into(),
            partitions: 3,
            ..Default::default()
        })
        .await
        .expect("seal over the socket");
    for shuffle in [Shuffle::None, Shuffle::Global] {
        let plan = local
            .plan(ReadPlan {
                dataset: "both".into(),
                world_size: 3,
                shuffle: shuffle.into(),
                seed: 7,
                batch_rows: 256,
                ..Default::default()
            })
            .await
            .expect("plan over the socket");
        let mut ids = HashSet::new();
        for shard in &plan.shards {
            let over_socket = raw_bytes(&mut local, shard.ticket.clone()).await;
            assert_eq!(over_socket, raw_bytes(&mut tcp, shard.ticket.clone()).await);
            for b in &flightdeck_tests::read_shard(&mut local, shard).await {
                ids.extend(check_batch(b, &|_| 0));
            }
        }
        assert_eq!(ids.len(), 2240, "{shuffle:?}: every row once");
    }
    drop((tcp, local));

    // A second server on a live socket is refused; a file is not a socket.
    let refused = |config: ServerConfig| async move {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let served = flightdeck_server::serve(listener, config, std::future::pending()).await;
        served.expect_err("refused").to_string()
    };
    let e = refused(config()).await;
    assert!(
        e.contains("already listening") && e.contains("fd.sock"),
        "{e}"
    );
    server.stop().await;
    assert!(!path.exists(), "the socket file is removed at shutdown");
    let file = dir.join("not-a-socket");
    std::fs::write(&file, b"x").expect("write");
    let e = refused(ServerConfig {
        unix_socket: Some(file.clone()),
        ..config()
    })
    .await;
    assert!(
        e.contains("is not a socket") && e.contains("not-a-socket"),
        "{e}"
    );
    assert!(file.exists(), "a file that is not a socket is left alone");

    // A socket left behind by a server that is gone is replaced.
    drop(std::os::unix::net::UnixListener::bind(&path).expect("stale socket"));
    assert!(path.exists());
    let server = TestServer::start_with(ServerConfig {
        unix_socket_mode: 0o600,
        ..config()
    })
    .await;
    let mut local = flightdeck_tests::eventually("the socket accepts again", || async {
        Client::connect(&local_uri).await.map_err(|e| e.to_string())
    })
    .await;
    assert_eq!(mode(&path), 0o600, "--unix-socket-mode");
    assert_eq!(
        local.list_datasets().await.expect("list"),
        Vec::<String>::new()
    );
    server.stop().await;
}

/// A shard's `DoGet` asked for through shared memory, with the number of
/// batches that came through the ring.
async fn through_ring(client: &mut Client, ticket: bytes::Bytes) -> (Vec<RecordBatch>, usize) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let mut metadata = tonic::metadata::MetadataMap::new();
    metadata.insert(
        flightdeck_client::shm::REQUEST_HEADER,
        tonic::metadata::MetadataValue::from_static("1"),
    );
    let messages = timed(
        "do_get",
        flightdeck_client::receive::do_get(
            &client.channel(),
            &metadata,
            arrow_flight::Ticket::new(ticket),
            64 << 20,
        ),
    )
    .await
    .expect("do_get");
    let described = Arc::new(AtomicUsize::new(0));
    let counted = described.clone();
    let messages = messages
        .inspect(move |m| {
            if m.as_ref()
                .is_ok_and(|m| m.data_header.is_empty() && m.app_metadata.starts_with(b"FDSHM:B1"))
            {
                counted.fetch_add(1, Ordering::Relaxed);
            }
        })
        .boxed();
    let Ok(messages) = flightdeck_client::shm::through_ring(messages).await else {
        panic!("the ring could not be read");
    };
    let batches: Vec<RecordBatch> = timed(
        "batches",
        arrow_flight::decode::FlightRecordBatchStream::new_from_flight_data(
            messages.map_err(arrow_flight::error::FlightError::from),
        )
        .try_collect(),
    )
    .await
    .expect("batches");
    (batches, described.load(Ordering::Relaxed))
}

#[tokio::test]
async fn shards_through_shared_memory_are_the_shards_over_the_socket() {
    let server = TestServer::start().await;
    let mut c = server.client().await;
    let mut over_socket = server.client().await.with_shared_memory(false);
    let parts = layout(&[9000, 0, 4100, 17]);
    for (p, ids) in parts.iter().enumerate() {
        put_rows(&mut c, "shm", p as u32, ids.clone()).await;
    }
    c.seal(SealDataset {
        dataset: "shm".into(),
        partitions: parts.len() as u32,
        ..Default::default()
    })
    .await
    .expect("seal");
    for shuffle in [Shuffle::None, Shuffle::Global, Shuffle::Block] {
        for world_size in [1, 3, 8] {
            let plan = c
                .plan(ReadPlan {
                    dataset: "shm".into(),
                    world_size,
                    shuffle: shuffle.into(),
                    seed: 11,
                    batch_rows: 2048,
                    ..Default::default()
                })
                .await
                .expect("plan");
            let mut ids = HashSet::new();
            for shard in &plan.shards {
                let socket = flightdeck_tests::read_shard(&mut over_socket, shard).await;
                let (ring, described) = through_ring(&mut c, shard.ticket.clone()).await;
                let what = format!("{shuffle:?} W={world_size} rank {}", shard.rank);
                assert_eq!(ring, socket, "{what}");
                assert!(
                    described > 0 && described + 1 >= socket.len(),
                    "{what}: {described} of {} batches through the ring",
                    socket.len()
                );
                let default = flightdeck_tests::read_shard(&mut c, shard).await;
                assert_eq!(default, socket, "{what}: the client's default way");
                for b in &ring {
                    ids.extend(check_batch(b, &|_| 0));
                }
            }
            assert_eq!(
                ids.len(),
                13_117,
                "{shuffle:?} W={world_size}: every row once"
            );
        }
    }
    server.stop().await;
}
