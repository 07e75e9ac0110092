"""A real PySpark job writes into flightdeck: a task fails mid-partition and
is retried, the dataset holds every row exactly once, and ranks read
balanced, disjoint shards with exact resume; a job that fails for good
leaves nothing behind. Reads give a dataset back (filters pushed down where
Spark keeps a pushed read to its own query; a DataFrame queried again gets
every row), never mixing two writes of it; a server that needs tokens takes them as the
`token` option."""

from __future__ import annotations

import contextlib
import threading
import time

import pyarrow as pa
import pytest

pytest.importorskip("pyspark")

import flightdeck  # noqa: E402
from conftest import TYPES, RunningServer, strided_order  # noqa: E402
from flightdeck import ShardedDataset  # noqa: E402
from flightdeck.spark import (  # noqa: E402
    rebatch,
    register,
    reuses_pushed_reads,
    vectors_to_arrays,
    write_dataframe,
)

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
    from pyspark.ml.linalg import Vectors, VectorUDT
    from pyspark.sql.types import LongType, StructField, StructType

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

    # Sparse vectors as dense arrays; a null vector a null array (Spark's
    # vector_to_array failed the job: "requires a non-null input argument").
    mixed = spark.createDataFrame(
        [(0, Vectors.sparse(3, [1], [2.0])), (1, None), (2, Vectors.dense([1.0, 0.0, 3.0]))],
        StructType([StructField("id", LongType()), StructField("features", VectorUDT())]),
    )
    rows = vectors_to_arrays(mixed).orderBy("id").collect()
    assert [r.features for r in rows] == [[0.0, 2.0, 0.0], None, [1.0, 0.0, 3.0]]


def check_vectors_are_refused(spark, uri, fmt):
    """A Spark ML vector column would be stored as Spark's internal struct:
    the write is refused naming it and the conversion, before any row is
    sent (it stored `struct<type, size, indices, values>`)."""
    from pyspark.ml.linalg import Vectors

    register(spark, "flightdeck_py")
    df = spark.createDataFrame([(Vectors.dense([1.0, 2.0]), 1)], ["features", "label"])
    with pytest.raises(Exception, match="column 'features' is a Spark ML vector.*vectors_to_arrays"):
        df.write.format(fmt).option("uri", uri).option("dataset", "vectors").mode(
            "overwrite").save()
    assert "vectors" not in flightdeck.connect(uri).list_datasets()


def test_python_source_refuses_vectors(flightdeck_server, spark):
    check_vectors_are_refused(spark, flightdeck_server.uri, "flightdeck_py")
    from pyspark.ml.linalg import Vectors

    df = spark.createDataFrame([(Vectors.dense([1.0, 2.0]), 1)], ["features", "label"])
    with pytest.raises(flightdeck.InvalidArgument, match="column 'features' is a Spark ML vector"):
        write_dataframe(df, flightdeck_server.uri, "vectors")


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


def test_read_parts_follow_the_stored_partitions_or_split_the_selection():
    from flightdeck.spark import read_parts

    assert read_parts([3, 0, 5]) == [(0, 3), (3, 0), (3, 5)]
    assert read_parts([]) == []
    # A filter's selected rows: as many equal parts as stored partitions,
    # in order, none empty.
    assert read_parts([3, 4, 5], 7) == [(0, 2), (2, 2), (4, 3)]
    assert read_parts([3, 4, 5], 1) == [(0, 1)]
    assert read_parts([3, 4, 5], 0) == []
    assert read_parts([], 4) == [(0, 4)]
    for stored, selected in [([5] * 7, 100), ([1, 2], 3), ([9] * 4, 3)]:
        parts = read_parts(stored, selected)
        assert [a for a, _ in parts] == [sum(n for _, n in parts[:i]) for i in range(len(parts))]
        assert sum(n for _, n in parts) == selected and all(n > 0 for _, n in parts)


def test_spark_filters_translate_only_where_they_mean_the_same():
    datasource = pytest.importorskip("pyspark.sql.datasource")
    if not hasattr(datasource, "EqualTo"):
        pytest.skip("this Spark pushes no filters to Python data sources (4.1+ does)")
    from pyspark.sql.datasource import (
        EqualNullSafe,
        EqualTo,
        GreaterThan,
        GreaterThanOrEqual,
        In,
        IsNotNull,
        IsNull,
        LessThan,
        LessThanOrEqual,
        Not,
        StringStartsWith,
    )
    from pyspark.sql.types import (
        BooleanType,
        DoubleType,
        IntegerType,
        LongType,
        StringType,
        StructField,
        StructType,
    )

    from flightdeck.spark import column_kinds, filter_sql

    kinds = column_kinds(
        StructType(
            [
                StructField("id", LongType()),
                StructField("k", IntegerType()),
                StructField("name", StringType()),
                StructField("ok", BooleanType()),
                StructField("x", DoubleType()),
                StructField('odd "name"', LongType()),
            ]
        )
    )
    cases = [
        (EqualTo(("id",), 3), '("id" = 3)'),
        (GreaterThan(("k",), -2), '("k" > -2)'),
        (GreaterThanOrEqual(("name",), "n'2"), "(\"name\" >= 'n''2')"),
        (LessThan(("id",), 2**63 - 1), f'("id" < {2**63 - 1})'),
        (LessThanOrEqual(("k",), 0), '("k" <= 0)'),
        (EqualTo(("ok",), True), '("ok" = TRUE)'),
        (Not(EqualTo(("ok",), False)), '(NOT ("ok" = FALSE))'),
        (In(("k",), (1, 2, 3)), '("k" IN (1, 2, 3))'),
        (IsNull(("x",)), '("x" IS NULL)'),
        (Not(IsNotNull(("name",))), '(NOT ("name" IS NOT NULL))'),
        (EqualTo(('odd "name"',), 1), '("odd ""name""" = 1)'),
        # Left to Spark: floating point, a bool against a number (Python's
        # bool is an int), a string against a number, the one integer whose
        # digits overflow, nested fields, unknown columns, other filters.
        (EqualTo(("x",), 1.5), None),
        (EqualTo(("k",), True), None),
        (EqualTo(("id",), "3"), None),
        (EqualTo(("id",), -(2**63)), None),
        (In(("k",), (1, "2")), None),
        (In(("k",), ()), None),
        (EqualTo(("st", "a"), 1), None),
        (EqualTo(("missing",), 1), None),
        (Not(EqualTo(("x",), 0.0)), None),
        (EqualNullSafe(("id",), 1), None),
        (StringStartsWith(("name",), "n"), None),
    ]
    for f, want in cases:
        assert filter_sql(f, kinds) == want, f


