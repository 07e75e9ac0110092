//! A five-minute tour: write a dataset as four partitions (one of them twice,
//! as a Spark retry would), seal it naming the winner, and read one epoch as
//! three ranks with a global shuffle.
//!
//! ```text
//! cargo run --release --bin flightdeck -- serve &
//! cargo run -p flightdeck-client --example tour -- http://127.0.0.1:50051
//! ```

use std::sync::Arc;

use arrow::array::{ArrayRef, Float32Array, Int64Array, RecordBatch};
use flightdeck_client::{Client, ClientError, PartitionAttempt, ReadPlan, SealDataset, Shuffle};
use futures::{TryStreamExt, stream};

fn partition(p: i64, rows: i64) -> RecordBatch {
    let ids: Vec<i64> = (p * 1000..p * 1000 + rows).collect();
    let x: Vec<f32> = ids.iter().map(|&i| i as f32 / 10.0).collect();
    RecordBatch::try_from_iter([
        ("id", Arc::new(Int64Array::from(ids)) as ArrayRef),
        ("x", Arc::new(Float32Array::from(x)) as ArrayRef),
    ])
    .expect("valid batch")
}

#[tokio::main]
async fn main() -> Result<(), ClientError> {
    let uri = std::env::args().nth(1).unwrap_or_else(|| "local".into());
    let mut client = Client::connect(&uri).await?;
    // Start from a clean slate when the tour is run twice.
    let _ = client.drop_dataset("tour").await;

    // Four partitions; partition 2 is written twice (attempts 0 and 1).
    for (p, attempt) in [(0, 0), (1, 0), (2, 0), (2, 1), (3, 0)] {
        let batch = partition(p, 10 + p);
        let ack = client
            .put_partition(
                "tour",
                p as u32,
                attempt,
                batch.schema(),
                stream::iter([Ok(batch)]),
            )
            .await?;
        println!(
            "put partition {} attempt {}: {} rows",
            ack.partition, ack.attempt, ack.rows
        );
    }

    // The driver knows attempt 1 of partition 2 won; the seal says so.
    let info = client
        .seal(SealDataset {
            dataset: "tour".into(),
            partitions: 4,
            attempts: vec![PartitionAttempt {
                partition: 2,
                attempt: 1,
            }],
            ..Default::default()
        })
        .await?;
    println!(
        "sealed '{}': {} rows in {} partitions",
        info.dataset, info.rows, info.committed_partitions
    );

    // One epoch for three ranks: equal shares of a global shuffle.
    let plan = client
        .plan(ReadPlan {
            dataset: "tour".into(),
            world_size: 3,
            epoch: 0,
            seed: 42,
            shuffle: Shuffle::Global.into(),
            batch_rows: 8,
            ..Default::default()
        })
        .await?;
    for shard in &plan.shards {
        let batches: Vec<RecordBatch> = client.read_shard(shard).await?.try_collect().await?;
        let ids: Vec<i64> = batches
            .iter()
            .flat_map(|b| {
                let col = b
                    .column(0)
                    .as_any()
                    .downcast_ref::<Int64Array>()
                    .expect("id column");
                col.values().to_vec()
            })
            .collect();
        println!(
            "rank {}: {} rows in {} batches, ids {:?}",
            shard.rank,
            shard.rows,
            batches.len(),
            &ids[..6]
        );
    }
    let stats = client.stats().await?;
    println!(
        "server holds {} bytes of {} allowed",
        stats.memory_used, stats.memory_limit
    );
    Ok(())
}
