//! The measured phases. `put` and `get` speak the flightdeck protocol, so
//! they run unchanged against flightdeck and against the pyarrow baseline;
//! `parquet_path` is the Parquet files + readers path; `limit_*` measure the
//! machine itself.

use std::io::{Read, Write};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow::array::RecordBatch;
use flightdeck_client::{
    Client, Locality, MemberPartitions, PartitionAttempt, ReadPlan, SealDataset, Shuffle,
};
use futures::{StreamExt, stream};
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;

use crate::data::Shape;
use crate::report::Sample;

/// Boxed error for the benchmark's plumbing.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Writes partition `p` to `uris[p % uris.len()]` with `writers` concurrent
/// writers; returns each partition's member location (from its ack) and
/// the latency of every partition.
async fn write_partitions(
    uris: &[String],
    dataset: &str,
    shape: &Shape,
    parts: &Arc<Vec<Vec<RecordBatch>>>,
    writers: usize,
) -> Result<(Vec<(String, u32)>, Vec<Duration>), BoxError> {
    let mut tasks = Vec::new();
    for w in 0..writers {
        let parts = parts.clone();
        let uris = uris.to_vec();
        let schema = shape.schema();
        let dataset = dataset.to_string();
        tasks.push(tokio::spawn(async move {
            let mut clients = Vec::new();
            for uri in &uris {
                clients.push(Client::connect(uri).await?);
            }
            let mut out = Vec::new();
            for p in (w..parts.len()).step_by(writers) {
                let t = Instant::now();
                let batches = stream::iter(parts[p].clone().into_iter().map(Ok));
                let ack = clients[p % uris.len()]
                    .put_partition(&dataset, p as u32, 0, schema.clone(), batches)
                    .await?;
                out.push(((ack.location, p as u32), t.elapsed()));
            }
            Ok::<_, BoxError>(out)
        }));
    }
    let mut written = Vec::new();
    let mut latencies = Vec::new();
    for t in tasks {
        for (w, l) in t.await?? {
            written.push(w);
            latencies.push(l);
        }
    }
    Ok((written, latencies))
}

/// Writes every partition with `writers` concurrent connections, then seals.
pub async fn put(
    uri: &str,
    dataset: &str,
    shape: &Shape,
    parts: &Arc<Vec<Vec<RecordBatch>>>,
    writers: usize,
) -> Result<Sample, BoxError> {
    let start = Instant::now();
    let (_, latencies) =
        write_partitions(&[uri.to_string()], dataset, shape, parts, writers).await?;
    Client::connect(uri)
        .await?
        .seal(SealDataset {
            dataset: dataset.to_string(),
            partitions: parts.len() as u32,
            ..Default::default()
        })
        .await?;
    Ok(Sample {
        elapsed: start.elapsed(),
        latencies,
    })
}

/// Writes partition `p` to `uris[p % uris.len()]` with `writers` concurrent
/// writers, then seals the members as one dataset.
pub async fn put_cluster(
    uris: &[String],
    dataset: &str,
    shape: &Shape,
    parts: &Arc<Vec<Vec<RecordBatch>>>,
    writers: usize,
) -> Result<Sample, BoxError> {
    let start = Instant::now();
    let (written, latencies) = write_partitions(uris, dataset, shape, parts, writers).await?;
    let mut members: Vec<MemberPartitions> = Vec::new();
    for (location, partition) in written {
        let at = match members.iter().position(|m| m.location == location) {
            Some(i) => i,
            None => {
                members.push(MemberPartitions {
                    location,
                    partitions: vec![],
                });
                members.len() - 1
            }
        };
        members[at].partitions.push(PartitionAttempt {
            partition,
            attempt: 0,
        });
    }
    Client::connect(&uris[0])
        .await?
        .seal_cluster(dataset, parts.len() as u32, members)
        .await?;
    Ok(Sample {
        elapsed: start.elapsed(),
        latencies,
    })
}

/// The plan `get` reads: one epoch, `ranks` ranks, seed 7.
pub fn read_plan(dataset: &str, ranks: u32, shuffle: Shuffle, batch_rows: u32) -> ReadPlan {
    ReadPlan {
        dataset: dataset.to_string(),
        world_size: ranks,
        shuffle: shuffle.into(),
        seed: 7,
        batch_rows,
        ..Default::default()
    }
}

/// `plan` with NODE locality, `per_node` ranks a node.
pub fn node_plan(plan: ReadPlan, per_node: u32) -> ReadPlan {
    ReadPlan {
        locality: Locality::Node.into(),
        ranks_per_node: per_node,
        ..plan
    }
}

