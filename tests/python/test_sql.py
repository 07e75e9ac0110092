"""SQL over the cache: a Flight SQL session with ADBC's Flight SQL driver on
the server's Flight port (tables listed, a schema, an aggregate, a filter,
results as Arrow, a prepared statement with `$1` and with `?` parameters), a cluster
dataset queried through one member, tokens, queries charged to the memory
budget, and action `derive` keeping a hash split as two datasets, and a
small part of a dataset holding what its rows take."""

from __future__ import annotations

import os
import re
import time

import pyarrow as pa
import pyarrow.compute as pc
import pytest

import flightdeck
from conftest import RunningServer, eventually, scaled
from test_observe import scrape, value
from test_query import ROWS, hash_bucket, read_all, table, write

adbc = pytest.importorskip("adbc_driver_flightsql.dbapi")


@pytest.fixture
def server():
    s = RunningServer("--memory-limit", "512MiB")
    yield s
    assert s.stop() == 0, "".join(s.stderr_lines)


def fetch(conn, sql, parameters=None) -> pa.Table:
    with conn.cursor() as cur:
        cur.execute(sql, parameters)
        return cur.fetch_arrow_table()


def test_an_adbc_session_lists_describes_aggregates_filters_and_binds(server):
    client = flightdeck.connect(server.uri)
    source = write(client, "events")
    client.put_partition("open_one", 0, table(range(10)))  # not sealed: no table
    with adbc.connect(server.uri, autocommit=True) as conn:
        objects = conn.adbc_get_objects(depth="all").read_all().to_pylist()
        tables = {
            t["table_name"]: [c["column_name"] for c in t["table_columns"]]
            for cat in objects
            for s in cat["catalog_db_schemas"]
            for t in s["db_schema_tables"]
        }
        assert objects[0]["catalog_name"] == "flightdeck"
        assert tables == {"events": source.column_names}
        assert conn.adbc_get_table_schema("events") == source.schema
        assert "TABLE" in conn.adbc_get_table_types()

        got = fetch(conn, "SELECT label, count(*) AS n FROM events GROUP BY label ORDER BY label NULLS FIRST")
        want = source.group_by("label").aggregate([([], "count_all")]).to_pydict()
        counts = dict(zip(want["label"], want["count_all"]))
        assert dict(zip(got["label"].to_pylist(), got["n"].to_pylist())) == counts

        got = fetch(conn, "SELECT id, country FROM events WHERE country = 'DE' AND label > 2 ORDER BY id")
        want = source.filter(pc.and_(pc.equal(source["country"], "DE"), pc.greater(source["label"], 2)))
        assert got["id"].to_pylist() == want["id"].to_pylist()
        assert got.schema.field("country").type == pa.string()
        # The filter and the projection are pushed into the scan of the
        # cache: evaluated there exactly, with no filter above it.
        plan = fetch(conn, "EXPLAIN SELECT id FROM events WHERE label > 2").to_pydict()
        text = " ".join(plan["plan"])
        assert "full_filters=[events.label > Int32(2)]" in text, text
        assert "projection=[id]" in text and "FilterExec" not in text, text

        # A prepared statement, executed twice with different parameters.
        with conn.cursor() as cur:
            for limit in (10, 1000):
                cur.execute("SELECT count(*) AS n FROM events WHERE id < $1", parameters=(limit,))
                assert cur.fetch_arrow_table()["n"].to_pylist() == [limit]
            # `?` placeholders, the style the driver declares (DB-API
            # `paramstyle`), bind in the order they appear; a `'?'` string
            # is not one.
            assert adbc.paramstyle == "qmark"
            cur.execute("SELECT id, ? AS tag, '?' AS q FROM events WHERE id >= ? ORDER BY id "
                        "LIMIT ?", parameters=("x", 5, 2))
            assert cur.fetchall() == [(5, "x", "?"), (6, "x", "?")]
            with pytest.raises(Exception, match="mixes `[?]` placeholders with numbered ones"):
                cur.execute("SELECT id FROM events WHERE id > ? AND id < $2", parameters=(1, 3))

        # hash_bucket is there too, and read-only is enforced.
        got = fetch(conn, "SELECT count(*) AS n FROM events WHERE hash_bucket(id) < 90")
        assert got["n"].to_pylist() == [sum(hash_bucket(i) < 90 for i in source["id"].to_pylist())]
        with pytest.raises(Exception, match="read-only"):
            fetch(conn, "CREATE TABLE t AS SELECT * FROM events")
        with pytest.raises(Exception, match="nope"):
            fetch(conn, "SELECT nope FROM events")
    # The data plane still answers on the same port.
    assert client.plan("events").total_rows == source.num_rows


