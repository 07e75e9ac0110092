"""SQL over the cache through Arrow Java's Flight SQL JDBC driver, the one
JVM tools load (DBeaver, Spark's JDBC source, application code): a small
Java program (`tests/jdbc`, built by `mvn -q -f tests/jdbc package` as the
test command does) makes the JDBC calls and prints what the driver returns.
Tables and columns listed, an aggregate, a result without rows (the probe by
which Spark's JDBC source learns a query's columns), strings made in SQL
read and bound, prepared statements run with several parameter sets, keys
answered with none, an unknown table named, a token in the URL, TLS with the
authority's certificate, a result paged with `LIMIT ? OFFSET ?`, updates refused
saying what to run instead, and Spark's JDBC source reading queries with
their decimal types."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.compute as pc
import pytest

import flightdeck
from conftest import REPO, RunningServer, make_test_certs, scaled
from test_query import write

CHECK = REPO / "tests" / "jdbc" / "target"


@pytest.fixture(scope="module", autouse=True)
def built():
    if not (CHECK / "classes" / "flightdeck" / "jdbc" / "JdbcCheck.class").exists():
        pytest.fail(f"{CHECK} not built: run `mvn -q -f tests/jdbc package` "
                    "(scripts/test.sh does)")


@pytest.fixture(scope="module")
def server():
    s = RunningServer("--memory-limit", "512MiB")
    yield s
    assert s.stop() == 0, "".join(s.stderr_lines)


@pytest.fixture(scope="module")
def events(server) -> pa.Table:
    return write(flightdeck.connect(server.uri), "events")


def jdbc(uri: str, *calls: tuple[str, ...]) -> list:
    """What the driver returned for each call (`tests/jdbc`'s JdbcCheck)."""
    where = urlparse(uri)
    tls = "true" if where.scheme == "grpc+tls" else "false"
    extra = f"&{where.query}" if where.query else ""
    url = f"jdbc:arrow-flight-sql://{where.hostname}:{where.port}?useEncryption={tls}{extra}"
    out = subprocess.run(
        # (In UTC: the driver binds a timestamp as its wall-clock time.)
        ["java", "--add-opens=java.base/java.nio=ALL-UNNAMED", "-Duser.timezone=UTC",
         "-cp", f"{CHECK / 'classes'}:{CHECK / 'lib'}/*", "flightdeck.jdbc.JdbcCheck",
         url, *("\t".join(c) for c in calls)],
        capture_output=True, text=True, timeout=scaled(120),
    )
    answers = [json.loads(line) for line in out.stdout.splitlines() if line[:1] in "{["]
    assert out.returncode == 0 and len(answers) == len(calls), out.stdout + out.stderr
    return answers


def names(answer: dict) -> list[str]:
    assert "error" not in answer, answer
    return [name for name, _ in answer["columns"]]


def test_tables_columns_an_aggregate_and_an_unknown_table(server, events):
    tables, columns, counts, first, unknown = jdbc(
        server.uri,
        ("tables",),
        ("columns", "events"),
        ("query", "SELECT label, count(*) AS n FROM events GROUP BY label ORDER BY label NULLS FIRST"),
        ("query", "SELECT id, country, score FROM events WHERE id < 3 ORDER BY id"),
        ("query", "SELECT * FROM clicks"),
    )
    assert [r[:4] for r in tables["rows"]] == [["flightdeck", "public", "events", "TABLE"]]
    assert [r[3] for r in columns["rows"]] == events.column_names

    want = events.group_by("label").aggregate([([], "count_all")]).to_pydict()
    got = {None if label is None else int(label): int(n) for label, n in counts["rows"]}
    assert got == dict(zip(want["label"], want["count_all"]))
    assert counts["columns"] == [["label", "INTEGER"], ["n", "BIGINT"]]

    assert names(first) == ["id", "country", "score"]
    head = events.slice(0, 3)
    assert first["rows"] == [
        [str(i), c, None if s is None else str(s)]
        for i, c, s in zip(*(head[n].to_pylist() for n in ("id", "country", "score")))
    ]
    assert "the tables (the sealed datasets) are: events" in unknown["error"], unknown


def test_a_prepared_result_without_rows_has_the_querys_columns(server, events):
    # How Spark's JDBC source learns a table's or query's columns: a
    # prepared `… WHERE 1=0`. (A plain Statement's result without rows lists
    # every column twice in drivers 15 to 18.3, whatever the server: the
    # driver adds the prepared schema to its own copy of it, a bug fixed
    # upstream after 18.3.)
    probe, limited = jdbc(
        server.uri,
        ("prepared", 'SELECT * FROM (SELECT * FROM events) SPARK_GEN_SUBQ_0 WHERE 1=0'),
        ("prepared", "SELECT id, country FROM events WHERE id < ?", "long:0"),
    )
    assert names(probe[0]) == events.column_names and probe[0]["rows"] == []
    assert limited[0] == {"columns": [["id", "BIGINT"], ["country", "VARCHAR"]], "rows": []}


def test_a_result_is_paged_with_limit_and_offset_parameters(server, events):
    # `LIMIT ? OFFSET ?`, how JVM tools page through a result, and a
    # parameter nothing in the query types: DataFusion leaves them untyped,
    # and a parameter declared `Null` binds nothing but NULL in this driver
    # ("Can't set non-null value on NullVector"). Row counts are declared
    # BIGINT, a cast's operand its cast's type (so a number is bound to
    # `CAST(? AS BIGINT)`), any other text.
    pages, tagged, cast = jdbc(
        server.uri,
        ("prepared", "SELECT id FROM events ORDER BY id LIMIT ? OFFSET ?",
         "int:3", "int:0", "|", "int:3", "int:3", "|", "long:2", "long:98"),
        ("prepared", "SELECT ? AS tag, id FROM events ORDER BY id LIMIT ?", "string:t", "int:2"),
        ("prepared", "SELECT CAST(? AS BIGINT) + 1 AS n", "long:41"),
    )
    ids = [str(i) for i in sorted(events["id"].to_pylist())]
    assert [page["rows"] for page in pages] == [
        [[i] for i in ids[0:3]], [[i] for i in ids[3:6]], [[i] for i in ids[98:100]],
    ]
    assert tagged == [{"columns": [["tag", "VARCHAR"], ["id", "BIGINT"]],
                       "rows": [["t", ids[0]], ["t", ids[1]]]}]
    assert cast == [{"columns": [["n", "BIGINT"]], "rows": [["42"]]}], cast


def test_timestamps_times_and_dates_bind_exactly(server, events):
    # The driver writes a bound timestamp as epoch milliseconds, a time as
    # milliseconds of the day and a date as days, whatever unit the
    # parameter is declared in (arrow-java issue 838): declared in Spark's
    # microseconds, `ts < ?` bound a value a thousand times too small and
    # matched no row. Parameters of time types are declared in the driver's
    # units and cast to the query's as it runs; nanoseconds, `time64` and
    # `date64` columns compare exactly too.
    client = flightdeck.connect(server.uri)
    client.put_partition("times", 0, pa.table({
        "ts_ns": pa.array([dt.datetime(2026, 1, 1, 0, 0, 1, 500000), dt.datetime(2026, 1, 1, 0, 0, 2)],
                          pa.timestamp("ns")),
        "t": pa.array([dt.time(10, 30, 0, 250000), dt.time(11, 0)], pa.time64("us")),
        "d64": pa.array([dt.date(2026, 1, 1), dt.date(2026, 1, 2)], pa.date64()),
    }))
    client.seal("times", partitions=1)
    before, at, on_day, exact, after, earlier, dated = jdbc(
        server.uri,
        ("prepared", "SELECT count(*) AS n FROM events WHERE ts < ?",
         "timestamp:2026-01-01 00:10:00"),
        ("prepared", "SELECT id FROM events WHERE ts = ?", "timestamp:2026-01-01 01:07:00"),
        ("prepared", "SELECT count(*) AS n FROM events WHERE CAST(ts AS DATE) = ?",
         "date:2026-01-02"),
        ("prepared", "SELECT count(*) AS n FROM times WHERE ts_ns = ?",
         "timestamp:2026-01-01 00:00:01.5"),
        ("prepared", "SELECT count(*) AS n FROM times WHERE ts_ns > ?",
         "timestamp:2026-01-01 00:00:01.6"),
        ("prepared", "SELECT count(*) AS n FROM times WHERE t < ?", "time:10:45:00"),
        ("prepared", "SELECT count(*) AS n FROM times WHERE d64 = ?", "date:2026-01-02"),
    )
    # `events` has a row a minute from 2026-01-01 00:00 UTC.
    assert [a[0]["rows"] for a in (before, at, on_day)] == [[["10"]], [["67"]], [["1060"]]]
    assert [a[0]["rows"] for a in (exact, after, earlier, dated)] == [[["1"]]] * 4
    client.drop("times")


def test_strings_made_in_sql_are_read_and_bound(server, events):
    # SQL's VARCHAR is Arrow's Utf8 here: the driver refuses a Utf8View
    # result column ("Unsupported ArrowType Utf8View") and parameter.
    cast, by_cast, by_column = jdbc(
        server.uri,
        ("query", "SELECT CAST(label AS VARCHAR) AS l, upper(country) AS c FROM events "
                  "WHERE id < 4 ORDER BY id"),
        ("prepared", "SELECT count(*) AS n FROM events WHERE CAST(label AS VARCHAR) = ?",
         "string:3", "|", "string:-2"),
        ("prepared", "SELECT count(*) AS n FROM events WHERE country = ? AND id < ?",
         "string:DE", "long:1000", "|", "string:US", "long:50"),
    )
    head = events.slice(0, 4)
    assert cast["columns"] == [["l", "VARCHAR"], ["c", "VARCHAR"]]
    assert cast["rows"] == [
        [None if l is None else str(l), None if c is None else c.upper()]
        for l, c in zip(head["label"].to_pylist(), head["country"].to_pylist())
    ]

    def count(mask) -> str:
        return str(pc.sum(mask.cast(pa.int64())).as_py() or 0)

    label = events["label"]
    assert [a["rows"] for a in by_cast] == [
        [[count(pc.equal(label, 3))]], [[count(pc.equal(label, -2))]],
    ]
    ids, country = events["id"], events["country"]
    assert [a["rows"] for a in by_column] == [
        [[count(pc.and_(pc.equal(country, "DE"), pc.less(ids, 1000)))]],
        [[count(pc.and_(pc.equal(country, "US"), pc.less(ids, 50)))]],
    ]

    # Columns stored in Arrow's view layouts (pyarrow's and Polars'
    # `string_view`) are answered as plain strings and bytes.
    client = flightdeck.connect(server.uri)
    client.put_partition("views", 0, pa.table({
        "s": pa.array(["a", "b", "a", None], pa.string_view()),
        "b": pa.array([b"x", b"y", None, b"\x00"], pa.binary_view()),
        "l": pa.array([["p"], [], None, ["q", "r"]], pa.list_(pa.string_view())),
    }))
    client.seal("views", partitions=1)
    views, bound, listed = jdbc(
        server.uri,
        ("query", "SELECT s, b, l FROM views"),
        ("prepared", "SELECT count(*) AS n FROM views WHERE s = ?", "string:a"),
        ("columns", "views"),
    )
    assert views == {"columns": [["s", "VARCHAR"], ["b", "VARBINARY"], ["l", "ARRAY"]], "rows": [
        ["a", "78", '["p"]'], ["b", "79", "[]"], ["a", None, None], [None, "00", '["q","r"]'],
    ]}
    assert bound == [{"columns": [["n", "BIGINT"]], "rows": [["2"]]}]
    assert [(r[3], r[5]) for r in listed["rows"]] == [("s", "VARCHAR"), ("b", "VARBINARY"), ("l", "ARRAY")]
    assert client.sql("SELECT s FROM views").schema.field("s").type == pa.string()

    # A read plan's select list types its strings the same way.
    plan = client.plan("events", select=["CAST(label AS VARCHAR) AS l"])
    assert client.read_table(plan.shards[0]).schema.field("l").type == pa.string()


def test_unsigned_and_half_float_columns_read_with_their_values(server):
    # The driver refused a half-float column — listing the table's columns
    # too — and read an unsigned value as the signed one of its bits (255
    # as -1). Answers carry them as wider types that keep every value;
    # a parameter compared with one binds as before.
    import numpy as np

    client = flightdeck.connect(server.uri)
    client.put_partition("unsigned", 0, pa.table({
        "u8": pa.array([255, None], pa.uint8()),
        "u16": pa.array([65535, 1], pa.uint16()),
        "u32": pa.array([4294967295, 2], pa.uint32()),
        "u64": pa.array([2**64 - 1, 3], pa.uint64()),
        "h": pa.array(np.array([1.5, -2.0], np.float16)),
        "l": pa.array([[255], []], pa.list_(pa.uint8())),
    }))
    client.seal("unsigned", partitions=1)
    answer, listed, bound = jdbc(
        server.uri,
        ("query", "SELECT * FROM unsigned ORDER BY u16 DESC"),
        ("columns", "unsigned"),
        ("prepared", "SELECT u16 FROM unsigned WHERE u8 = ?", "int:255"),
    )
    assert answer == {"columns": [
        ["u8", "SMALLINT"], ["u16", "INTEGER"], ["u32", "BIGINT"], ["u64", "DECIMAL"],
        ["h", "FLOAT"], ["l", "ARRAY"],
    ], "rows": [
        ["255", "65535", "4294967295", str(2**64 - 1), "1.5", "[255]"],
        [None, "1", "2", "3", "-2.0", "[]"],
    ]}
    assert [(r[3], r[5]) for r in listed["rows"]] == [
        ("u8", "SMALLINT"), ("u16", "INTEGER"), ("u32", "BIGINT"), ("u64", "DECIMAL"),
        ("h", "FLOAT"), ("l", "ARRAY"),
    ]
    assert bound == [{"columns": [["u16", "INTEGER"]], "rows": [["65535"]]}]
    # Every Flight SQL client gets the same types; the dataset keeps its own.
    got = client.sql("SELECT u8, u64, h FROM unsigned ORDER BY u16 DESC")
    assert got.schema.types == [pa.int16(), pa.decimal128(20, 0), pa.float32()]
    assert got.column("u64").to_pylist()[0] == 2**64 - 1
    assert client.read_table(client.plan("unsigned").shards[0]).schema.field("u8").type == pa.uint8()
    client.drop("unsigned")


# Spark's JDBC source in a JVM of its own, with the driver on its classpath.
SPARK_JDBC_JOB = """
import json, sys
from pyspark.sql import SparkSession
jar, url = sys.argv[1:]
spark = (SparkSession.builder.master("local[2]").config("spark.jars", jar)
         .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
         .config("spark.ui.enabled", "false").getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
jdbc = dict(url=url, driver="org.apache.arrow.driver.jdbc.ArrowFlightJdbcDriver")
columns = "SELECT id, label, country, price, score FROM events"
whole = spark.read.format("jdbc").options(
    **jdbc, query=columns.replace(" FROM", ", CAST(ts AS BIGINT) AS ts_us FROM"),
    customSchema="id BIGINT, label INT, ts_us BIGINT").load()
split = spark.read.format("jdbc").options(
    **jdbc, dbtable=f"({columns}) t", customSchema="id BIGINT", partitionColumn="id",
    lowerBound="0", upperBound="2500", numPartitions="4").load()
counts = spark.read.format("jdbc").options(
    **jdbc, query="SELECT country, count(*) AS n FROM events GROUP BY country").load()
print(json.dumps({
    "schema": whole.schema.simpleString(),
    "rows": whole.count(),
    "sums": [str(v) for v in whole.groupBy().sum("id", "label", "price", "ts_us").first()],
    "first": str(whole.selectExpr("timestamp_micros(min(ts_us)) AS t").first().t),
    "split": [split.rdd.getNumPartitions(), split.count(), split.schema.simpleString()],
    "counts": sorted((r.country or "", int(r.n)) for r in counts.collect()),
}))
"""


def test_sparks_jdbc_source_reads_a_query_with_its_decimal_types(server, events):
    """Spark's JDBC source reads a query, split over partitions of a column
    and aggregated on the server. A decimal column keeps its precision and
    scale: the driver reads them from Flight SQL's column metadata, which
    answers now carry (without, Spark read every decimal as
    `decimal(38,18)`). The driver says no integer is signed, so Spark reads
    `bigint` as `decimal(20,0)` unless `customSchema` names the type, and
    Spark knows no type for a zoned timestamp, sent as microseconds (the
    README's recipe)."""
    import os
    import subprocess
    import sys

    [driver] = (CHECK / "lib").glob("flight-sql-jdbc-driver-*.jar")
    where = urlparse(server.uri)
    url = f"jdbc:arrow-flight-sql://{where.hostname}:{where.port}?useEncryption=false"
    job = subprocess.run([sys.executable, "-c", SPARK_JDBC_JOB, str(driver), url],
                         env=dict(os.environ, PYSPARK_PYTHON=sys.executable, TZ="UTC"),
                         capture_output=True, text=True, timeout=scaled(300))
    assert job.returncode == 0, job.stderr[-3000:]
    out = json.loads(job.stdout.strip().splitlines()[-1])
    assert out["schema"] == ("struct<id:bigint,label:int,country:string,price:decimal(12,2),"
                             "score:double,ts_us:bigint>")
    assert out["rows"] == events.num_rows
    ts_us = events["ts"].cast(pa.int64())
    assert out["sums"] == [str(pc.sum(c).as_py()) for c in
                           (events["id"], events["label"], events["price"], ts_us)]
    # (A zoned timestamp as microseconds, made a timestamp again in Spark.)
    assert out["first"] == "2026-01-01 00:00:00", out
    assert out["split"] == [4, events.num_rows,
                            "struct<id:bigint,label:bigint,country:string,price:decimal(12,2),"
                            "score:double>"]
    want = pc.value_counts(events["country"].fill_null("")).to_pylist()
    assert out["counts"] == sorted([c["values"], c["counts"]] for c in want)


def test_datasets_have_no_keys_and_say_so(server, events):
    # Tools ask for a table's keys when they show it; the calls were
    # UNIMPLEMENTED. (The driver gives a listing without rows no columns.)
    for answer in jdbc(server.uri, ("primary-keys", "events"), ("imported-keys", "events"),
                       ("exported-keys", "events")):
        assert answer == {"columns": [], "rows": []}, answer


def test_updates_are_refused_saying_what_to_run_instead(server, events):
    # A statement that changes data gets the read-only refusal a query plan
    # gives it; a query sent as an update (a prepared statement's
    # executeUpdate) is told to run as a query. It was UNIMPLEMENTED with
    # "do_put_prepared_statement_update has no default implementation".
    rows = events.num_rows
    as_update, delete, bound_delete = jdbc(
        server.uri,
        ("prepared-update", "SELECT ? AS tag", "string:a"),
        ("update", "DELETE FROM events"),
        ("prepared-update", "DELETE FROM events WHERE id = ?", "long:1"),
    )
    assert "the query `SELECT ? AS tag` was sent as an update" in as_update["error"], as_update
    assert "run it as a query (executeQuery, execute)" in as_update["error"], as_update
    for refused in (delete, bound_delete):
        assert "DML not supported" in refused["error"], refused
        assert "queries over the cache are read-only" in refused["error"], refused
    [count] = jdbc(server.uri, ("query", "SELECT count(*) AS n FROM events"))
    assert count["rows"] == [[str(rows)]], count


def test_a_token_in_the_url_reaches_a_server_with_tokens(tmp_path):
    # The driver shakes hands with its `token` first, then sends it on every
    # call; the handshake was UNIMPLEMENTED, so no connection was made.
    tokens = tmp_path / "tokens"
    tokens.write_text("writer w-jdbc-1\nreader r-jdbc-1\n")
    guarded = RunningServer("--memory-limit", "256MiB", "--auth-token-file", str(tokens))
    try:
        client = flightdeck.connect(guarded.uri, token="w-jdbc-1")
        client.put_partition("t", 0, pa.table({"x": pa.array(range(10), pa.int64())}))
        client.seal("t", partitions=1)
        [read] = jdbc(guarded.uri + "?token=r-jdbc-1", ("query", "SELECT sum(x) AS s FROM t"))
        assert read == {"columns": [["s", "BIGINT"]], "rows": [["45"]]}
        [refused] = jdbc(guarded.uri, ("query", "SELECT sum(x) AS s FROM t"))
        assert "this server needs a token" in refused["error"], refused
    finally:
        assert guarded.stop() == 0, "".join(guarded.stderr_lines)


def test_tls_with_the_authoritys_certificate(tmp_path):
    certs = make_test_certs(tmp_path)
    tls = RunningServer("--memory-limit", "256MiB",
                        "--tls-cert", str(certs["cert"]), "--tls-key", str(certs["key"]))
    uri = f"grpc+tls://{tls.addr}"
    try:
        client = flightdeck.connect(uri, tls_root_certs=certs["ca"].read_bytes())
        client.put_partition("t", 0, pa.table({"x": pa.array(range(5), pa.int64())}))
        client.seal("t", partitions=1)
        trusted, untrusted = (
            jdbc(uri + query, ("query", "SELECT sum(x) AS s FROM t"))[0]
            for query in (f"?tlsRootCerts={certs['ca']}", "")
        )
        assert trusted == {"columns": [["s", "BIGINT"]], "rows": [["10"]]}
        assert "unable to find valid certification path" in untrusted["error"], untrusted
    finally:
        assert tls.stop() == 0, "".join(tls.stderr_lines)
