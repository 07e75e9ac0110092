//! Every bad input gets its gRPC code and a message naming the problem, and
//! the server keeps serving afterwards.

use arrow::array::{ArrayRef, Float64Array, Int64Array, RecordBatch};
use arrow::datatypes::{DataType, Field, Schema};
use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::error::FlightError;
use arrow_flight::{Action, FlightData, FlightDescriptor, Ticket};
use bytes::Bytes;
use flightdeck_client::{Client, ClientError, DatasetState, ReadPlan, SealDataset, Shuffle};
use flightdeck_server::ServerConfig;
use flightdeck_tests::{TestServer, check_batch, partition_batches, read_all, schema, timed};
use futures::{StreamExt, TryStreamExt, stream};
use prost::Message;
use std::sync::Arc;
use tonic::Code;

fn assert_code<T: std::fmt::Debug>(res: Result<T, ClientError>, code: Code, needles: &[&str]) {
    let err = res.expect_err("the server must refuse this");
    assert_eq!(err.code(), code, "{err}");
    let msg = err.message();
    for n in needles {
        assert!(msg.contains(n), "message {msg:?} should mention {n:?}");
    }
}

async fn put(
    client: &mut Client,
    ds: &str,
    p: u32,
    a: u32,
    ids: std::ops::Range<i64>,
) -> Result<u64, ClientError> {
    flightdeck_tests::put_ids(client, ds, p, a, ids, 64)
        .await
        .map(|ack| ack.rows)
}

/// A plan of `ds` for `world_size` ranks in batches of `batch_rows`.
fn plan_rows(ds: &str, world_size: u32, batch_rows: u32) -> ReadPlan {
    ReadPlan {
        dataset: ds.into(),
        world_size,
        batch_rows,
        ..Default::default()
    }
}

fn plan(ds: &str) -> ReadPlan {
    ReadPlan {
        dataset: ds.into(),
        world_size: 2,
        ..Default::default()
    }
}

/// A raw DoPut of arbitrary FlightData messages through the plain client.
async fn raw_put(client: &mut Client, msgs: Vec<FlightData>) -> Result<(), ClientError> {
    let results: Vec<_> = client
        .flight()
        .do_put(stream::iter(msgs.into_iter().map(Ok)))
        .await?
        .try_collect()
        .await?;
    assert_eq!(results.len(), 1);
    Ok(())
}

