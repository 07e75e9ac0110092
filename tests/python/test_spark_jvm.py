"""The JVM Spark connector (`connectors/spark`, on `spark.jars`) from
PySpark, with no Python between the executor and the server: every row
exactly once when a task fails mid-partition and is retried, the winner
named; overwrite, append refused, a failed job leaving nothing (a failed
overwrite: the dataset it would have replaced); every type
Arrow carries round-trips (read back with the Python client and with
`spark.read.format("flightdeck")`); a type Arrow cannot carry is refused
before any byte is sent; a read sends only the rows its filter selects (the
`filter` option, and Spark's filters pushed down); a read never mixes two
writes; the `token` option; TLS servers trusted through
FLIGHTDECK_TLS_ROOT_CERTS; unknown options and unreachable servers
refused saying what to give; a server that hangs fails the job instead of
holding it."""

from __future__ import annotations

import pyarrow as pa
import pytest

pytest.importorskip("pyspark")

import flightdeck  # noqa: E402
from conftest import SPARK_JAR, TYPES, server_name_cases  # noqa: E402
from test_spark import (  # noqa: E402
    always_fail,
    check_a_failed_overwrite_keeps_the_dataset,
    check_an_append_onto_an_unfinished_write,
    check_batch_rows_keeps_each_message_under_the_servers_limit,
    check_options_a_writer_gets_wrong_are_refused,
    check_an_empty_dataframe_writes_an_empty_dataset,
    check_a_read_never_mixes_two_writes,
    check_a_table_made_in_sql,
    check_streams_are_refused,
    check_vectors_are_refused,
    check_a_write_whose_server_dies_fails,
    check_the_token_option,
    check_unknown_options_are_refused,
    check_other_writers_types_read_as_spark_reads_parquet,
    check_view_columns_read_as_strings_and_bytes,
    fail_first_attempt,
    source,
)

ROWS = 200_000


@pytest.fixture(scope="module", autouse=True)
def jar():
    if not SPARK_JAR.exists():
        pytest.fail(f"{SPARK_JAR} not built: run `mvn -q -f connectors/spark package` "
                    "(scripts/test.sh does)")


def write(df, uri, dataset, mode="overwrite", **options):
    w = df.write.format("flightdeck").option("uri", uri).option("dataset", dataset)
    for k, v in options.items():
        w = w.option(k, v)
    w.mode(mode).save()


def everything(client, dataset):
    plan = client.plan(dataset)
    return client.read_table(plan.shards[0])


def test_every_row_once_when_a_task_fails_mid_partition(flightdeck_server, spark):
    uri = flightdeck_server.uri
    # Several batches per partition, so the failure comes after some were sent.
    write(fail_first_attempt(source(spark)), uri, "jvm", batch_rows=1000)
    client = flightdeck.connect(uri)
    info = client.describe("jvm")
    assert info.state == 2 and info.rows == ROWS
    assert {p.partition: p.attempt for p in info.partitions}[3] == 1, "the retry won"
    assert all(p.attempt == 0 for p in info.partitions if p.partition != 3)
    ids = everything(client, "jvm").column("id").to_pylist()
    assert sorted(ids) == list(range(ROWS)), "every row exactly once"
    # A failed first attempt was refused (explicit commit), not stored.
    assert next(p for p in info.partitions if p.partition == 3).committed_attempts == 1


def test_modes_and_a_failed_job(flightdeck_server, spark):
    uri = flightdeck_server.uri
    client = flightdeck.connect(uri)
    write(spark.range(100, numPartitions=2), uri, "m")
    with pytest.raises(Exception, match="cannot append to dataset 'm'"):
        write(spark.range(10), uri, "m", mode="append")
    write(spark.range(30, numPartitions=3), uri, "m")  # overwrite replaces
    assert client.describe("m").rows == 30
    write(spark.range(7), uri, "new", mode="append")  # append creates
    assert client.describe("new").rows == 7
    # Spark's default mode is not offered to a catalog-less V2 source; it
    # says so (append is the create-only write).
    with pytest.raises(Exception, match="UNSUPPORTED_DATA_SOURCE_SAVE_MODE"):
        spark.range(3).write.format("flightdeck").option("uri", uri).option("dataset", "d").save()
    with pytest.raises(Exception, match=r'set the dataset to write or read: \.option\("dataset"'):
        spark.range(3).write.format("flightdeck").option("uri", uri).mode("overwrite").save()

    df = always_fail(spark.range(80_000, numPartitions=4).selectExpr("id", "cast(id as float) x"))
    with pytest.raises(Exception, match="injected failure of every attempt"):
        write(df, uri, "failed", batch_rows=1000)
    with pytest.raises(flightdeck.NotFound):
        client.describe("failed")
    log = "".join(flightdeck_server.stderr_lines)
    assert "committed attempt dataset=failed " in log, "partitions had been committed"
    assert "dropped dataset dataset=failed " in log