def test_spark_reads_a_dataset_back(flightdeck_server, spark):
    if not hasattr(spark, "dataSource"):
        pytest.skip("Python data sources need Spark 4")
    register(spark, "flightdeck_py")
    uri = flightdeck_server.uri
    df = source(spark)
    df.write.format("flightdeck_py").option("uri", uri).option("dataset", "back").mode(
        "overwrite"
    ).save()
    client = flightdeck.connect(uri)
    order = ids(client.read_shard(client.plan("back").shards[0]))

    def read(**options):
        r = spark.read.format("flightdeck_py").option("uri", uri).option("dataset", "back")
        for k, v in options.items():
            r = r.option(k, v)
        return r

    # One Spark partition per stored partition, the same schema and rows,
    # in the dataset's order.
    back = read(batch_rows=3000).load()
    assert back.rdd.getNumPartitions() == 8
    assert back.schema == df.schema
    assert [r.id for r in back.select("id").collect()] == order
    assert sorted(back.collect(), key=lambda r: r.id) == sorted(df.collect(), key=lambda r: r.id)

    # The filter option: only the selected rows, in order, split evenly
    # over as many partitions, none empty (one server: no locality to
    # keep, so a skewed filter still makes as many tasks).
    chosen = read(filter="id % 3 = 0 AND name IS NOT NULL").load()
    assert chosen.rdd.getNumPartitions() == 8
    assert [r.id for r in chosen.select("id").collect()] == [
        i for i in order if i % 3 == 0 and i % 10
    ]
    assert read(filter="id = 5").load().rdd.getNumPartitions() == 1
    assert read(filter="id < 0").load().count() == 0
    # Rows of one stored partition only: still eight tasks.
    first = order[: min(100, client.describe("back").partitions[0].rows)]
    skewed = read(filter=f"id IN ({', '.join(map(str, first))})").load()
    assert skewed.rdd.getNumPartitions() == 8
    assert [r.id for r in skewed.select("id").collect()] == first

    # Spark's own filters on integer and string columns are pushed down
    # where Spark keeps a pushed read to its own scan (5+); the one on a
    # float stays in Spark (and Spark checks every one again). On Spark 4
    # none is: Spark filters what arrives.
    served = client.stats().rows_served
    where = "id >= 1000 AND id < 1100 AND name <> 'row-1050' AND x > 520.0"
    got = [r.id for r in read(batch_rows=100).load().where(where).select("id").collect()]
    want = [i for i in order if 1040 < i < 1100 and i % 10 and i != 1050]
    assert got == want
    sent = client.stats().rows_served - served
    if reuses_pushed_reads(spark.version):
        assert sent >= ROWS, sent
    else:
        assert len(want) <= sent < 1_000, sent

    # One DataFrame queried with filters, then with none that Spark can
    # push: every row each time. (Spark 4 gave the later queries the read
    # the first one's pushed filters planned: 10 rows, then 1.)
    base = read().load()
    assert base.where("id < 10").count() == 10
    assert base.count() == ROWS
    assert base.where("id = 11").count() == 1
    assert base.where("id < 10 OR name = 'row-11'").count() == 11

    # Where the session does not let Spark push filters to Python data
    # sources, the read still works: Spark filters what the server sends.
    key = "spark.sql.python.filterPushdown.enabled"
    spark.conf.set(key, "false")
    try:
        register(spark, "flightdeck_py")
        served = client.stats().rows_served
        assert [r.id for r in read().load().where(where).select("id").collect()] == want
        assert client.stats().rows_served - served >= ROWS
    finally:
        spark.conf.set(key, "true")
        register(spark, "flightdeck_py")

    # A schema given to the read names the columns the server sends.
    named = spark.read.schema("name string, id long").format("flightdeck_py")
    named = named.option("uri", uri).option("dataset", "back").load()
    assert named.columns == ["name", "id"]
    rows = named.collect()
    assert [r.id for r in rows] == order
    assert rows[order.index(7)].name == "row-7"

    with pytest.raises(Exception, match="the read's schema names \\['nope'\\]"):
        spark.read.schema("nope long").format("flightdeck_py").option("uri", uri).option(
            "dataset", "back"
        ).load().collect()
    with pytest.raises(Exception, match="dataset 'missing' does not exist on"):
        spark.read.format("flightdeck_py").option("uri", uri).option("dataset", "missing").load()
    with pytest.raises(Exception, match=r"set the dataset to read: \.option\('dataset', NAME\)"):
        spark.read.format("flightdeck_py").option("uri", uri).load()
    with pytest.raises(Exception, match="option batch_rows must be a whole number"):
        read(batch_rows="ten").load().collect()