#[tokio::test]
async fn bad_inputs_get_their_codes_and_the_server_keeps_serving() {
    let server = TestServer::start().await;
    let mut c = server.client().await;

    // Ingest errors.
    put(&mut c, "d", 0, 0, 0..100).await.expect("first put");
    assert_code(
        put(&mut c, "d", 0, 0, 0..100).await,
        Code::AlreadyExists,
        &["attempt 0", "partition 0", "'d'"],
    );

    let other = Arc::new(Schema::new(vec![Field::new(
        "id",
        DataType::Float64,
        false,
    )]));
    let b = RecordBatch::try_new(
        other.clone(),
        vec![Arc::new(Float64Array::from(vec![1.0])) as ArrayRef],
    )
    .expect("batch");
    assert_code(
        c.put_partition("d", 1, 0, other, stream::iter([Ok(b)]))
            .await,
        Code::InvalidArgument,
        &["schema", "partition 1", "'d'", "id: Float64"],
    );

    // A plain DoPut without a descriptor, with an undecodable command, with a
    // bad path, with garbage IPC, with no messages.
    let no_descriptor = FlightDataEncoderBuilder::new().build(stream::iter(
        partition_batches(0..3, 0, 3).into_iter().map(Ok),
    ));
    let msgs: Vec<FlightData> = no_descriptor.try_collect().await.expect("encode");
    assert_code(
        raw_put(&mut c, msgs).await,
        Code::InvalidArgument,
        &["descriptor"],
    );
    let garbage_cmd =
        FlightData::new().with_descriptor(FlightDescriptor::new_cmd(vec![0xff, 0x01, 0x02]));
    assert_code(
        raw_put(&mut c, vec![garbage_cmd]).await,
        Code::InvalidArgument,
        &["PutPartition"],
    );
    let bad_path = FlightData::new().with_descriptor(FlightDescriptor::new_path(vec!["d".into()]));
    assert_code(
        raw_put(&mut c, vec![bad_path]).await,
        Code::InvalidArgument,
        &["[dataset, partition]"],
    );
    let garbage_ipc = FlightData::new()
        .with_descriptor(FlightDescriptor::new_path(vec!["d".into(), "5".into()]))
        .with_data_header(Bytes::from_static(
            b"\x00\x01\x02 definitely not flatbuffers",
        ));
    assert_code(
        raw_put(&mut c, vec![garbage_ipc]).await,
        Code::InvalidArgument,
        &["malformed"],
    );
    assert_code(
        raw_put(&mut c, vec![]).await,
        Code::InvalidArgument,
        &["empty"],
    );
    let no_schema =
        FlightData::new().with_descriptor(FlightDescriptor::new_path(vec!["d".into(), "6".into()]));
    assert_code(
        raw_put(&mut c, vec![no_schema]).await,
        Code::InvalidArgument,
        &["no schema"],
    );
    let empty_name = flightdeck_client::SealDataset::default();
    assert_code(c.seal(empty_name).await, Code::InvalidArgument, &["empty"]);

    // A writer whose batch iterator fails mid-partition leaves nothing.
    let good = partition_batches(1000..1300, 0, 100);
    let failing = stream::iter(good.into_iter().map(Ok)).chain(stream::once(async {
        Err(FlightError::protocol("the task's iterator failed"))
    }));
    let err = c
        .put_partition("d", 7, 0, schema(), failing)
        .await
        .expect_err("a failed writer cannot commit");
    assert!(
        err.to_string().contains("the task's iterator failed"),
        "{err}"
    );

    // With explicit_commit, a stream that ends cleanly but without the
    // writer's matching commit marker stores nothing.
    let explicit = |marker: Option<u64>| {
        let cmd = flightdeck_client::PutPartition {
            dataset: "d".into(),
            partition: 8,
            attempt: 0,
            explicit_commit: true,
            ..Default::default()
        };
        let batches = partition_batches(2000..2100, 0, 50);
        let data = FlightDataEncoderBuilder::new()
            .with_flight_descriptor(Some(FlightDescriptor::new_cmd(cmd.encode_to_vec())))
            .build(stream::iter(batches.into_iter().map(Ok)));
        async move {
            let mut msgs: Vec<FlightData> = data.try_collect().await.expect("encode");
            if let Some(rows) = marker {
                let commit = flightdeck_protos::PutCommit { rows: Some(rows) };
                msgs.push(FlightData::new().with_app_metadata(commit.encode_to_vec()));
            }
            msgs
        }
    };
    assert_code(
        raw_put(&mut c, explicit(None).await).await,
        Code::Aborted,
        &["commit marker"],
    );
    assert_code(
        raw_put(&mut c, explicit(Some(99)).await).await,
        Code::Aborted,
        &["99 rows but 100"],
    );

    // Lifecycle errors.
    assert_code(
        c.plan(plan("d")).await,
        Code::FailedPrecondition,
        &["not sealed", "'d'"],
    );
    assert_code(c.plan(plan("nope")).await, Code::NotFound, &["'nope'"]);
    assert_code(c.describe("nope").await, Code::NotFound, &["'nope'"]);
    assert_code(c.drop_dataset("nope").await, Code::NotFound, &["'nope'"]);
    assert_code(
        c.seal(SealDataset {
            dataset: "nope".into(),
            ..Default::default()
        })
        .await,
        Code::NotFound,
        &["'nope'"],
    );
    put(&mut c, "d", 2, 0, 100..150).await.expect("put");
    assert_code(
        c.seal(SealDataset {
            dataset: "d".into(),
            partitions: 5,
            ..Default::default()
        })
        .await,
        Code::FailedPrecondition,
        &["[1, 3, 4]", "'d'"],
    );
    assert_code(
        c.seal(SealDataset {
            dataset: "d".into(),
            attempts: vec![flightdeck_client::PartitionAttempt {
                partition: 2,
                attempt: 9,
            }],
            ..Default::default()
        })
        .await,
        Code::FailedPrecondition,
        &["attempt 9 of partition 2", "never committed"],
    );
    let info = c.describe("d").await.expect("describe");
    assert_eq!(info.rows, 150, "failed puts stored nothing");
    assert_eq!(info.committed_partitions, 2);
    let missing = c
        .seal(SealDataset {
            dataset: "d".into(),
            partitions: 3,
            attempts: vec![],
            ..Default::default()
        })
        .await
        .map(|_| ());
    assert_code(missing, Code::FailedPrecondition, &["partition 1"]);
    c.seal(SealDataset {
        dataset: "d".into(),
        ..Default::default()
    })
    .await
    .expect("seal what is there");
    assert_code(
        put(&mut c, "d", 9, 0, 0..1).await,
        Code::FailedPrecondition,
        &["sealed", "'d'"],
    );
    assert_code(
        c.seal(SealDataset {
            dataset: "d".into(),
            ..Default::default()
        })
        .await,
        Code::FailedPrecondition,
        &["already sealed"],
    );

    // Plan errors.
    assert_code(
        c.plan(ReadPlan {
            world_size: 0,
            ..plan("d")
        })
        .await,
        Code::InvalidArgument,
        &["world_size"],
    );
    assert_code(
        c.plan(ReadPlan {
            columns: vec!["id".into(), "bogus".into()],
            ..plan("d")
        })
        .await,
        Code::InvalidArgument,
        &["'bogus'", "id: Int64"],
    );
    assert_code(
        c.plan(ReadPlan {
            start_sample: 151,
            ..plan("d")
        })
        .await,
        Code::InvalidArgument,
        &["start_sample"],
    );
    assert_code(
        c.plan(ReadPlan {
            shuffle: 7,
            ..plan("d")
        })
        .await,
        Code::InvalidArgument,
        &["shuffle"],
    );
    assert_code(
        c.plan(ReadPlan {
            batch_rows: u32::MAX,
            ..plan("d")
        })
        .await,
        Code::InvalidArgument,
        &["batch_rows"],
    );
    let garbage_plan = c
        .flight()
        .get_flight_info(FlightDescriptor::new_cmd(vec![0xff; 3]))
        .await;
    assert_code(
        garbage_plan.map_err(ClientError::from),
        Code::InvalidArgument,
        &["descriptor command"],
    );

    // Ticket errors: garbage, and a ticket that outlived its dataset.
    let garbage = c.flight().do_get(Ticket::new(vec![0xde, 0xad])).await;
    assert_code(
        garbage.map_err(ClientError::from),
        Code::InvalidArgument,
        &["ticket"],
    );
    // The same through this client's own receive path.
    let garbage = c.do_get(Ticket::new(vec![0xde, 0xad])).await;
    assert_code(garbage.map(|_| ()), Code::InvalidArgument, &["ticket"]);
    let old = c.plan(plan("d")).await.expect("plan");
    let first = c.describe("d").await.expect("describe").generation;
    assert_ne!(
        first, 0,
        "0 is no generation: a plan's sealed_as 0 means any"
    );
    c.drop_dataset("d").await.expect("drop");
    put(&mut c, "d", 0, 0, 0..10).await.expect("write again");
    c.seal(SealDataset {
        dataset: "d".into(),
        ..Default::default()
    })
    .await
    .expect("seal");
    let stale = c.read_shard(&old.shards[0]).await;
    assert_code(
        stale.map(|_| ()),
        Code::FailedPrecondition,
        &["plan again (Client::plan)"],
    );
    // A plan expecting the dataset as first sealed is refused; one expecting
    // its new seal is served.
    let pinned = c
        .plan(ReadPlan {
            sealed_as: first,
            ..plan("d")
        })
        .await;
    assert_code(
        pinned.map(|_| ()),
        Code::FailedPrecondition,
        &[
            "dataset 'd' was dropped or written again since this read began",
            &format!("sealed_as {first}"),
        ],
    );
    let now = c.describe("d").await.expect("describe").generation;
    assert_ne!(now, first);
    let current = c
        .plan(ReadPlan {
            sealed_as: now,
            ..plan("d")
        })
        .await
        .expect("a plan of the dataset as it is sealed now");
    assert_eq!(current.shards.len(), 2);

    // Action errors.
    let bad_body = c
        .flight()
        .do_action(Action::new("seal", Bytes::from_static(b"\xff\xff")))
        .await;
    assert_code(
        bad_body.map(|_| ()).map_err(ClientError::from),
        Code::InvalidArgument,
        &["seal"],
    );
    let unknown = c
        .flight()
        .do_action(Action::new("explode", Bytes::new()))
        .await;
    assert_code(
        unknown.map(|_| ()).map_err(ClientError::from),
        Code::Unimplemented,
        &["explode", "seal"],
    );
    let actions: Vec<String> = c
        .flight()
        .list_actions()
        .await
        .expect("list")
        .map_ok(|a| a.r#type)
        .try_collect()
        .await
        .expect("actions");
    assert_eq!(
        actions,
        [
            "seal",
            "drop",
            "describe",
            "stats",
            "place",
            "evict",
            "train",
            "job",
            "member_prepare",
            "member_commit",
            "derive",
            "member_select"
        ]
    );

    // Calls flightdeck does not offer.
    let hs = c.flight().handshake(Bytes::from_static(b"hi")).await;
    assert_code(
        hs.map_err(ClientError::from),
        Code::Unimplemented,
        &["Handshake"],
    );
    let poll = c
        .flight()
        .poll_flight_info(FlightDescriptor::new_path(vec!["d".into()]))
        .await;
    assert_code(
        poll.map_err(ClientError::from),
        Code::Unimplemented,
        &["PollFlightInfo"],
    );
    let ex = c.flight().do_exchange(stream::empty()).await;
    assert_code(
        ex.map(|_| ()).map_err(ClientError::from),
        Code::Unimplemented,
        &["DoExchange"],
    );

    // Still serving: a full round trip works.
    let p = c
        .plan(ReadPlan {
            shuffle: Shuffle::Global.into(),
            ..plan("d")
        })
        .await
        .expect("plan");
    let mut ids: Vec<i64> = read_all(&mut c, &p)
        .await
        .iter()
        .flatten()
        .flat_map(|b| check_batch(b, &|_| 0))
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, (0..10).collect::<Vec<_>>());
    server.stop().await;
}

