"""Read plans with a filter and derived columns, against pyarrow.compute on
the same data: nulls, strings, lists, timestamps and decimals; shards over
the selection equal to shards of a dataset holding only the selected rows
(balanced, disjoint, complete, resumable at another world size); bad SQL
refused with INVALID_ARGUMENT; and the same over a cluster dataset."""

from __future__ import annotations

import datetime as dt
import decimal
import re

import pyarrow as pa
import pyarrow.compute as pc
import pytest

import flightdeck
from conftest import RunningServer, strided_order

SIZES = [700, 0, 1300, 500]  # partition sizes, one empty
ROWS = sum(SIZES)
MASK = (1 << 64) - 1


def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & MASK
    return h


def mix(h: int) -> int:
    h ^= h >> 30
    h = (h * 0xBF58476D1CE4E5B9) & MASK
    h ^= h >> 27
    h = (h * 0x94D049BB133111EB) & MASK
    return h ^ (h >> 31)


def hash_bucket(value, buckets: int = 100) -> int | None:
    """The documented definition of the server's `hash_bucket`."""
    if value is None:
        return None
    data = value.encode() if isinstance(value, str) else int(value).to_bytes(8, "little", signed=True)
    return mix(fnv1a64(data)) % buckets


def table(ids: range) -> pa.Table:
    base = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    countries = ["DE", "FR", None, "US", "de"]
    return pa.table(
        {
            "id": pa.array(list(ids), pa.int64()),
            "label": pa.array([None if i % 11 == 0 else i % 7 - 2 for i in ids], pa.int32()),
            "country": pa.array([countries[i % 5] for i in ids], pa.string()),
            "price": pa.array(
                [None if i % 13 == 0 else decimal.Decimal(i % 3000) / 100 for i in ids],
                pa.decimal128(12, 2),
            ),
            "ts": pa.array([base + dt.timedelta(minutes=i) for i in ids], pa.timestamp("us", tz="UTC")),
            "tags": pa.array(
                [None if i % 9 == 0 else list(range(i % 4)) for i in ids], pa.list_(pa.int32())
            ),
            "score": pa.array([None if i % 6 == 0 else i / 7 for i in ids], pa.float64()),
        }
    )


def write(client, name, sizes=SIZES) -> pa.Table:
    start, parts = 0, []
    for p, n in enumerate(sizes):
        t = table(range(start, start + n))
        client.put_partition(name, p, t)
        parts.append(t)
        start += n
    client.seal(name, partitions=len(sizes))
    return pa.concat_tables(parts)


def read_all(client, name, **plan) -> pa.Table:
    p = client.plan(name, **plan)
    assert len(p.shards) == 1
    t = client.read_table(p.shards[0])
    assert t.num_rows == p.shards[0].rows
    return t


@pytest.fixture
def server():
    s = RunningServer("--memory-limit", "512MiB")
    yield s
    assert s.stop() == 0, "".join(s.stderr_lines)


FILTERS = {
    "label >= 0 AND country = 'DE'": lambda t: pc.and_(
        pc.greater_equal(t["label"], 0), pc.equal(t["country"], "DE")
    ),
    "price > 10.5": lambda t: pc.greater(t["price"], pa.scalar(decimal.Decimal("10.50"), pa.decimal128(12, 2))),
    "country IS NULL OR score < 3": lambda t: pc.or_kleene(pc.is_null(t["country"]), pc.less(t["score"], 3)),
    "ts >= '2026-01-01T20:00:00Z'": lambda t: pc.greater_equal(
        t["ts"], pa.scalar(dt.datetime(2026, 1, 1, 20, tzinfo=dt.timezone.utc), pa.timestamp("us", tz="UTC"))
    ),
    "array_length(tags) > 1": lambda t: pc.greater(pc.list_value_length(t["tags"]), 1),
    "hash_bucket(id) < 90": lambda t: pa.array([hash_bucket(i) < 90 for i in t["id"].to_pylist()]),
    "hash_bucket(country, 4) = 1": lambda t: pa.array(
        [None if c is None else hash_bucket(c, 4) == 1 for c in t["country"].to_pylist()]
    ),
    "upper(country) = 'DE' AND NOT (label = 1)": lambda t: pc.and_(
        pc.equal(pc.utf8_upper(t["country"]), "DE"), pc.invert(pc.equal(t["label"], 1))
    ),
    "id < 0": lambda t: pc.less(t["id"], 0),
    "id >= 0": lambda t: pc.greater_equal(t["id"], 0),
    # Functions the query engine runs only as rewrites of its simplifier.
    "coalesce(label, 0) = 0": lambda t: pc.equal(pc.coalesce(t["label"], 0), 0),
    "nvl2(country, 1, 0) = 0": lambda t: pc.is_null(t["country"]),
    "arrow_cast(id, 'Float32') < 100.5": lambda t: pc.less(t["id"], 101),
}


