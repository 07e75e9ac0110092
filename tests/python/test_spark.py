"""A real PySpark job writes into flightdeck: a task fails mid-partition and
is retried, the dataset holds every row exactly once, and ranks read
balanced, disjoint shards with exact resume; a job that fails for good
leaves nothing behind."""

from __future__ import annotations

import pytest

pytest.importorskip("pyspark")

import flightdeck  # noqa: E402
from conftest import strided_order  # noqa: E402
from flightdeck import ShardedDataset  # noqa: E402
from flightdeck.spark import register, vectors_to_arrays, write_dataframe  # noqa: E402

ROWS = 200_000


def source(spark):
    return spark.range(ROWS, numPartitions=8).selectExpr(
        "id",
        "cast(id * 0.5 as float) as x",
        "array(cast(id as float), cast(-id as float), 1.0f) as vec",
        "case when id % 10 = 0 then null else concat('row-', id) end as name",
    )


def fail_first_attempt(df, partition=3):
    """The same rows, but partition `partition` dies on its first attempt
    after it has already sent one batch."""
    from pyspark import TaskContext

    def run(batches):
        ctx = TaskContext.get()
        for i, batch in enumerate(batches):
            if ctx.partitionId() == partition and ctx.attemptNumber() == 0 and i == 1:
                raise RuntimeError("injected failure of the first attempt")
            yield batch

    return df.mapInArrow(run, df.schema)


def ids(batches):
    return [i for b in batches for i in b.column("id").to_pylist()]