#[tokio::test]
async fn memory_limit_refuses_ingest_with_resource_exhausted() {
    let server = TestServer::start_with(ServerConfig {
        memory_limit: 256 << 10,
        ..flightdeck_tests::test_config()
    })
    .await;
    let mut c = server.client().await;
    assert_code(
        put(&mut c, "big", 0, 0, 0..100_000).await,
        Code::ResourceExhausted,
        &["partition 0", "'big'", "--memory-limit"],
    );
    let stats = c.stats().await.expect("stats");
    // Nothing of the refused attempt is live; at most idle slabs are kept.
    assert_eq!((stats.host_live_bytes, stats.memory_limit), (0, 256 << 10));
    assert!(stats.memory_used <= 256 << 10);
    // The server is alive and a small dataset still fits.
    assert_eq!(put(&mut c, "small", 0, 0, 0..100).await.expect("fits"), 100);
    let stats = c.stats().await.expect("stats");
    assert!(stats.memory_used > 0 && stats.memory_used <= 256 << 10);
    server.stop().await;
}

/// The `DoPut` messages of partition 0 of `ds`: `n` int64 rows in one
/// record batch, sent as one message however large.
async fn one_message_put(ds: &str, n: i64) -> Vec<FlightData> {
    let s = Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, false)]));
    let b = RecordBatch::try_new(
        s.clone(),
        vec![Arc::new(Int64Array::from_iter_values(0..n)) as ArrayRef],
    )
    .expect("batch");
    let data = FlightDataEncoderBuilder::new()
        .with_max_flight_data_size(usize::MAX)
        .with_flight_descriptor(Some(FlightDescriptor::new_cmd(
            flightdeck_client::PutPartition {
                dataset: ds.into(),
                partition: 0,
                attempt: 0,
                explicit_commit: false,
                ..Default::default()
            }
            .encode_to_vec(),
        )))
        .build(stream::iter([Ok(b)]));
    data.try_collect().await.expect("encode")
}

/// A message over `--max-message-size` is refused for good (sending it
/// again cannot help), not marked as worth a retry.
#[tokio::test]
async fn messages_over_the_size_limit_are_invalid_not_retryable() {
    let server = TestServer::start_with(ServerConfig {
        max_message_bytes: 1 << 20,
        ..flightdeck_tests::test_config()
    })
    .await;
    let mut c = server.client().await;
    let msgs = one_message_put("wide", 500_000).await;
    assert_code(
        raw_put(&mut c, msgs).await,
        Code::InvalidArgument,
        &["larger than this server accepts", "smaller record batches"],
    );
    timed("stats", c.stats()).await.expect("still serving");
    // A read plan whose batches could not be sent is refused when planned.
    sealed_rows(&mut c, "d", 20_000).await;
    assert_code(
        c.plan(plan_rows("d", 1, 1 << 24)).await,
        Code::InvalidArgument,
        &[
            "batch_rows 16777216",
            "--max-message-size 1048576",
            "at most",
        ],
    );
    let fits = c
        .plan(plan_rows("d", 1, 1_000))
        .await
        .expect("batches that fit");
    assert_eq!(fits.total_rows, 20_000);
    // A ticket whose plan asks for such batches (made by hand: the server
    // never issues one) is refused the same way when read, before any
    // message is sent.
    let mut forged = flightdeck_protos::ShardTicket::decode(fits.shards[0].ticket.clone())
        .expect("a ticket the server issued");
    forged.plan.as_mut().expect("the ticket's plan").batch_rows = 1 << 24;
    let oversized = c
        .flight()
        .do_get(Ticket::new(forged.encode_to_vec()))
        .await
        .map(|_| ());
    assert_code(
        oversized.map_err(ClientError::from),
        Code::InvalidArgument,
        &[
            "batch_rows 16777216",
            "--max-message-size 1048576",
            "at most",
        ],
    );
    let batches = read_all(&mut c, &fits).await.concat();
    assert_eq!(batches.len(), 20);
    assert!(batches.iter().all(|b| b.num_rows() == 1_000));
    server.stop().await;
}

#[tokio::test]
async fn large_single_messages_are_accepted() {
    let server = TestServer::start().await;
    let mut c = server.client().await;
    // 12 MiB in one record batch, one gRPC message: above tonic's 4 MiB default.
    let n = 1_500_000i64;
    let msgs = one_message_put("wide", n).await;
    assert!(msgs.iter().any(|m| m.data_body.len() >= 8 << 20));
    raw_put(&mut c, msgs).await.expect("large message accepted");
    c.seal(SealDataset {
        dataset: "wide".into(),
        ..Default::default()
    })
    .await
    .expect("seal");
    let p = c
        .plan(ReadPlan {
            dataset: "wide".into(),
            world_size: 1,
            batch_rows: n as u32,
            ..Default::default()
        })
        .await
        .expect("plan");
    let batches: Vec<RecordBatch> = c
        .read_shard(&p.shards[0])
        .await
        .expect("read")
        .try_collect()
        .await
        .expect("batches");
    assert_eq!(batches.len(), 1, "one batch of batch_rows rows");
    assert_eq!(batches[0].num_rows() as i64, n);
    server.stop().await;
}