def test_derive_keeps_a_hash_split_as_two_datasets(server):
    client = flightdeck.connect(server.uri)
    source = write(client, "src")
    train = client.derive("train", "SELECT * FROM source WHERE hash_bucket(id) < 80", source="src")
    held = client.derive("held", 'SELECT * FROM "src" WHERE hash_bucket(id) >= 80')
    assert train.rows + held.rows == source.num_rows
    a = set(client.read_table(client.plan("train").shards[0])["id"].to_pylist())
    b = set(client.read_table(client.plan("held").shards[0])["id"].to_pylist())
    assert a.isdisjoint(b) and a | b == set(source["id"].to_pylist())
    assert a == {i for i in source["id"].to_pylist() if hash_bucket(i) < 80}
    # The derived dataset is a dataset like any other: same schema, readable shuffled.
    whole = client.read_table(client.plan("train").shards[0])
    assert whole.schema == source.schema
    assert sum(s.rows for s in client.plan("train", world_size=3, shuffle="global").shards) >= len(a)
    # Derived columns, and the errors.
    feats = client.derive("feats", "SELECT id, CAST(price AS DOUBLE) * 2 AS p2 FROM src WHERE label = 1")
    assert feats.rows == pc.sum(pc.equal(source["label"], 1)).as_py()
    with pytest.raises(flightdeck.FailedPrecondition, match="exists"):
        client.derive("train", "SELECT 1")
    with pytest.raises(flightdeck.InvalidArgument, match="nope"):
        client.derive("x", "SELECT nope FROM src")
    with pytest.raises(flightdeck.NotFound):
        client.derive("y", "SELECT * FROM source", source="missing")
    assert "x" not in client.list_datasets()


def test_a_derived_part_holds_what_its_rows_take(server):
    """`LIMIT … OFFSET …` keeps slices of the source's stored batches, whose
    strings and lists point into the whole batch's values: the derived
    dataset holds its own rows' (it held the whole batch's, 382 KB for 10
    rows of a Spark-shaped table)."""
    client = flightdeck.connect(server.uri)
    rows = 20_000
    source = pa.table({
        "id": pa.array(range(rows), pa.int64()),
        "name": pa.array([f"row-{i}" for i in range(rows)]),
        "features": pa.array([[float(i), i + 0.5, i + 0.25] for i in range(rows)],
                             pa.list_(pa.float32())),
    })
    client.put_partition("spark_rows", 0, source)
    whole = client.seal("spark_rows", partitions=1)
    part = client.derive("ten", 'SELECT * FROM "spark_rows" LIMIT 10 OFFSET 1500')
    assert part.rows == 10
    assert read_all(client, "ten").equals(source.slice(1500, 10))
    assert part.bytes < 8192, (part.bytes, whole.bytes)


def test_sql_over_a_cluster_dataset_sees_every_member(server):
    members = [RunningServer("--memory-limit", "256MiB") for _ in range(2)]
    try:
        start, layout, parts = 0, {}, []
        for p, n in enumerate([300, 500, 200]):
            t = table(range(start, start + n))
            ack = flightdeck.connect(members[p % 2].uri).put_partition("c", p, t)
            layout.setdefault(ack.location, {})[p] = 0
            parts.append(t)
            start += n
        flightdeck.connect(members[0].uri).seal_cluster("c", layout, partitions=3)
        source = pa.concat_tables(parts)
        with adbc.connect(members[1].uri, autocommit=True) as conn:
            got = fetch(conn, "SELECT count(*) AS n, sum(id) AS s FROM c WHERE label >= 0")
            everything = fetch(conn, "SELECT count(*) AS n FROM c")
            ids = fetch(conn, "SELECT id FROM c WHERE country = 'FR' ORDER BY id")
        want = source.filter(pc.greater_equal(source["label"], 0))
        assert got["n"].to_pylist() == [want.num_rows]
        assert got["s"].to_pylist() == [pc.sum(want["id"]).as_py()]
        assert everything["n"].to_pylist() == [source.num_rows]
        fr = source.filter(pc.equal(source["country"], "FR"))
        assert ids["id"].to_pylist() == sorted(fr["id"].to_pylist())
    finally:
        for m in members:
            assert m.stop() == 0, "".join(m.stderr_lines)


