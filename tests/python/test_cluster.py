"""Many nodes, one dataset, from Python: three server processes on loopback
are written by real PySpark (`uris` routing, 12 partitions spread 6/4/2, a
task failing mid-partition on its first attempt), sealed as one dataset by
the driver, and read by ranks that follow each endpoint's location — with
this package, with nothing but `pyarrow.flight`, and (where torch is
installed) by a two-node × two-process `torch.distributed` job started the
way torchrun starts it, and by one whose second node's server holds none of
the dataset."""

from __future__ import annotations

import textwrap
from collections import Counter

import pyarrow as pa
import pyarrow.flight as flight
import pytest

import flightdeck
from conftest import RunningServer, require_torch, scaled, torchrun
from flightdeck import ShardedDataset
from flightdeck import _wire as wire

ROWS = 24_000


def routes(members):
    """Partition p goes to uris[p % 6]: 6 / 4 / 2 of 12 partitions."""
    a, b, c = (m.uri for m in members)
    return [a, a, a, b, b, c]


def write_with_spark(spark, members, dataset, writer):
    """Writes with `format(writer)`: "flightdeck" is the JVM connector (on
    the session's spark.jars), "flightdeck_py" the Python data source."""
    pytest.importorskip("pyspark")
    from flightdeck.spark import register
    from test_spark import fail_first_attempt

    if writer == "flightdeck_py":
        register(spark, writer)
    df = spark.range(ROWS, numPartitions=12).selectExpr(
        "id", "cast(id * 0.5 as float) as x", "array(cast(id as float), 1.0f) as vec"
    )
    key = "spark.sql.execution.arrow.maxRecordsPerBatch"
    before = spark.conf.get(key)
    # Several batches per partition, so the injected failure hits mid-partition.
    spark.conf.set(key, "500")
    try:
        (
            fail_first_attempt(df, partition=3)
            .write.format(writer)
            .option("uris", ",".join(routes(members)))
            .option("dataset", dataset)
            .mode("overwrite")
            .save()
        )
    finally:
        spark.conf.set(key, before)


def ids(batches):
    return [i for b in batches for i in b.column("id").to_pylist()]