def check_a_read_never_mixes_two_writes(spark, uri, fmt):
    """A read whose partitions Spark planned (`.rdd` plans them) before the
    dataset was written again fails its tasks, naming why, rather than
    reading the new write in some partitions and the old in others; read
    again, it gives the new rows."""

    def write(first):
        df = spark.range(first, first + 1_000, numPartitions=4)
        w = df.write.format(fmt).option("uri", uri).option("dataset", "twice")
        w.mode("overwrite").save()

    def read():
        return spark.read.format(fmt).option("uri", uri).option("dataset", "twice").load()

    write(0)
    planned = read().rdd
    filtered = read().where("id % 2 = 0").rdd
    write(1_000)
    for rdd in (planned, filtered):
        with pytest.raises(Exception, match="written again since this read began"):
            rdd.count()
    assert sorted(r.id for r in read().collect()) == list(range(1_000, 2_000))


def check_a_failed_overwrite_keeps_the_dataset(server, spark, write):
    """An overwrite stages its rows beside the dataset: while it runs, and
    after it failed, readers read the old rows through the very plan they
    had (the dataset was not written again); what it staged is dropped."""
    client = flightdeck.connect(server.uri)
    write(spark.range(30, numPartitions=3), "kept")
    plan = client.plan("kept")
    before = client.read_table(plan.shards[0])
    df = always_fail(spark.range(80_000, numPartitions=4).selectExpr("id", "cast(id as float) x"))
    with pytest.raises(Exception, match="injected failure of every attempt"):
        write(df, "kept")
    assert client.read_table(plan.shards[0]).equals(before)
    assert client.list_datasets() == ["kept"]
    log = "".join(server.stderr_lines)
    assert "dropped dataset dataset=kept " in log and "staged=true" in log, log
    stats = client.stats()
    assert (stats.datasets, stats.rows) == (1, 30), stats
    # The next overwrite that succeeds replaces it.
    write(spark.range(5, numPartitions=1), "kept")
    assert sorted(client.read_table(client.plan("kept").shards[0]).column("id").to_pylist()) == [
        0, 1, 2, 3, 4
    ]


def test_a_failed_overwrite_keeps_the_dataset(flightdeck_server, spark):
    uri = flightdeck_server.uri
    check_a_failed_overwrite_keeps_the_dataset(
        flightdeck_server, spark, lambda df, name: write_dataframe(df, uri, name)
    )


def python_source_overwrite(spark):
    """`write(df, uri, name)`: an overwrite through the Python data source
    (registered as `flightdeck_py`); skips the test before Spark 4."""
    if not hasattr(spark, "dataSource"):
        pytest.skip("Python data sources need Spark 4")
    register(spark, "flightdeck_py")

    def write(df, uri, name):
        df.write.format("flightdeck_py").option("uri", uri).option("dataset", name).mode(
            "overwrite"
        ).save()

    return write


def test_a_failed_python_source_overwrite_keeps_the_dataset(flightdeck_server, spark):
    write = python_source_overwrite(spark)
    uri = flightdeck_server.uri
    check_a_failed_overwrite_keeps_the_dataset(
        flightdeck_server, spark, lambda df, name: write(df, uri, name)
    )


def check_an_empty_dataframe_writes_an_empty_dataset(uri, spark, fmt, write):
    """A DataFrame with no rows — with no partitions at all, or with
    partitions that are all empty — writes a sealed dataset of no rows with
    its schema, which reads back as an empty DataFrame and an epoch of no
    batches; as an overwrite it empties the dataset it replaces."""
    client = flightdeck.connect(uri)
    no_partitions = spark.createDataFrame(spark.sparkContext.emptyRDD(), "id long, x float")
    assert no_partitions.rdd.getNumPartitions() == 0
    empty_partitions = spark.range(100, numPartitions=4).selectExpr("id", "cast(id as float) x")
    empty_partitions = empty_partitions.where("id < 0")
    write(spark.range(30, numPartitions=3).selectExpr("id", "cast(id as float) x"), "emptied")
    cases = (("none", no_partitions), ("empty", empty_partitions), ("emptied", empty_partitions))
    for name, df in cases:
        write(df, name)
        info = client.describe(name)
        assert (info.state, info.rows) == (2, 0), (name, info)
        back = spark.read.format(fmt).option("uri", uri).option("dataset", name).load()
        assert back.columns == ["id", "x"] and back.count() == 0, name
        assert list(ShardedDataset(uri, name, rank=0, world_size=2, seed=3)) == [], name
    assert sorted(client.list_datasets()) == ["emptied", "empty", "none"]


