"""A reader on the server's machine gets its record batches through the
server's shared memory: the same batches as over the socket, whatever the
order, the ranks, a message larger than the ring, a dictionary; nothing
left in the shared-memory folder; a reader that cannot map the ring reads
over the socket, and one that never maps it is ended, not waited for."""

from __future__ import annotations

import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest

import flightdeck
from conftest import RunningServer, eventually, scaled
from flightdeck import ShardedDataset, _shm
from test_client import mixed_table

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/dev/shm"), reason="no /dev/shm on this machine"
)


def rings_of(server: RunningServer) -> list[str]:
    """The server's shared-memory files still linked."""
    prefix = f"flightdeck-{server.proc.pid}-"
    return [f for f in os.listdir("/dev/shm") if f.startswith(prefix)]


def written(server: RunningServer, name: str, rows: int) -> flightdeck.Client:
    """A client of `server`, with `rows` rows of the mixed table sealed as
    dataset `name`."""
    client = flightdeck.connect(server.uri)
    client.put_partition(name, 0, mixed_table(range(rows)))
    client.seal(name, partitions=1)
    return client


def read(uri: str, shm: bool, dataset: str, **plan) -> tuple[list[pa.Table], list[bool]]:
    """Every rank's stream of `plan`, each read whole, and whether each
    came through shared memory."""
    old = os.environ.get("FLIGHTDECK_SHM")
    os.environ["FLIGHTDECK_SHM"] = "1" if shm else "0"
    try:
        client = flightdeck.connect(uri)
    finally:
        if old is None:
            del os.environ["FLIGHTDECK_SHM"]
        else:
            os.environ["FLIGHTDECK_SHM"] = old
    tables, through = [], []
    for shard in client.plan(dataset, **plan).shards:
        reader = client._do_get(shard)
        through.append(isinstance(reader, _shm.RingReader) and reader.attached)
        tables.append(reader.read_all())
    client.close()
    return tables, through


def test_batches_through_shared_memory_are_the_batches_over_the_socket(flightdeck_server):
    client = flightdeck.connect(flightdeck_server.uri)
    for p, (start, n) in enumerate([(0, 7000), (7000, 1), (7001, 12000)]):
        client.put_partition("m", p, mixed_table(range(start, start + n)))
    client.seal("m", partitions=3)
    for shuffle in ("none", "global", "block"):
        for world in (1, 3, 8):
            plan = dict(world_size=world, shuffle=shuffle, seed=5, epoch=1, batch_rows=700)
            ring, through = read(flightdeck_server.uri, True, "m", **plan)
            socket, over = read(flightdeck_server.uri, False, "m", **plan)
            assert all(through) and not any(over)
            for a, b in zip(ring, socket):
                assert a.equals(b), (shuffle, world)
    eventually("rings removed", lambda: rings_of(flightdeck_server) == [])


def test_a_shard_many_times_the_ring_and_messages_larger_than_it(flightdeck_server):
    client = flightdeck.connect(flightdeck_server.uri)
    rows = 600_000  # 64 float32 + id: about 160 MB, ten times the ring
    wide = pa.table(
        {"id": pa.array(np.arange(rows, dtype=np.int64))}
        | {f"c{i}": pa.array(np.full(rows, i, dtype=np.float32)) for i in range(64)}
    )
    client.put_partition("w", 0, wide)
    client.seal("w", partitions=1)
    # 4 096 rows a message (about 1 MiB): many laps of the ring, the
    # server waiting for the reader to make room; then 120 000 rows (about
    # 31 MiB, more than the ring): those go over the socket in their place.
    for batch_rows in (4096, 120_000):
        plan = dict(world_size=2, shuffle="global", seed=1, batch_rows=batch_rows)
        ring, through = read(flightdeck_server.uri, True, "w", **plan)
        socket, _ = read(flightdeck_server.uri, False, "w", **plan)
        assert all(through)
        for a, b in zip(ring, socket):
            assert a.num_rows == rows // 2 and a.equals(b)
        # A reader that pauses: the server, far ahead, must wait for room
        # rather than write over batches not yet copied out.
        reader = client._do_get(client.plan("w", **plan).shards[1])
        first = reader.read_chunk().data
        time.sleep(scaled(1))
        rest = reader.read_all()
        assert pa.concat_tables([pa.Table.from_batches([first]), rest]).equals(socket[1])
    eventually("rings removed", lambda: rings_of(flightdeck_server) == [])