/// A writer of null columns claims any row count for free; a seal can name
/// any partition count. Neither stops the server: a claim past the row limit
/// is refused, a large one is planned without counting its batches one by
/// one, and a missing-partition error is counted rather than listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claimed_row_and_partition_counts_cannot_wedge_the_server() {
    use arrow::array::NullArray;
    let server = TestServer::start().await;
    let mut c = server.client().await;
    let nulls = Arc::new(Schema::new(vec![Field::new("n", DataType::Null, true)]));
    let put_nulls = |ds: &'static str, p: u32, rows: usize| {
        let schema = nulls.clone();
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![Arc::new(NullArray::new(rows)) as ArrayRef],
        )
        .expect("batch");
        let mut c = c.clone();
        async move {
            timed(
                "put nulls",
                c.put_partition(ds, p, 0, schema, stream::iter([Ok(batch)])),
            )
            .await
        }
    };
    assert_code(
        put_nulls("nulls", 9, 1 << 62).await,
        Code::InvalidArgument,
        &["more than 1099511627776 rows"],
    );
    for ds in ["nulls", "more"] {
        for p in 0..4 {
            put_nulls(ds, p, 1 << 38).await.expect("within the limit");
        }
    }
    // One more row takes "more" past the limit at seal.
    put_nulls("more", 4, 1).await.expect("a small partition");
    assert_code(
        c.seal(SealDataset {
            dataset: "more".into(),
            ..Default::default()
        })
        .await,
        Code::InvalidArgument,
        &["'more'", "more than 1099511627776 rows"],
    );
    let missing = timed(
        "seal with 2^32 - 1 partitions",
        c.seal(SealDataset {
            dataset: "more".into(),
            partitions: u32::MAX,
            ..Default::default()
        }),
    )
    .await
    .expect_err("most partitions are missing");
    assert_eq!(missing.code(), Code::FailedPrecondition, "{missing}");
    assert!(missing.message().len() < 1024, "{}", missing.message());
    assert!(
        missing
            .message()
            .contains("4294967290 partitions have no committed attempt"),
        "{}",
        missing.message()
    );
    timed(
        "seal 2^40 rows",
        c.seal(SealDataset {
            dataset: "nulls".into(),
            ..Default::default()
        }),
    )
    .await
    .expect("seal");
    let planned = timed("plan 2^40 rows", c.plan(plan_rows("nulls", 2, 1)))
        .await
        .expect("plan");
    assert_eq!(planned.total_rows, 1 << 40);
    assert_eq!(planned.shards[1].rows, 1 << 39);
    assert_eq!(planned.shards[1].batches, 1 << 39);
    timed("list", c.list_datasets()).await.expect("list");
    timed("stats", c.stats()).await.expect("stats");
    server.stop().await;
}

/// Record batch bodies cut short (what a broken writer or a
/// hostile one sends) are refused with INVALID_ARGUMENT, whether arrow's
/// reader reports them or panics on them, and the server keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_ipc_bodies_are_invalid_arguments() {
    let server = TestServer::start().await;
    let mut c = server.client().await;
    let good = one_message_put("bad", 1_000).await;
    let body = good
        .iter()
        .position(|m| !m.data_body.is_empty())
        .expect("a record batch message");
    type Mutation = fn(&mut FlightData);
    let mutations: [(&str, Mutation); 3] = [
        ("cut to half", |m| {
            m.data_body.truncate(m.data_body.len() / 2)
        }),
        ("cut to one byte", |m| m.data_body.truncate(1)),
        ("emptied", |m| m.data_body.truncate(0)),
    ];
    for (what, mutate) in mutations {
        let mut msgs = good.clone();
        mutate(&mut msgs[body]);
        let res = timed(what, raw_put(&mut c, msgs)).await;
        let err = res.expect_err(what);
        assert_eq!(err.code(), Code::InvalidArgument, "{what}: {err}");
    }
    timed("stats", c.stats()).await.expect("still serving");
    server.stop().await;
}

/// A Flight client with plain HTTP/2 settings (64 KiB windows), on its own
/// connection.
async fn plain_flight(
    uri: &str,
) -> arrow_flight::flight_service_client::FlightServiceClient<tonic::transport::Channel> {
    let channel = tonic::transport::Channel::from_shared(uri.replace("grpc://", "http://"))
        .expect("uri")
        .connect()
        .await
        .expect("connect");
    arrow_flight::flight_service_client::FlightServiceClient::new(channel)
}

/// `DoGet` streams of `tickets` opened on one plain Flight connection to
/// `uri` (HTTP/2 windows of 64 KiB: the server soon has to wait for each)
/// and never read.
async fn stalled_streams<'a>(
    uri: &str,
    tickets: impl IntoIterator<Item = &'a bytes::Bytes>,
) -> Vec<tonic::Response<tonic::Streaming<FlightData>>> {
    let mut raw = plain_flight(uri).await;
    let mut stalled = Vec::new();
    for ticket in tickets {
        let stream = timed("open a stream", raw.do_get(Ticket::new(ticket.clone())))
            .await
            .expect("do_get");
        stalled.push(stream);
    }
    stalled
}

/// Rows a fresh reader gets from `shard`, read to the end.
async fn rows_read(c: &mut Client, shard: &flightdeck_client::Shard) -> u64 {
    timed("a fresh reader", async {
        c.read_shard(shard)
            .await
            .expect("read")
            .try_collect::<Vec<_>>()
            .await
            .expect("batches")
            .iter()
            .map(|b| b.num_rows() as u64)
            .sum()
    })
    .await
}

/// A sealed dataset of `rows` rows written as one partition.
async fn sealed_rows(c: &mut Client, ds: &str, rows: i64) {
    put(c, ds, 0, 0, 0..rows).await.expect("put");
    c.seal(SealDataset {
        dataset: ds.into(),
        ..Default::default()
    })
    .await
    .expect("seal");
}