def test_spark_writes_exactly_once_and_ranks_read_balanced_shards(flightdeck_server, spark):
    register(spark, "flightdeck_py")
    uri = flightdeck_server.uri
    df = fail_first_attempt(source(spark))
    df.write.format("flightdeck_py").option("uri", uri).option("dataset", "spark").mode(
        "overwrite"
    ).save()

    client = flightdeck.connect(uri)
    info = client.describe("spark")
    assert info.state == 2 and info.rows == ROWS
    parts = {p.partition: (p.attempt, p.committed_attempts) for p in info.partitions}
    assert sorted(parts) == list(range(8))
    assert parts[3] == (1, 1), "the failed first attempt left nothing; the retry won"

    ranks = [
        ShardedDataset(uri, "spark", rank=r, world_size=4, batch_rows=4096, seed=11)
        for r in range(4)
    ]
    epoch0 = [ids(ds) for ds in ranks]
    assert [len(x) for x in epoch0] == [ROWS // 4] * 4
    flat = sum(epoch0, [])
    assert len(set(flat)) == ROWS and set(flat) == set(range(ROWS))
    for ds in ranks:
        ds.set_epoch(1)
    first_batches = [next(iter(ds)) for ds in ranks]
    assert ids(first_batches) != [x for r in epoch0 for x in r[:4096]]

    # Resume mid-epoch 1 at world size 2: exactly the unseen rows.
    for ds in ranks:
        ds.set_epoch(1)
    seen = set()
    for ds in ranks:
        it = iter(ds)
        for _ in range(5):
            seen.update(next(it).column("id").to_pylist())
    state = ranks[0].state_dict()
    resumed = [
        ShardedDataset(uri, "spark", rank=r, world_size=2, batch_rows=4096, seed=11)
        for r in range(2)
    ]
    rest = []
    for ds in resumed:
        ds.load_state_dict(state)
        rest.append(ids(ds))
    remaining = ROWS - state["start_sample"]
    unseen = strided_order(rest, remaining)
    assert len(set(unseen)) == remaining
    assert set(unseen).isdisjoint(seen) and len(seen) + remaining == ROWS

    # Values intact, and the mapInArrow helper writes the same dataset.
    assert write_dataframe(fail_first_attempt(source(spark)), uri, "spark_map") == ROWS
    info2 = client.describe("spark_map")
    assert {p.partition: p.attempt for p in info2.partitions}[3] == 1

    def whole(name):
        plan = client.plan(name, world_size=1)
        return client.read_table(plan.shards[0]).sort_by("id")

    a, b = whole("spark"), whole("spark_map")
    assert a.equals(b)
    assert a.column("x").to_pylist()[:3] == [0.0, 0.5, 1.0]
    assert a.column("name").to_pylist()[:2] == [None, "row-1"]
    assert flightdeck.to_numpy(a.combine_chunks().to_batches()[0], "vec").shape[1] == 3


def test_spark_modes(flightdeck_server, spark):
    register(spark, "flightdeck_py")
    uri = flightdeck_server.uri
    small = spark.range(100, numPartitions=2)
    writer = lambda df, mode: (  # noqa: E731
        df.write.format("flightdeck_py").option("uri", uri).option("dataset", "m").mode(mode).save()
    )
    writer(small, "overwrite")
    with pytest.raises(Exception, match="cannot append to dataset 'm'"):
        writer(small, "append")
    writer(spark.range(30, numPartitions=3), "overwrite")
    client = flightdeck.connect(uri)
    assert client.describe("m").rows == 30
    with pytest.raises(Exception, match=r"set the dataset to write: \.option\('dataset', NAME\)"):
        small.write.format("flightdeck_py").option("uri", uri).mode("overwrite").save()


def test_vectors_become_float_arrays(flightdeck_server, spark):
    from pyspark.ml.linalg import Vectors

    uri = flightdeck_server.uri
    df = spark.createDataFrame(
        [(i, Vectors.dense([float(i), 2.0 * i])) for i in range(10)], ["id", "features"]
    )
    write_dataframe(vectors_to_arrays(df), uri, "vec")
    client = flightdeck.connect(uri)
    table = client.read_table(client.plan("vec").shards[0]).sort_by("id")
    feats = flightdeck.to_numpy(table.combine_chunks().to_batches()[0], "features")
    assert feats.dtype.name == "float32" and feats.shape == (10, 2)
    assert feats[3].tolist() == [3.0, 6.0]


def always_fail(df, partition=1):
    """The same rows, but partition `partition` dies on every attempt after
    it has sent one batch: the job fails with other partitions written."""

    def run(batches):
        from pyspark import TaskContext

        for i, batch in enumerate(batches):
            if TaskContext.get().partitionId() == partition and i == 1:
                raise RuntimeError("injected failure of every attempt")
            yield batch

    return df.mapInArrow(run, df.schema)


def test_a_failed_job_drops_what_it_wrote(flightdeck_server, spark):
    uri = flightdeck_server.uri
    df = always_fail(
        spark.range(80_000, numPartitions=4).selectExpr("id", "cast(id as float) as x")
    )
    client = flightdeck.connect(uri)
    writers = [lambda: write_dataframe(df, uri, "failed-a")]
    if hasattr(spark, "dataSource"):  # Spark 4: the data source too
        register(spark, "flightdeck_py")
        writers.append(
            lambda: df.write.format("flightdeck_py").option("uri", uri)
            .option("dataset", "failed-b").mode("overwrite").save()
        )
    for name, write in zip(["failed-a", "failed-b"], writers):
        with pytest.raises(Exception, match="injected failure of every attempt"):
            write()
        # Nothing of it is left: not the partitions that were committed,
        # not the failed attempts' halves.
        with pytest.raises(flightdeck.NotFound):
            client.describe(name)
        assert name not in client.list_datasets()
        # (There was something to drop: partitions had been committed.)
        log = "".join(flightdeck_server.stderr_lines)
        assert f"committed attempt dataset={name} " in log, log
        assert f"dropped dataset dataset={name} " in log, log
    stats = client.stats()
    # (Idle slabs stay pooled for the next writer; no live byte is left.)
    assert (stats.datasets, stats.rows, stats.host_live_bytes) == (0, 0, 0), stats