/// Reads one epoch with `ranks` concurrent ranks, each on its own
/// connection, through the server's shared memory where `shm` (else over
/// the connection); returns the sample and the rows read.
pub async fn get(
    uri: &str,
    dataset: &str,
    ranks: u32,
    shuffle: Shuffle,
    batch_rows: u32,
    shm: bool,
) -> Result<(Sample, u64), BoxError> {
    read(
        uri,
        read_plan(dataset, ranks, shuffle, batch_rows),
        None,
        shm,
    )
    .await
}

/// Reads `plan` with ranks `only` (all when `None`) at once, each on its
/// own connection to the member that serves it.
pub async fn get_ranks(
    uri: &str,
    plan: ReadPlan,
    only: Option<std::ops::Range<u32>>,
) -> Result<(Sample, u64), BoxError> {
    read(uri, plan, only, false).await
}

/// [`get_ranks`], through shared memory where `shm`.
async fn read(
    uri: &str,
    plan: ReadPlan,
    only: Option<std::ops::Range<u32>>,
    shm: bool,
) -> Result<(Sample, u64), BoxError> {
    let start = Instant::now();
    let plan = Client::connect(uri).await?.plan(plan).await?;
    let mut tasks = Vec::new();
    let wanted = |r: u32| only.as_ref().is_none_or(|o| o.contains(&r));
    for shard in plan.shards.into_iter().filter(|s| wanted(s.rank)) {
        let uri = shard.location.clone().unwrap_or_else(|| uri.to_string());
        let mut client = Client::connect(&uri).await?.with_shared_memory(shm);
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut rows = 0u64;
            let mut last = Instant::now();
            let mut batches = client.read_shard(&shard).await?;
            while let Some(batch) = batches.next().await {
                rows += batch?.num_rows() as u64;
                latencies.push(last.elapsed());
                last = Instant::now();
            }
            Ok::<_, BoxError>((latencies, rows))
        }));
    }
    let mut latencies = Vec::new();
    let mut rows = 0;
    for t in tasks {
        let (l, r) = t.await??;
        latencies.extend(l);
        rows += r;
    }
    Ok((
        Sample {
            elapsed: start.elapsed(),
            latencies,
        },
        rows,
    ))
}

/// A read timed in parts, one after another (`get_ranks` node by node):
/// `so_far` (`Default` before the first part) followed by `next`, rows
/// added.
pub fn then((sample, rows): (Sample, u64), next: (Sample, u64)) -> (Sample, u64) {
    (sample.then(next.0), rows + next.1)
}

