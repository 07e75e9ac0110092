//! Memory tiers end to end: datasets spill to the store when the budget is
//! full and come back byte for byte in every shuffle mode (`memory://` and
//! `file://` stores); `--persist` survives a restart, a persisted dataset
//! spills without being written again, and a persist that fails answers
//! `UNAVAILABLE` with the dataset still readable; a persisted copy damaged
//! while the server was down costs that dataset only (`DATA_LOSS`, or left
//! out when its manifest is); dropping returns memory to
//! the pool, and so does a reader that hangs up; `place` without a CUDA
//! driver answers its code. Batches gathered on several threads
//! (`--gather-threads`) are the bytes of batches gathered on one. A killed
//! server's spill files are removed by the next server on its store; a
//! second server persisting into a store another holds is refused, and one
//! whose holder it cannot check takes the store over once the holder's
//! record stays silent (a SIGHUP while it waits does not kill it).

use std::path::PathBuf;
use std::time::Duration;

use flightdeck_client::{Client, Code, DatasetState, Expected, ReadPlan, SealDataset, Shuffle};
use flightdeck_server::ServerConfig;
use flightdeck_tests::{
    MemberProcess, TempDir, TestServer, partition_batches, raw_bytes, scaled, schema, spawn_server,
    temp_dir, test_config, timed,
};
use futures::{TryStreamExt, stream};

const ROWS_PER_PART: i64 = 10_000;
const PARTS: u32 = 3;

/// Writes and seals `PARTS` partitions of the synthetic dataset; its bytes.
async fn write_sealed(c: &mut Client, ds: &str) -> u64 {
    try_write_sealed(c, ds).await.expect("seal").bytes
}

/// Writes `PARTS` partitions of the synthetic dataset; the seal's answer.
async fn try_write_sealed(
    c: &mut Client,
    ds: &str,
) -> Result<flightdeck_client::DatasetInfo, flightdeck_client::ClientError> {
    for p in 0..PARTS {
        let start = i64::from(p) * ROWS_PER_PART;
        flightdeck_tests::put_ids(c, ds, p, 0, start..start + ROWS_PER_PART, 1_000)
            .await
            .expect("put fits");
    }
    timed(
        "seal",
        c.seal(SealDataset {
            dataset: ds.into(),
            partitions: PARTS,
            attempts: vec![],
            ..Default::default()
        }),
    )
    .await
}

/// The raw `DoGet` bytes of every rank of 1, 3 and 8 ranks, for each
/// shuffle mode (shuffled reads gather from the packed rows of the
/// fixed-width columns, the others column by column).
async fn read_every_mode(c: &mut Client, ds: &str) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let modes = [Shuffle::None, Shuffle::Global, Shuffle::Block];
    for (shuffle, world_size) in modes.into_iter().flat_map(|s| [1, 3, 8].map(|w| (s, w))) {
        let plan = timed(
            "plan",
            c.plan(ReadPlan {
                dataset: ds.into(),
                world_size,
                epoch: 1,
                seed: 7,
                shuffle: shuffle.into(),
                batch_rows: 4_096,
                block_rows: 512,
                ..Default::default()
            }),
        )
        .await
        .expect("plan");
        for shard in &plan.shards {
            out.push(raw_bytes(c, shard.ticket.clone()).await);
        }
    }
    out
}

/// Bytes one synthetic dataset takes in the arena (measured on a roomy server).
async fn dataset_bytes() -> u64 {
    let server = TestServer::start().await;
    let mut c = server.client().await;
    let bytes = write_sealed(&mut c, "probe").await;
    server.stop().await;
    bytes
}