def wide(client: flightdeck.Client, name: str, rows: int) -> None:
    """`rows` rows of an id and 64 float32 columns (260 bytes a row),
    sealed as `name`."""
    table = pa.table(
        {"id": pa.array(np.arange(rows, dtype=np.int64))}
        | {f"c{i}": pa.array(np.arange(rows, dtype=np.float32) + i) for i in range(64)}
    )
    client.put_partition(name, 0, table)
    client.seal(name, partitions=1)


def in_ring(reader: _shm.RingReader, batch: pa.RecordBatch) -> bool:
    """Whether `batch`'s data lies in `reader`'s ring (lent, not copied)."""
    address = batch.column(1).buffers()[1].address
    start = reader._lender._address
    return start <= address < start + len(reader._map)


def test_a_lending_reader_hands_out_views_and_gives_each_back_once_dropped(flightdeck_server):
    client = flightdeck.connect(flightdeck_server.uri)
    wide(client, "lent", 200_000)  # 52 MB, three rings' worth
    plan = dict(world_size=1, shuffle="global", seed=3, batch_rows=8192)  # 2 MiB messages
    (socket,), _ = read(flightdeck_server.uri, False, "lent", **plan)
    reader = client._do_get(client.plan("lent", **plan).shards[0], lend=True)
    assert isinstance(reader, _shm.RingReader) and reader.lends
    consumed = lambda: int(reader._words[_shm._CONSUMED])  # noqa: E731
    first, second, third, fourth = (reader.read_chunk().data for _ in range(4))
    assert all(in_ring(reader, b) for b in (first, second, third, fourth))
    # Nothing given back while the batches live: the server may not write
    # over them.
    time.sleep(scaled(0.2))
    assert consumed() == 0
    tensor = np.asarray(first.column(1))  # a view of the batch keeps it too
    del first
    assert consumed() == 0
    del tensor
    after_first = consumed()
    assert after_first > 0
    # Given back in order: a later batch dropped first waits for the one
    # before it.
    del third
    assert consumed() == after_first
    del second
    after_third = consumed()
    assert after_third > after_first
    del fourth
    assert consumed() > after_third
    # A caller that keeps every batch (`read_all`) fills the ring, and the
    # rest of the stream comes over the socket: the same batches in order.
    rest = reader.read_all()
    assert sum(in_ring(reader, b) for b in rest.to_batches()) > 0
    assert sum(not in_ring(reader, b) for b in rest.to_batches()) > 0
    assert rest.equals(socket.slice(4 * 8192))


def test_a_loop_that_keeps_its_batches_reads_them_unchanged(flightdeck_server):
    client = flightdeck.connect(flightdeck_server.uri)
    wide(client, "kept", 200_000)
    (socket,), _ = read(flightdeck_server.uri, False, "kept", world_size=1, shuffle="global", seed=4)
    for prefetch in (0, 2):
        ds = ShardedDataset(
            flightdeck_server.uri, "kept", rank=0, world_size=1, batch_rows=8192, seed=4,
            prefetch=prefetch,
        )
        kept = list(ds)  # every batch held to the end: none written over
        assert pa.Table.from_batches(kept).equals(socket), prefetch
        # One batch kept while the rest are dropped holds the ring back
        # behind it, not the stream.
        it = iter(ds)
        held = next(it)
        firsts = [b.column("id")[0].as_py() for b in it]
        assert held.equals(kept[0]), prefetch
        assert firsts == [b.column("id")[0].as_py() for b in kept[1:]], prefetch
    eventually("rings removed", lambda: rings_of(flightdeck_server) == [])


