"""The Python package against a real server: round trips, errors with their
codes, sharded epochs with exact resume, and zero-copy tensors."""

from __future__ import annotations

import datetime as dt
import os
import select
import signal
import threading
import time

import numpy as np
import pyarrow as pa
import pytest
from pathlib import Path
from types import SimpleNamespace

import flightdeck
from conftest import RunningServer, eventually, scaled, server_name_cases, strided_order
from flightdeck import ShardedDataset, to_numpy
from flightdeck.client import Prefetched


def mixed_table(ids: range) -> pa.Table:
    base = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    return pa.table(
        {
            "id": pa.array(list(ids), pa.int64()),
            "i8": pa.array([i % 100 - 50 for i in ids], pa.int8()),
            "u32": pa.array([i * 3 for i in ids], pa.uint32()),
            "f32": pa.array([i / 3 for i in ids], pa.float32()),
            "f64": pa.array([None if i % 6 == 0 else i * 1.5 for i in ids], pa.float64()),
            "s": pa.array([None if i % 4 == 0 else "x" * (i % 9) for i in ids], pa.string()),
            "b": pa.array([None if i % 5 == 0 else i % 2 == 0 for i in ids], pa.bool_()),
            "ts": pa.array(
                [base + dt.timedelta(seconds=i) for i in ids], pa.timestamp("us", tz="UTC")
            ),
            "tags": pa.array(
                [None if i % 7 == 0 else list(range(i % 4)) for i in ids], pa.list_(pa.int32())
            ),
            "emb": pa.array([[i, -i, 0.5] for i in ids], pa.list_(pa.float32(), 3)),
            "feat": pa.array([[float(i)] * 4 for i in ids], pa.list_(pa.float32())),
        }
    )


def write(client, name, sizes, *, seal=True):
    start = 0
    for p, n in enumerate(sizes):
        ack = client.put_partition(name, p, mixed_table(range(start, start + n)))
        assert (ack.partition, ack.rows) == (p, n)
        start += n
    if seal:
        client.seal(name, partitions=len(sizes))
    return start


def test_round_trip_every_type(flightdeck_server):
    client = flightdeck.connect(flightdeck_server.uri)
    table = mixed_table(range(1000))
    # A Table, a RecordBatchReader and an iterable of batches.
    client.put_partition("rt", 0, table.slice(0, 300))
    reader = pa.RecordBatchReader.from_batches(table.schema, table.slice(300, 300).to_batches(50))
    client.put_partition("rt", 1, reader)
    client.put_partition("rt", 2, iter(table.slice(600).to_batches(77)))
    client.put_partition("rt", 3, iter([]), schema=table.schema)  # empty partition
    info = client.seal("rt", partitions=4)
    assert info.rows == 1000
    assert flightdeck.dataset_schema(info) == table.schema
    plan = client.plan("rt", world_size=1)
    got = client.read_table(plan.shards[0])
    assert got.equals(table)
    assert client.list_datasets() == ["rt"]
    assert client.stats().rows == 1000


def test_a_dataframe_is_written_and_anything_else_refused_naming_what_is_taken(
    flightdeck_server,
):
    # A pandas DataFrame went through iter() as its column names and failed
    # with an AttributeError; any other non-Arrow value likewise.
    import pandas as pd

    client = flightdeck.connect(flightdeck_server.uri)
    df = pd.DataFrame({"id": range(10), "x": np.arange(10) / 2})
    client.put_partition("frames", 0, df[df.id >= 4])  # an index of 4..9: left out

    class Exported:
        """A DataFrame of another library: it hands over an Arrow stream."""

        def __arrow_c_stream__(self, requested_schema=None):
            table = pa.table({"id": pa.array([20, 21]), "x": pa.array([0.0, 0.5])})
            return table.__arrow_c_stream__(requested_schema)

    client.put_partition("frames", 1, Exported())
    info = client.seal("frames", partitions=2)
    assert flightdeck.dataset_schema(info).names == ["id", "x"]
    got = client.read_table(client.plan("frames").shards[0])
    assert got.column("id").to_pylist() == [4, 5, 6, 7, 8, 9, 20, 21]
    assert got.column("x").to_pylist()[:2] == [2.0, 2.5]

    for bad, got in [({"id": [1]}, "dict"), ("abc", "str"), (5, "int"),
                     ([mixed_table(range(2))], "list of Table"), ([1, 2], "list of int")]:
        with pytest.raises(flightdeck.InvalidArgument, match=(
            "a partition's data is a pyarrow Table, RecordBatch or RecordBatchReader, an "
            rf"iterable of RecordBatches, or a DataFrame \(pandas, Polars\); got {got}$"
        )):
            client.put_partition("refused", 0, bad)
    assert client.list_datasets("refused") == []