def test_an_empty_dataframe_writes_an_empty_dataset(flightdeck_server, spark):
    write = python_source_overwrite(spark)
    uri = flightdeck_server.uri
    check_an_empty_dataframe_writes_an_empty_dataset(
        uri, spark, "flightdeck_py", lambda df, name: write(df, uri, name)
    )


def test_write_dataframe_writes_an_empty_dataframe(flightdeck_server, spark):
    if not hasattr(spark, "dataSource"):
        pytest.skip("reads back through the Python data source, which needs Spark 4")
    register(spark, "flightdeck_py")
    uri = flightdeck_server.uri
    check_an_empty_dataframe_writes_an_empty_dataset(
        uri, spark, "flightdeck_py", lambda df, name: write_dataframe(df, uri, name)
    )


CONNECT_JOB = r"""
import json, sys
from pyspark.sql import SparkSession, functions as F
from flightdeck.spark import register, write_dataframe

uri, jar = sys.argv[1], sys.argv[2]
spark = (
    SparkSession.builder.remote("local[2]")
    .config("spark.connect.grpc.binding.address", "127.0.0.1")
    .config("spark.driver.host", "127.0.0.1")
    .config("spark.driver.bindAddress", "127.0.0.1")
    .config("spark.ui.enabled", "false")
    .config("spark.jars", jar)
    .getOrCreate()
)
register(spark, "flightdeck_py")
df = spark.range(1000, numPartitions=4).selectExpr("id", "cast(id as float) x")
said = {}
for fmt in ("flightdeck_py",) + (("flightdeck",) if jar else ()):
    df.write.format(fmt).option("uri", uri).option("dataset", "by_" + fmt).mode("overwrite").save()
    back = spark.read.format(fmt).option("uri", uri).option("dataset", "by_" + fmt).load()
    said[fmt] = sorted(r.id for r in back.collect())
groups = df.groupBy((F.col("id") % 7).alias("k")).agg(F.count("*").alias("n"))
said["grouped"] = write_dataframe(groups, uri, "grouped")
said["empty"] = write_dataframe(df.where("id < 0"), uri, "empty")
print(json.dumps(said))
"""


def test_spark_connect_writes_and_reads(flightdeck_server, tmp_path):
    """A Spark Connect session (PySpark 4's `remote`, a thin client with no
    RDDs) writes and reads with the Python data source and the JVM
    connector, and `write_dataframe` works there too: it counted the
    partitions with `df.rdd`, which Spark Connect does not have (and which
    ran a shuffle's plan once more before the write). Runs in a process of
    its own: a local Spark Connect server cannot start beside a Spark
    context."""
    pytest.importorskip("grpc_status", reason="Spark Connect needs pyspark[connect]")
    import json
    import os
    import socket
    import subprocess
    import sys

    from conftest import SPARK_JAR

    # The local server listens where the client looks: Spark Connect's port.
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", 15002)) == 0:
            pytest.skip("port 15002, where a local Spark Connect server listens, is taken")
    uri = flightdeck_server.uri
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
    jar = str(SPARK_JAR) if SPARK_JAR.exists() else ""
    job = subprocess.run(
        [sys.executable, "-c", CONNECT_JOB, uri, jar],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )
    assert job.returncode == 0, job.stderr[-4000:]
    said = json.loads(job.stdout.strip().splitlines()[-1])
    for fmt in ("flightdeck_py",) + (("flightdeck",) if jar else ()):
        assert said[fmt] == list(range(1000)), fmt
    client = flightdeck.connect(uri)
    assert said["grouped"] == 7
    grouped = client.read_table(client.plan("grouped").shards[0])
    assert sorted(grouped["n"].to_pylist()) == sorted([143] * 6 + [142])
    assert said["empty"] == 0 and client.describe("empty").rows == 0
    assert client.describe("empty").state == 2  # sealed


def check_a_write_whose_server_dies_fails(spark, write):
    """A server killed while the tasks stream to it: the job fails (each
    retry finds the server gone) and the driver gets control back. (The JVM
    connector's task whose stream the server had ended used to wait for the
    transport to take more, which it never does again, spinning without
    end: the suite's per-test timeout is what bounds this test then.)"""
    server = RunningServer("--memory-limit", "2GiB")
    client = flightdeck.connect(server.uri)
    df = spark.range(20_000_000, numPartitions=2).selectExpr("id", "cast(id as double) x")
    killed = threading.Event()

    def kill_once_streaming():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if client.stats().memory_used > 0:
                server.proc.kill()
                killed.set()
                return
            time.sleep(0.01)

    # The write runs on this thread: a Python data source is found through
    # the session this thread made active.
    killer = threading.Thread(target=kill_once_streaming, daemon=True)
    killer.start()
    try:
        with pytest.raises(Exception):  # noqa: B017 - Spark wraps what the tasks raised
            write(df, server.uri, "cut")
    finally:
        killer.join(130)
        client.close()
        server.stop()
    assert killed.is_set(), "the tasks never started streaming"


def test_a_python_source_write_whose_server_dies_fails(spark):
    check_a_write_whose_server_dies_fails(spark, python_source_overwrite(spark))


