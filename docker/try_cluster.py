"""Tries a three-member flightdeck cluster (docker/compose.yaml): Spark
writes a DataFrame across the members, one dataset; four ranks read a
shuffled epoch of it through one member; every row arrives once."""

from __future__ import annotations

import os
import time

from pyspark.sql import SparkSession

import flightdeck
from flightdeck.spark import register

URIS = os.environ.get("FLIGHTDECK_URIS", "grpc://member-0:50051,grpc://member-1:50051,grpc://member-2:50051")


def wait_for(uri: str) -> None:
    """Waits until `uri` answers (members start alongside this client)."""
    for _ in range(60):
        try:
            with flightdeck.connect(uri, timeout=2) as c:
                c.stats()
                return
        except flightdeck.FlightDeckError:
            time.sleep(1)
    raise SystemExit(f"{uri} did not answer within 60 s")


def main() -> None:
    uris = URIS.split(",")
    for uri in uris:
        wait_for(uri)
    spark = SparkSession.builder.master("local[4]").appName("flightdeck-try").getOrCreate()
    register(spark)
    df = spark.range(0, 1_000_000, numPartitions=12).selectExpr("id", "cast(id % 10 as int) as label")
    df.write.format("flightdeck").option("uris", URIS).option("dataset", "try").mode("overwrite").save()
    with flightdeck.connect(uris[0]) as c:
        info = c.describe("try")
        print(f"dataset 'try': {info.rows} rows over {len(info.layout.members)} members")
        plan = c.plan("try", world_size=4, shuffle="global", seed=7)
        ids = []
        for shard in plan.shards:
            for batch in c.read_shard(shard):
                ids.extend(batch.column("id").to_pylist())
    assert sorted(ids) == list(range(1_000_000)), "every row once"
    print(f"4 ranks read {len(ids)} rows, each once")


if __name__ == "__main__":
    main()