def test_list_datasets_by_name_prefix(flightdeck_server):
    client = flightdeck.connect(flightdeck_server.uri)
    for name in ["train/a", "train/b", "eval/a"]:
        client.put_partition(name, 0, mixed_table(range(3)))
    client.seal("train/b", partitions=1)
    assert sorted(client.list_datasets()) == ["eval/a", "train/a", "train/b"]
    assert sorted(client.list_datasets("train/")) == ["train/a", "train/b"]
    assert client.list_datasets("eval") == ["eval/a"]
    assert client.list_datasets("test/") == []
    # Plain pyarrow.flight: the criteria is the prefix; bytes that are not
    # UTF-8 are refused with a message saying what the criteria is.
    plain = pa.flight.connect(flightdeck_server.uri)
    assert [i.descriptor.path for i in plain.list_flights(b"train/b")] == [[b"train/b"]]
    with pytest.raises(pa.ArrowInvalid, match="dataset name prefix in UTF-8"):
        list(plain.list_flights(b"\xff"))


def test_errors_keep_code_and_message(flightdeck_server):
    client = flightdeck.connect(flightdeck_server.uri)
    with pytest.raises(flightdeck.NotFound) as err:
        client.describe("missing")
    assert err.value.code == "NOT_FOUND" and "'missing' does not exist" in err.value.message
    assert isinstance(err.value, KeyError)

    client.put_partition("e", 0, mixed_table(range(5)))
    with pytest.raises(flightdeck.AlreadyExists, match="retry with a new attempt"):
        client.put_partition("e", 0, mixed_table(range(5)))
    with pytest.raises(flightdeck.InvalidArgument, match="does not match dataset 'e'"):
        client.put_partition("e", 1, pa.table({"id": [1.5]}))
    with pytest.raises(flightdeck.FailedPrecondition, match="not sealed"):
        client.plan("e")
    with pytest.raises(flightdeck.FailedPrecondition, match=r"\[1, 2\]"):
        client.seal("e", partitions=3)
    with pytest.raises(flightdeck.InvalidArgument, match="shuffle"):
        client.plan("e", shuffle="sideways")
    # A column named twice could be stored but never read by name.
    twice = pa.table([pa.array([1]), pa.array(["x"])], names=["id", "id"])
    with pytest.raises(flightdeck.InvalidArgument, match=r"names column 'id' twice \(fields 0 and 1\)"):
        client.put_partition("twice", 0, twice)
    with pytest.raises(flightdeck.NotFound):
        client.describe("twice")
    uri = flightdeck_server.uri
    with pytest.raises(flightdeck.InvalidArgument, match="world_size must be at least 1, not 0"):
        flightdeck.ShardedDataset(uri, "e", rank=0, world_size=0)
    with pytest.raises(flightdeck.InvalidArgument, match=r"rank 2 must be in \[0, world_size=2\)"):
        flightdeck.ShardedDataset(uri, "e", rank=2, world_size=2)

    # A writer whose data source fails half-way stores nothing.
    def failing():
        yield from mixed_table(range(100, 200)).to_batches(10)
        raise RuntimeError("the executor's iterator broke")

    with pytest.raises(RuntimeError, match="iterator broke"):
        client.put_partition("e", 1, failing(), schema=mixed_table(range(1)).schema)
    info = client.describe("e")
    assert (info.rows, info.committed_partitions) == (5, 1)
    assert client.stats().host_live_bytes == info.bytes

    with pytest.raises(flightdeck.Unavailable, match="127.0.0.1:1.*; is a flightdeck server "
                       "running there\\? Start one with `flightdeck serve`"):
        flightdeck.connect("127.0.0.1:1", timeout=5).stats()


def ids_of(batches) -> list[int]:
    return [i for b in batches for i in b.column("id").to_pylist()]