/// What `readers` streams that never read make a member grow by, with a
/// read-ahead allowance of `allowance`: each is owed a whole 32 MiB dataset
/// in batches of 4 MiB. Then, once `--stream-idle-timeout` has ended them,
/// a fresh reader reads the whole dataset.
async fn growth_with_stalled_readers(readers: usize, allowance: &str) -> u64 {
    let member = flightdeck_tests::MemberProcess::start(
        "127.0.0.1:0",
        &[
            "--memory-limit",
            "256MiB",
            "--read-ahead-memory",
            allowance,
            "--stream-idle-timeout",
            "1s",
        ],
    );
    let mut c = member.client().await;
    let columns = 8;
    let schema = Arc::new(Schema::new(
        (0..columns)
            .map(|i| Field::new(format!("f{i}"), DataType::Float64, false))
            .collect::<Vec<_>>(),
    ));
    let rows_per_batch = 65_536;
    let batches: Vec<RecordBatch> = (0..8)
        .map(|b| {
            let values: ArrayRef = Arc::new(Float64Array::from_iter_values(
                (0..rows_per_batch).map(|r| f64::from(b * rows_per_batch + r)),
            ));
            RecordBatch::try_new(schema.clone(), vec![values; columns]).expect("batch")
        })
        .collect();
    let rows: u64 = batches.iter().map(|b| b.num_rows() as u64).sum();
    timed(
        "put",
        c.put_partition("d", 0, 0, schema, stream::iter(batches.into_iter().map(Ok))),
    )
    .await
    .expect("put");
    c.seal(SealDataset {
        dataset: "d".into(),
        ..Default::default()
    })
    .await
    .expect("seal");
    let plan = c
        .plan(plan_rows("d", 1, rows_per_batch as u32))
        .await
        .expect("plan");
    let before = member.rss();
    let ticket = &plan.shards[0].ticket;
    let stalled = stalled_streams(&member.location(), std::iter::repeat_n(ticket, readers)).await;
    // Each stream gathers what it may, then waits; the peak comes before
    // the idle timeout ends them.
    let mut peak = before;
    for _ in 0..8 {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        peak = peak.max(member.rss());
    }
    let mut fresh = member.client().await;
    assert_eq!(rows_read(&mut fresh, &plan.shards[0]).await, rows);
    drop(stalled);
    peak.saturating_sub(before)
}

/// Readers that never read hold the read-ahead allowance at most, not
/// batches per stream: twenty-four of them, each owed 32 MiB, grow the
/// server by about a 16 MiB allowance (with one allowance large enough for
/// all, by far more); a fresh reader still reads once they time out.
#[tokio::test]
async fn readers_that_never_read_stay_within_the_read_ahead_allowance() {
    let mib = |b: u64| b >> 20;
    let bounded = growth_with_stalled_readers(24, "16MiB").await;
    let unbounded = growth_with_stalled_readers(24, "4GiB").await;
    eprintln!(
        "24 stalled readers: +{} MiB with a 16 MiB allowance, +{} MiB with 4 GiB",
        mib(bounded),
        mib(unbounded)
    );
    assert!(
        bounded < 48 << 20,
        "24 stalled readers grew the server by {} MiB with a 16 MiB allowance",
        mib(bounded)
    );
    assert!(
        unbounded > 3 * bounded.max(16 << 20),
        "the allowance is what bounds them: {} MiB with 16 MiB, {} MiB with 4 GiB",
        mib(bounded),
        mib(unbounded)
    );
}

/// Readers that open `DoGet` streams and never read them hold no threads:
/// with a blocking pool of 4, seven of them (each owed more than the HTTP/2
/// windows and send buffers hold) do not stop a fresh reader, a seal or
/// `stats`.
#[test]
fn readers_that_never_read_do_not_starve_the_others() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(4)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let server = TestServer::start().await;
        let mut c = server.client().await;
        sealed_rows(&mut c, "d", 160_000).await;
        let plan = c.plan(plan_rows("d", 8, 1_000)).await.expect("plan");
        let tickets = plan.shards[..7].iter().map(|s| &s.ticket);
        let stalled = stalled_streams(&server.uri(), tickets).await;
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        let mut fresh = server.client().await;
        assert_eq!(
            rows_read(&mut fresh, &plan.shards[7]).await,
            plan.shards[7].rows
        );
        sealed_rows(&mut fresh, "other", 1_000).await;
        timed("stats", fresh.stats()).await.expect("stats");
        drop(stalled);
        server.stop().await;
    });
}

/// Sends `msgs` as a `DoPut` that then never ends; the status it is ended
/// with.
async fn stalled_put(c: &mut Client, msgs: Vec<FlightData>) -> tonic::Status {
    let sent = stream::iter(msgs).chain(stream::pending());
    timed("a stalled put", async {
        match c.flight().inner_mut().do_put(sent).await {
            Err(status) => status,
            Ok(response) => {
                let mut acks = response.into_inner();
                loop {
                    match acks.next().await {
                        Some(Ok(_)) => continue,
                        Some(Err(status)) => break status,
                        None => panic!("the stalled put ended cleanly"),
                    }
                }
            }
        }
    })
    .await
}

/// Writers that each stage a row and then stall hold the arena only until
/// `--stream-idle-timeout`: each is ended with ABORTED, nothing of theirs is
/// stored, and every byte they staged is freed (a stalled writer cannot pin
/// the memory it shares with others for longer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_writers_free_what_they_staged_at_the_idle_timeout() {
    let server = TestServer::start_with(ServerConfig {
        stream_idle_timeout: std::time::Duration::from_millis(300),
        ..flightdeck_tests::test_config()
    })
    .await;
    let c = server.client().await;
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let mut c = c.clone();
            tokio::spawn(async move {
                let msgs = one_message_put(&format!("stalled-{w}"), 1).await;
                stalled_put(&mut c, msgs).await
            })
        })
        .collect();
    until_live_bytes(&c, "the writers staging their rows", true).await;
    for (w, writer) in writers.into_iter().enumerate() {
        let err = writer.await.expect("joins");
        assert_eq!(err.code(), Code::Aborted, "{err}");
        let mut c = c.clone();
        assert_code(
            c.describe(&format!("stalled-{w}")).await,
            Code::NotFound,
            &["stalled"],
        );
    }
    until_live_bytes(&c, "the staged rows freed", false).await;
    server.stop().await;
}