def test_filters_select_what_pyarrow_compute_selects(server):
    client = flightdeck.connect(server.uri)
    source = write(client, "q")
    for sql, expected in FILTERS.items():
        want = source.filter(expected(source))  # nulls are dropped, as in SQL
        got = read_all(client, "q", filter=sql)
        assert got.num_rows == want.num_rows, sql
        assert got.equals(want), sql
    # The two extremes.
    assert read_all(client, "q", filter="id < 0").num_rows == 0
    assert read_all(client, "q", filter="id >= 0").equals(source)
    # A hash split's two sides are complementary.
    train = read_all(client, "q", filter="hash_bucket(id) < 90")
    held = read_all(client, "q", filter="hash_bucket(id) >= 90")
    assert sorted(train["id"].to_pylist() + held["id"].to_pylist()) == list(range(ROWS))
    assert 0.85 < train.num_rows / ROWS < 0.95


def test_select_derives_columns_as_pyarrow_computes_them(server):
    client = flightdeck.connect(server.uri)
    source = write(client, "d")
    select = [
        "id",
        "CAST(price AS DOUBLE) / 100 AS price_eur",
        "upper(country) AS c",
        "label + 1 AS l1",
        "array_length(tags) AS n_tags",
        "date_part('hour', ts) AS hour",
        "coalesce(country, 'none') AS country_or_none",
    ]
    got = read_all(client, "d", select=select, filter="label IS NOT NULL")
    src = source.filter(pc.is_valid(source["label"]))
    assert got.column_names == ["id", "price_eur", "c", "l1", "n_tags", "hour", "country_or_none"]
    assert got["country_or_none"].to_pylist() == pc.coalesce(src["country"], "none").to_pylist()
    assert got["id"].to_pylist() == src["id"].to_pylist()
    want_price = pc.divide(pc.cast(src["price"], pa.float64()), 100.0).to_pylist()
    assert got["price_eur"].to_pylist() == pytest.approx(want_price, nan_ok=True) or all(
        (a is None and b is None) or abs(a - b) < 1e-9
        for a, b in zip(got["price_eur"].to_pylist(), want_price)
    )
    assert got["c"].to_pylist() == pc.utf8_upper(src["country"]).to_pylist()
    assert got["l1"].to_pylist() == [v + 1 for v in src["label"].to_pylist()]
    assert got["n_tags"].to_pylist() == pc.list_value_length(src["tags"]).to_pylist()
    assert got["hour"].to_pylist() == [
        None if t is None else t.hour for t in src["ts"].to_pylist()
    ]
    # The plan's schema is the derived one.
    plan = client.plan("d", select=select)
    assert plan.schema.names == got.column_names


def shards(client, name, **plan):
    p = client.plan(name, **plan)
    out = [client.read_table(s)["id"].to_pylist() for s in p.shards]
    assert [len(o) for o in out] == [s.rows for s in p.shards]
    return out