@pytest.mark.parametrize("writer", ["flightdeck_py", "flightdeck"])
def test_spark_writes_one_dataset_across_three_members(members, spark, writer):
    write_with_spark(spark, members, "events", writer)
    per_member = Counter(routes(members)[p % 6] for p in range(12))
    for m in members:
        info = flightdeck.connect(m.uri).describe("events")
        assert info.state == 2 and info.rows == ROWS, "each member describes the whole dataset"
        layout = info.layout
        assert len(layout.members) == 3
        held = {x.location: [p.partition for p in x.partitions] for x in layout.members}
        assert {loc: len(ps) for loc, ps in held.items()} == {
            m2.uri: per_member[m2.uri] for m2 in members
        }
        named = sorted(p.partition for x in layout.members for p in x.partitions)
        assert named == list(range(12)), "each winner named once"
        attempts = {p.partition: p.attempt for x in layout.members for p in x.partitions}
        assert attempts[3] == 1, "the failed first attempt left nothing; the retry won"
        assert sum(x.rows for x in layout.members) == ROWS

    # Read back through any member by the connector that wrote: one Spark
    # partition per stored partition over the whole layout, every row once,
    # in the order, each partition served by the member holding it, so no
    # row crosses between members.
    order = ids(flightdeck.connect(members[0].uri).read_shard(
        flightdeck.connect(members[0].uri).plan("events").shards[0]))
    assert sorted(order) == list(range(ROWS))

    def fetched():
        return sum(flightdeck.connect(m.uri).stats().rows_fetched_from_peers for m in members)

    before = fetched()
    back = (spark.read.format(writer).option("uri", members[2].uri)
            .option("dataset", "events").load())
    assert back.rdd.getNumPartitions() == 12
    assert [r.id for r in back.select("id").collect()] == order
    assert fetched() == before
    if writer == "flightdeck":
        # The JVM connector asks Spark to run each task on its holder's host.
        scan = back._jdf.queryExecution().executedPlan().collectLeaves().head()
        rdd = scan.inputRDD()
        where = [rdd.preferredLocations(p).mkString(",") for p in rdd.partitions()]
        assert where == ["127.0.0.1"] * 12
    # Given the write's `uris` instead of a `uri`, the read goes through them.
    routed = (spark.read.format(writer).option("uris", ",".join(routes(members)))
              .option("dataset", "events").load())
    assert [r.id for r in routed.select("id").collect()] == order
    # A Spark filter pushed down to a cluster dataset: the members
    # select, the selected rows come in the same order, each stored
    # partition's selected rows served by its holder (none crossing).
    before = fetched()
    odd = back.where("id % 2 = 1 AND id >= 100")
    assert [r.id for r in odd.select("id").collect()] == [i for i in order if i % 2 and i >= 100]
    filtered = (spark.read.format(writer).option("uri", members[2].uri)
                .option("dataset", "events").option("filter", "id % 3 = 0").load())
    assert [r.id for r in filtered.select("id").collect()] == [i for i in order if i % 3 == 0]
    assert filtered.rdd.getNumPartitions() == 12
    assert fetched() == before

    # Four ranks, GLOBAL: equal counts, every row once, each from its member.
    client = flightdeck.connect(members[1].uri)
    plan = client.plan("events", world_size=4, shuffle="global", seed=3, batch_rows=1000)
    assert [s.location for s in plan.shards] == [
        loc for loc in sorted(m.uri for m in members) for _ in range(2)
    ][:4]
    shards = [ids(client.read_shard(s)) for s in plan.shards]
    assert [len(s) for s in shards] == [ROWS // 4] * 4
    assert sorted(sum(shards, [])) == list(range(ROWS))

    # NODE, 3 nodes x 2 ranks: equal counts, every row once, and exactly the
    # imbalance crosses nodes (12000/8000/4000 rows for 8000 per node).
    before = sum(flightdeck.connect(m.uri).stats().rows_fetched_from_peers for m in members)
    ranks = [
        ShardedDataset(
            members[0].uri, "events", rank=r, world_size=6, locality="node",
            ranks_per_node=2, batch_rows=1000, seed=5,
        )
        for r in range(6)
    ]
    epoch = [ids(ds) for ds in ranks]
    after = sum(flightdeck.connect(m.uri).stats().rows_fetched_from_peers for m in members)
    assert [len(e) for e in epoch] == [ROWS // 6] * 6
    assert sorted(sum(epoch, [])) == list(range(ROWS))
    assert after - before == 4_000

    # A NODE epoch resumes at the world size it started with, and only there.
    state = ranks[0].state_dict(batches=2)
    assert state == {"epoch": 0, "start_sample": 2 * 1000 * 6, "world_size": 6}
    again = ShardedDataset(
        members[0].uri, "events", rank=0, world_size=3, locality="node", ranks_per_node=1,
    )
    again.load_state_dict(state)
    with pytest.raises(flightdeck.FailedPrecondition, match="resumes only"):
        next(iter(again))


def write_spread(servers, dataset: str, partitions: int, rows: int, seal_at) -> None:
    """Writes partition p (ids p·rows to (p+1)·rows) to servers[p % n]
    with the package's own client, and seals them as one dataset at
    `seal_at`."""
    layout = {}
    for p in range(partitions):
        m = servers[p % len(servers)]
        table = pa.table({"id": pa.array(range(p * rows, (p + 1) * rows), pa.int64())})
        ack = flightdeck.connect(m.uri).put_partition(dataset, p, table)
        layout.setdefault(ack.location, {})[p] = 0
    flightdeck.connect(seal_at.uri).seal_cluster(dataset, layout, partitions=partitions)


def test_plain_pyarrow_reads_a_rank_by_following_the_endpoint(members, pb):
    # Written without Spark: the package's own client and cluster seal.
    write_spread(members, "plain", 6, 100, seal_at=members[2])

    cmd = pb.ReadPlan(dataset="plain", world_size=3, shuffle=pb.SHUFFLE_GLOBAL, seed=1)
    info = flight.FlightClient(members[0].uri).get_flight_info(
        flight.FlightDescriptor.for_command(cmd.SerializeToString())
    )
    seen = []
    for endpoint in info.endpoints:
        (location,) = endpoint.locations
        table = flight.FlightClient(location).do_get(endpoint.ticket).read_all()
        meta = pb.ShardInfo.FromString(endpoint.app_metadata)
        assert table.num_rows == meta.rows == 200
        seen += table.column("id").to_pylist()
    assert sorted(seen) == list(range(600))


def test_a_member_down_is_unavailable_naming_it(members):
    for p in range(3):
        table = pa.table({"id": pa.array(range(p * 10, (p + 1) * 10), pa.int64())})
        flightdeck.connect(members[p].uri).put_partition("down", p, table)
    layout = {m.uri: {p: 0} for p, m in enumerate(members)}
    flightdeck.connect(members[0].uri).seal_cluster("down", layout, partitions=3)
    members[2].proc.kill()
    members[2].proc.wait()
    with pytest.raises(flightdeck.Unavailable, match=members[2].addr):
        flightdeck.connect(members[0].uri).plan("down", world_size=2)


def test_a_reader_rides_out_a_restart_of_the_member_its_rows_come_from(tmp_path):
    """A rank reading through member 0 whose rows are partly member 1's:
    member 1 killed mid-read and started again with `--persist` on its
    address, the reader (`reconnect_seconds`) takes the read up where it
    stood and reads exactly the rows of an uninterrupted read, on a
    connection of its own: the client it was given stays the caller's."""
    import threading
    import time

    stores = [("--memory-limit", "256MiB", "--persist", "--spill-url", str(tmp_path / f"s{i}"))
              for i in range(2)]
    servers = [RunningServer(*store) for store in stores]
    try:
        write_spread(servers, "cut", 8, 100_000, seal_at=servers[0])

        def reader(at=None) -> ShardedDataset:
            return ShardedDataset(
                at or servers[0].uri, "cut", rank=0, world_size=2, batch_rows=1000, read_rows=1000,
                seed=3, prefetch=0, reconnect_seconds=scaled(30),
            )

        whole = [i for b in reader() for i in b.column("id").to_pylist()]
        assert len(whole) == 400_000
        given = flightdeck.connect(servers[0].uri)
        r, got = reader(given), []
        for n, batch in enumerate(r):
            got += batch.column("id").to_pylist()
            if n == 9:
                servers[1].proc.kill()
                servers[1].proc.wait()
                addr = servers[1].addr

                def later():
                    time.sleep(1)
                    servers[1] = RunningServer("--listen", addr, *stores[1])

                threading.Thread(target=later, daemon=True).start()
        assert r.reconnects == 1
        assert got == whole
        assert r.client is not given and given.describe("cut").rows == 800_000
    finally:
        for s in servers:
            assert s.stop() == 0, "".join(s.stderr_lines)


WORKER = textwrap.dedent(
    """
    import os, sys, json
    import torch.distributed as dist
    from torch.utils.data import DataLoader
    from flightdeck.torch import FlightDeckIterableDataset

    dist.init_process_group("gloo")
    data = FlightDeckIterableDataset("local", "ddp", batch_rows=100, shuffle="global", seed=1)
    steps, rows = 0, []
    for epoch in range(2):
        data.set_epoch(epoch)
        for batch in DataLoader(data, batch_size=None):
            steps += 1
            rows += batch["id"].tolist()
    dist.barrier()
    print(json.dumps({"rank": dist.get_rank(), "steps": steps, "rows": rows,
                      "nodes": data.shards.nodes, "sealed_as": data.shards.sealed_as}))
    dist.destroy_process_group()
    """
)


def test_torchrun_style_job_reads_equal_steps_from_its_node(members, tmp_path):
    require_torch()
    for p in range(4):
        m = members[p % 2]
        table = pa.table({"id": pa.array(range(p * 250, (p + 1) * 250), pa.int64())})
        flightdeck.connect(m.uri).put_partition("ddp", p, table)
    layout = {}
    for p in range(4):
        layout.setdefault(members[p % 2].uri, {})[p] = 0
    flightdeck.connect(members[0].uri).seal_cluster("ddp", layout, partitions=4)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    results = torchrun(script, [members[0].uri, members[1].uri], ranks_per_node=2)
    assert len({r["steps"] for r in results}) == 1, "equal steps on every rank"
    assert all(r["nodes"] == [members[0].uri, members[1].uri] for r in results)
    seal = flightdeck.sealed_as(flightdeck.connect(members[1].uri).describe("ddp"))
    assert [r["sealed_as"] for r in results] == [seal] * 4
    epoch_rows = [r["rows"][: len(r["rows"]) // 2] for r in results]
    assert sorted(sum(epoch_rows, [])) == list(range(1000))


@pytest.mark.parametrize("sealed", ["across members", "on one server"])
def test_a_node_whose_server_holds_none_of_a_dataset_reads_it_from_another(
    members, tmp_path, sealed
):
    """A small dataset Spark wrote from one node's executors only: the
    ranks of the node whose server holds none of it read through the
    server that does (they used to fail building the reader)."""
    require_torch()
    a, b = members[0], members[1]
    for p in range(2):
        table = pa.table({"id": pa.array(range(p * 250, (p + 1) * 250), pa.int64())})
        flightdeck.connect(a.uri).put_partition("ddp", p, table)
    if sealed == "across members":
        flightdeck.connect(a.uri).seal_cluster("ddp", {a.uri: {0: 0, 1: 0}}, partitions=2)
    else:
        flightdeck.connect(a.uri).seal("ddp", partitions=2)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    results = torchrun(script, [a.uri, b.uri], ranks_per_node=1)
    assert [r["steps"] for r in results] == [6, 6]
    epoch_rows = [r["rows"][: len(r["rows"]) // 2] for r in results]
    assert sorted(sum(epoch_rows, [])) == list(range(500))
    expected_nodes = [a.uri, ""] if sealed == "across members" else []
    assert all(r["nodes"] == expected_nodes for r in results)

    # On no server of the job: every rank says so (none waits for the others).
    script.write_text(WORKER.replace('"ddp"', '"nowhere"'))
    with pytest.raises(AssertionError, match="dataset 'nowhere' is on none of this job's"):
        torchrun(script, [a.uri, b.uri], ranks_per_node=1)


def test_members_with_different_schemas_refuse_the_seal_and_stay_open(members):
    ints = pa.table({"id": pa.array([1, 2], pa.int64())})
    strings = pa.table({"id": pa.array(["a", "b"], pa.string())})
    flightdeck.connect(members[0].uri).put_partition("mixed", 0, ints)
    flightdeck.connect(members[1].uri).put_partition("mixed", 1, strings)
    layout = {members[0].uri: {0: 0}, members[1].uri: {1: 0}}
    with pytest.raises(flightdeck.FailedPrecondition, match="different schemas"):
        flightdeck.connect(members[2].uri).seal_cluster("mixed", layout, partitions=2)
    # Compared before any member sealed its part: both are still open, and
    # the member with the odd schema can drop and write again.
    for m in members[:2]:
        info = flightdeck.connect(m.uri).describe("mixed")
        assert info.state == wire.DATASET_STATE_OPEN, info
    flightdeck.connect(members[1].uri).drop("mixed")
    flightdeck.connect(members[1].uri).put_partition("mixed", 1, ints)
    info = flightdeck.connect(members[2].uri).seal_cluster("mixed", layout, partitions=2)
    assert info.rows == 4


def test_a_seal_taking_partitions_of_two_writes_is_refused_and_nothing_sealed(members):
    """A member's part dropped while job a wrote, and written by job b: a's
    seal would take partition 0 of a and partition 1 of b, so it is refused
    before any member seals; with b's part gone and a's written again, the
    same seal goes through."""
    a, b = (flightdeck.connect(m.uri) for m in members[:2])

    def part(p, job):
        return pa.table({"id": pa.array([2 * p, 2 * p + 1], pa.int64()),
                         "job": pa.array([job] * 2, pa.string())})

    a.put_partition("two", 0, part(0, "a"), write_id="job-a")
    b.put_partition("two", 1, part(1, "a"), write_id="job-a")
    b.drop("two")  # an operator drops b's part; job b writes it meanwhile
    b.put_partition("two", 1, part(1, "b"), write_id="job-b")
    layout = {members[0].uri: {0: 0}, members[1].uri: {1: 0}}
    with pytest.raises(flightdeck.FailedPrecondition,
                       match=r"cannot seal dataset 'two': member \S+ holds attempts of write "
                             r"'job-[ab]' and member \S+ of write 'job-[ab]'.*nothing was sealed"):
        flightdeck.connect(members[2].uri).seal_cluster("two", layout, partitions=2)
    for c in (a, b):
        assert c.describe("two").state == wire.DATASET_STATE_OPEN
    b.drop("two", abort_write="job-b")
    b.put_partition("two", 1, part(1, "a"), write_id="job-a")
    assert a.seal_cluster("two", layout, partitions=2).rows == 4
    shard = a.plan("two").shards[0]
    assert set(a.read_table(shard).column("job").to_pylist()) == {"a"}


@pytest.mark.parametrize("writer", ["flightdeck_py", "flightdeck"])
def test_a_member_whose_cluster_seal_did_not_finish_says_so(members, spark, writer):
    """A coordinator prepared one member's part, then died: that member
    describes the dataset as `sealing` (its own rows), reads and appends
    through either connector say the seal did not finish there and what to
    do, and the seal sent again finishes it."""
    import subprocess

    from conftest import server_binary
    from flightdeck.spark import register

    register(spark, "flightdeck_py")
    a, b = (flightdeck.connect(m.uri) for m in members[:2])
    name = f"cut_{writer}"
    a.put_partition(name, 0, pa.table({"id": pa.array([0, 1], pa.int64())}), write_id="w1")
    b.put_partition(name, 1, pa.table({"id": pa.array([2, 3], pa.int64())}), write_id="w1")
    a._action(
        "member_prepare",
        wire.PrepareMember(dataset=name, partitions=[wire.PartitionAttempt(partition=0)]),
        wire.MemberPrepared,
    )
    info = a.describe(name)
    assert (info.state, info.rows) == (wire.DATASET_STATE_SEALING, 2)
    assert "sealing (its seal across members did not finish here)" in str(info)
    with pytest.raises(flightdeck.FailedPrecondition, match="being sealed across members"):
        a.plan(name)
    shown = subprocess.run(
        [str(server_binary()), "describe", name, "--server", a.uri],
        capture_output=True, text=True, timeout=60,
    )
    assert "sealing (generation" in shown.stdout, shown
    assert "the seal across members did not finish here" in shown.stdout, shown
    unfinished = (
        rf"dataset '{name}' on {a.uri} is being sealed across servers and its seal did not "
        r"finish there .*write it again with mode\(.overwrite.\), or drop it: flightdeck drop "
        rf"{name} --server {a.uri}"
    )
    with pytest.raises(Exception, match=unfinished):
        spark.read.format(writer).option("uri", a.uri).option("dataset", name).load().collect()
    with pytest.raises(Exception, match=f"cannot append to dataset '{name}': " + unfinished):
        (spark.range(3).write.format(writer).option("uri", a.uri).option("dataset", name)
         .mode("append").save())
    layout = {members[0].uri: {0: 0}, members[1].uri: {1: 0}}
    assert flightdeck.connect(members[2].uri).seal_cluster(name, layout, partitions=2).rows == 4
    assert a.describe(name).state == wire.DATASET_STATE_SEALED


def test_an_overwrite_across_members_swaps_at_its_seal_and_drops_parts_left_out(members):
    a, b, c = (flightdeck.connect(m.uri) for m in members)
    old = pa.table({"id": pa.array(range(90), pa.int64())})
    locations = [cl.put_partition("swapped", i, old.slice(30 * i, 30)).location
                 for i, cl in enumerate((a, b, c))]
    a.seal_cluster("swapped", {loc: {i: 0} for i, loc in enumerate(locations)}, partitions=3)
    before = a.plan("swapped")
    old_order = ids(a.read_shard(before.shards[0]))

    # The replacement goes to two of the three members; until its seal,
    # every member serves the old dataset.
    new = pa.table({"id": pa.array(range(1000, 1040), pa.int64())})
    layout = {
        a.put_partition("swapped", 0, new.slice(0, 20), write_id="w", replace=True).location:
            {0: 0},
        b.put_partition("swapped", 1, new.slice(20), write_id="w", replace=True).location: {1: 0},
    }
    assert ids(c.read_shard(before.shards[0])) == old_order
    info = c.seal_cluster("swapped", layout, partitions=2, replace_write="w")
    assert (info.rows, len(info.layout.members)) == (40, 2)
    # Sent again (as after a lost reply), the seal changes nothing.
    again = a.seal_cluster("swapped", layout, partitions=2, replace_write="w")
    assert again.layout.id == info.layout.id
    # A write that staged nothing is refused, though the dataset there has
    # the very partitions and attempts it names.
    with pytest.raises(flightdeck.FailedPrecondition, match="write 'w3' staged nothing"):
        a.seal_cluster("swapped", layout, partitions=2, replace_write="w3")
    assert sorted(ids(b.read_shard(b.plan("swapped").shards[0]))) == list(range(1000, 1040))
    # A read planned on the old layout is refused: "written again" where
    # its serving member holds the new layout, not found where that member
    # was left out of it.
    with pytest.raises((flightdeck.FailedPrecondition, flightdeck.NotFound)):
        a.read_table(before.shards[0])
    # The member the new layout leaves out dropped its part of the old one.
    assert c.list_datasets() == []
    assert "replaced dataset dataset=swapped rows=30" in "".join(members[0].stderr_lines)

    # A replacement that fails is dropped where it was staged; the dataset
    # stays as the last seal left it.
    current = a.plan("swapped")
    for cl in (a, c):
        cl.put_partition("swapped", 0, new, write_id="w2", replace=True)
        cl.drop("swapped", abort_write="w2", staged=True)
    assert sorted(ids(a.read_shard(current.shards[0]))) == list(range(1000, 1040))
    assert c.list_datasets() == [] and c.stats().rows == 0


def test_a_rank_on_the_unix_socket_reads_its_own_member_there(tmp_path):
    """A member started with `--unix-socket`: a client connected through the
    socket (`grpc+unix://`, as `FLIGHTDECK_URI` may name it) writes, plans
    and reads; the shards its own member serves stay on the socket (no
    second connection to that member's network location), the other
    member's come over TCP, and every stream equals the TCP one."""
    sock = tmp_path / "fd.sock"
    near = RunningServer("--memory-limit", "256MiB", "--unix-socket", str(sock))
    far = RunningServer("--memory-limit", "256MiB")
    try:
        local = flightdeck.connect(f"grpc+unix://{sock}")
        assert local.location == near.uri
        layout = {}
        for p in range(4):
            table = pa.table({"id": pa.array(range(p * 100, (p + 1) * 100), pa.int64())})
            writer = local if p % 2 == 0 else flightdeck.connect(far.uri)
            ack = writer.put_partition("uds", p, table)
            layout.setdefault(ack.location, {})[p] = 0
        assert set(layout) == {near.uri, far.uri}, "acks name network locations"
        local.seal_cluster("uds", layout, partitions=4)
        tcp = flightdeck.connect(near.uri)
        for locality in ("global", "node"):
            args = dict(world_size=2, seed=5, locality=locality, ranks_per_node=1)
            plan = local.plan("uds", **args)
            assert sorted(s.location for s in plan.shards) == sorted([near.uri, far.uri])
            streams = [ids(local.read_shard(s)) for s in plan.shards]
            assert streams == [ids(tcp.read_shard(s)) for s in tcp.plan("uds", **args).shards]
            assert sorted(streams[0] + streams[1]) == list(range(400))
            assert list(local._members) == [far.uri], "its own shard stayed on the socket"
    finally:
        for server in (near, far):
            assert server.stop() == 0, "".join(server.stderr_lines)
    assert not sock.exists(), "the socket file goes with the server"


@pytest.mark.parametrize("writer", ["flightdeck_py", "flightdeck", "write_dataframe"])
def test_an_overwrite_leaves_no_older_copy_on_servers_it_wrote_nothing_to(members, spark, writer):
    """An overwrite routed to three servers whose rows all land on two: the
    third's older copy of the dataset (written there alone) goes at the
    seal, so readers there find no dataset rather than the rows the
    overwrite replaced; a server named twice (another spelling of a member)
    keeps the member's part of the new dataset."""
    pytest.importorskip("pyspark")
    from flightdeck.spark import register, write_dataframe

    if writer == "flightdeck_py":
        register(spark, writer)
    a, b, c = (flightdeck.connect(m.uri) for m in members)
    c.put_partition("moved", 0, pa.table({"id": pa.array(range(10), pa.int64())}))
    c.seal("moved", partitions=1)
    also_a = members[0].uri.replace("grpc://", "grpc+tcp://")
    assert also_a != members[0].uri

    def overwrite(first, uris):
        df = spark.range(first, first + 40, numPartitions=2)
        if writer == "write_dataframe":
            write_dataframe(df, uris[0], "moved", uris=uris)
            return
        df.write.format(writer).option("uris", ",".join(uris)).option(
            "dataset", "moved"
        ).mode("overwrite").save()

    # Partition p goes to uris[p % 3]: the third gets none.
    overwrite(100, [members[0].uri, members[1].uri, members[2].uri])
    assert c.list_datasets() == [], "the older copy on the server left out is gone"
    info = a.describe("moved")
    assert (info.rows, len(info.layout.members)) == (40, 2)
    read = a.read_table(a.plan("moved").shards[0])
    assert sorted(read.column("id").to_pylist()) == list(range(100, 140))

    overwrite(200, [members[0].uri, members[1].uri, also_a])
    with flightdeck.connect(also_a) as again:
        read = again.read_table(again.plan("moved").shards[0])
        assert sorted(read.column("id").to_pylist()) == list(range(200, 240))
    assert a.describe("moved").rows == 40