@contextlib.contextmanager
def guarded_server(tmp_path):
    """A server that takes writer token `w-spark` and reader token `r-spark`."""
    tokens = tmp_path / "tokens"
    tokens.write_text("writer w-spark\nreader r-spark\n")
    server = RunningServer("--memory-limit", "256MiB", "--auth-token-file", str(tokens))
    try:
        yield server
    finally:
        assert server.stop() == 0


def check_the_token_option(spark, fmt, tmp_path):
    """On a server that needs tokens, the `token` option writes with a
    writer's token and reads with a reader's; a reader's token cannot
    replace the dataset (which stays whole), and without a token the server
    refuses, saying one is needed."""
    with guarded_server(tmp_path) as server:

        def write(**options):
            df = spark.range(0, 500, numPartitions=2)
            w = df.write.format(fmt).option("uri", server.uri).option("dataset", "guarded")
            w.options(**options).mode("overwrite").save()

        def read(**options):
            r = spark.read.format(fmt).option("uri", server.uri).option("dataset", "guarded")
            return sorted(row.id for row in r.options(**options).load().collect())

        write(token="w-spark")
        assert read(token="r-spark") == list(range(500))
        with pytest.raises(Exception, match="a reader token may not"):
            write(token="r-spark")
        with pytest.raises(Exception, match="needs a token"):
            write()
        with pytest.raises(Exception, match="needs a token"):
            read()
        assert read(token="r-spark", filter="id < 10") == list(range(10))


def test_the_python_source_takes_a_token_option(spark, tmp_path):
    if not hasattr(spark, "dataSource"):
        pytest.skip("Python data sources need Spark 4")
    register(spark, "flightdeck_py")
    check_the_token_option(spark, "flightdeck_py", tmp_path)
    # write_dataframe takes it as an argument.
    with guarded_server(tmp_path) as server:
        df = spark.range(0, 300, numPartitions=3)
        with pytest.raises(Exception, match="needs a token"):
            write_dataframe(df, server.uri, "mapped")
        assert write_dataframe(df, server.uri, "mapped", token="w-spark") == 300
        with flightdeck.connect(server.uri, token="r-spark") as c:
            assert c.describe("mapped").rows == 300


def test_a_python_source_read_never_mixes_two_writes(flightdeck_server, spark):
    if not hasattr(spark, "dataSource"):
        pytest.skip("Python data sources need Spark 4")
    register(spark, "flightdeck_py")
    check_a_read_never_mixes_two_writes(spark, flightdeck_server.uri, "flightdeck_py")


def test_spark_reads_refuse_an_unsealed_dataset_and_columns_spark_cannot_hold(
    flightdeck_server, spark
):
    if not hasattr(spark, "dataSource"):
        pytest.skip("Python data sources need Spark 4")
    import pyarrow as pa

    register(spark, "flightdeck_py")
    uri = flightdeck_server.uri
    client = flightdeck.connect(uri)
    import decimal

    batch = pa.record_batch({
        "id": pa.array([1, 2, 3], pa.int64()),
        "u": pa.array([7, 8, 9], pa.uint32()),
        "w": pa.array([decimal.Decimal(1)] * 3, pa.decimal256(40, 2)),
    })
    client.put_partition("raw", 0, [batch])

    def read(schema=None):
        r = spark.read.format("flightdeck_py").option("uri", uri).option("dataset", "raw")
        return (r.schema(schema) if schema else r).load()

    with pytest.raises(Exception, match="'raw' is still being written; read it once"):
        read("id long").collect()
    client.seal("raw", partitions=1)
    with pytest.raises(Exception, match=r"column 'w' of dataset 'raw' .* is decimal256\(40, 2\), "
                       "which Spark"):
        read()
    # Without it, or with a type it converts to, the dataset reads.
    assert [r.id for r in read("id long").collect()] == [1, 2, 3]
    assert [(r.id, r.u) for r in read("id long, u long").collect()] == [(1, 7), (2, 8), (3, 9)]


def test_every_type_round_trips_through_the_python_source(flightdeck_server, spark):
    if not hasattr(spark, "dataSource"):
        pytest.skip("Python data sources need Spark 4")
    register(spark, "flightdeck_py")
    uri = flightdeck_server.uri
    df = spark.range(2_000, numPartitions=3).selectExpr(*TYPES)
    df.write.format("flightdeck_py").option("uri", uri).option("dataset", "types").mode(
        "overwrite"
    ).save()
    back = spark.read.format("flightdeck_py").option("uri", uri).option("dataset", "types").load()
    assert back.rdd.getNumPartitions() == 3
    assert back.schema == df.schema
    assert sorted(back.collect(), key=lambda r: r.id) == sorted(df.collect(), key=lambda r: r.id)


def check_view_columns_read_as_strings_and_bytes(spark, uri, fmt):
    """Columns a pyarrow or Polars writer stored in Arrow's view layouts
    (`string_view`, `binary_view`) read as Spark strings and bytes."""
    import pyarrow as pa

    client = flightdeck.connect(uri)
    client.put_partition("views", 0, pa.table({
        "n": pa.array([1, 2, 3], pa.int64()),
        "s": pa.array(["a", None, "c"], pa.string_view()),
        "b": pa.array([b"x", b"y", None], pa.binary_view()),
        "l": pa.array([["p"], None, []], pa.list_(pa.string_view())),
    }))
    client.seal("views", partitions=1)
    df = spark.read.format(fmt).option("uri", uri).option("dataset", "views").load()
    assert df.schema.simpleString() == "struct<n:bigint,s:string,b:binary,l:array<string>>"
    assert [tuple(r) for r in df.orderBy("n").collect()] == [
        (1, "a", bytearray(b"x"), ["p"]), (2, None, bytearray(b"y"), None), (3, "c", None, []),
    ]
    assert df.filter("s = 'c'").select("n").collect()[0].n == 3
    client.drop("views")