def test_sharded_epochs_balance_and_resume(flightdeck_server):
    client = flightdeck.connect(flightdeck_server.uri)
    n = write(client, "sh", [1000, 0, 2345, 1, 6000])
    ranks = [
        ShardedDataset(flightdeck_server.uri, "sh", rank=r, world_size=4, batch_rows=100, seed=3)
        for r in range(4)
    ]
    epoch0 = [ids_of(ds) for ds in ranks]
    per_rank = -(-n // 4)
    assert [len(x) for x in epoch0] == [per_rank] * 4
    assert [len(ds) for ds in ranks] == [-(-per_rank // 100)] * 4
    order = strided_order(epoch0)
    assert sorted(order[:n]) == list(range(n))
    for ds in ranks:
        ds.set_epoch(1)
    epoch1 = [ids_of(ds) for ds in ranks]
    assert epoch1 != epoch0
    order1 = strided_order(epoch1)
    assert sorted(order1[:n]) == list(range(n))

    # Stop every rank after 7 batches of epoch 1, resume with 2 ranks.
    seen = set()
    for ds in ranks:
        it = iter(ds)
        for _ in range(7):
            seen.update(next(it).column("id").to_pylist())
    state = ranks[0].state_dict()
    assert state == {"epoch": 1, "start_sample": 7 * 100 * 4, "world_size": 4}
    resumed = [
        ShardedDataset(flightdeck_server.uri, "sh", rank=r, world_size=2, batch_rows=100, seed=3)
        for r in range(2)
    ]
    for ds in resumed:
        ds.load_state_dict(state)
    after = [ids_of(ds) for ds in resumed]
    remaining = n - state["start_sample"]
    rest = strided_order(after, remaining)
    assert len(set(rest)) == remaining
    assert set(rest).isdisjoint(seen)
    assert set(rest) | seen == set(range(n))


def test_a_sharded_dataset_keeps_to_the_write_it_first_read(flightdeck_server):
    """Written again between epochs, a dataset is not read under the old
    write's epochs and positions: the next epoch refuses, naming what to do;
    a new reader (or one told `sealed_as=0`) reads the new write."""
    client = flightdeck.connect(flightdeck_server.uri)
    write(client, "again", [300])
    first = client.describe("again")
    ds = ShardedDataset(flightdeck_server.uri, "again", rank=0, world_size=2, batch_rows=50)
    any_seal = ShardedDataset(
        flightdeck_server.uri, "again", rank=0, world_size=2, batch_rows=50, sealed_as=0
    )
    assert ds.sealed_as is None
    assert len(ids_of(ds)) == len(ids_of(any_seal)) == 150
    assert ds.sealed_as == ds.pin() == flightdeck.sealed_as(first) != 0
    assert any_seal.sealed_as == 0

    client.drop("again")
    write(client, "again", [500])
    assert flightdeck.sealed_as(client.describe("again")) != ds.sealed_as
    ds.set_epoch(1)
    with pytest.raises(flightdeck.FailedPrecondition, match="build a new reader") as e:
        ids_of(ds)
    assert f"sealed_as {flightdeck.sealed_as(first)}" in str(e.value)
    # The same before a batch is read: `len` plans the epoch too.
    with pytest.raises(flightdeck.FailedPrecondition, match="sealed_as=0"):
        len(ds)
    any_seal.set_epoch(1)
    assert len(ids_of(any_seal)) == 250
    fresh = ShardedDataset(flightdeck_server.uri, "again", rank=0, world_size=2, batch_rows=50)
    assert len(ids_of(fresh)) == 250

    # A state that names the old write's seal resumes only on that write.
    resumed = ShardedDataset(flightdeck_server.uri, "again", rank=1, world_size=2, batch_rows=50)
    resumed.load_state_dict(
        {"epoch": 0, "start_sample": 100, "world_size": 2, "sealed_as": flightdeck.sealed_as(first)}
    )
    with pytest.raises(flightdeck.FailedPrecondition, match="written again"):
        ids_of(resumed)
    with pytest.raises(flightdeck.InvalidArgument, match="sealed_as"):
        ShardedDataset(flightdeck_server.uri, "again", rank=0, world_size=1, sealed_as=-1)


def test_numeric_buffers_arrive_aligned_for_their_values(flightdeck_server):
    # pyarrow reads a large message into one buffer and leaves the body
    # where the message puts it: the server starts bodies at a multiple of
    # 64 bytes into the message, so float32 and int64 values are not at odd
    # addresses (which PyTorch's and NumPy's kernels read more slowly).
    client = flightdeck.connect(flightdeck_server.uri)
    rows, dim = 20000, 32
    features = pa.FixedSizeListArray.from_arrays(
        pa.array(np.arange(rows * dim, dtype=np.float32)), dim
    )
    table = pa.table({"features": features, "label": pa.array(np.arange(rows), pa.int64())})
    client.put_partition("aligned", 0, table)
    client.seal("aligned")
    ds = ShardedDataset(
        flightdeck_server.uri, "aligned", rank=0, world_size=1, batch_rows=1024, seed=3,
        read_rows=16384, prefetch=0,
    )
    seen = 0
    for batch in ds:
        x, y = to_numpy(batch, "features"), to_numpy(batch, "label")
        assert x.ctypes.data % 8 == 0 and y.ctypes.data % 8 == 0, (x.ctypes.data, y.ctypes.data)
        assert (x[:, 0] == y * dim).all()
        seen += len(y)
    assert seen == rows


@pytest.mark.parametrize("prefetch", [0, 2])
def test_batches_sliced_from_larger_messages_are_the_batches_read_one_by_one(
    flightdeck_server, prefetch
):
    client = flightdeck.connect(flightdeck_server.uri)
    n = write(client, "coalesced", [1000, 0, 2345, 1, 6000])

    def batches(rank, read_rows, state=None, world_size=3):
        ds = ShardedDataset(
            flightdeck_server.uri, "coalesced", rank=rank, world_size=world_size, batch_rows=64,
            seed=9, prefetch=prefetch, read_rows=read_rows,
        )
        if state:
            ds.load_state_dict(state)
        got = [b.column("id").to_pylist() for b in ds]
        return ds, got

    for rank in range(3):
        one_by_one = batches(rank, 64)[1]
        chosen, coalesced = batches(rank, None)
        # The default reads many batches a message: 16 384 rows at most.
        assert chosen.read_rows == 64 * (16384 // 64)
        assert coalesced == one_by_one
        assert all(len(b) == 64 for b in coalesced[:-1]) and 0 < len(coalesced[-1]) <= 64
        assert batches(rank, 64 * 5)[1] == one_by_one
    # A resumed epoch too, at another world size.
    state = {"epoch": 0, "start_sample": 64 * 3 * 7, "world_size": 3}
    for rank in range(2):
        resumed = batches(rank, None, state, world_size=2)[1]
        assert resumed == batches(rank, 64, state, world_size=2)[1] and resumed
    with pytest.raises(flightdeck.InvalidArgument, match="multiple of batch_rows"):
        ShardedDataset(
            flightdeck_server.uri, "coalesced", rank=0, world_size=1, batch_rows=64, read_rows=100
        )
    assert n == 9346


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name == "flightdeck-prefetch"]


def test_read_ahead_takes_whole_messages_and_stays_within_two_of_them(flightdeck_server):
    client = flightdeck.connect(flightdeck_server.uri)
    n = write(client, "pfm", [3000])
    ds = ShardedDataset(
        flightdeck_server.uri, "pfm", rank=0, world_size=1, batch_rows=100, seed=2,
        prefetch=1, read_rows=1000,
    )
    it = iter(ds)
    first = next(it)
    # One batch taken of a 10-batch message: the thread reads one more
    # message (the batches waiting are fewer than the message held) and
    # then waits, whole messages at a time.
    eventually("reading the next message", lambda: ds._reader.received >= 20 or None)
    time.sleep(0.3)
    assert ds._reader.received == 20 and ds.state_dict()["start_sample"] == 100
    rest = [first] + list(it)
    assert sum(b.num_rows for b in rest) == n and prefetch_threads() == []


def test_bursts_are_read_whole_before_their_batches_and_resume_exactly(flightdeck_server):
    client = flightdeck.connect(flightdeck_server.uri)
    n = write(client, "burst", [1000, 1500, 700])

    def dataset(**kw):
        return ShardedDataset(
            flightdeck_server.uri, "burst", rank=0, world_size=2, batch_rows=50, seed=4,
            read_rows=200, **kw,
        )

    def counted(ds):
        """Counts the messages the dataset takes from its stream, and their bytes."""
        read_shard, sizes = ds.client.read_shard, []

        def reading(*args, **kw):
            for message in read_shard(*args, **kw):
                sizes.append(message.nbytes)
                yield message

        ds.client.read_shard = reading
        return sizes

    one_by_one = [b.column("id").to_pylist() for b in dataset(prefetch=0)]
    for limit in [1, 3000, 10**9]:
        ds = dataset(prefetch=0, burst_bytes=limit)
        sizes = counted(ds)
        it = iter(ds)
        first = next(it)
        read_before_first = len(sizes)
        assert prefetch_threads() == []
        rest = [first.column("id").to_pylist()] + [b.column("id").to_pylist() for b in it]
        assert rest == one_by_one, limit
        # The first burst was read whole before its first batch came out:
        # the fewest messages that reach the limit (every message, past it).
        reached = next((k + 1 for k in range(len(sizes)) if sum(sizes[: k + 1]) >= limit), None)
        assert read_before_first == (reached or len(sizes)), (limit, sizes)
        assert limit > 1 or read_before_first == 1
        assert limit < 10**9 or read_before_first == len(sizes) > 1
        assert ds.stall_seconds > 0

    # Stopped inside a burst: only the batches handed out count, and a
    # resume (on one rank) reads each remaining row once.
    both = [dataset(prefetch=0, burst_bytes=10**9), dataset(prefetch=0, burst_bytes=10**9)]
    both[1].rank = 1
    seen = set()
    for ds in both:
        it = iter(ds)
        for _ in range(3):
            seen.update(next(it).column("id").to_pylist())
        it.close()
    state = both[0].state_dict()
    assert state == {"epoch": 0, "start_sample": 3 * 50 * 2, "world_size": 2}
    one = ShardedDataset(flightdeck_server.uri, "burst", rank=0, world_size=1, batch_rows=50, seed=4)
    one.load_state_dict(state)
    rest = ids_of(one)
    assert len(rest) == n - 300 and set(rest).isdisjoint(seen) and set(rest) | seen == set(range(n))

    with pytest.raises(flightdeck.InvalidArgument, match="pass prefetch=0 with burst_bytes"):
        dataset(burst_bytes=1 << 20)
    with pytest.raises(flightdeck.InvalidArgument, match="burst_bytes must be 0"):
        dataset(prefetch=0, burst_bytes=-1)


def test_without_prefetch_the_stall_is_all_the_loop_does_to_get_a_batch(flightdeck_server):
    # On the loop's thread, preparing a batch (decoding, a transform) is
    # waiting for data as much as reading it is.
    n = write(flightdeck.connect(flightdeck_server.uri), "slowprep", [400, 200])
    pause = 0.02

    def slow(batch):
        time.sleep(pause)
        return batch

    for options in [{}, {"burst_bytes": 1 << 20}]:
        ds = ShardedDataset(
            flightdeck_server.uri, "slowprep", rank=0, world_size=1, batch_rows=100, seed=2,
            prefetch=0, **options,
        )
        got = list(ds.iter_batches(prepare=slow))
        assert sum(b.num_rows for b in got) == n
        assert ds.stall_seconds >= pause * len(got), (options, ds.stall_seconds)


def test_prefetch_reads_ahead_counts_only_what_it_handed_out_and_leaves_no_thread(
    flightdeck_server,
):
    client = flightdeck.connect(flightdeck_server.uri)
    n = write(client, "pf", [1000, 1500])
    ds = ShardedDataset(
        flightdeck_server.uri, "pf", rank=0, world_size=2, batch_rows=100, seed=5, prefetch=3
    )
    it = iter(ds)
    first = next(it)
    # The next batches arrive while the loop holds the first: read ahead
    # before it asks for them (no more than `prefetch` queued).
    eventually("reading ahead", lambda: ds._reader.received >= 4 or None)
    seen = set(first.column("id").to_pylist())
    for _ in range(2):
        seen.update(next(it).column("id").to_pylist())
    # Three handed out, more read: the state counts the three.
    state = ds.state_dict()
    assert state == {"epoch": 0, "start_sample": 3 * 100 * 2, "world_size": 2}
    # Whether the loop waited here depends on the threads' timing (the
    # waits themselves are counted in the test of `Prefetched` below): the
    # dataset reports its reader's.
    assert ds.stall_seconds == ds._reader.stall
    # The loop stops mid-epoch: the stream is cancelled, the thread ends.
    it.close()
    assert ds._reader is None and prefetch_threads() == []

    # Rank 1 took as many; both resume on one rank and read the rest once.
    other = ShardedDataset(
        flightdeck_server.uri, "pf", rank=1, world_size=2, batch_rows=100, seed=5, prefetch=3
    )
    taken = iter(other)
    for _ in range(3):
        seen.update(next(taken).column("id").to_pylist())
    del taken  # dropped without close(): the generator closes, and its thread ends
    eventually("the dropped iterator's thread ending", lambda: prefetch_threads() == [] or None)
    one = ShardedDataset(flightdeck_server.uri, "pf", rank=0, world_size=1, batch_rows=100, seed=5)
    one.load_state_dict(state)
    rest = ids_of(one)
    assert len(rest) == n - 600 and set(rest).isdisjoint(seen)
    assert set(rest) | seen == set(range(n))
    assert prefetch_threads() == []

    # Without prefetch the same rows come, read when asked for.
    plain = ShardedDataset(
        flightdeck_server.uri, "pf", rank=0, world_size=1, batch_rows=100, seed=5, prefetch=0
    )
    plain.load_state_dict(state)
    assert ids_of(plain) == rest and prefetch_threads() == []
    assert plain.stall_seconds > 0
    plain.set_epoch(1)
    assert plain.stall_seconds == 0


class GatedReader:
    """A stand-in for a `DoGet` stream: each message is read once the test
    opens its gate, so when the consumer waits is the test's choice."""

    def __init__(self, messages: list[pa.RecordBatch]) -> None:
        self.messages = messages
        self.gates = [threading.Event() for _ in messages]
        self.read = 0
        self.cancelled = False

    def read_chunk(self) -> SimpleNamespace:
        if self.read == len(self.messages):
            raise StopIteration
        self.gates[self.read].wait(timeout=30)
        self.read += 1
        return SimpleNamespace(data=self.messages[self.read - 1])

    def cancel(self) -> None:
        self.cancelled = True


def test_prefetch_counts_the_consumer_waits_and_only_them():
    messages = [
        pa.record_batch({"id": pa.array(range(i * 4, i * 4 + 4), pa.int64())}) for i in range(3)
    ]
    reader = GatedReader(messages)
    fetched = Prefetched(reader, depth=8, slice_rows=2)
    it = iter(fetched)
    # The first message is held back 0.2 s: the consumer waits that long.
    threading.Timer(0.2, reader.gates[0].set).start()
    assert next(it).column("id").to_pylist() == [0, 1]
    waited = fetched.stall
    assert 0.15 <= waited < 30
    # The rest read before they are asked for: no more waiting counted.
    reader.gates[1].set()
    reader.gates[2].set()
    eventually("reading to the end", lambda: not fetched._thread.is_alive() or None)
    rest = [b.column("id").to_pylist() for b in it]
    assert rest == [[2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    assert fetched.stall == waited and fetched.received == 6
    assert reader.cancelled and not fetched._thread.is_alive()


def test_split_streams_partition_a_rank(flightdeck_server):
    client = flightdeck.connect(flightdeck_server.uri)
    write(client, "sp", [999])
    ds = ShardedDataset(flightdeck_server.uri, "sp", rank=1, world_size=2, batch_rows=64)
    whole = [b.column("id").to_pylist() for b in ds.iter_batches()]
    parts = [[b.column("id").to_pylist() for b in ds.iter_batches(3, i)] for i in range(3)]
    assert strided_order(parts) == whole


def test_a_child_forked_after_the_parent_connected_gets_the_clear_error(flightdeck_server):
    """A DataLoader worker forked after the parent called len(data): its copy
    of the parent's connection would hang; it raises within seconds."""
    client = flightdeck.connect(flightdeck_server.uri)
    write(client, "fk", [500])
    ds = ShardedDataset(flightdeck_server.uri, "fk", rank=0, world_size=1, batch_rows=64)
    assert sum(b.num_rows for b in ds.iter_batches()) == 500  # the parent connects
    pid = os.fork()
    if pid == 0:  # the child: only os._exit, whatever happens
        code = 3
        try:
            next(iter(ds.iter_batches()))
        except RuntimeError as e:
            code = 0 if "forked" in str(e) and "spawn" in str(e) else 2
        except BaseException:
            code = 4
        os._exit(code)
    # Waits on the child's exit itself (a pidfd becomes readable then).
    pidfd = os.pidfd_open(pid)
    try:
        exited, _, _ = select.select([pidfd], [], [], scaled(30))
    finally:
        os.close(pidfd)
    if not exited:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung instead of raising")
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    # The parent's connection still works.
    assert sum(b.num_rows for b in ds.iter_batches()) == 500


def test_dataset_info_prints_readably(flightdeck_server):
    client = flightdeck.connect(flightdeck_server.uri)
    write(client, "pr", [300, 200])
    info = client.describe("pr")
    lines = str(info).splitlines()
    assert lines[0] == (
        f"dataset 'pr': sealed, 500 rows, {info.bytes:,} bytes in memory, 2 partitions"
    ), lines[0]
    assert lines[1:] == str(mixed_table(range(1)).schema).splitlines()[: len(lines) - 1]
    shown = repr(info)
    assert "state=DATASET_STATE_SEALED" in shown and "schema=<" in shown, shown
    assert len(shown) < 800, shown
    # An open dataset, before anything was sealed.
    client.put_partition("open", 0, mixed_table(range(10)))
    assert str(client.describe("open")).startswith("dataset 'open': open, 10 rows")
    # Advice in this client's terms, not Flight's.
    with pytest.raises(flightdeck.NotFound, match=r"client\.list_datasets\(\)") as info:
        client.describe("nope")
    assert "ListFlights" not in str(info.value)


def test_every_translated_phrase_is_one_the_server_says():
    """The Python table follows the server's wording: a phrase the server no
    longer says would leave its advice in protocol words."""
    import re
    from pathlib import Path

    from flightdeck.errors import _IN_PYTHON_TERMS

    src = Path(__file__).resolve().parents[2] / "server" / "src"
    # String line continuations joined as the Rust compiler joins them.
    said = "".join(re.sub(r"\\\n\s*", "", p.read_text()) for p in src.rglob("*.rs"))
    for flight_words, python_words in _IN_PYTHON_TERMS.items():
        assert flight_words in said, f"the server never says {flight_words!r}"
        for word in ("DoPut", "DoGet", "ListFlights", "GetFlightInfo"):
            assert word not in python_words


def test_numpy_views_share_arrow_memory():
    table = mixed_table(range(10, 20))
    batch = table.to_batches()[0]
    emb = to_numpy(batch, "emb")
    assert emb.shape == (10, 3) and emb.dtype == np.float32
    values = batch.column("emb").flatten()
    assert emb.ctypes.data == values.buffers()[1].address + values.offset * 4
    np.testing.assert_array_equal(emb[:, 0], np.arange(10, 20, dtype=np.float32))
    # Spark's array<float> arrives as a variable-size list.
    feat = to_numpy(batch, "feat")
    assert feat.shape == (10, 4) and not feat.flags.writeable
    sliced = batch.slice(3, 4)
    assert to_numpy(sliced, "emb")[0, 0] == 13.0
    assert to_numpy(sliced, "feat").shape == (4, 4)
    np.testing.assert_array_equal(to_numpy(batch, "u32"), np.arange(30, 60, 3))
    with pytest.raises(ValueError, match="nulls"):
        to_numpy(batch, "f64")
    with pytest.raises(ValueError, match="ragged"):
        to_numpy(batch.slice(0, 4), "tags")
    with pytest.raises(TypeError, match="string"):
        to_numpy(batch, "s")


def test_server_names_read_as_the_shared_table_says():
    """The same table the Rust client's parser is tested with."""
    from flightdeck.client import normalize_uri

    for name, local, want in server_name_cases():
        if want == "error":
            with pytest.raises(flightdeck.InvalidArgument, match="does not name a server"):
                normalize_uri(name, local or "")
        else:
            assert normalize_uri(name, local or "") == want, name


def test_a_replacing_write_is_read_only_once_sealed_and_a_failed_one_changes_nothing(
    flightdeck_server,
):
    c = flightdeck.connect(flightdeck_server.uri)
    old = pa.table({"v": pa.array(range(10), pa.int64())})
    c.put_partition("r", 0, old)
    c.seal("r")
    before = c.plan("r")
    new = pa.table({"v": pa.array(range(100, 106), pa.int64()), "w": pa.array([1.5] * 6)})
    c.put_partition("r", 0, new.slice(0, 4), write_id="w1", replace=True)
    c.put_partition("r", 1, new.slice(4), write_id="w1", replace=True)
    # Staged beside the dataset: readers keep the old rows, nothing else shows.
    assert c.describe("r").rows == 10
    assert c.list_datasets() == ["r"] and c.stats().datasets == 1
    # ... but describe and stats say what is under way.
    (staged,) = c.describe("r").replacements
    assert (staged.write_id, staged.rows, staged.committed_partitions) == ("w1", 6, 2)
    assert str(c.describe("r")).splitlines()[0].endswith(
        " 1 partitions, being replaced by write 'w1' (6 rows staged)"
    )
    assert [(w.dataset, w.write_id) for w in c.stats().staged] == [("r", "w1")]
    assert c.read_table(before.shards[0]).equals(old)
    with pytest.raises(flightdeck.InvalidArgument, match="names no write"):
        c.put_partition("r", 2, new, replace=True)
    with pytest.raises(flightdeck.FailedPrecondition, match="write 'w9' staged nothing"):
        c.seal("r", replace_write="w9")

    info = c.seal("r", partitions=2, replace_write="w1")
    assert (info.dataset, info.rows, info.partitions[1].rows) == ("r", 6, 2)
    assert c.read_table(c.plan("r").shards[0]).equals(new)
    # A read planned on the old rows is refused rather than mixing the two.
    with pytest.raises(flightdeck.FailedPrecondition, match="written again"):
        c.read_table(before.shards[0])
    # A late attempt of the write that replaced it (a speculative task ending
    # after its job's seal) is refused, not staged where no seal takes it.
    with pytest.raises(flightdeck.FailedPrecondition, match="write 'w1' replaced dataset 'r' already"):
        c.put_partition("r", 0, new, write_id="w1", replace=True)
    assert not c.describe("r").replacements

    # A replacing write that fails drops what it staged, nothing more, and
    # its late attempts are refused.
    c.put_partition("r", 0, old, write_id="w2", replace=True)
    c.drop("r", abort_write="w2", staged=True)
    with pytest.raises(flightdeck.Aborted, match="write 'w2' to dataset 'r' was aborted"):
        c.put_partition("r", 1, old, write_id="w2", replace=True)
    assert c.read_table(c.plan("r").shards[0]).equals(new)
    log = "".join(flightdeck_server.stderr_lines)
    assert "committed attempt dataset=r partition=0 attempt=0 rows=10" in log
    assert "replaced dataset dataset=r rows=10" in log
    assert "dropped dataset dataset=r rows=10" in log and "staged=true" in log
    stats = c.stats()
    assert (stats.datasets, stats.rows, list(stats.staged)) == (1, 6, []), stats
    assert not c.describe("r").replacements
    c.drop("r")


def test_numbers_out_of_range_are_refused_before_anything_is_sent(flightdeck_server):
    """A partition, world size or batch size past what the protocol carries
    is refused by name (not cut to its low bits, which wrote partition
    2**32 + 5 as partition 5), and so is a resume state that is no state."""
    uri = flightdeck_server.uri
    client = flightdeck.connect(uri)
    with pytest.raises(ValueError, match=r"partition must be a whole number in \[0, 2\*\*32\)"):
        client.put_partition("big", 2**32 + 5, mixed_table(range(3)))
    with pytest.raises(flightdeck.NotFound):
        client.describe("big")
    write(client, "range", [10, 10])
    with pytest.raises(ValueError, match="world_size must be a whole number"):
        len(ShardedDataset(uri, "range", rank=0, world_size=2**32 + 1))
    with pytest.raises(ValueError, match="batch_rows must be a whole number"):
        len(ShardedDataset(uri, "range", rank=0, world_size=1, batch_rows=2**32 + 4))

    ds = ShardedDataset(uri, "range", rank=0, world_size=2, batch_rows=3, seed=1)
    before = ds.state_dict()
    for state, says in [
        ({"epoch": -1, "start_sample": 0}, "epoch must be a whole number, at least 0, not -1"),
        ({"epoch": 1, "start_sample": 2.5}, "start_sample must be .* not 2.5"),
        ({"epoch": 1, "start_sample": 4, "world_size": -3}, "world_size must be .* not -3"),
        ({"step": 7}, r"needs \['epoch', 'start_sample'\]: pass what state_dict\(\) returned"),
    ]:
        with pytest.raises(ValueError, match=says):
            ds.load_state_dict(state)
        assert ds.state_dict() == before, "a refused state changes nothing"
    with pytest.raises(ValueError, match="epoch must be a whole number, at least 0, not -1"):
        ds.set_epoch(-1)
    assert ds.state_dict() == before
    # What state_dict() gives, saved through JSON or numpy, still loads.
    ds.load_state_dict({"epoch": np.int64(1), "start_sample": 4, "world_size": 2})
    assert ds.state_dict() == {"epoch": 1, "start_sample": 4, "world_size": 2}
    assert sorted(ids_of(ds)) == sorted(set(ids_of(ds)))


def test_what_a_dead_job_left_unsealed_is_dropped_after_the_unsealed_timeout():
    """`--unsealed-timeout 1s`: a dataset a job wrote and never sealed (it
    died) is dropped a second after its last attempt, with a warning naming
    it and its write, and the job's tasks still running are refused saying
    why; `0` keeps such a dataset until it is dropped."""
    from conftest import RunningServer

    table = pa.table({"id": pa.array(range(10), pa.int64())})
    server = RunningServer("--unsealed-timeout", "1s")
    keeper = RunningServer("--unsealed-timeout", "0")
    try:
        c, k = flightdeck.connect(server.uri), flightdeck.connect(keeper.uri)
        c.put_partition("left", 0, table, write_id="dead")
        k.put_partition("left", 0, table, write_id="dead")
        started = time.monotonic()

        def gone():
            try:
                c.describe("left")
            except flightdeck.NotFound:
                return True
            return None

        eventually("the unsealed dataset dropped", gone)
        assert time.monotonic() - started >= 0.9
        with pytest.raises(flightdeck.Aborted, match="write 'dead' to dataset 'left' was aborted "
                           r"\(nothing of it was written for 1s and it was never sealed"):
            c.put_partition("left", 1, table, write_id="dead")
        log = "".join(server.stderr_lines)
        assert "dropped what a write left unsealed" in log and "writes=dead" in log, log
        time.sleep(1.5)
        assert k.describe("left").rows == 10, "--unsealed-timeout 0 keeps it"
        c.close()
        k.close()
    finally:
        assert server.stop() == 0
        assert keeper.stop() == 0


def test_two_jobs_writing_one_dataset_at_once_never_mix(flightdeck_server):
    """Two jobs (write ids) creating the same dataset at once: the second's
    attempts are refused while the first's dataset is open, saying which
    write holds it; the refused job's failure drops nothing of the first's,
    and the sealed dataset holds one job's rows only."""
    c = flightdeck.connect(flightdeck_server.uri)

    def part(p, job):
        return pa.table({"id": pa.array(range(p * 5, p * 5 + 5), pa.int64()),
                         "job": pa.array([job] * 5, pa.string())})

    c.put_partition("both", 0, part(0, "a"), write_id="job-a")
    with pytest.raises(flightdeck.FailedPrecondition,
                       match=r"dataset 'both' is being written by another write \('job-a': 1 "
                             r"attempts committed.*nothing of write 'job-b' was stored"):
        c.put_partition("both", 1, part(1, "b"), write_id="job-b")
    # Job b fails and drops what it wrote, naming its write: job a's
    # dataset is not its to drop.
    with pytest.raises(flightdeck.FailedPrecondition, match="holds no attempt of the failed "
                       "write 'job-b'"):
        c.drop("both", abort_write="job-b")
    c.put_partition("both", 1, part(1, "a"), write_id="job-a")
    c.seal("both", partitions=2)
    t = c.read_table(c.plan("both").shards[0])
    assert t.column("id").to_pylist() == list(range(10))
    assert set(t.column("job").to_pylist()) == {"a"}
    # Its later attempts stay refused (the job failed), even once the
    # dataset is dropped and free to write.
    c.drop("both")
    with pytest.raises(flightdeck.Aborted, match="write 'job-b'"):
        c.put_partition("both", 0, part(0, "b"), write_id="job-b")
    c.close()


def test_a_read_from_a_server_that_hangs_fails_instead_of_waiting_forever():
    """A server that stops answering mid-read (hung; on a cluster, a node cut
    off without a word) used to hold the reading rank — and so the DDP job —
    forever: nothing closes a TCP connection whose peer is alive but silent.
    The client's HTTP/2 pings go unanswered and the read fails UNAVAILABLE
    within the ping timeout, which `reconnect_seconds` rides out or the
    job sees."""
    server = RunningServer("--memory-limit", "256MiB")
    try:
        with flightdeck.connect(server.uri) as c:
            c.put_partition("d", 0, pa.table({"x": pa.array(np.arange(8_000_000))}))
            c.seal("d")
            [shard] = c.plan("d", batch_rows=50_000).shards
            batches = c.read_shard(shard)
            next(batches)
            server.proc.send_signal(signal.SIGSTOP)
            started = time.monotonic()
            try:
                with pytest.raises(flightdeck.Unavailable, match="ping timeout"):
                    for _ in batches:
                        pass
                assert time.monotonic() - started < scaled(80)
            finally:
                server.proc.send_signal(signal.SIGCONT)
            # Back again: reads as before, on the same connection. gRPC may
            # still hand the first call after the hang to the transport its
            # ping timeout is closing — the one failure `reconnect_seconds`
            # rides out in a training loop — so a call that fails so is
            # asked again, within a bound.
            def read_again():
                try:
                    return c.read_table(shard)
                except flightdeck.Unavailable:
                    return None

            assert eventually("a read after the hang", read_again, 30).num_rows == 8_000_000
    finally:
        assert server.stop() == 0, "".join(server.stderr_lines)