def test_a_failed_overwrite_keeps_the_dataset(flightdeck_server, spark):
    uri = flightdeck_server.uri
    check_a_failed_overwrite_keeps_the_dataset(
        flightdeck_server, spark, lambda df, name: write(df, uri, name, batch_rows=1000)
    )


def test_an_empty_dataframe_writes_an_empty_dataset(flightdeck_server, spark):
    uri = flightdeck_server.uri
    check_an_empty_dataframe_writes_an_empty_dataset(
        uri, spark, "flightdeck", lambda df, name: write(df, uri, name)
    )


def test_a_write_whose_server_dies_fails_instead_of_waiting_for_ever(spark):
    check_a_write_whose_server_dies_fails(
        spark, lambda df, uri, name: write(df, uri, name, batch_rows=1000)
    )


def test_a_read_from_a_server_that_hangs_fails_instead_of_waiting_for_ever(spark):
    """A server that stops answering (hung; its node cut off) without
    closing its connections used to hold the job for ever: the connector's
    HTTP/2 pings go unanswered and the read fails UNAVAILABLE within about
    20 s, naming the server."""
    import signal
    import time

    from conftest import RunningServer, scaled

    server = RunningServer("--memory-limit", "256MiB")
    try:
        with flightdeck.connect(server.uri) as c:
            c.put_partition("hang", 0, pa.table({"id": pa.array(range(1000), pa.int64())}))
            c.seal("hang")
        df = spark.read.format("flightdeck").option("uri", server.uri).option(
            "dataset", "hang").load()
        server.proc.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        try:
            with pytest.raises(Exception, match="Keepalive failed") as failed:
                df.selectExpr("sum(id)").collect()
            assert time.monotonic() - started < scaled(90)
            assert server.uri in str(failed.value)
        finally:
            server.proc.send_signal(signal.SIGCONT)
    finally:
        assert server.stop() == 0, "".join(server.stderr_lines)