def check_other_writers_types_read_as_spark_reads_parquet(spark, uri, fmt):
    """A dataset a pyarrow, Polars or pandas writer stored with types Spark
    does not hold reads as Spark's own Parquet reader gives them: unsigned
    integers widened (`uint64` as `decimal(20,0)`, its largest value kept),
    half floats, `date64`, `time32`, timestamps and durations finer than a
    microsecond (the digits below it dropped), `decimal256`, fixed-size
    binary and lists, large lists and dictionaries as the types Spark has,
    inside structs, maps and lists too. Before, each was refused (or failed
    inside Spark's reader). One Spark has no type for is refused naming it,
    and a read schema without it reads the rest."""
    import datetime
    import decimal

    import numpy as np
    import pyarrow as pa

    utc = datetime.timezone.utc
    client = flightdeck.connect(uri)
    client.put_partition("produced", 0, pa.table({
        "id": pa.array([1, 2], pa.int64()),
        "u8": pa.array([255, None], pa.uint8()),
        "u16": pa.array([65535, 0], pa.uint16()),
        "u32": pa.array([4294967295, 3], pa.uint32()),
        "u64": pa.array([2**64 - 1, 4], pa.uint64()),
        "f16": pa.array(np.array([1.5, -2.0], np.float16)),
        "d64": pa.array([86_400_000, 0], pa.date64()),
        "t32": pa.array([1_500, 0], pa.time32("ms")),
        "ts_ns": pa.array([1_000_007, 2_000_000_000], pa.timestamp("ns", tz="UTC")),
        "ts_ms": pa.array([1_500, 0], pa.timestamp("ms")),
        "dur_ns": pa.array([3_000_009, 0], pa.duration("ns")),
        "dec": pa.array([decimal.Decimal("1.25"), None], pa.decimal256(20, 2)),
        "fsb": pa.array([b"ab", b"cd"], pa.binary(2)),
        "fsl": pa.array([[1.0, 2.0], [3.0, 4.0]], pa.list_(pa.float32(), 2)),
        "ll": pa.array([[5], []], pa.large_list(pa.int64())),
        "cat": pa.array(["x", "y"]).dictionary_encode(),
        "st": pa.array([{"a": 7, "t": 1_000}, None],
                       pa.struct([("a", pa.uint8()), ("t", pa.timestamp("ms"))])),
        "mp": pa.array([[("k", 9)], []], pa.map_(pa.string(), pa.uint16())),
        "lu": pa.array([[1, 2], None], pa.list_(pa.uint32())),
    }))
    client.seal("produced", partitions=1)
    df = spark.read.format(fmt).option("uri", uri).option("dataset", "produced").load()
    assert df.schema.simpleString() == (
        "struct<id:bigint,u8:smallint,u16:int,u32:bigint,u64:decimal(20,0),f16:float,"
        "d64:date,t32:time(6),ts_ns:timestamp,ts_ms:timestamp_ntz,"
        "dur_ns:interval day to second,dec:decimal(20,2),fsb:binary,fsl:array<float>,"
        "ll:array<bigint>,cat:string,st:struct<a:smallint,t:timestamp_ntz>,"
        "mp:map<string,int>,lu:array<bigint>>"
    )
    first, second = df.orderBy("id").collect()
    assert tuple(first) == (
        1, 255, 65535, 4294967295, decimal.Decimal(2**64 - 1), 1.5,
        datetime.date(1970, 1, 2), datetime.time(0, 0, 1, 500_000),
        datetime.datetime(1970, 1, 1, 0, 0, 0, 1_000, tzinfo=utc).astimezone().replace(tzinfo=None),
        datetime.datetime(1970, 1, 1, 0, 0, 1, 500_000),
        datetime.timedelta(microseconds=3_000), decimal.Decimal("1.25"), bytearray(b"ab"),
        [1.0, 2.0], [5], "x", (7, datetime.datetime(1970, 1, 1, 0, 0, 1)), {"k": 9}, [1, 2],
    )
    assert second.u8 is None and second.u64 == 4 and second.f16 == -2.0
    assert second.st is None and second.lu is None and second.mp == {} and second.ll == []
    assert second.ts_ns.second == 2 and second.cat == "y"
    # Spark's filters on a widened column select as on the stored values.
    assert [r.id for r in df.where("u32 > 4000000000").collect()] == [1]
    assert [r.id for r in df.where("cat = 'y'").collect()] == [2]

    client.put_partition("wide", 0, pa.table({
        "id": pa.array([1], pa.int64()),
        "big": pa.array([decimal.Decimal("1.5")], pa.decimal256(40, 2)),
    }))
    client.seal("wide", partitions=1)
    wide = spark.read.format(fmt).option("uri", uri).option("dataset", "wide")
    with pytest.raises(Exception, match=r"column 'big' of dataset 'wide' on .* is "
                       r"decimal256\(40, 2\), which Spark cannot hold"):
        wide.load().collect()
    assert [tuple(r) for r in wide.schema("id long").load().collect()] == [(1,)]
    client.drop("produced")
    client.drop("wide")