def test_bulk_ingestion_writes_a_dataset_whole_in_each_mode(server):
    """ADBC's `adbc_ingest` (and pandas' `to_sql` through it) writes a
    dataset of one partition, sealed at its end; `replace` replaces it at
    once, as Spark's overwrite does. A dataset is sealed whole, so an append
    to one is refused, and so are what flightdeck has no notion of. A stream
    that breaks leaves nothing. Before, every ingestion was UNIMPLEMENTED."""
    import pandas as pd

    client = flightdeck.connect(server.uri)
    rows = pa.table({"id": pa.array(range(1_000)), "x": pa.array([0.5] * 1_000)})

    def ingest(table, data, **options):
        with adbc.connect(server.uri, autocommit=True) as conn, conn.cursor() as cur:
            return cur.adbc_ingest(table, data, **options)

    assert ingest("ingested", rows, mode="create") == 1_000
    info = client.describe("ingested")
    assert (info.rows, len(info.partitions)) == (1_000, 1)
    assert flightdeck.dataset_schema(info) == rows.schema
    assert read_all(client, "ingested").sort_by("id").equals(rows)
    for mode, code, words in [
        ("create", "ALREADY_EXISTS", "dataset 'ingested' exists; ingest with mode 'replace'"),
        ("append", "FailedPrecondition", "rows cannot be appended to it; ingest all its rows"),
    ]:
        with pytest.raises(Exception, match=f"(?=.*{code}).*{re.escape(words)}"):
            ingest("ingested", rows, mode=mode)
    with pytest.raises(Exception, match="NOT_FOUND.*dataset 'missing' does not exist; ingest "
                       "with mode 'create'"):
        ingest("missing", rows, mode="append")

    # Replaced at once: a read planned before the replace still reads the
    # old rows whole, or fails saying the dataset was written again.
    plan = client.plan("ingested", world_size=1)
    assert ingest("ingested", rows.slice(0, 10), mode="replace") == 10
    assert client.sql("SELECT count(*) AS n FROM ingested")["n"].to_pylist() == [10]
    with pytest.raises(flightdeck.FailedPrecondition, match="written again"):
        client.read_table(plan.shards[0])
    assert ingest("both", rows.slice(0, 3), mode="create_append") == 3

    for options, words in [
        ({"temporary": True}, "asks for a temporary table"),
        ({"catalog_name": "other"}, "every dataset is in catalog 'flightdeck'"),
        ({"db_schema_name": "other"}, "every dataset is in schema 'public'"),
    ]:
        with pytest.raises(Exception, match=f"INVALID_ARGUMENT.*{words}"):
            ingest("odd", rows, mode="create", **options)
    assert ingest("named", rows.slice(0, 1), mode="create", db_schema_name="public") == 1

    def broken():
        yield rows.to_batches()[0].slice(0, 5)
        raise RuntimeError("the producer failed")

    with pytest.raises(Exception, match="the producer failed"):
        ingest("broken", pa.RecordBatchReader.from_batches(rows.schema, broken()), mode="create")
    # (The client gives up before the server has seen the stream break.)
    eventually("the broken ingestion's dataset to go",
               lambda: True if "broken" not in client.list_datasets() else None)

    frame = pd.DataFrame({"a": [1, 2, 3], "b": ["x", "y", "z"]})
    with adbc.connect(server.uri, autocommit=True) as conn:
        assert frame.to_sql("frame", conn, index=False) == 3
        # pandas replaces by DROP TABLE, which a query cannot do: the
        # refusal says how datasets are written and dropped.
        with pytest.raises(Exception, match="read-only .*bulk ingestion .*dropped with action"):
            frame.to_sql("frame", conn, index=False, if_exists="replace")
    assert fetch_rows(client, "SELECT * FROM frame ORDER BY a") == [(1, "x"), (2, "y"), (3, "z")]


def fetch_rows(client, sql):
    return [tuple(r.values()) for r in client.sql(sql).to_pylist()]