def test_a_server_that_is_not_running_is_named(spark):
    """The first mistake a job tends to make, no server at its `uri`, fails
    naming the server and what to check: it failed with a bare
    `NoSuchElementException` (the connector read a trailer the transport's
    error does not have)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        uri = f"grpc://127.0.0.1:{s.getsockname()[1]}"
    said = (
        f"UNAVAILABLE: cannot reach the flightdeck server at {uri} "
        r"\(.*Connection refused.*\): start it \(flightdeck serve\) or point option uri at"
    )
    with pytest.raises(Exception, match=said):
        spark.read.format("flightdeck").option("uri", uri).option("dataset", "x").load()
    with pytest.raises(Exception, match=said):
        write(spark.range(10), uri, "x")


# A job in a JVM of its own: FLIGHTDECK_TLS_ROOT_CERTS is read from the
# environment, which a running JVM cannot be given.
TLS_JOB = """
import json, sys
from pathlib import Path
from pyspark.sql import SparkSession
jar, uri, ca, roots = sys.argv[1:]
spark = (SparkSession.builder.master("local[2]").config("spark.jars", jar)
         .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
         .config("spark.ui.enabled", "false").getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
def read():
    return spark.read.format("flightdeck").option("uri", uri).option("dataset", "tls").load()
out = {}
try:
    read()
except Exception as e:
    out["unreadable"] = str(e)[:2000]
Path(roots).write_bytes(Path(ca).read_bytes())
df = spark.range(0, 1000, numPartitions=2)
df.write.format("flightdeck").option("uri", uri).option("dataset", "tls").mode("overwrite").save()
back = read()
out["rows"], out["sum"] = back.count(), back.groupBy().sum("id").first()[0]
print(json.dumps(out))
"""


def test_tls_servers_are_trusted_by_the_authority_the_variable_names(spark, tmp_path):
    """Over TLS the connector trusts the certificate authority whose PEM
    file FLIGHTDECK_TLS_ROOT_CERTS names, as the Python and Rust clients
    do: a job writes and reads a TLS server with it (a file it names that
    cannot be read is refused naming it). Without it the JVM's trust store
    does not know a private authority, and a scheme that does not match the
    server fails the same way: each says what to give."""
    import json
    import os
    import re
    import subprocess
    import sys

    from conftest import RunningServer, make_test_certs

    certs = make_test_certs(tmp_path)
    server = RunningServer(
        "--memory-limit", "256MiB", "--tls-cert", str(certs["cert"]), "--tls-key", str(certs["key"])
    )
    try:
        uri = f"grpc+tls://{server.addr}"
        roots = tmp_path / "roots.pem"
        env = dict(os.environ, FLIGHTDECK_TLS_ROOT_CERTS=str(roots))
        job = subprocess.run(
            [sys.executable, "-c", TLS_JOB, str(SPARK_JAR), uri, str(certs["ca"]), str(roots)],
            env=env, capture_output=True, text=True, timeout=300,
        )
        assert job.returncode == 0, job.stderr[-3000:]
        out = json.loads(job.stdout.strip().splitlines()[-1])
        assert f"FLIGHTDECK_TLS_ROOT_CERTS names '{roots}', which cannot be read" in out["unreadable"]
        assert (out["rows"], out["sum"]) == (1000, sum(range(1000)))
        with flightdeck.connect(uri, tls_root_certs=certs["ca"].read_bytes()) as c:
            assert c.describe("tls").rows == 1000

        hint = r"\): a server started with --tls-cert takes grpc\+tls:// and a client that trusts"
        said = "the TLS handshake with the flightdeck server at {} failed \\(.*{}.*" + hint
        with pytest.raises(Exception, match=said.format(re.escape(uri), "certification path")):
            spark.read.format("flightdeck").option("uri", uri).option("dataset", "tls").load()
        plain = f"grpc://{server.addr}"
        with pytest.raises(Exception, match=said.format(re.escape(plain), "not SETTINGS")):
            spark.read.format("flightdeck").option("uri", plain).option("dataset", "tls").load()
    finally:
        server.stop()


def test_every_type_round_trips(flightdeck_server, spark):
    uri = flightdeck_server.uri
    df = spark.range(5_000, numPartitions=4).selectExpr(*TYPES)
    write(df, uri, "types", batch_rows=700)
    client = flightdeck.connect(uri)
    stored = everything(client, "types")
    order = stored.column("id").to_pylist()  # the dataset's row order
    stored = stored.sort_by("id")
    expected = df.toArrow().sort_by("id")
    assert stored.column_names == expected.column_names
    for name in expected.column_names:
        assert stored.column(name).to_pylist() == expected.column(name).to_pylist(), name

    # Read back by Spark: one partition per stored partition, the same rows.
    back = spark.read.format("flightdeck").option("uri", uri).option("dataset", "types").load()
    assert back.rdd.getNumPartitions() == 4
    assert back.schema == df.schema
    assert sorted(back.collect(), key=lambda r: r.id) == sorted(df.collect(), key=lambda r: r.id)
    # Columns are pruned on the server; partitions read in the dataset's order.
    assert [r.id for r in back.select("id").collect()] == order


def test_a_read_schema_is_cast_on_the_server_or_refused_before_any_task(
    flightdeck_server, spark
):
    """A column Spark holds only as a wider type is read as that; a schema
    given to the read may ask a column as another simple type
    (the server casts it: the columnar reader hands Spark the vectors as
    they arrive), and Spark's filters on a cast column are left to Spark,
    which compares as the schema types it; a column the dataset lacks, or a
    type it is not cast to, is refused when the read is planned, naming it.
    Before, every task failed on each of these inside Spark."""
    import pyarrow as pa

    uri = flightdeck_server.uri
    client = flightdeck.connect(uri)
    client.put_partition("raw", 0, pa.table(
        {"id": pa.array([1, 2, 3, 9, 20], pa.int64()), "u": pa.array([7, 8, 9, 10, 11], pa.uint32())}
    ))
    client.seal("raw", partitions=1)
    client.close()

    def read(schema=None, where=None):
        r = spark.read.format("flightdeck").option("uri", uri).option("dataset", "raw")
        df = (r.schema(schema) if schema else r).load()
        return [tuple(row) for row in (df.where(where) if where else df).collect()]

    assert read() == [(1, 7), (2, 8), (3, 9), (9, 10), (20, 11)]
    assert read("id long") == [(1,), (2,), (3,), (9,), (20,)]
    assert read("id int, u long") == [(1, 7), (2, 8), (3, 9), (9, 10), (20, 11)]
    assert read("u double, id string") == [(7.0, "1"), (8.0, "2"), (9.0, "3"), (10.0, "9"), (11.0, "20")]
    # As strings '9' > '10': a filter compared as numbers on the server
    # would have dropped rows Spark keeps.
    assert read("id string", where="id > '10'") == [("2",), ("3",), ("9",), ("20",)]
    assert read("id long, u long", where="u > 8") == [(3, 9), (9, 10), (20, 11)]
    # Filters on the columns read as stored still go to the server.
    client = flightdeck.connect(uri)
    served = client.stats().rows_served
    assert read("id long, u double", where="id >= 9 AND u > 10") == [(20, 11.0)]
    assert client.stats().rows_served - served == 2
    with pytest.raises(Exception, match=r"gives column 'id' of dataset 'raw' as timestamp, but it "
                       r"is stored as int64; the JVM connector reads a column as stored \(bigint\) "
                       r"or cast to boolean, tinyint, .*: give one of those, or leave it out"):
        read("id timestamp")
    with pytest.raises(Exception, match=r"names column 'nope', which dataset 'raw' on .* does "
                       r"not have; its columns are \[id, u\]"):
        read("id long, nope string")


def test_a_read_reports_its_size_so_a_small_dataset_is_broadcast(flightdeck_server, spark):
    """The scan tells Spark's planner the dataset's rows and its size (rows
    times Spark's estimate of a row of the columns read): a join with a
    small flightdeck dataset broadcasts it instead of shuffling both sides
    (Spark took every source without statistics as too large to)."""
    uri = flightdeck_server.uri
    write(spark.range(0, 1000, numPartitions=2).selectExpr("id", "id * 2 AS twice"), uri, "small")

    def stats(df):
        return df._jdf.queryExecution().optimizedPlan().stats()

    def read(**options):
        r = spark.read.format("flightdeck").option("uri", uri).option("dataset", "small")
        return r.options(**options).load()

    small = read()
    assert str(stats(small).sizeInBytes()) == str(1000 * 16)
    assert str(stats(small.select("id")).sizeInBytes()) == str(1000 * 8)
    joined = spark.range(0, 100_000).join(small, "id")
    assert "BroadcastHashJoin" in joined._jdf.queryExecution().executedPlan().toString()
    assert joined.count() == 1000
    # Spark's cost-based optimizer also takes the row count; with a filter
    # it is not known, and the size is the bound.
    spark.conf.set("spark.sql.cbo.enabled", "true")
    try:
        assert str(stats(read()).rowCount().get()) == "1000"
        filtered = stats(read(filter="id < 10"))
        assert filtered.rowCount().isEmpty() and str(filtered.sizeInBytes()) == str(1000 * 16)
    finally:
        spark.conf.unset("spark.sql.cbo.enabled")


def test_a_count_reads_nothing_from_the_server(flightdeck_server, spark):
    """Spark wants no column for `count()` (or a literal a row): the plan
    has counted each partition's rows, filtered or not, so nothing is read —
    an empty projection asked the server for every column, and a count of a
    wide dataset moved all of it."""
    uri = flightdeck_server.uri
    df = spark.range(0, 10_000, numPartitions=4).selectExpr(
        "id", *[f"cast(id * {i} as double) AS c{i}" for i in range(8)]
    )
    write(df, uri, "counted")
    client = flightdeck.connect(uri)

    def read(**options):
        r = spark.read.format("flightdeck").option("uri", uri).option("dataset", "counted")
        return r.options(**options).load()

    before = client.stats()
    assert read().count() == 10_000
    assert read().selectExpr("1 AS one").count() == 10_000
    assert read(filter="id < 100").count() == 100
    after = client.stats()
    assert (after.rows_served, after.bytes_served) == (before.rows_served, before.bytes_served)
    # A column read is still read.
    assert sorted(r.id for r in read().select("id").collect()) == list(range(10_000))
    assert client.stats().rows_served == after.rows_served + 10_000
    client.close()


def test_other_writers_types_read_as_spark_reads_parquet(flightdeck_server, spark):
    check_other_writers_types_read_as_spark_reads_parquet(spark, flightdeck_server.uri, "flightdeck")
    # A column cast to the type Spark holds keeps Spark's filters on the
    # server: the widening keeps every value, so they select the same rows.
    import pyarrow as pa

    uri = flightdeck_server.uri
    client = flightdeck.connect(uri)
    client.put_partition("unsigned", 0, pa.table({
        "id": pa.array(range(100), pa.int64()), "u": pa.array(range(100), pa.uint16()),
    }))
    client.seal("unsigned", partitions=1)
    df = spark.read.format("flightdeck").option("uri", uri).option("dataset", "unsigned").load()
    where = df.where("u >= 90 AND id <> 95")
    plan = where._jdf.queryExecution().executedPlan().toString()
    scan = next(line for line in plan.splitlines() if "flightdeck dataset 'unsigned'" in line)
    assert '"u" >= 90' in scan, scan
    served = client.stats().rows_served
    assert sorted(r.u for r in where.collect()) == [90, 91, 92, 93, 94, 96, 97, 98, 99]
    assert client.stats().rows_served - served == 9
    client.drop("unsigned")


def test_a_type_arrow_cannot_carry_is_refused_before_any_byte(flightdeck_server, spark):
    uri = flightdeck_server.uri
    df = spark.range(10).selectExpr("id", "make_interval(0, 0, 0, cast(id as int), 0, 0, 0) as gap")
    # (Spark itself refuses CalendarInterval for any table; every type it
    # lets through, Arrow carries — variant and day/month intervals too.)
    with pytest.raises(Exception, match="gap"):
        write(df, uri, "interval")
    with pytest.raises(flightdeck.NotFound):
        flightdeck.connect(uri).describe("interval")


def test_a_unix_socket_is_refused_naming_what_to_give_instead(spark):
    """`grpc+unix://` names parse as in the other clients, but this
    connector speaks TCP only: a write to a socket fails saying to give
    the server's grpc:// location."""
    with pytest.raises(Exception, match="reaches flightdeck over TCP: give the server's grpc://"):
        write(spark.range(10), "grpc+unix:///run/flightdeck.sock", "unix")


def test_server_names_read_as_the_shared_table_says(spark):
    """The JVM connector reads `uri`/`uris` by the table the Rust and
    Python clients are tested with."""
    names = spark.sparkContext._jvm.flightdeck.spark.ServerNames
    for name, local, want in server_name_cases():
        if want == "error":
            # (PySpark turns the JVM's IllegalArgumentException into its own.)
            with pytest.raises(Exception, match="does not name a server"):
                names.normalize(name, local or "")
        else:
            assert names.normalize(name, local or "") == want, name
    # The host Spark is asked to run a partition's task on: its holder's.
    assert names.host("grpc://10.0.0.3:50051") == "10.0.0.3"
    assert names.host("grpc+tls://gpu-3.cluster:50051") == "gpu-3.cluster"
    assert names.host("gpu-4") == "gpu-4"
    assert names.host("grpc://[::1]:50051") == "::1"
    assert names.host("grpc+unix:///run/flightdeck.sock") == ""
    assert names.host("not a name") == ""


def test_the_token_option(spark, tmp_path):
    check_the_token_option(spark, "flightdeck", tmp_path)


def test_a_read_never_mixes_two_writes(flightdeck_server, spark):
    check_a_read_never_mixes_two_writes(spark, flightdeck_server.uri, "flightdeck")


def test_reads_send_only_the_rows_a_filter_selects(flightdeck_server, spark):
    uri = flightdeck_server.uri
    df = spark.range(1_000, numPartitions=4).selectExpr(
        "id",
        "cast(id % 7 as int) as k",
        "concat('n', cast(id % 5 as string)) as name",
        "id % 2 = 0 as even",
        "cast(id as double) / 3 as x",
    )
    write(df, uri, "filtered", batch_rows=100)
    client = flightdeck.connect(uri)
    order = everything(client, "filtered").column("id").to_pylist()

    def read(filter=None):
        r = spark.read.format("flightdeck").option("uri", uri).option("dataset", "filtered")
        return r.option("filter", filter).load() if filter else r.load()

    # The filter option: the server selects, Spark has no filter of its own;
    # the selected rows come in the dataset's order, over as many partitions.
    chosen = read("k = 3 AND name <> 'n1'")
    assert chosen.rdd.getNumPartitions() == 4
    assert [r.id for r in chosen.select("id").collect()] == [
        i for i in order if i % 7 == 3 and i % 5 != 1
    ]
    # Fewer selected rows than stored partitions: no empty partitions.
    assert read("id = 5").rdd.getNumPartitions() == 1
    assert read("id < 0").count() == 0

    # Spark's own filters on integer, string and boolean columns are pushed
    # down and named in the plan; the one on a double stays in Spark.
    where = "(k = 3 OR k IN (4, 5)) AND NOT even AND name >= 'n2' AND x > 10"
    pushed = read().where(where)
    plan = pushed._jdf.queryExecution().executedPlan().toString()
    scan = next(line for line in plan.splitlines() if "flightdeck dataset 'filtered'" in line)
    assert '"k" = 3' in scan and '"even"' in scan and "'n2'" in scan, scan
    assert '"x" >' not in scan, scan
    served = client.stats().rows_served
    got = sorted(r.id for r in pushed.collect())
    want = [i for i in range(1_000) if i % 7 in (3, 4, 5) and i % 2 and i % 5 >= 2 and i / 3 > 10]
    assert got == want
    # The server sent the selected rows (each partition's stream may run a
    # little past its end), not the dataset.
    sent = client.stats().rows_served - served
    assert len(want) <= sent < 500, sent

    with pytest.raises(Exception, match="no_such_column"):
        read("no_such_column > 1").collect()
    with pytest.raises(Exception, match="option filter selects the rows a read sends"):
        write(df, uri, "never", filter="k = 1")


def test_options_a_writer_gets_wrong_are_refused(spark):
    check_options_a_writer_gets_wrong_are_refused(spark, "flightdeck")


def test_unknown_options_are_refused(spark):
    check_unknown_options_are_refused(spark, "flightdeck")


def test_view_columns_read_as_strings_and_bytes(flightdeck_server, spark):
    check_view_columns_read_as_strings_and_bytes(spark, flightdeck_server.uri, "flightdeck")


def test_a_table_made_in_sql_reads_the_dataset(flightdeck_server, spark):
    check_a_table_made_in_sql(spark, flightdeck_server.uri, "flightdeck", reads=True)


def test_tables_of_spark_s_catalog_write_and_read_datasets(flightdeck_server, spark):
    """A table in Spark's catalog: made with its dataset in its options
    (`CREATE TABLE ... OPTIONS`, `writeTo(...).tableProperty`) it is filled
    by INSERT INTO (a new dataset), replaced by INSERT OVERWRITE and
    `insertInto`, and read; `saveAsTable` and `writeTo(...).option(...)`
    hand the table none of the writer's options (only the write gets them),
    so they are refused before any row is sent, saying how to make the
    table."""
    uri = flightdeck_server.uri
    client = flightdeck.connect(uri)
    made = "a flightdeck table needs its dataset among its own options.*CREATE TABLE"
    try:
        spark.sql(f"CREATE TABLE cat_a (id BIGINT, s STRING) USING flightdeck "
                  f"OPTIONS (dataset 'cat_a', uri '{uri}')")
        spark.sql("INSERT INTO cat_a SELECT id, CAST(id AS STRING) FROM range(5)")
        assert spark.sql("SELECT count(*), max(s) FROM cat_a").first() == (5, "4")
        with pytest.raises(Exception, match="cannot append to dataset 'cat_a'"):
            spark.sql("INSERT INTO cat_a SELECT id, 'x' FROM range(2)")
        spark.sql("INSERT OVERWRITE cat_a SELECT id, 'y' FROM range(7)")
        assert spark.sql("SELECT count(*), max(s) FROM cat_a").first() == (7, "y")
        spark.sql("SELECT id, 'z' AS s FROM range(3)").write.mode("overwrite").insertInto("cat_a")
        assert client.describe("cat_a").rows == 3

        spark.range(4).writeTo("cat_b").using("flightdeck").tableProperty(
            "dataset", "cat_b").tableProperty("uri", uri).create()
        assert spark.sql("SELECT count(*) FROM cat_b").first() == (4,)
        assert client.describe("cat_b").rows == 4

        with pytest.raises(Exception, match=made):
            spark.range(3).write.format("flightdeck").option("uri", uri).option(
                "dataset", "cat_c").mode("overwrite").saveAsTable("cat_c")
        with pytest.raises(Exception, match=made):
            spark.range(3).writeTo("cat_d").using("flightdeck").option(
                "dataset", "cat_d").option("uri", uri).create()
        with pytest.raises(Exception, match=made):
            spark.sql("CREATE TABLE cat_e (a INT) USING flightdeck")
        listed = client.list_datasets("cat_")
        assert listed == ["cat_a", "cat_b"], "nothing written by a refused table"
    finally:
        for t in ("cat_a", "cat_b", "cat_c", "cat_d", "cat_e"):
            spark.sql(f"DROP TABLE IF EXISTS {t}")


def test_vectors_are_refused(flightdeck_server, spark):
    check_vectors_are_refused(spark, flightdeck_server.uri, "flightdeck")


def test_streams_are_refused(flightdeck_server, spark, tmp_path):
    check_streams_are_refused(spark, flightdeck_server.uri, "flightdeck", tmp_path)


def test_partition_columns_are_refused_naming_them(flightdeck_server, spark):
    """`partitionBy`, `clusterBy` and `PARTITIONED BY` have no meaning for a
    dataset (its partitions are the DataFrame's): refused naming the
    columns and saying what to do, before anything is written."""
    uri = flightdeck_server.uri
    df = spark.range(10, numPartitions=2).selectExpr("id", "id % 3 AS k")
    refused = r"dataset 'parted' cannot be partitioned by columns \({}\).*df\.repartition"
    w = df.write.format("flightdeck").option("uri", uri).option("dataset", "parted")
    with pytest.raises(Exception, match=refused.format("k")):
        w.partitionBy("k").mode("overwrite").save()
    with pytest.raises(Exception, match=refused.format(r"cluster_by\(k\)")):
        df.write.format("flightdeck").option("uri", uri).option("dataset", "parted").clusterBy(
            "k").mode("overwrite").save()
    with pytest.raises(Exception, match=refused.format("k")):
        spark.sql(f"CREATE TABLE parted (id BIGINT, k BIGINT) USING flightdeck "
                  f"PARTITIONED BY (k) OPTIONS (dataset 'parted', uri '{uri}')")
    assert "parted" not in flightdeck.connect(uri).list_datasets()


def test_batch_rows_keeps_messages_under_the_servers_limit(spark):
    check_batch_rows_keeps_each_message_under_the_servers_limit(spark, "flightdeck")


def test_an_append_onto_an_unfinished_write(flightdeck_server, spark):
    check_an_append_onto_an_unfinished_write(spark, flightdeck_server.uri, "flightdeck")


def test_a_read_of_a_missing_or_unsealed_dataset_says_so(flightdeck_server, spark):
    """As the Python source says it: which server lacks the dataset, or that
    it is still being written (the raw server text spoke of DoPut and
    ListFlights)."""
    import pyarrow as pa

    uri = flightdeck_server.uri
    client = flightdeck.connect(uri)
    client.put_partition("unsealed", 0, pa.table({"id": pa.array([1, 2], pa.int64())}))

    def read(name):
        return spark.read.format("flightdeck").option("uri", uri).option("dataset", name).load()

    with pytest.raises(Exception, match=f"dataset 'missing' does not exist on {uri}; write it"):
        read("missing")
    with pytest.raises(Exception, match="dataset 'unsealed' is still being written; read it once"):
        read("unsealed")
    client.close()


def test_a_servers_code_reaches_jvm_errors_as_the_server_sent_it(flightdeck_server, spark):
    """Arrow Java folds gRPC's FAILED_PRECONDITION into Flight's
    INVALID_ARGUMENT; the connector reports the code the server sent (in
    its trailer), so a read planned before the dataset was written again
    says FAILED_PRECONDITION, as the Python clients do."""
    import pyarrow as pa

    uri = flightdeck_server.uri
    client = flightdeck.connect(uri)
    table = pa.table({"id": pa.array(range(10), pa.int64())})
    client.put_partition("moved", 0, table)
    client.seal("moved")
    df = spark.read.format("flightdeck").option("uri", uri).option("dataset", "moved").load()
    df.rdd  # planned now
    client.drop("moved")
    client.put_partition("moved", 0, table)
    client.seal("moved")
    with pytest.raises(Exception, match="FlightDeckException: FAILED_PRECONDITION: dataset 'moved' "
                       "was dropped or written again since this read began"):
        df.collect()
    client.close()