def test_python_source_reads_other_writers_types(flightdeck_server, spark):
    if not hasattr(spark, "dataSource"):
        pytest.skip("Python data sources need Spark 4")
    register(spark, "flightdeck_py")
    check_other_writers_types_read_as_spark_reads_parquet(
        spark, flightdeck_server.uri, "flightdeck_py"
    )


def test_python_source_reads_view_columns(flightdeck_server, spark):
    if not hasattr(spark, "dataSource"):
        pytest.skip("Python data sources need Spark 4")
    register(spark, "flightdeck_py")
    check_view_columns_read_as_strings_and_bytes(spark, flightdeck_server.uri, "flightdeck_py")


def check_options_a_writer_gets_wrong_are_refused(spark, fmt):
    """Options that would send the rows somewhere unintended, or not at all,
    are refused naming what to give: a `uris` naming no server (an empty
    variable substituted into it would send every partition to this node's
    server) on writes and reads, and a `batch_rows` that is no row count."""
    register(spark, "flightdeck_py")
    df = spark.range(10)
    for value in ["", " , "]:
        with pytest.raises(Exception, match=r"option uris names no server \('"):
            df.write.format(fmt).option("dataset", "x").option("uris", value).mode(
                "overwrite"
            ).save()
        with pytest.raises(Exception, match=r"option uris names no server \('"):
            spark.read.format(fmt).option("dataset", "x").option("uris", value).load().count()
    for value in ["0", "-5", "abc"]:
        with pytest.raises(Exception, match=f"whole number of rows, 1 or more, not '{value}'"):
            df.write.format(fmt).option("dataset", "x").option("batch_rows", value).mode(
                "overwrite"
            ).save()


def check_unknown_options_are_refused(spark, fmt):
    """An option the source does not take is refused before anything is
    read or sent, naming the one meant where the spelling is close (a
    misspelt `filter` would read every row, a misspelt `uris` send every
    partition to this node's server); `filter` on a write says what to do
    instead, and so does a path given where the dataset goes. No server
    runs: nothing gets that far."""
    register(spark, "flightdeck_py")
    df = spark.range(10)

    def write(**options):
        w = df.write.format(fmt).option("dataset", "x").mode("overwrite")
        for k, v in options.items():
            w = w.option(k, v)
        w.save()

    def read(**options):
        r = spark.read.format(fmt).option("dataset", "x")
        for k, v in options.items():
            r = r.option(k, v)
        r.load().count()

    listed = r"; format\('flightdeck'\) takes uri, uris, dataset, batch_rows, token and, for reads, filter"
    with pytest.raises(Exception, match=r"unknown option 'fliter' \(did you mean 'filter'\?\)" + listed):
        read(fliter="id < 5")
    with pytest.raises(Exception, match=r"unknown option 'urls' \(did you mean 'uris'\?\)" + listed):
        write(urls="grpc://127.0.0.1:1")
    with pytest.raises(Exception, match=r"unknown option 'batchrows' \(did you mean 'batch_rows'\?\)"):
        write(batchrows="100")
    with pytest.raises(Exception, match=r"unknown option 'shuffle'" + listed):
        read(shuffle="global")
    with pytest.raises(Exception, match="option filter selects the rows a read sends; a write"):
        write(filter="id < 5")
    # A path where the dataset goes (as files sources take one) names it.
    path = r"names its dataset with an option, not a path: \.option\(.dataset., .clicks.\)"
    with pytest.raises(Exception, match=path):
        df.write.format(fmt).mode("overwrite").save("clicks")
    with pytest.raises(Exception, match=path):
        spark.read.format(fmt).load("clicks").count()


def check_streams_are_refused(spark, uri, fmt, tmp_path):
    """`writeStream` and `readStream` are refused saying what to do (a
    dataset per micro-batch, with foreachBatch), before any row is sent."""
    register(spark, "flightdeck_py")
    refused = r"writes and reads batches, not streams.*foreachBatch"
    with pytest.raises(Exception, match=refused):
        query = (spark.readStream.format("rate").load().writeStream.format(fmt)
                 .option("uri", uri).option("dataset", "streamed")
                 .option("checkpointLocation", str(tmp_path / "checkpoint")).start())
        try:
            query.awaitTermination(60)  # the Python source refuses in the query
        finally:
            query.stop()
    if fmt != "flightdeck":  # Spark refuses a JVM source's stream read itself
        with pytest.raises(Exception, match=refused):
            query = (spark.readStream.format(fmt).schema("id long").option("uri", uri)
                     .option("dataset", "streamed").load().writeStream.format("noop")
                     .option("checkpointLocation", str(tmp_path / "read")).start())
            try:
                query.awaitTermination(60)
            finally:
                query.stop()
    assert "streamed" not in flightdeck.connect(uri).list_datasets()