/// A writer that stops sending and a reader that stops reading are ended
/// after `--stream-idle-timeout`: the writer's attempt with ABORTED and
/// nothing stored, the reader's stream with ABORTED after what was sent,
/// never as a clean, short end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_streams_end_after_the_idle_timeout() {
    let server = TestServer::start_with(ServerConfig {
        stream_idle_timeout: std::time::Duration::from_millis(300),
        ..flightdeck_tests::test_config()
    })
    .await;
    let mut c = server.client().await;
    let mut msgs = one_message_put("stalled", 1_000).await;
    msgs.truncate(1);
    let err = stalled_put(&mut c, msgs).await;
    assert_eq!(err.code(), Code::Aborted, "{err}");
    assert!(err.message().contains("--stream-idle-timeout"), "{err}");
    assert_code(c.describe("stalled").await, Code::NotFound, &["'stalled'"]);

    sealed_rows(&mut c, "d", 100_000).await;
    let plan = c.plan(plan_rows("d", 1, 1_000)).await.expect("plan");
    let mut raw = plain_flight(&server.uri()).await;
    let mut stream = raw
        .do_get(Ticket::new(plan.shards[0].ticket.clone()))
        .await
        .expect("do_get")
        .into_inner();
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let mut messages = 0;
    let end = timed("the rest of the stream", async {
        loop {
            match stream.next().await {
                Some(Ok(_)) => messages += 1,
                Some(Err(status)) => break Some(status),
                None => break None,
            }
        }
    })
    .await;
    let status = end.expect("the stream must not end cleanly");
    assert_eq!(status.code(), Code::Aborted, "{status}");
    assert!(
        status.message().contains("--stream-idle-timeout"),
        "{status}"
    );
    assert!(
        messages > 1 && messages < 101,
        "{messages} messages before the end"
    );
    server.stop().await;
}

/// Every call × {no token, a wrong token, a reader's, a writer's}: no or a
/// wrong token is UNAUTHENTICATED, a reader's is PERMISSION_DENIED on calls
/// that change the server, and a token with the role gets past both (to the
/// call's own answer). `DoGet` is checked on the hand-written edge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_needs_a_token_with_its_role() {
    use flightdeck_client::TrainJob;
    use flightdeck_client::actions;
    let dir = flightdeck_tests::temp_dir("auth");
    let file = dir.join("tokens");
    std::fs::write(&file, "# test tokens\nreader r-token\nwriter w-token\n").expect("file");
    let server = TestServer::start_with(ServerConfig {
        auth_token_file: Some(file),
        ..flightdeck_tests::test_config()
    })
    .await;
    let writer = || async { server.client().await.with_token("w-token").expect("token") };
    let mut w = writer().await;
    put(&mut w, "d", 0, 0, 0..100).await.expect("a writer puts");
    w.seal(SealDataset {
        dataset: "d".into(),
        ..Default::default()
    })
    .await
    .expect("a writer seals");
    let ticket = w.plan(plan("d")).await.expect("plan").shards[0]
        .ticket
        .clone();

    #[derive(Clone, Copy, PartialEq, Debug)]
    enum Need {
        Reader,
        Writer,
    }
    let calls: Vec<(&str, Need)> = vec![
        ("ListFlights", Need::Reader),
        ("GetFlightInfo", Need::Reader),
        ("GetSchema", Need::Reader),
        ("DoGet", Need::Reader),
        ("ListActions", Need::Reader),
        ("Handshake", Need::Reader),
        ("describe", Need::Reader),
        ("stats", Need::Reader),
        ("job", Need::Reader),
        ("DoPut", Need::Writer),
        ("DoExchange", Need::Writer),
        ("seal", Need::Writer),
        ("drop", Need::Writer),
        ("place", Need::Writer),
        ("evict", Need::Writer),
        ("train", Need::Writer),
        ("member_prepare", Need::Writer),
        ("member_commit", Need::Writer),
        ("derive", Need::Writer),
        ("member_select", Need::Reader),
    ];
    let mut attempt = 0;
    for (name, need) in calls {
        for who in ["none", "wrong", "reader", "writer"] {
            let c = server.client().await;
            let mut c = match who {
                "none" => c,
                "wrong" => c.with_token("r-tokenX").expect("token"),
                "reader" => c.with_token("r-token").expect("token"),
                _ => c.with_token("w-token").expect("token"),
            };
            attempt += 1;
            let raw_action = |kind: &'static str| {
                let mut c = c.clone();
                async move {
                    c.flight()
                        .do_action(Action::new(kind, Bytes::new()))
                        .await
                        .map_err(ClientError::from)?
                        .try_collect::<Vec<_>>()
                        .await
                        .map(|_| ())
                        .map_err(ClientError::from)
                }
            };
            let outcome: Result<(), ClientError> = match name {
                "ListFlights" => c.list_datasets().await.map(|_| ()),
                "GetFlightInfo" => c.plan(plan("d")).await.map(|_| ()),
                "GetSchema" => c
                    .flight()
                    .get_schema(FlightDescriptor::new_cmd(
                        flightdeck_client::ReadPlan {
                            dataset: "d".into(),
                            ..Default::default()
                        }
                        .encode_to_vec(),
                    ))
                    .await
                    .map(|_| ())
                    .map_err(ClientError::from),
                "DoGet" => match c.flight().do_get(Ticket::new(ticket.clone())).await {
                    Ok(s) => s.try_collect::<Vec<_>>().await.map(|_| ()),
                    Err(e) => Err(e),
                }
                .map_err(ClientError::from),
                "ListActions" => c
                    .flight()
                    .list_actions()
                    .await
                    .map(|_| ())
                    .map_err(ClientError::from),
                "Handshake" => c
                    .flight()
                    .handshake(Bytes::new())
                    .await
                    .map(|_| ())
                    .map_err(ClientError::from),
                "describe" => c.describe("d").await.map(|_| ()),
                "stats" => c.stats().await.map(|_| ()),
                "job" => c.jobs(0).await.map(|_| ()),
                "DoPut" => put(&mut c, "open", attempt, 0, 0..10).await.map(|_| ()),
                "DoExchange" => {
                    let mut sent = tonic::Request::new(stream::iter(Vec::<FlightData>::new()));
                    *sent.metadata_mut() = c.flight().metadata().clone();
                    match c.flight().inner_mut().do_exchange(sent).await {
                        Ok(_) => Ok(()),
                        Err(s) => Err(ClientError::from(s)),
                    }
                }
                "seal" => c
                    .seal(SealDataset {
                        dataset: "nope".into(),
                        ..Default::default()
                    })
                    .await
                    .map(|_| ()),
                "drop" => c.drop_dataset("nope").await.map(|_| ()),
                "place" => c.place("nope", &["x"], &[0]).await.map(|_| ()),
                "evict" => c.evict("nope", &[0]).await.map(|_| ()),
                "train" => match c
                    .train(TrainJob {
                        dataset: "nope".into(),
                        ..Default::default()
                    })
                    .await
                {
                    Ok(s) => s.try_collect::<Vec<_>>().await.map(|_| ()),
                    Err(e) => Err(e),
                },
                "member_prepare" => raw_action(actions::MEMBER_PREPARE).await,
                "member_commit" => raw_action(actions::MEMBER_COMMIT).await,
                "derive" => raw_action(actions::DERIVE).await,
                "member_select" => raw_action(actions::MEMBER_SELECT).await,
                other => panic!("no call {other}"),
            };
            let code = outcome.err().map(|e| e.code());
            let case = format!("{name} with {who} token: {code:?}");
            if name == "Handshake" && matches!(who, "reader" | "writer") {
                // Clients that authenticate by handshake first (the Flight
                // SQL JDBC driver) are answered.
                assert_eq!(code, None, "{case}");
            }
            match who {
                "none" | "wrong" => assert_eq!(code, Some(Code::Unauthenticated), "{case}"),
                "reader" if need == Need::Writer => {
                    assert_eq!(code, Some(Code::PermissionDenied), "{case}")
                }
                _ => assert!(
                    !matches!(code, Some(Code::Unauthenticated | Code::PermissionDenied)),
                    "{case}"
                ),
            }
        }
    }
    // Nothing a refused caller sent was stored: only writers' attempts.
    let open = w.describe("open").await.expect("open");
    assert_eq!(open.committed_partitions, 1);
    server.stop().await;
}