@pytest.mark.parametrize("lend", [False, True])
def test_a_batch_described_outside_the_ring_is_refused(lend):
    import mmap
    import struct

    reader = _shm.RingReader(None, lend=lend)
    reader._map = mmap.mmap(-1, 8192)
    reader._words = np.frombuffer(reader._map, dtype=np.uint64, count=5)
    if lend:
        reader._lender = _shm._Lender(reader._map, reader._words)
    for offset, length in [(8000, 400), (0, 64), (4096, 1 << 40)]:
        raw = _shm._BATCH + struct.pack("<QQQ", offset, length, offset + length)
        with pytest.raises(flight.FlightServerError, match="outside its ring"):
            reader._take(raw)


def test_dictionary_columns_follow_their_dictionaries_over_the_socket(flightdeck_server):
    client = flightdeck.connect(flightdeck_server.uri)
    words = pa.array(["a", "bb", "ccc"] * 1000).dictionary_encode()
    client.put_partition("dict", 0, pa.table({"id": pa.array(range(3000)), "w": words}))
    client.seal("dict", partitions=1)
    ring, _ = read(flightdeck_server.uri, True, "dict", world_size=2, shuffle="global", seed=2)
    socket, _ = read(flightdeck_server.uri, False, "dict", world_size=2, shuffle="global", seed=2)
    for a, b in zip(ring, socket):
        assert a.equals(b)


def test_sharded_datasets_read_ahead_and_resume_through_shared_memory(flightdeck_server):
    written(flightdeck_server, "r", 20_000)
    ds = ShardedDataset(flightdeck_server.uri, "r", rank=0, world_size=2, batch_rows=100, seed=9)
    whole = [i for b in ds for i in b.column("id").to_pylist()]
    it = iter(ds)
    seen = [i for _ in range(13) for i in next(it).column("id").to_pylist()]
    state = ds.state_dict()
    it.close()
    again = ShardedDataset(flightdeck_server.uri, "r", rank=0, world_size=2, batch_rows=100, seed=9)
    again.load_state_dict(state)
    rest = [i for b in again for i in b.column("id").to_pylist()]
    assert seen + rest == whole
    eventually("rings closed", lambda: rings_of(flightdeck_server) == [])


def test_a_reader_that_cannot_map_the_ring_reads_over_the_socket(flightdeck_server, monkeypatch):
    client = written(flightdeck_server, "f", 5000)
    expected, _ = read(flightdeck_server.uri, False, "f", world_size=1)

    def refuse(path, flags, *args):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(_shm.os, "open", refuse)
    shard = client.plan("f").shards[0]
    reader = client._do_get(shard)
    assert not isinstance(reader, _shm.RingReader)
    assert reader.read_all().equals(expected[0])
    assert client._shm_options is None, "not asked for again"
    eventually("the refused ring removed", lambda: rings_of(flightdeck_server) == [])


def test_a_reader_that_never_maps_the_ring_is_ended_and_leaves_nothing():
    server = RunningServer("--memory-limit", "256MiB", "--stream-idle-timeout", "1s")
    try:
        shard = written(server, "n", 5000).plan("n").shards[0]
        raw = flight.FlightClient(server.uri)
        options = flight.FlightCallOptions(headers=[(_shm.REQUEST_HEADER, b"1")])
        reader = raw.do_get(flight.Ticket(shard.ticket), options=options)
        announce = reader.read_chunk()
        assert announce.data is None and announce.app_metadata.to_pybytes()[:8] == b"FDSHM:A1"
        assert len(rings_of(server)) == 1
        started = time.monotonic()
        with pytest.raises(flight.FlightError, match="did not map its shared-memory ring"):
            reader.read_chunk()
        assert time.monotonic() - started < scaled(10)
        eventually("the ring removed", lambda: rings_of(server) == [])
        raw.close()
    finally:
        server.stop()


def test_a_server_without_shared_memory_answers_over_the_socket():
    server = RunningServer("--memory-limit", "256MiB", "--shm-dir", "none")
    try:
        client = written(server, "o", 3000)
        reader = client._do_get(client.plan("o").shards[0])
        assert isinstance(reader, _shm.RingReader) and not reader.attached
        assert reader.read_all().equals(client.read_table(client.plan("o").shards[0]))
    finally:
        server.stop()