def test_flight_sql_takes_the_same_tokens(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("writer w-sql\nreader r-sql\n")
    s = RunningServer("--memory-limit", "256MiB", "--auth-token-file", str(tokens))
    try:
        write(flightdeck.connect(s.uri, token="w-sql"), "t")
        header = "adbc.flight.sql.authorization_header"
        with adbc.connect(s.uri, db_kwargs={header: "Bearer r-sql"}, autocommit=True) as conn:
            # A reader queries and binds parameters (a DoPut that reads).
            got = fetch(conn, "SELECT count(*) AS n FROM t WHERE id < $1", parameters=(5,))
            assert got["n"].to_pylist() == [5]
        with pytest.raises(Exception, match="(?i)unauthenticated|token"):
            with adbc.connect(s.uri, autocommit=True) as conn:
                fetch(conn, "SELECT 1")
        with flightdeck.connect(s.uri, token="r-sql") as r:
            with pytest.raises(flightdeck.PermissionDenied, match="derive"):
                r.derive("u", "SELECT * FROM t")
        # A bulk ingestion writes: a writer's token, not a reader's.
        rows = pa.table({"id": [1, 2]})
        for token, refused in [("r-sql", "(?i)permission"), ("w-sql", None)]:
            with adbc.connect(s.uri, db_kwargs={header: f"Bearer {token}"}, autocommit=True) as conn:
                with conn.cursor() as cur:
                    if refused:
                        with pytest.raises(Exception, match=refused):
                            cur.adbc_ingest("ingested", rows, mode="create")
                    else:
                        assert cur.adbc_ingest("ingested", rows, mode="create") == 2
        with flightdeck.connect(s.uri, token="r-sql") as r:
            assert r.describe("ingested").rows == 2
    finally:
        assert s.stop() == 0, "".join(s.stderr_lines)


def test_a_spilled_dataset_is_restored_for_a_query_and_a_filter(tmp_path):
    args = ("--memory-limit", "256MiB", "--persist", "--spill-url", str(tmp_path / "store"))
    s = RunningServer(*args)
    try:
        source = write(flightdeck.connect(s.uri), "kept")
    finally:
        assert s.stop() == 0, "".join(s.stderr_lines)
    s = RunningServer(*args)  # starts with the dataset in the store only
    try:
        c = flightdeck.connect(s.uri)
        assert c.describe("kept").spilled
        with adbc.connect(s.uri, autocommit=True) as conn:
            got = fetch(conn, "SELECT count(*) AS n FROM kept WHERE country = 'FR'")
        assert got["n"].to_pylist() == [pc.sum(pc.equal(source["country"], "FR")).as_py()]
        assert not c.describe("kept").spilled
        plan = c.plan("kept", filter="country = 'FR'")
        assert plan.total_rows == got["n"][0].as_py()
    finally:
        assert s.stop() == 0, "".join(s.stderr_lines)


WIDE_JOIN = "SELECT a.*, b.x0 AS y FROM wide a JOIN wide b ON a.id = b.id"


def write_wide(client) -> int:
    """Seals dataset `wide`: 300 000 rows of an int64 id and eight float64
    columns (21.6 MB), which `WIDE_JOIN` joins with itself (its build side
    holds every column of one side); returns the rows."""
    import numpy as np

    rows = 300_000
    cols = {"id": pa.array(np.arange(rows, dtype=np.int64))}
    for i in range(8):
        cols[f"x{i}"] = pa.array(np.full(rows, float(i)))
    client.put_partition("wide", 0, pa.table(cols))
    client.seal("wide", partitions=1)
    return rows


def test_a_query_is_charged_to_the_memory_budget_and_gives_it_back():
    import numpy as np

    s = RunningServer("--memory-limit", "256MiB")  # a query may hold 64 MiB
    try:
        c = flightdeck.connect(s.uri)
        rows = write_wide(c)
        # An open write holds its rows (nothing to spill): the budget keeps
        # a few MiB free, less than the join's build side needs.
        filler = pa.table({"v": pa.array(np.zeros(27_500_000, dtype=np.int64))})
        c.put_partition("filler", 0, filler)
        with adbc.connect(s.uri, autocommit=True) as conn:
            with pytest.raises(Exception, match="memory budget is full") as refused:
                fetch(conn, WIDE_JOIN)
            assert "HashJoin" in str(refused.value)
            c.drop("filler")
            used = c.stats().memory_used
            assert fetch(conn, WIDE_JOIN).num_rows == rows
            # What the query held went back when it ended.
            assert c.stats().memory_used == used
    finally:
        assert s.stop() == 0, "".join(s.stderr_lines)


def test_a_query_past_its_memory_is_resource_exhausted_and_the_server_keeps_serving():
    import numpy as np

    s = RunningServer("--memory-limit", "64MiB")  # a query may hold 16 MiB
    try:
        c = flightdeck.connect(s.uri)
        rows = write_wide(c)
        with adbc.connect(s.uri, autocommit=True) as conn:
            # A join's build side holds every column of one side: past 16 MiB.
            with pytest.raises(Exception, match="needs more memory than a query may hold"):
                fetch(conn, WIDE_JOIN)
            # The server is fine, and so is a query that fits.
            assert fetch(conn, "SELECT count(*) AS n FROM wide")["n"].to_pylist() == [rows]
        # A window over 200 000 rows (3 MiB) fits: each sorting partition
        # used to set aside 10 MiB up front for a merge it might need after
        # spilling, so two cores' sorts asked for more than the 16 MiB.
        for p in range(4):
            ids = np.arange(p * 50_000, (p + 1) * 50_000, dtype=np.int64)
            c.put_partition("sevens", p, pa.table({"id": ids, "k": ids % 7}))
        c.seal("sevens", partitions=4)
        for limit in ["", "LIMIT 5"]:
            window = c.sql("SELECT id, k, row_number() OVER (PARTITION BY k ORDER BY id) AS r "
                           f"FROM sevens ORDER BY id {limit}")
            assert window.column("r").to_pylist() == [i // 7 + 1 for i in range(window.num_rows)]
        # A sort of more than the query may hold spills instead (21.6 MB).
        ordered = c.sql("SELECT * FROM wide ORDER BY id DESC")
        assert ordered.num_rows == rows
        assert ordered.column("id").to_pylist()[::100_000] == [rows - 1, rows - 100_001, rows - 200_001]
        assert c.plan("wide").total_rows == rows
    finally:
        assert s.stop() == 0, "".join(s.stderr_lines)


#: DataFusion panics on this one while typing it (an overflow in its
#: decimal coercion, in builds with overflow checks): the server answers
#: INVALID_ARGUMENT naming it, wherever a client sends it. (Should the
#: engine learn to refuse it itself, the answer stays INVALID_ARGUMENT.)
ENGINE_FAILS = "arrow_cast(id, 'Decimal256(76, -100)') > 1"


def test_an_expression_the_query_engine_fails_on_is_invalid_argument(server):
    client = flightdeck.connect(server.uri)
    write(client, "events")
    with pytest.raises(flightdeck.InvalidArgument, match=re.escape(ENGINE_FAILS)):
        client.plan("events", filter=ENGINE_FAILS)
    with pytest.raises(flightdeck.InvalidArgument, match=re.escape(ENGINE_FAILS)):
        client.plan("events", select=["id", f"{ENGINE_FAILS} AS odd"])
    query = f"SELECT count(*) FROM events WHERE {ENGINE_FAILS}"
    with pytest.raises(flightdeck.InvalidArgument, match=re.escape(query)):
        client.derive("never", query)
    with pytest.raises(flightdeck.NotFound):
        client.describe("never")
    with adbc.connect(server.uri, autocommit=True) as conn:
        with pytest.raises(Exception, match="INVALID_ARGUMENT.*" + re.escape(query)):
            fetch(conn, query)
        # The same session and server go on answering.
        assert fetch(conn, "SELECT count(*) AS n FROM events")["n"].to_pylist() == [ROWS]
    assert client.plan("events", filter="id < 10").total_rows == 10


def test_updates_are_refused_saying_what_to_run_instead(server):
    # ADBC's executemany and execute_update send ExecuteUpdate; they were
    # UNIMPLEMENTED ("do_put_prepared_statement_update has no default
    # implementation"). Nothing changes.
    client = flightdeck.connect(server.uri)
    write(client, "events")
    with adbc.connect(server.uri, autocommit=True) as conn:
        cur = conn.cursor()
        with pytest.raises(Exception, match=r"INVALID_ARGUMENT.*the query `SELECT \? AS x` "
                           r"was sent as an update .*run it as a query"):
            cur.executemany("SELECT ? AS x", [(1,), (2,)])
        cur.adbc_statement.set_sql_query("DELETE FROM events")
        with pytest.raises(Exception, match="INVALID_ARGUMENT.*DML not supported.*read-only"):
            cur.adbc_statement.execute_update()
        cur.close()
        assert fetch(conn, "SELECT count(*) AS n FROM events")["n"].to_pylist() == [ROWS]


def test_a_dataset_still_being_written_is_not_a_table_yet_and_says_so(server):
    client = flightdeck.connect(server.uri)
    client.put_partition("arriving", 0, [pa.record_batch({"id": pa.array([1, 2], pa.int64())})])
    with adbc.connect(server.uri, autocommit=True) as conn:
        with pytest.raises(Exception, match="dataset 'arriving', which is not readable yet: it is "
                                            "still being written; query it once it is sealed"):
            fetch(conn, "SELECT count(*) FROM arriving")
        with pytest.raises(flightdeck.FailedPrecondition, match="still being written"):
            client.derive("copy", "SELECT * FROM arriving")
        # A name that is no dataset at all is still "not found".
        with pytest.raises(Exception, match="'flightdeck.public.missing' not found"):
            fetch(conn, "SELECT * FROM missing")
        client.seal("arriving", partitions=1)
        assert fetch(conn, "SELECT count(*) AS n FROM arriving")["n"].to_pylist() == [2]


def cpu_seconds(pid: int) -> float:
    """CPU time (user and system) process `pid` has used so far."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_query_its_client_gave_up_on_stops_and_leaves_reads_alone():
    """A cross join's count of 10^12 rows stops once its client has gone
    (the join yields to the runtime, and the query is dropped there); while
    it ran, reads and plans were answered as before, and the server stops
    cleanly after."""
    import threading

    s = RunningServer("--memory-limit", "256MiB", "--metrics-listen", "127.0.0.1:0")
    try:
        client = flightdeck.connect(s.uri)
        write(client, "events")
        # One partition of one batch: the join runs in the call's own task.
        client.put_partition("one", 0, table(range(1000)))
        client.seal("one", partitions=1)
        endless = "SELECT count(*) FROM one a, one b, one c, one d"
        gave_up = []
        started = threading.Barrier(4, timeout=30)

        def query():
            # The client gives up after 3 s.
            options = {
                "adbc.flight.sql.rpc.timeout_seconds.query": "3",
                "adbc.flight.sql.rpc.timeout_seconds.fetch": "3",
            }
            with adbc.connect(s.uri, autocommit=True, db_kwargs=options) as conn:
                started.wait()
                try:
                    fetch(conn, endless)
                except Exception as e:  # noqa: BLE001 - the client's deadline
                    gave_up.append(str(e))

        threads = [threading.Thread(target=query, daemon=True) for _ in range(3)]
        for t in threads:
            t.start()
        started.wait()
        # More queries than a 2-core server has query threads are running;
        # the data path answers at once.
        time.sleep(0.5)
        patient = flightdeck.connect(s.uri, timeout=10)
        assert patient.plan("events", filter="id < 10").total_rows == 10
        assert read_all(patient, "events").num_rows == ROWS
        for t in threads:
            t.join(timeout=30)
        assert len(gave_up) == 3 and all("TIMEOUT" in e for e in gave_up), gave_up
        # The three stop: the server goes idle (it burnt a core each, or
        # every core it has, while they ran) ...
        deadline = time.monotonic() + scaled(15)
        while True:
            before = cpu_seconds(s.proc.pid)
            time.sleep(1)
            busy = cpu_seconds(s.proc.pid) - before
            if busy < 0.3:
                break
            assert time.monotonic() < deadline, f"still {busy:.2f} CPU s a second"
        # ... and a query gets a query thread.
        with adbc.connect(s.uri, autocommit=True) as conn:
            assert fetch(conn, "SELECT count(*) AS n FROM one").to_pydict() == {"n": [1000]}
            with pytest.raises(Exception, match="no_such_column"):
                fetch(conn, "SELECT no_such_column FROM one")
            with pytest.raises(Exception, match="cannot run"):
                # Planned, then failed while it ran.
                fetch(conn, "SELECT arrow_cast('x' || id, 'Int64') FROM one")
        # The metrics say so.
        samples = scrape(s.metrics_url)
        assert value(samples, "flightdeck_queries_running") == 0
        assert value(samples, "flightdeck_queries_total", outcome="given_up") == 3
        assert value(samples, "flightdeck_queries_total", outcome="done") == 1
        assert value(samples, "flightdeck_queries_total", outcome="failed") == 1
        assert value(samples, "flightdeck_query_duration_seconds_count") == 5
        assert value(samples, "flightdeck_query_duration_seconds_sum") >= 3 * 2.5
        # ... and so does stats.
        stats = flightdeck.connect(s.uri).stats()
        counts = (stats.queries_running, stats.queries_done, stats.queries_failed,
                  stats.queries_given_up)
        assert counts == (0, 1, 1, 3), stats
    finally:
        assert s.stop() == 0, "".join(s.stderr_lines)