/// Drops a dataset, ignoring "not found".
pub async fn drop_dataset(uri: &str, dataset: &str) -> Result<(), BoxError> {
    let mut client = Client::connect(uri).await?;
    match client.drop_dataset(dataset).await {
        Ok(_) => Ok(()),
        Err(e) if e.code() == flightdeck_client::Code::NotFound => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// The Parquet path users take today: each partition written to a Parquet
/// file (snappy, as Spark writes), then `ranks` readers each read their
/// files. Returns the write and the read samples.
pub fn parquet_path(
    dir: &Path,
    shape: &Shape,
    parts: &Arc<Vec<Vec<RecordBatch>>>,
    writers: usize,
    ranks: usize,
) -> Result<(Sample, Sample), BoxError> {
    let start = Instant::now();
    std::thread::scope(|s| -> Result<(), BoxError> {
        let handles: Vec<_> = (0..writers)
            .map(|w| {
                s.spawn(move || -> Result<(), BoxError> {
                    for p in (w..parts.len()).step_by(writers) {
                        let file = std::fs::File::create(dir.join(format!("part-{p:05}.parquet")))?;
                        let props = WriterProperties::builder()
                            .set_compression(Compression::SNAPPY)
                            .build();
                        let mut writer = ArrowWriter::try_new(file, shape.schema(), Some(props))?;
                        for b in &parts[p] {
                            writer.write(b)?;
                        }
                        writer.close()?;
                    }
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join().map_err(|_| "parquet writer panicked")??;
        }
        Ok(())
    })?;
    let write = Sample {
        elapsed: start.elapsed(),
        latencies: vec![],
    };
    let start = Instant::now();
    let rows = std::thread::scope(|s| -> Result<u64, BoxError> {
        let handles: Vec<_> = (0..ranks)
            .map(|r| {
                s.spawn(move || -> Result<u64, BoxError> {
                    let mut rows = 0;
                    for p in (r..parts.len()).step_by(ranks) {
                        let file = std::fs::File::open(dir.join(format!("part-{p:05}.parquet")))?;
                        for batch in ParquetRecordBatchReaderBuilder::try_new(file)?.build()? {
                            rows += batch?.num_rows() as u64;
                        }
                    }
                    Ok(rows)
                })
            })
            .collect();
        let mut rows = 0;
        for h in handles {
            rows += h.join().map_err(|_| "parquet reader panicked")??;
        }
        Ok(rows)
    })?;
    if rows != shape.rows {
        return Err(format!("parquet readers read {rows} rows of {}", shape.rows).into());
    }
    let read = Sample {
        elapsed: start.elapsed(),
        latencies: vec![],
    };
    Ok((write, read))
}

/// Raw loopback TCP: `conns` connections each carrying `bytes / conns`
/// bytes in `message` byte writes, as fast as the kernel moves them.
pub fn limit_tcp(conns: usize, bytes: u64, message: usize) -> Result<Sample, BoxError> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    limit_stream(
        conns,
        bytes,
        message,
        move || listener.accept().map(|(s, _)| s),
        move || std::net::TcpStream::connect(addr),
    )
}

/// [`limit_tcp`] over a Unix domain socket (what `--unix-socket` serves on).
pub fn limit_unix(conns: usize, bytes: u64, message: usize) -> Result<Sample, BoxError> {
    let path = std::env::temp_dir().join(format!("flightdeck-limit-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = std::os::unix::net::UnixListener::bind(&path)?;
    let at = path.clone();
    let measured = limit_stream(
        conns,
        bytes,
        message,
        move || listener.accept().map(|(s, _)| s),
        move || std::os::unix::net::UnixStream::connect(&at),
    );
    let _ = std::fs::remove_file(&path);
    measured
}

/// `conns` streams from `accept` to `connect` each carrying `bytes / conns`
/// bytes in `message` byte writes, timed from the first connect to the last
/// byte read.
fn limit_stream<S: Read + Write + Send + 'static>(
    conns: usize,
    bytes: u64,
    message: usize,
    accept: impl Fn() -> std::io::Result<S> + Send + 'static,
    connect: impl Fn() -> std::io::Result<S> + Send + Sync + 'static,
) -> Result<Sample, BoxError> {
    let per_conn = bytes / conns as u64;
    let message = message.max(1);
    let sender = std::thread::spawn(move || -> Result<(), BoxError> {
        let mut senders = Vec::new();
        for _ in 0..conns {
            let mut sock = accept()?;
            senders.push(std::thread::spawn(move || -> std::io::Result<()> {
                let buf = vec![7u8; message];
                let mut left = per_conn;
                while left > 0 {
                    let n = left.min(message as u64) as usize;
                    sock.write_all(&buf[..n])?;
                    left -= n as u64;
                }
                Ok(())
            }));
        }
        for s in senders {
            s.join().map_err(|_| "sender panicked")??;
        }
        Ok(())
    });
    let connect = Arc::new(connect);
    let start = Instant::now();
    let readers: Vec<_> = (0..conns)
        .map(|_| {
            let connect = connect.clone();
            std::thread::spawn(move || -> std::io::Result<u64> {
                let mut sock = connect()?;
                let mut buf = vec![0u8; 1 << 20];
                let mut total = 0u64;
                loop {
                    let n = sock.read(&mut buf)?;
                    if n == 0 {
                        return Ok(total);
                    }
                    total += n as u64;
                }
            })
        })
        .collect();
    let mut total = 0;
    for r in readers {
        total += r.join().map_err(|_| "reader panicked")??;
    }
    let elapsed = start.elapsed();
    sender.join().map_err(|_| "sender panicked")??;
    if total != per_conn * conns as u64 {
        return Err(format!(
            "the socket moved {total} bytes, expected {}",
            per_conn * conns as u64
        )
        .into());
    }
    Ok(Sample {
        elapsed,
        latencies: vec![],
    })
}

/// Single-threaded memcpy of `bytes` bytes (in 64 MiB chunks).
pub fn limit_memcpy(bytes: u64) -> Sample {
    let chunk = (64usize << 20).min(bytes.max(1) as usize);
    let src = vec![1u8; chunk];
    let mut dst = vec![0u8; chunk];
    let start = Instant::now();
    let mut left = bytes;
    while left > 0 {
        let n = left.min(chunk as u64) as usize;
        dst[..n].copy_from_slice(&src[..n]);
        std::hint::black_box(&mut dst);
        left -= n as u64;
    }
    Sample {
        elapsed: start.elapsed(),
        latencies: vec![],
    }
}

/// A duration as seconds with millisecond precision, for progress lines.
pub fn secs(d: Duration) -> String {
    format!("{:.3}s", d.as_secs_f64())
}