/// Over TLS (`--tls-cert`/`--tls-key`) a client that trusts the server's
/// authority writes, seals and reads; a client without TLS, or without the
/// authority, gets a clear failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_serves_clients_that_trust_it_and_no_others() {
    let dir = flightdeck_tests::temp_dir("tls");
    let certs = flightdeck_tests::TestCerts::make(&dir);
    let server = TestServer::start_with(ServerConfig {
        tls_cert: Some(certs.cert.clone()),
        tls_key: Some(certs.key.clone()),
        ..flightdeck_tests::test_config()
    })
    .await;
    let ca = std::fs::read(&certs.ca).expect("ca");
    let uri = format!("grpc+tls://127.0.0.1:{}", server.addr().port());
    let mut c = timed("connect over TLS", Client::connect_with(&uri, Some(&ca)))
        .await
        .expect("connect");
    put(&mut c, "d", 0, 0, 0..500).await.expect("put over TLS");
    c.seal(SealDataset {
        dataset: "d".into(),
        ..Default::default()
    })
    .await
    .expect("seal");
    let p = c.plan(plan("d")).await.expect("plan");
    let rows: usize = read_all(&mut c, &p)
        .await
        .iter()
        .flatten()
        .map(RecordBatch::num_rows)
        .sum();
    assert_eq!(rows, 500);
    let stats = c.stats().await.expect("stats");
    assert_eq!(stats.location, uri, "the server advertises TLS");

    let err = Client::connect(&uri).await.expect_err("no roots");
    assert!(err.to_string().contains("tls_root_certs"), "{err}");
    let plain = format!("http://127.0.0.1:{}", server.addr().port());
    let failed = match timed("plaintext connect", Client::connect(&plain)).await {
        Err(e) => e.to_string(),
        Ok(mut c) => timed("plaintext call", c.stats())
            .await
            .expect_err("a plaintext call to a TLS server fails")
            .to_string(),
    };
    assert!(!failed.is_empty());
    let stranger = std::fs::read(&certs.cert).expect("cert");
    let untrusted = match timed(
        "connect with other roots",
        Client::connect_with(&uri, Some(&stranger)),
    )
    .await
    {
        Err(e) => e.to_string(),
        Ok(mut c) => timed("untrusted call", c.stats())
            .await
            .expect_err("the server's certificate is not trusted")
            .to_string(),
    };
    assert!(!untrusted.is_empty());
    server.stop().await;
}

