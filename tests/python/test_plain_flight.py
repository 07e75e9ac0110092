"""A client with nothing but `pyarrow.flight` and `protos/flightdeck.proto`
can write, seal, plan and read a dataset, and gets the documented errors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from conftest import eventually, strided_order, scaled

SIZES = [300, 0, 1, 250, 777, 64]


def partition_table(ids: range, attempt: int) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(list(ids), pa.int64()),
            "attempt": pa.array([attempt] * len(ids), pa.uint32()),
            "x": pa.array([i * 0.25 + attempt for i in ids], pa.float32()),
            "name": pa.array([None if i % 5 == 0 else f"r{i}" for i in ids], pa.string()),
            "vec": pa.array([[float(i), float(-i)] for i in ids], pa.list_(pa.float32(), 2)),
        }
    )


# How pyarrow names each gRPC code in its error text ("gRPC returned <name>
# error" or "... debug context: <CODE>:"), whatever exception class it maps to.
GRPC_NAMES = {
    "INVALID_ARGUMENT": "invalid argument",
    "NOT_FOUND": "not found",
    "ALREADY_EXISTS": "already exists",
    "FAILED_PRECONDITION": "precondition failed",
    "RESOURCE_EXHAUSTED": "resource exhausted",
    "ABORTED": "aborted",
}


@contextmanager
def grpc_error(code: str, match: str):
    """Expects a server error with gRPC status `code` whose text matches."""
    with pytest.raises(pa.ArrowException, match=match) as info:
        yield
    text = str(info.value)
    assert f"context: {code}:" in text or f"returned {GRPC_NAMES[code]} error" in text, text


def layout() -> list[range]:
    out, start = [], 0
    for n in SIZES:
        out.append(range(start, start + n))
        start += n
    return out


def put(client, pb, dataset, partition, attempt, table):
    cmd = pb.PutPartition(dataset=dataset, partition=partition, attempt=attempt)
    descriptor = flight.FlightDescriptor.for_command(cmd.SerializeToString())
    writer, reader = client.do_put(descriptor, table.schema)
    # Small batches so a partition spans several messages.
    writer.write_table(table, max_chunksize=100)
    writer.done_writing()
    meta = reader.read()
    writer.close()
    ack = pb.PutAck()
    ack.ParseFromString(meta.to_pybytes())
    return ack


def action(client, pb, kind, message, reply_type):
    body = message.SerializeToString() if message is not None else b""
    results = list(client.do_action(flight.Action(kind, body)))
    assert len(results) == 1
    reply = reply_type()
    reply.ParseFromString(results[0].body.to_pybytes())
    return reply


def read_plan(client, pb, **fields):
    plan = pb.ReadPlan(**fields)
    info = client.get_flight_info(flight.FlightDescriptor.for_command(plan.SerializeToString()))
    shards = []
    for endpoint in info.endpoints:
        meta = pb.ShardInfo()
        meta.ParseFromString(endpoint.app_metadata)
        table = client.do_get(endpoint.ticket).read_all()
        assert table.num_rows == meta.rows
        shards.append((meta.rank, table))
    return info, shards


def test_write_seal_plan_read(flightdeck_server, pb):
    client = flight.connect(flightdeck_server.uri)
    parts = layout()
    for p, ids in enumerate(parts):
        ack = put(client, pb, "py", p, 0, partition_table(ids, 0))
        assert (ack.partition, ack.attempt, ack.rows) == (p, 0, len(ids))
    # A retried attempt of partition 3; the seal names it the winner.
    put(client, pb, "py", 3, 1, partition_table(parts[3], 1))

    info = action(
        client,
        pb,
        "seal",
        pb.SealDataset(
            dataset="py",
            partitions=len(SIZES),
            attempts=[pb.PartitionAttempt(partition=3, attempt=1)],
        ),
        pb.DatasetInfo,
    )
    assert info.state == pb.DATASET_STATE_SEALED
    assert info.rows == sum(SIZES)
    schema = pa.ipc.read_schema(pa.py_buffer(info.schema))
    assert schema == partition_table(range(1), 0).schema

    expected = pa.concat_tables(
        [partition_table(ids, 1 if p == 3 else 0) for p, ids in enumerate(parts)]
    ).sort_by("id")
    n = sum(SIZES)
    for world_size in (1, 3):
        for shuffle in (pb.SHUFFLE_NONE, pb.SHUFFLE_GLOBAL, pb.SHUFFLE_BLOCK):
            info, shards = read_plan(
                client,
                pb,
                dataset="py",
                world_size=world_size,
                epoch=2,
                seed=5,
                shuffle=shuffle,
                batch_rows=128,
                block_rows=16,
            )
            assert [rank for rank, _ in shards] == list(range(world_size))
            per_rank = -(-n // world_size)
            assert all(t.num_rows == per_rank for _, t in shards)
            assert info.total_records == per_rank * world_size
            columns = [t.column("id").to_pylist() for _, t in shards]
            order = strided_order(columns)
            assert sorted(order[:n]) == list(range(n))
            assert order[n:] == order[: len(order) - n]
            everything = pa.concat_tables([t for _, t in shards])
            unique = everything.group_by("id").aggregate([]).num_rows
            assert unique == n
            # Every column's values intact.
            first_n = pa.concat_tables([t for _, t in shards]).sort_by("id")
            deduped = first_n.take(
                pa.array([i for i, v in enumerate(first_n.column("id").to_pylist())
                          if i == 0 or first_n.column("id")[i - 1].as_py() != v])
            )
            assert deduped.equals(expected)

    # Determinism: the same ticket gives the same data.
    info, _ = read_plan(client, pb, dataset="py", world_size=3, shuffle=pb.SHUFFLE_GLOBAL, seed=8)
    ticket = info.endpoints[1].ticket
    assert client.do_get(ticket).read_all().equals(client.do_get(ticket).read_all())

    # Projection and the path descriptor for plain readers.
    info, shards = read_plan(client, pb, dataset="py", world_size=2, columns=["name", "id"])
    assert shards[0][1].schema.names == ["name", "id"]
    path_info = client.get_flight_info(flight.FlightDescriptor.for_path("py"))
    whole = client.do_get(path_info.endpoints[0].ticket).read_all()
    assert whole.equals(expected)
    stats = action(client, pb, "stats", None, pb.ServerStats)
    assert stats.datasets == 1 and stats.rows == n and 0 < stats.memory_used <= stats.memory_limit


def test_errors_keep_their_codes(flightdeck_server, pb):
    client = flight.connect(flightdeck_server.uri)
    put(client, pb, "e", 0, 0, partition_table(range(10), 0))

    other = pa.table({"id": pa.array([1.0])})
    with grpc_error("INVALID_ARGUMENT", "does not match dataset 'e'"):
        put(client, pb, "e", 1, 0, other)
    with grpc_error("ALREADY_EXISTS", "already committed"):
        put(client, pb, "e", 0, 0, partition_table(range(10), 0))
    with grpc_error("FAILED_PRECONDITION", "not sealed"):
        read_plan(client, pb, dataset="e", world_size=1)
    with grpc_error("FAILED_PRECONDITION", r"partitions \[1, 2\] have no committed attempt"):
        action(client, pb, "seal", pb.SealDataset(dataset="e", partitions=3), pb.DatasetInfo)
    with grpc_error("NOT_FOUND", "'missing' does not exist"):
        action(client, pb, "describe", pb.DescribeDataset(dataset="missing"), pb.DatasetInfo)
    action(client, pb, "seal", pb.SealDataset(dataset="e", partitions=1), pb.DatasetInfo)
    with grpc_error("INVALID_ARGUMENT", "world_size"):
        read_plan(client, pb, dataset="e", world_size=0)
    with grpc_error("INVALID_ARGUMENT", "no column 'nope'"):
        read_plan(client, pb, dataset="e", world_size=1, columns=["nope"])
    with grpc_error("INVALID_ARGUMENT", "ticket"):
        client.do_get(flight.Ticket(b"\xff\xfe")).read_all()
    with grpc_error("FAILED_PRECONDITION", "is sealed"):
        put(client, pb, "e", 5, 0, partition_table(range(3), 0))

    # explicit_commit: pyarrow ends a stream cleanly even when the writer
    # stopped early; without the matching commit marker nothing is stored.
    cmd = pb.PutPartition(dataset="x", partition=0, attempt=0, explicit_commit=True)
    table = partition_table(range(300), 0)
    descriptor = flight.FlightDescriptor.for_command(cmd.SerializeToString())
    writer, reader = client.do_put(descriptor, table.schema)
    writer.write_table(table.slice(0, 100))  # ... and then the task failed
    with grpc_error("ABORTED", "without its commit marker"):
        writer.close()
    writer, reader = client.do_put(descriptor, table.schema)
    writer.write_table(table)
    writer.write_metadata(pb.PutCommit(rows=300).SerializeToString())
    writer.done_writing()
    ack = pb.PutAck()
    ack.ParseFromString(reader.read().to_pybytes())
    writer.close()
    assert ack.rows == 300

    # Still serving.
    _, shards = read_plan(client, pb, dataset="e", world_size=1)
    assert shards[0][1].column("id").to_pylist() == list(range(10))


def test_memory_limit_is_resource_exhausted(pb):
    from conftest import RunningServer

    server = RunningServer("--memory-limit", "64KiB")
    try:
        client = flight.connect(server.uri)
        with grpc_error("RESOURCE_EXHAUSTED", "memory budget"):
            put(client, pb, "big", 0, 0, partition_table(range(20_000), 0))
        stats = action(client, pb, "stats", None, pb.ServerStats)
        # Nothing of the refused attempt is live (idle slabs may be kept).
        assert stats.host_live_bytes == 0 and stats.memory_used <= stats.memory_limit
        put(client, pb, "small", 0, 0, partition_table(range(10), 0))
    finally:
        assert server.stop() == 0


WRITER_THAT_DIES = textwrap.dedent(
    """
    import os, sys
    import pyarrow as pa, pyarrow.flight as flight
    import flightdeck_pb2 as pb
    client = flight.connect(sys.argv[1])
    cmd = pb.PutPartition(dataset="dies", partition=0, attempt=0)
    table = pa.table({"id": pa.array(range(50_000), pa.int64())})
    writer, _ = client.do_put(flight.FlightDescriptor.for_command(cmd.SerializeToString()), table.schema)
    writer.write_table(table, max_chunksize=1000)
    print("sent", flush=True)
    sys.stdin.readline()  # wait until the test has seen the bytes staged
    os._exit(1)           # die mid-stream, like a killed executor
    """
)


def test_writer_killed_mid_stream_leaves_nothing(flightdeck_server, pb):
    client = flight.connect(flightdeck_server.uri)
    env = dict(os.environ, PYTHONPATH=str(Path(pb.__file__).parent))
    child = subprocess.Popen(
        [sys.executable, "-c", WRITER_THAT_DIES, flightdeck_server.uri],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout.readline().strip() == "sent"
        def live_bytes():
            return action(client, pb, "stats", None, pb.ServerStats).host_live_bytes

        eventually("the server staging the attempt", lambda: live_bytes() or None)
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(timeout=scaled(30)) == 1
    finally:
        child.kill()
    eventually("the broken attempt freed", lambda: True if live_bytes() == 0 else None)
    with grpc_error("NOT_FOUND", "'dies' does not exist"):
        action(client, pb, "describe", pb.DescribeDataset(dataset="dies"), pb.DatasetInfo)