@pytest.mark.parametrize("shuffle", ["none", "global", "block"])
def test_shards_over_a_selection_are_those_of_the_selected_rows(server, shuffle):
    client = flightdeck.connect(server.uri)
    source = write(client, "s")
    sql = "label >= 0 AND hash_bucket(id) < 60"
    want = source.filter(
        pc.and_(
            pc.greater_equal(source["label"], 0),
            pa.array([hash_bucket(i) < 60 for i in source["id"].to_pylist()]),
        )
    )
    # The reference: a dataset holding only the selected rows, in storage order.
    client.put_partition("s_ref", 0, want)
    client.seal("s_ref", partitions=1)
    n = want.num_rows
    ids = set(want["id"].to_pylist())
    for w in (1, 3, 8):
        for epoch in (0, 1):
            common = dict(world_size=w, epoch=epoch, seed=7, shuffle=shuffle, block_rows=64, batch_rows=100)
            got = shards(client, "s", filter=sql, **common)
            assert got == shards(client, "s_ref", **common), (w, epoch)
            # Balanced and complete (the tail wrapped), or disjoint with drop_last.
            assert {len(s) for s in got} == {-(-n // w)}
            assert set(sum(got, [])) == ids
            dropped = shards(client, "s", filter=sql, drop_last=True, **common)
            flat = sum(dropped, [])
            assert {len(s) for s in dropped} == {n // w}
            assert len(set(flat)) == len(flat) and set(flat) <= ids
    # Resume at another world size: 3 ranks took 5 steps of 10, 8 ranks go on.
    whole = strided_order(shards(client, "s", filter=sql, world_size=1, seed=3, shuffle=shuffle, block_rows=64))
    start = 3 * 5 * 10
    rest = shards(
        client, "s", filter=sql, world_size=8, seed=3, shuffle=shuffle, block_rows=64,
        start_sample=start, drop_last=True,
    )
    assert strided_order(rest) == whole[start : start + 8 * ((n - start) // 8)]


BAD = [
    ("label >>> 3", "label >>> 3"),
    ("nope > 1", "nope"),
    ("label + 1", "not boolean"),
    ("country + 1 > 2", "country + 1"),
    ("hash_bucket(score) < 3", "hash_bucket"),
    ("", None),  # no filter: fine
]


def test_bad_expressions_are_invalid_argument_and_the_server_keeps_serving(server):
    client = flightdeck.connect(server.uri)
    write(client, "bad")
    for sql, words in BAD:
        if words is None:
            assert client.plan("bad", filter=sql).total_rows == ROWS
            continue
        with pytest.raises(flightdeck.InvalidArgument) as e:
            client.plan("bad", filter=sql)
        assert words in str(e.value), (sql, str(e.value))
        assert sql in str(e.value)
    for select, words in [
        (["id", "nope * 2 AS x"], "nope"),
        (["id + 'a' AS x"], "id + 'a'"),
        (["id", "id"], "twice"),
        (["id AS"], "id AS"),
    ]:
        with pytest.raises(flightdeck.InvalidArgument, match=re.escape(words)):
            client.plan("bad", select=select)
    with pytest.raises(flightdeck.InvalidArgument, match="both columns and a select list"):
        client.plan("bad", select=["id"], columns=["id"])
    # Still serving, the same dataset.
    assert read_all(client, "bad", filter="id < 10").num_rows == 10


def test_a_filter_over_a_cluster_dataset_reads_as_one_server_would(members, server):
    single = flightdeck.connect(server.uri)
    sizes = [400, 300, 0, 500, 200, 600]
    start, layout, parts = 0, {}, []
    for p, n in enumerate(sizes):
        t = table(range(start, start + n))
        m = members[p % 3]
        ack = flightdeck.connect(m.uri).put_partition("c", p, t)
        layout.setdefault(ack.location, {})[p] = 0
        single.put_partition("c", p, t)
        parts.append(t)
        start += n
    flightdeck.connect(members[1].uri).seal_cluster("c", layout, partitions=len(sizes))
    single.seal("c", partitions=len(sizes))
    source = pa.concat_tables(parts)
    sql = "label >= 0 AND country <> 'FR'"
    want = source.filter(pc.and_(pc.greater_equal(source["label"], 0), pc.not_equal(source["country"], "FR")))
    n = want.num_rows
    select = ["id", "CAST(price AS DOUBLE) AS p"]
    for w in (1, 3, 8):
        common = dict(world_size=w, seed=5, shuffle="global", batch_rows=50, filter=sql)
        cluster = flightdeck.connect(members[0].uri)
        got = shards(cluster, "c", **common)
        assert got == shards(single, "c", **common), w
        assert set(sum(got, [])) == set(want["id"].to_pylist())
        # Derived columns come through members' reads too.
        plan = cluster.plan("c", select=select, **common)
        for s in plan.shards:
            t = cluster.read_table(s)
            assert t.column_names == ["id", "p"]
            assert t.num_rows == s.rows
        # NODE: each node's ranks read equal shares of the selection.
        node = shards(cluster, "c", locality="node", drop_last=True, **common)
        flat = sum(node, [])
        assert {len(s) for s in node} == {n // w}
        assert len(set(flat)) == len(flat) and set(flat) <= set(want["id"].to_pylist())
    # A filter no member can evaluate is refused before any ticket.
    with pytest.raises(flightdeck.InvalidArgument, match="nope"):
        flightdeck.connect(members[2].uri).plan("c", filter="nope = 1")


def test_a_sharded_dataset_over_a_filter_resumes_at_another_world_size(server):
    from flightdeck import ShardedDataset

    client = flightdeck.connect(server.uri)
    source = write(client, "sd")
    sql = "hash_bucket(id) < 70"
    selected = {i for i in source["id"].to_pylist() if hash_bucket(i) < 70}
    n = len(selected)

    def ranks(w):
        return [
            ShardedDataset(server.uri, "sd", rank=r, world_size=w, batch_rows=50, seed=2, filter=sql)
            for r in range(w)
        ]

    first = ranks(4)
    seen = set()
    for ds in first:
        it = iter(ds)
        for _ in range(3):
            seen.update(next(it).column("id").to_pylist())
    state = first[0].state_dict()
    assert state["start_sample"] == 3 * 50 * 4
    resumed = ranks(3)
    for ds in resumed:
        ds.load_state_dict(state)
    after = [[i for b in ds for i in b.column("id").to_pylist()] for ds in resumed]
    remaining = n - state["start_sample"]
    rest = strided_order(after, remaining)  # the wrapped tail left out
    assert len(set(rest)) == remaining
    assert set(rest).isdisjoint(seen) and set(rest) | seen == selected


def test_client_sql_answers_as_pyarrow_over_one_server_and_a_cluster(members, server):
    single = flightdeck.connect(server.uri)
    source = write(single, "Events")
    # The same rows as a cluster dataset, one partition on each member.
    start, layout = 0, {}
    for p, n in enumerate(SIZES):
        ack = flightdeck.connect(members[p % 3].uri).put_partition("spread", p, table(range(start, start + n)))
        layout.setdefault(ack.location, {})[p] = 0
        start += n
    flightdeck.connect(members[0].uri).seal_cluster("spread", layout, partitions=len(SIZES))

    by_label = source.group_by("label").aggregate([([], "count_all")]).to_pydict()
    want = dict(zip(by_label["label"], by_label["count_all"]))
    for client, name in [(single, '"Events"'), (flightdeck.connect(members[2].uri), "spread")]:
        got = client.sql(f"SELECT label, count(*) AS n FROM {name} GROUP BY label")
        assert dict(zip(got["label"].to_pylist(), got["n"].to_pylist())) == want, name
        got = client.sql(f"SELECT id, price FROM {name} WHERE country = 'DE' ORDER BY id")
        rows = source.filter(pc.equal(source["country"], "DE"))
        assert got.column_names == ["id", "price"]
        assert got["id"].to_pylist() == rows["id"].to_pylist()
        assert got["price"].to_pylist() == rows["price"].to_pylist()
        # No rows: the result's schema still.
        empty = client.sql(f"SELECT id, ts FROM {name} WHERE id < 0")
        assert empty.num_rows == 0 and empty.schema == pa.schema([("id", pa.int64()), ("ts", source.schema.field("ts").type)])

    # Names the caller got wrong are told apart, and the server keeps serving.
    with pytest.raises(flightdeck.InvalidArgument, match=re.escape('write "Events"')):
        single.sql("SELECT * FROM events")
    with pytest.raises(flightdeck.InvalidArgument, match=re.escape("the tables (the sealed datasets) are: Events")):
        single.sql("SELECT * FROM nope")
    with pytest.raises(flightdeck.InvalidArgument, match="read-only"):
        single.sql('DELETE FROM "Events"')
    assert single.sql('SELECT count(*) AS n FROM "Events"')["n"].to_pylist() == [ROWS]