async fn spill_and_read_back(spill_url: String) {
    let one = dataset_bytes().await;
    // Room for two datasets and a half, in slabs of a 32nd of the limit.
    let limit = one * 5 / 2;
    let server = TestServer::start_with(ServerConfig {
        memory_limit: limit,
        spill_url: Some(spill_url),
        slab_bytes: Some(usize::try_from(limit / 32).expect("fits")),
        ..test_config()
    })
    .await;
    let mut c = server.client().await;
    write_sealed(&mut c, "a").await;
    let before = read_every_mode(&mut c, "a").await;
    // The shuffled reads packed the fixed-width columns; the copy is in the
    // budget and is given up before anything spills.
    let stats = c.stats().await.expect("stats");
    assert!(stats.packed_bytes > 0, "{stats:?}");
    write_sealed(&mut c, "b").await;
    // "a" was read before "b" was sealed: it is the one to spill for "c".
    write_sealed(&mut c, "c").await;
    let a = c.describe("a").await.expect("describe");
    assert!(a.spilled, "a should have spilled: {a:?}");
    assert_eq!(a.bytes, 0);
    assert_eq!(a.state(), DatasetState::Sealed);
    assert_eq!(a.rows, u64::from(PARTS) * ROWS_PER_PART as u64);
    let stats = c.stats().await.expect("stats");
    assert!(
        stats.spills >= 1 && stats.spilled_datasets >= 1,
        "{stats:?}"
    );
    assert!(stats.memory_used <= limit, "{stats:?}");

    // Reading brings it back, byte for byte, in every mode (spilling another).
    let after = read_every_mode(&mut c, "a").await;
    assert_eq!(before.len(), after.len());
    for (i, (x, y)) in before.iter().zip(&after).enumerate() {
        assert!(x == y, "stream {i} differs after spill and read back");
    }
    assert!(!c.describe("a").await.expect("describe").spilled);
    let stats = c.stats().await.expect("stats");
    assert!(stats.restores >= 1, "{stats:?}");
    assert!(stats.memory_used <= limit, "{stats:?}");
    // Everyone is still readable, and serves what a server that never
    // spilled serves (the three hold the same rows: the same streams).
    for ds in ["a", "b", "c"] {
        let streams = read_every_mode(&mut c, ds).await;
        assert_eq!(streams.len(), before.len());
        assert!(
            streams == before,
            "a stream of '{ds}' differs from the unspilled read"
        );
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_gathered_on_several_threads_are_the_bytes_of_one() {
    // `--gather-threads 3` splits each 4 096-row batch of scattered rows
    // into three parts gathered at once; the default here (two cores) one.
    let one = TestServer::start().await;
    let three = TestServer::start_with(ServerConfig {
        gather_threads: Some(3),
        ..test_config()
    })
    .await;
    let (mut a, mut b) = (one.client().await, three.client().await);
    write_sealed(&mut a, "d").await;
    write_sealed(&mut b, "d").await;
    // Twice: the second time every shuffled stream gathers from packed rows.
    for pass in 0..2 {
        let (x, y) = (
            read_every_mode(&mut a, "d").await,
            read_every_mode(&mut b, "d").await,
        );
        assert_eq!(x.len(), y.len());
        for (i, (x, y)) in x.iter().zip(&y).enumerate() {
            assert!(x == y, "pass {pass}, stream {i}: the bytes differ");
        }
    }
    let stats = b.stats().await.expect("stats");
    assert!(stats.packed_bytes > 0, "{stats:?}");
    one.stop().await;
    three.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spill_to_a_memory_store_reads_back_byte_identical() {
    spill_and_read_back("memory://".to_string()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spill_to_a_file_store_reads_back_byte_identical() {
    let dir = temp_dir("spill");
    spill_and_read_back(format!("file://{}", dir.display())).await;
    // The server removes its spill files at shutdown.
    let leftover: Vec<_> = walk(&dir)
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "parquet"))
        .collect();
    assert!(leftover.is_empty(), "{leftover:?}");
}

fn walk(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else {
            out.push(path);
        }
    }
    out
}

/// A roomy server persisting to a fresh folder named after `name`: the
/// folder, and the config to start (and start again) the server with.
fn persisting(name: &str) -> (TempDir, ServerConfig) {
    let dir = temp_dir(name);
    let config = ServerConfig {
        memory_limit: 1 << 30,
        spill_url: Some(format!("file://{}", dir.display())),
        persist: true,
        ..test_config()
    };
    (dir, config)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_with_persist_serves_the_same_data() {
    let (dir, config) = persisting("persist");
    let server = TestServer::start_with(config.clone()).await;
    let mut c = server.client().await;
    write_sealed(&mut c, "kept").await;
    let described = c.describe("kept").await.expect("describe");
    assert!(described.persisted && !described.spilled);
    let before = read_every_mode(&mut c, "kept").await;
    // An open dataset is not persisted: it was never sealed.
    let batches = partition_batches(0..10, 0, 10);
    c.put_partition(
        "unsealed",
        0,
        0,
        schema(),
        stream::iter(batches.into_iter().map(Ok)),
    )
    .await
    .expect("put");
    server.stop().await;
    let files = walk(&dir);
    assert!(
        files.iter().any(|p| p.ends_with("manifest.json")),
        "{files:?}"
    );

    let server = TestServer::start_with(config.clone()).await;
    let mut c = server.client().await;
    assert_eq!(
        c.list_datasets().await.expect("list"),
        vec!["kept".to_string()]
    );
    let again = c.describe("kept").await.expect("describe");
    assert_eq!(again.state(), DatasetState::Sealed);
    assert!(again.persisted && again.spilled);
    assert_eq!(
        (
            again.rows,
            again.generation,
            &again.partitions,
            &again.schema
        ),
        (
            described.rows,
            described.generation,
            &described.partitions,
            &described.schema
        )
    );
    let after = read_every_mode(&mut c, "kept").await;
    assert!(before == after, "a restarted server serves different bytes");
    // A new dataset gets a new generation, not one a persisted one has.
    write_sealed(&mut c, "new").await;
    let new = c.describe("new").await.expect("describe");
    assert!(new.generation > again.generation);
    // Dropping removes it from the store too.
    c.drop_dataset("kept").await.expect("drop");
    c.drop_dataset("new").await.expect("drop");
    server.stop().await;
    assert!(
        !walk(&dir).iter().any(|p| p.ends_with("manifest.json")),
        "{:?}",
        walk(&dir)
    );
    let server = TestServer::start_with(config).await;
    let mut c = server.client().await;
    let err = c.describe("kept").await.expect_err("dropped");
    assert_eq!(err.code(), Code::NotFound);
    server.stop().await;
}

/// The persisted file `file` (`data.parquet`, `manifest.json`) of dataset `ds`.
fn persisted_file(dir: &std::path::Path, ds: &str, file: &str) -> PathBuf {
    let found: Vec<PathBuf> = walk(&dir.join("datasets").join(ds))
        .into_iter()
        .filter(|p| p.ends_with(file))
        .collect();
    assert_eq!(found.len(), 1, "{found:?}");
    found[0].clone()
}

/// A persisted copy damaged or lost while the server was down (a disk
/// error, a file removed by hand) costs that dataset only: the server
/// starts and serves the others; a read of a dataset whose rows are gone
/// or torn is `DATA_LOSS` naming it and what to do (it was `UNAVAILABLE`,
/// which readers retry in vain), and it can be dropped and written again;
/// a damaged manifest is logged and its dataset left out (it stopped the
/// server from starting at all).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_with_damaged_persisted_copies_serves_the_rest() {
    let (dir, config) = persisting("persist-damaged");
    let server = TestServer::start_with(config.clone()).await;
    let mut c = server.client().await;
    for ds in ["good", "torn", "gone", "garbled"] {
        write_sealed(&mut c, ds).await;
    }
    let before = read_every_mode(&mut c, "good").await;
    server.stop().await;
    let torn = persisted_file(&dir, "torn", "data.parquet");
    let len = std::fs::metadata(&torn).expect("metadata").len();
    std::fs::write(
        &torn,
        &std::fs::read(&torn).expect("read")[..len as usize / 2],
    )
    .expect("tear");
    std::fs::remove_file(persisted_file(&dir, "gone", "data.parquet")).expect("remove");
    std::fs::write(
        persisted_file(&dir, "garbled", "manifest.json"),
        b"{\"datas",
    )
    .expect("garble");

    let server = TestServer::start_with(config.clone()).await;
    let mut c = server.client().await;
    assert_eq!(
        c.list_datasets().await.expect("list"),
        ["gone", "good", "torn"].map(String::from)
    );
    assert!(read_every_mode(&mut c, "good").await == before);
    for ds in ["torn", "gone"] {
        let plan = c
            .plan(ReadPlan {
                dataset: ds.into(),
                world_size: 1,
                ..Default::default()
            })
            .await
            .expect("planned from the manifest");
        // The read brings the rows back from the store.
        let read = async {
            let mut batches = c.read_shard(&plan.shards[0]).await?;
            while batches.try_next().await?.is_some() {}
            Ok::<_, flightdeck_client::ClientError>(())
        };
        let err = read.await.expect_err("its rows are lost");
        assert_eq!(err.code(), Code::DataLoss, "{err}");
        let said = err.to_string();
        assert!(
            said.contains(&format!(
                "dataset '{ds}' cannot be brought back from the store"
            )) && said
                .contains("the stored copy is missing or damaged; drop it and write it again"),
            "{said}"
        );
    }
    c.drop_dataset("torn").await.expect("drop");
    write_sealed(&mut c, "torn").await;
    assert_eq!(read_every_mode(&mut c, "torn").await.len(), before.len());
    let err = c.describe("garbled").await.expect_err("left out");
    assert_eq!(err.code(), Code::NotFound);
    server.stop().await;
}

/// Every file under `dir` with its size and modification time.
fn files_and_times(dir: &std::path::Path) -> Vec<(PathBuf, u64, std::time::SystemTime)> {
    let mut out: Vec<_> = walk(dir)
        .into_iter()
        .map(|p| {
            let m = std::fs::metadata(&p).expect("metadata");
            (p, m.len(), m.modified().expect("mtime"))
        })
        .collect();
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_persisted_dataset_spills_without_a_second_copy() {
    let one = dataset_bytes().await;
    let dir = temp_dir("persist-spill");
    let limit = one * 5 / 2;
    let server = TestServer::start_with(ServerConfig {
        memory_limit: limit,
        spill_url: Some(format!("file://{}", dir.display())),
        slab_bytes: Some(usize::try_from(limit / 32).expect("fits")),
        persist: true,
        ..test_config()
    })
    .await;
    let mut c = server.client().await;
    write_sealed(&mut c, "a").await;
    let before = read_every_mode(&mut c, "a").await;
    let persisted = files_and_times(&dir);
    assert!(!persisted.is_empty());
    write_sealed(&mut c, "b").await;
    write_sealed(&mut c, "c").await;
    let a = c.describe("a").await.expect("describe");
    assert!(a.spilled && a.persisted, "{a:?}");
    assert_eq!(a.bytes, 0);
    let stats = c.stats().await.expect("stats");
    assert!(stats.spills >= 1 && stats.memory_used <= limit, "{stats:?}");
    // Its spill is the copy persisted at seal: not written again.
    let a_files = |files: &[(PathBuf, u64, std::time::SystemTime)]| {
        files
            .iter()
            .filter(|(p, ..)| persisted.iter().any(|(q, ..)| q == p))
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(a_files(&files_and_times(&dir)), persisted);
    // Read back from it, the same bytes; still persisted.
    assert!(read_every_mode(&mut c, "a").await == before);
    let a = c.describe("a").await.expect("describe");
    assert!(!a.spilled && a.persisted, "{a:?}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_persist_is_unavailable_and_leaves_the_dataset_readable() {
    let dir = temp_dir("persist-fail");
    let store = dir.join("store");
    let server = TestServer::start_with(ServerConfig {
        spill_url: Some(store.display().to_string()),
        persist: true,
        ..test_config()
    })
    .await;
    let mut c = server.client().await;
    // Serving (its store checked at start), then the store's folder becomes
    // a file: nothing can be written under it.
    timed("stats", c.stats()).await.expect("serving");
    std::fs::remove_dir_all(&store).expect("remove the store folder");
    std::fs::write(&store, b"not a folder").expect("write");
    let err = try_write_sealed(&mut c, "d")
        .await
        .expect_err("the store cannot be written");
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    for needle in [
        "'d'",
        "sealed and readable",
        "persisting it failed",
        "restart",
    ] {
        assert!(err.message().contains(needle), "{err} lacks {needle}");
    }
    let d = c.describe("d").await.expect("describe");
    assert_eq!(d.state(), DatasetState::Sealed);
    assert!(!d.persisted, "{d:?}");
    assert_eq!(read_every_mode(&mut c, "d").await.len(), 3 * 12);
    server.stop().await;
}

/// A server with a 64 MiB budget in 1 MiB slabs, so memory figures move
/// slab by slab.
async fn small_slab_server() -> TestServer {
    TestServer::start_with(ServerConfig {
        memory_limit: 64 << 20,
        slab_bytes: Some(1 << 20),
        ..test_config()
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_returns_memory_to_the_pool() {
    let server = small_slab_server().await;
    let mut c = server.client().await;
    write_sealed(&mut c, "x").await;
    write_sealed(&mut c, "y").await;
    let full = c.stats().await.expect("stats");
    assert!(full.host_live_bytes > 0 && full.host_held_bytes >= full.host_live_bytes);
    assert_eq!(full.memory_used, full.host_held_bytes);
    c.drop_dataset("x").await.expect("drop");
    c.drop_dataset("y").await.expect("drop");
    let empty = c.stats().await.expect("stats");
    assert_eq!(empty.host_live_bytes, 0, "{empty:?}");
    // What is still held is the current slab and a few idle ones, for reuse.
    assert!(empty.host_held_bytes <= 3 << 20, "{empty:?}");
    assert_eq!(empty.memory_used, empty.host_held_bytes);
    // Reuse: writing the same again takes no more than the first time.
    write_sealed(&mut c, "x").await;
    write_sealed(&mut c, "y").await;
    let again = c.stats().await.expect("stats");
    assert!(
        again.host_held_bytes <= full.host_held_bytes,
        "{again:?} vs {full:?}"
    );
    server.stop().await;
}

/// A reader that hangs up mid-stream stops its gather and lets go of the
/// dataset: after the drop, the rows' memory is freed only once the hung-up
/// reader is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_hangs_up_lets_go_of_the_dataset() {
    use futures::StreamExt;
    let server = small_slab_server().await;
    let mut c = server.client().await;
    write_sealed(&mut c, "x").await;
    let plan = timed(
        "plan",
        c.plan(ReadPlan {
            dataset: "x".into(),
            world_size: 1,
            batch_rows: 100,
            ..Default::default()
        }),
    )
    .await
    .expect("plan");
    let mut reader = server.client().await;
    let mut stream = timed(
        "do_get",
        reader
            .flight()
            .inner_mut()
            .do_get(arrow_flight::Ticket::new(plan.shards[0].ticket.clone())),
    )
    .await
    .expect("do_get")
    .into_inner();
    // The schema and the first of 300 batches; the rest waits on the reader.
    for _ in 0..2 {
        timed("message", stream.next())
            .await
            .expect("a message")
            .expect("ok");
    }
    c.drop_dataset("x").await.expect("drop");
    let open = c.stats().await.expect("stats");
    assert!(
        open.host_live_bytes > 0,
        "the open reader still holds the rows: {open:?}"
    );
    drop(stream);
    drop(reader);
    flightdeck_tests::eventually("the hung-up reader's rows freed", || {
        let mut c = c.clone();
        async move {
            let stats = c.stats().await.expect("stats");
            if stats.host_live_bytes == 0 {
                Ok(())
            } else {
                Err(stats)
            }
        }
    })
    .await;
    server.stop().await;
}

#[tokio::test]
async fn place_without_a_cuda_driver_is_a_failed_precondition() {
    let server = TestServer::start_with(ServerConfig {
        memory_limit: 1 << 30,
        use_cuda: false,
        ..test_config()
    })
    .await;
    let mut c = server.client().await;
    write_sealed(&mut c, "d").await;
    let err = c.place("d", &["x"], &[0]).await.expect_err("no driver");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    assert!(err.message().contains("no CUDA driver"), "{err}");
    let stats = c.stats().await.expect("stats");
    assert_eq!(
        (stats.cuda_devices, stats.host_pinned, stats.device_bytes),
        (0, false, 0)
    );
    // Evict has nothing to free but still names unknown datasets.
    let info = c.evict("d", &[]).await.expect("evict");
    assert!(info.placements.is_empty());
    assert_eq!(
        c.evict("nope", &[]).await.expect_err("unknown").code(),
        Code::NotFound
    );
    let err = c
        .place("d", &["x"], &[1, 1])
        .await
        .expect_err("repeated device");
    assert_eq!(err.code(), Code::InvalidArgument);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_that_say_their_size_are_admitted_whole_or_refused_up_front() {
    let limit = 64u64 << 20;
    let server = TestServer::start_with(ServerConfig {
        memory_limit: limit,
        slab_bytes: Some(1 << 20),
        admission_wait: std::time::Duration::from_millis(300),
        ..test_config()
    })
    .await;
    let mut c = server.client().await;
    let batches = partition_batches(0..10_000, 0, 1_000);
    let sized = |bytes: u64| Expected { bytes, rows: 0 };
    let all = || stream::iter(batches.clone().into_iter().map(Ok));

    // More than the whole budget: refused at once, saying what to do.
    let err = c
        .put_partition_expecting("d", 0, 0, schema(), sized(2 * limit), all())
        .await
        .expect_err("larger than the budget");
    assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
    assert!(err.message().contains("whole memory budget"), "{err}");

    // A writer that set 40 MiB aside (its stream still open) leaves too
    // little for a second one of 40 MiB: that one waits, then is refused.
    let (tx, rx) = futures::channel::mpsc::unbounded();
    let mut first_client = server.client().await;
    let first = tokio::spawn(async move {
        first_client
            .put_partition_expecting("d", 1, 0, schema(), sized(40 << 20), rx)
            .await
    });
    tx.unbounded_send(Ok(batches[0].clone())).expect("send");
    flightdeck_tests::eventually("the first reservation", || {
        let mut c = c.clone();
        async move {
            let used = c.stats().await.expect("stats").memory_used;
            if used >= 40 << 20 { Ok(()) } else { Err(used) }
        }
    })
    .await;
    let err = c
        .put_partition_expecting("d", 2, 0, schema(), sized(40 << 20), all())
        .await
        .expect_err("no room");
    assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
    assert!(err.message().contains("--admission-wait"), "{err}");
    for b in &batches[1..] {
        tx.unbounded_send(Ok(b.clone())).expect("send");
    }
    drop(tx);
    let ack = timed("the first writer", first)
        .await
        .expect("join")
        .expect("admitted whole");
    assert_eq!(ack.rows, 10_000);

    // What it set aside and did not use went back: a writer of its real
    // size fits.
    c.put_partition_expecting("d", 3, 0, schema(), Expected::of(&batches), all())
        .await
        .expect("fits");
    let info = c.describe("d").await.expect("describe");
    assert_eq!(info.committed_partitions, 2, "{info:?}");
    let stats = c.stats().await.expect("stats");
    assert!(stats.memory_used_peak <= limit, "{stats:?}");
    assert!(stats.memory_used < 40 << 20, "{stats:?}");
    server.stop().await;
}

/// The `.parquet` files under `dir`.
fn parquet_files(dir: &std::path::Path) -> Vec<PathBuf> {
    walk(dir)
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "parquet"))
        .collect()
}

/// A server killed while it held spill files leaves them behind; the next
/// server started on the same store removes them, at start, without being
/// asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_servers_spill_files_are_removed_by_the_next_server() {
    let one = dataset_bytes().await;
    let dir = temp_dir("stopped-spills");
    let url = format!("file://{}", dir.display());
    let limit = (one * 5 / 2).to_string();
    let args = [
        "--spill-url",
        url.as_str(),
        "--memory-limit",
        limit.as_str(),
    ];
    let mut first = MemberProcess::start("127.0.0.1:0", &args);
    let mut c = first.client().await;
    for ds in ["a", "b", "c"] {
        write_sealed(&mut c, ds).await;
    }
    let stats = c.stats().await.expect("stats");
    assert!(stats.spills >= 1, "{stats:?}");
    let left = parquet_files(&dir);
    assert!(!left.is_empty());
    first.kill();
    assert_eq!(parquet_files(&dir), left, "a killed server removes nothing");

    let second = MemberProcess::start("127.0.0.1:0", &args);
    let deadline = std::time::Instant::now() + scaled(Duration::from_secs(10));
    while !parquet_files(&dir).is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the killed server's spill files stay: {:?}",
            parquet_files(&dir)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let log = std::fs::read_to_string(&second.log).expect("log");
    assert!(
        log.contains("removed the spill files of a server that stopped without shutting down"),
        "{log}"
    );
}

/// Two servers persisting into one store would write over each other's
/// datasets (each numbers its generations from 1): the second is refused
/// at start, naming the first and what to do. Once the first is killed —
/// even before it is reaped — the next server takes the store over at once
/// and serves what the first persisted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_server_persisting_into_one_store_is_refused_by_name() {
    let dir = temp_dir("one-store");
    let url = format!("file://{}", dir.display());
    let args = ["--persist", "--spill-url", url.as_str()];
    let first = MemberProcess::start("127.0.0.1:0", &args);
    let mut c = first.client().await;
    write_sealed(&mut c, "kept").await;
    let kept = c.describe("kept").await.expect("describe");

    let log = dir.join("second.log");
    let argv: Vec<String> = ["serve", "--listen", "127.0.0.1:0"]
        .iter()
        .chain(&args)
        .map(|a| a.to_string())
        .collect();
    let (mut second, lines) = spawn_server(&argv, &log);
    // Its stdout ends as it exits (its exit status follows soon after).
    let printed: Vec<String> = lines.collect();
    let exited = (0..250).find_map(|_| {
        let status = second.try_wait().expect("waits");
        if status.is_none() {
            std::thread::sleep(Duration::from_millis(20));
        }
        status
    });
    let Some(status) = exited else {
        let _ = second.kill();
        panic!("a second server on the store started: {printed:?}");
    };
    let said = std::fs::read_to_string(&log).expect("log");
    assert_eq!(status.code(), Some(1), "{said}");
    for part in [
        format!("held by another flightdeck server (pid {} ", first.pid()),
        format!("serving at {}", first.location()),
        "needs a store of its own".to_string(),
    ] {
        assert!(said.contains(&part), "{part:?} not in: {said}");
    }

    // Killed, and not reaped yet: its pid is a zombie's.
    let pid = first.pid();
    let killed = std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
    let deadline = std::time::Instant::now() + scaled(Duration::from_secs(10));
    loop {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        if stat
            .rsplit(')')
            .next()
            .is_some_and(|s| s.trim_start().starts_with('Z'))
        {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "not killed: {stat}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let third = MemberProcess::start("127.0.0.1:0", &args);
    let mut c = third.client().await;
    let again = c.describe("kept").await.expect("describe");
    assert_eq!((again.rows, again.generation), (kept.rows, kept.generation));
    drop(first);
}

/// A server whose store is held by a server it cannot check (another
/// machine's, or another container's: a container restarted after being
/// killed finds its own record so) watches the record for a beat and, when
/// none comes, takes the store over and serves. A SIGHUP meanwhile (an
/// operator rotating credentials) does not kill the starting server.
#[test]
fn a_silent_holder_elsewhere_is_taken_over_after_a_watch() {
    let dir = temp_dir("silent-holder");
    std::fs::create_dir_all(dir.join("datasets")).expect("dirs");
    let record = dir.join("datasets/server.json");
    std::fs::write(
        &record,
        r#"{"session": "1-1", "host": "node-b", "location": "grpc://10.0.0.2:50051",
            "process": {"machine": "another-boot", "pid_namespace": "pid:[1]", "pid": 1,
                        "start": 1},
            "beat": 3}"#,
    )
    .expect("writes the record");
    let log = dir.join("stderr.log");
    let url = format!("file://{}", dir.display());
    let argv: Vec<String> = [
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--persist",
        "--spill-url",
    ]
    .iter()
    .map(|a| a.to_string())
    .chain([url])
    .collect();
    let (mut child, mut lines) = spawn_server(&argv, &log);
    let said = || std::fs::read_to_string(&log).unwrap_or_default();
    let deadline = std::time::Instant::now() + scaled(Duration::from_secs(20));
    while !said().contains("watching its record for a beat") {
        assert!(std::time::Instant::now() < deadline, "no watch: {}", said());
        assert!(
            child.try_wait().expect("waits").is_none(),
            "exited: {}",
            said()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(said().contains("node-b"), "{}", said());
    let hangup = std::process::Command::new("kill")
        .args(["-HUP", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(hangup.success());
    let Some(listening) = lines.next() else {
        // Its stdout closed (it ended), or it never said it listens.
        let _ = child.kill();
        let status = child.wait().expect("waits");
        panic!("no server after the SIGHUP ({status}): {}", said());
    };
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        listening.starts_with("flightdeck listening on "),
        "{listening}"
    );
    assert!(
        said().contains("taking over the persisted datasets of a server that stopped"),
        "{}",
        said()
    );
}