def check_a_table_made_in_sql(spark, uri, fmt, reads):
    """`CREATE TABLE ... USING` the source, its options in `OPTIONS`: Spark
    adds properties of its own (owner, provider, the table's path, ...),
    which the source takes as Spark's and not as misspelt options, and the
    table reads the dataset where Spark hands the reader its options
    (`reads`; Spark gives a Python data source's reader none, which it says);
    a misspelt option of the user's is refused all the same."""
    register(spark, "flightdeck_py")
    spark.range(0, 10, numPartitions=2).write.format(fmt).option("uri", uri).option(
        "dataset", "in_sql"
    ).mode("overwrite").save()
    table = f"in_sql_{fmt}"
    try:
        spark.sql(f"CREATE TABLE {table} USING {fmt} OPTIONS (dataset 'in_sql', uri '{uri}')")
        query = f"SELECT count(*) AS n, sum(id) AS s FROM {table}"
        if reads:
            assert spark.sql(query).first() == (10, 45)
        else:
            with pytest.raises(Exception, match="the read was given no options: .*CREATE TABLE"):
                spark.sql(query).first()
    finally:
        spark.sql(f"DROP TABLE IF EXISTS {table}")
    with pytest.raises(Exception, match=r"unknown option 'datset' \(did you mean 'dataset'\?\)"):
        spark.sql(f"CREATE TABLE {table} USING {fmt} OPTIONS (datset 'in_sql', uri '{uri}')")
    spark.sql(f"DROP TABLE IF EXISTS {table}")


def check_batch_rows_keeps_each_message_under_the_servers_limit(spark, fmt):
    """Spark hands a writer batches of `maxRecordsPerBatch` rows; wide rows
    make such a batch more than a server takes in one message (1 MiB here).
    The write is refused saying so, and with `batch_rows` it is sent in
    messages that fit: every row arrives."""
    register(spark, "flightdeck_py")
    server = RunningServer("--max-message-size", "1MiB")
    df = spark.range(3_000, numPartitions=2).selectExpr("id", "repeat('x', 2000) AS s")

    def write(name, **options):
        w = df.write.format(fmt).option("uri", server.uri).option("dataset", name)
        w.options(**options).mode("overwrite").save()

    try:
        with pytest.raises(Exception, match="larger than this server accepts"):
            write("whole")
        write("sliced", batch_rows="100")
        client = flightdeck.connect(server.uri)
        table = client.read_table(client.plan("sliced", batch_rows=100).shards[0])
        assert sorted(table.column("id").to_pylist()) == list(range(3_000))
        assert set(table.column("s").to_pylist()) == {"x" * 2000}
        client.close()
    finally:
        assert server.stop() == 0


def check_an_append_onto_an_unfinished_write(spark, uri, fmt):
    """A dataset a crashed job left written but never sealed: an append says
    so (rows, age, how to replace or drop it) rather than calling it
    immutable, and an overwrite replaces what it left."""
    register(spark, "flightdeck_py")
    client = flightdeck.connect(uri)
    name = f"left_{fmt}"
    client.put_partition(name, 0, pa.table({"id": pa.array([7, 8, 9], pa.int64())}), write_id="gone")

    def write(mode):
        spark.range(5).write.format(fmt).option("uri", uri).option("dataset", name).mode(
            mode
        ).save()

    left = (
        rf"cannot append to dataset '{name}': another write of it is under way or was left "
        r"unfinished \(3 rows, last written \d+s ago, never sealed\); if the job writing it is "
        rf"gone, mode\(.overwrite.\) replaces what it left \(or drop it first: flightdeck drop "
        rf"{name} --server "
    )
    with pytest.raises(Exception, match=left):
        write("append")
    write("overwrite")
    info = client.describe(name)
    assert (info.state, info.rows) == (2, 5)
    client.close()


def test_python_source_options_a_writer_gets_wrong_are_refused(spark):
    check_options_a_writer_gets_wrong_are_refused(spark, "flightdeck_py")


def test_python_source_unknown_options_are_refused(spark):
    check_unknown_options_are_refused(spark, "flightdeck_py")


def test_python_source_refuses_streams(flightdeck_server, spark, tmp_path):
    check_streams_are_refused(spark, flightdeck_server.uri, "flightdeck_py", tmp_path)


def test_python_source_and_a_table_made_in_sql(flightdeck_server, spark):
    check_a_table_made_in_sql(spark, flightdeck_server.uri, "flightdeck_py", reads=False)


def test_python_source_batch_rows_keeps_messages_under_the_servers_limit(spark):
    check_batch_rows_keeps_each_message_under_the_servers_limit(spark, "flightdeck_py")


def test_python_source_append_onto_an_unfinished_write(flightdeck_server, spark):
    check_an_append_onto_an_unfinished_write(spark, flightdeck_server.uri, "flightdeck_py")


def test_rebatch_slices_and_joins_to_the_rows_asked():
    batches = [pa.record_batch({"a": list(range(10 * i, 10 * i + n))}) for i, n in
               enumerate([3, 10, 1, 0, 7])]
    given = [v for b in batches for v in b.column("a").to_pylist()]
    for rows in [1, 4, 5, 21, 100]:
        out = list(rebatch(batches, rows))
        assert [v for b in out for v in b.column("a").to_pylist()] == given, rows
        assert [b.num_rows for b in out[:-1]] == [rows] * (len(out) - 1), rows
        assert 0 < out[-1].num_rows <= rows, rows
    assert list(rebatch([], 4)) == []