/// A `DoGet` request as raw HTTP/2: `body` as sent, `encoding` in its
/// `grpc-encoding` header; the status of its trailers-only answer, and the
/// answer's headers.
async fn raw_do_get(
    uri: &str,
    body: Vec<u8>,
    encoding: Option<&str>,
) -> (tonic::Status, tonic::codegen::http::HeaderMap) {
    use tonic::codegen::{Service, http};
    let mut channel = tonic::transport::Channel::from_shared(uri.to_string())
        .expect("uri")
        .connect()
        .await
        .expect("connect");
    let mut request = http::Request::builder()
        .method("POST")
        .uri(format!("{uri}/arrow.flight.protocol.FlightService/DoGet"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    if let Some(e) = encoding {
        request = request.header("grpc-encoding", e);
    }
    let body = String::from_utf8(body).expect("the test's bodies are ASCII");
    let request = request.body(tonic::body::Body::new(body)).expect("request");
    std::future::poll_fn(|cx| channel.poll_ready(cx))
        .await
        .expect("ready");
    let response = timed("raw DoGet", channel.call(request))
        .await
        .expect("an answer");
    let headers = response.headers().clone();
    let status = tonic::Status::from_header_map(&headers).expect("a trailers-only answer");
    (status, headers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compressed_do_get_requests_get_the_codes_grpc_gives_them() {
    let server = TestServer::start().await;
    let uri = server.uri();
    // One gRPC message holding `Ticket{ticket: "abc"}`, with `flag`.
    let framed = |flag: u8| {
        let mut m = vec![flag, 0, 0, 0, 5];
        m.extend_from_slice(b"\x0a\x03abc");
        m
    };
    // An encoding this server does not take: refused before the body is
    // read, saying what it takes.
    let (status, headers) = raw_do_get(&uri, framed(1), Some("gzip")).await;
    assert_eq!(status.code(), Code::Unimplemented, "{status}");
    assert!(status.message().contains("`gzip`"), "{status}");
    assert_eq!(headers["grpc-accept-encoding"], "identity");
    // Marked compressed without an encoding: a protocol error.
    let (status, headers) = raw_do_get(&uri, framed(1), None).await;
    assert_eq!(status.code(), Code::Internal, "{status}");
    assert!(status.message().contains("no grpc-encoding"), "{status}");
    assert_eq!(headers["grpc-accept-encoding"], "identity");
    let (status, _) = raw_do_get(&uri, framed(7), Some("identity")).await;
    assert_eq!(status.code(), Code::Internal, "{status}");
    assert!(status.message().contains("flag 7"), "{status}");
    // Uncompressed, with an identity encoding: read, and the ticket judged.
    let (status, _) = raw_do_get(&uri, framed(0), Some("identity")).await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status}");
    // Calls the generated service answers say so too.
    let mut c = server.client().await;
    let stats = c
        .flight()
        .inner_mut()
        .do_action(arrow_flight::Action::new("stats", Bytes::new()))
        .await
        .expect("stats");
    assert_eq!(
        stats
            .metadata()
            .get("grpc-accept-encoding")
            .expect("advertised"),
        "identity"
    );
    server.stop().await;
}

/// What a job that died left unsealed — a dataset it wrote, a replacement it
/// staged — is dropped once nothing was written to it for
/// `--unsealed-timeout`: its memory freed, its tasks still running refused
/// saying why. A sealed dataset, and a write still under way (a new attempt
/// every 100 ms for longer than the timeout), are kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_dead_job_left_unsealed_is_dropped_after_the_unsealed_timeout() {
    let idle = std::time::Duration::from_secs(3);
    let server = TestServer::start_with(ServerConfig {
        unsealed_timeout: Some(idle),
        ..flightdeck_tests::test_config()
    })
    .await;
    let mut c = server.client().await;
    put(&mut c, "kept", 0, 0, 0..100).await.expect("put");
    c.seal(SealDataset {
        dataset: "kept".into(),
        partitions: 1,
        ..Default::default()
    })
    .await
    .expect("seal");
    let mut dead = c.clone().with_write_id("dead");
    put(&mut dead, "left", 0, 0, 0..100).await.expect("put");
    let mut gone = c.clone().with_replacing_write("gone");
    put(&mut gone, "kept", 0, 0, 0..50).await.expect("stage");
    let started = std::time::Instant::now();
    let mut live = c.clone().with_write_id("live");
    let writer = tokio::spawn(async move {
        for p in 0..60u32 {
            put(&mut live, "live", p, 0, 0..10).await.expect("put");
            if started.elapsed() > idle * 3 / 2 {
                return p + 1;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        60
    });

    flightdeck_tests::eventually("what the dead job left dropped", || {
        let mut c = c.clone();
        async move {
            let stats = c.stats().await.expect("stats");
            let left = c.describe("left").await.map(|i| i.rows);
            if left.is_err() && stats.staged.is_empty() {
                Ok(())
            } else {
                Err((left.ok(), stats.staged))
            }
        }
    })
    .await;
    assert!(started.elapsed() >= idle, "dropped before the timeout");
    let written = writer.await.expect("joins");
    let info = c.describe("live").await.expect("a write under way is kept");
    assert_eq!(info.rows, u64::from(written) * 10);
    let kept = c.describe("kept").await.expect("kept");
    assert_eq!((kept.state(), kept.rows), (DatasetState::Sealed, 100));
    for (client, dataset, write) in [(&mut dead, "left", "dead"), (&mut gone, "kept", "gone")] {
        assert_code(
            put(client, dataset, 1, 0, 0..10).await,
            Code::Aborted,
            &[
                &format!("write '{write}'"),
                "never sealed, so the server dropped what it wrote (--unsealed-timeout)",
            ],
        );
    }
    server.stop().await;
}

/// A writer that resets its `DoPut` with `NO_ERROR` part way (what gRPC
/// clients in Go do when a call is cancelled) stores nothing: hyper ends
/// such a request like a finished one, so an attempt is committed only
/// when its answer is sent, which a reset stream never takes. Before, the
/// rows sent until then were committed as the whole partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_reset_with_no_error_stores_nothing() {
    let server = TestServer::start().await;
    let mut c = server.client().await;
    let tcp = tokio::net::TcpStream::connect(server.addr())
        .await
        .expect("connect");
    let (h2, connection) = h2::client::handshake(tcp).await.expect("h2 handshake");
    tokio::spawn(connection);
    let mut h2 = h2.ready().await.expect("h2 ready");
    let request = http::Request::post(format!(
        "{}/arrow.flight.protocol.FlightService/DoPut",
        server.uri()
    ))
    .header("content-type", "application/grpc")
    .header("te", "trailers")
    .body(())
    .expect("request");
    let (_answer, mut sent) = h2.send_request(request, false).expect("DoPut sent");
    for msg in one_message_put("reset", 1_000).await {
        // A gRPC message: uncompressed, its length, the FlightData.
        let body = msg.encode_to_vec();
        let mut framed = vec![0u8];
        framed.extend_from_slice(&u32::try_from(body.len()).expect("small").to_be_bytes());
        framed.extend_from_slice(&body);
        sent.send_data(Bytes::from(framed), false)
            .expect("data sent");
    }
    until_live_bytes(&c, "the writer's rows staged", true).await;
    sent.send_reset(h2::Reason::NO_ERROR);
    let committed = flightdeck_tests::eventually("the reset attempt dropped or kept", || {
        let mut c = c.clone();
        async move {
            let live = c.stats().await.expect("stats").host_live_bytes;
            match c.describe("reset").await {
                Ok(info) => Ok(Some(info.rows)),
                Err(_) if live == 0 => Ok(None),
                Err(e) => Err((live, e.to_string())),
            }
        }
    })
    .await;
    assert_eq!(committed, None, "a reset put committed rows");
    assert_code(c.describe("reset").await, Code::NotFound, &["'reset'"]);
    // The partition is then written whole by its writer's retry.
    raw_put(&mut c, one_message_put("reset", 1_000).await)
        .await
        .expect("the retry is stored");
    assert_eq!(c.describe("reset").await.expect("describe").rows, 1_000);
    server.stop().await;
}

/// Waits until the arena holds live bytes (`staged`: a writer's rows have
/// arrived) or none (`!staged`: every attempt's rows are freed).
async fn until_live_bytes(c: &Client, what: &str, staged: bool) {
    flightdeck_tests::eventually(what, || {
        let mut c = c.clone();
        async move {
            let live = c.stats().await.expect("stats").host_live_bytes;
            if (live > 0) == staged {
                Ok(())
            } else {
                Err(live)
            }
        }
    })
    .await;
}
