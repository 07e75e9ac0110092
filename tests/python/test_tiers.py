"""Memory tiers through the `flightdeck serve` binary and the Python client:
a server started with `--persist` serves its sealed datasets again after a
restart (and readers ride the restart out; a copy lost meanwhile is
DataLoss), a small budget spills and
brings datasets back with the same rows, a dataset the store cannot hold
stays in memory (and is refused by --persist), and `place` without a CUDA
driver raises FailedPrecondition."""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pytest

import flightdeck
from conftest import RunningServer, scaled


def table(n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table(
        {
            "id": pa.array(np.arange(n, dtype=np.int64)),
            "x": pa.array(rng.standard_normal(n).astype(np.float32)),
            "label": pa.array(rng.integers(0, 3, n).astype(np.int32)),
        }
    )


def write(client: flightdeck.Client, name: str, t: pa.Table, parts: int = 4) -> None:
    step = -(-t.num_rows // parts)
    for p in range(parts):
        client.put_partition(name, p, t.slice(p * step, step))
    client.seal(name, partitions=parts)


def epoch(client: flightdeck.Client, name: str, shuffle: str) -> list[pa.Table]:
    plan = client.plan(name, world_size=2, epoch=3, seed=11, shuffle=shuffle)
    return [client.read_table(s) for s in plan.shards]


def stopped(server: RunningServer) -> None:
    assert server.stop() == 0, "".join(server.stderr_lines)


def test_persist_survives_a_restart(tmp_path):
    args = ("--memory-limit", "256MiB", "--persist", "--spill-url", str(tmp_path / "store"))
    t = table(50_000, 1)
    server = RunningServer(*args)
    try:
        with flightdeck.connect(server.uri) as c:
            write(c, "kept", t)
            info = c.describe("kept")
            assert info.persisted and not info.spilled
            before = {m: epoch(c, "kept", m) for m in ("none", "global", "block")}
    finally:
        stopped(server)
    assert list((tmp_path / "store" / "datasets" / "kept").glob("*/manifest.json"))

    server = RunningServer(*args)
    try:
        with flightdeck.connect(server.uri) as c:
            assert c.list_datasets() == ["kept"]
            info = c.describe("kept")
            assert (info.rows, info.persisted, info.spilled) == (50_000, True, True)
            for mode, tables in before.items():
                assert epoch(c, "kept", mode) == tables, mode
            assert not c.describe("kept").spilled
            stats = c.stats()
            assert stats.persist and stats.restores == 1
    finally:
        stopped(server)


def test_a_persisted_dataset_overwritten_comes_back_as_its_replacement(tmp_path):
    args = ("--memory-limit", "256MiB", "--persist", "--spill-url", str(tmp_path / "store"))
    server = RunningServer(*args)
    try:
        with flightdeck.connect(server.uri) as c:
            write(c, "swap", table(1_000, 1))
            c.put_partition("swap", 0, table(500, 2), write_id="w", replace=True)
            info = c.seal("swap", replace_write="w")
            assert (info.rows, info.persisted) == (500, True)
            after = epoch(c, "swap", "global")
    finally:
        stopped(server)
    # The replaced dataset's files went with it; the new ones are under its name.
    assert len(list((tmp_path / "store" / "datasets").glob("*/*/manifest.json"))) == 1
    assert len(list((tmp_path / "store" / "datasets" / "swap").glob("*/manifest.json"))) == 1

    server = RunningServer(*args)
    try:
        with flightdeck.connect(server.uri) as c:
            assert c.list_datasets() == ["swap"]
            assert c.describe("swap").rows == 500
            assert epoch(c, "swap", "global") == after
    finally:
        stopped(server)


def test_a_lost_persisted_copy_is_data_loss_and_the_rest_is_served(tmp_path):
    """Files of a persisted dataset lost while the server was down: its
    reads raise DataLoss at once (a reader that rides restarts out does
    not wait for a server that is up), a dataset whose manifest is damaged
    is left out and logged, and the server serves the rest."""
    store = tmp_path / "store"
    args = ("--memory-limit", "256MiB", "--persist", "--spill-url", str(store))
    server = RunningServer(*args)
    try:
        with flightdeck.connect(server.uri) as c:
            for name in ("kept", "lost", "garbled"):
                write(c, name, table(1_000, 1))
    finally:
        stopped(server)
    for f in (store / "datasets" / "lost").glob("*/data.parquet"):
        f.unlink()
    for f in (store / "datasets" / "garbled").glob("*/manifest.json"):
        f.write_text("{")

    server = RunningServer(*args)
    try:
        with flightdeck.connect(server.uri) as c:
            assert c.list_datasets() == ["kept", "lost"]
            assert epoch(c, "kept", "global")[0].num_rows == 500
            data = flightdeck.ShardedDataset(
                server.uri, "lost", rank=0, world_size=1, reconnect_seconds=60
            )
            started = time.monotonic()
            with pytest.raises(flightdeck.DataLoss, match="dataset 'lost' cannot be brought "
                               "back from the store: .*drop it and write it again"):
                list(data)
            assert time.monotonic() - started < 30, "waited as for a server gone"
    finally:
        stopped(server)
    logged = "".join(server.stderr_lines)
    assert "a persisted dataset's manifest is damaged" in logged, logged


def test_a_small_budget_spills_and_reads_back():
    one = table(200_000, 2)  # ~3.2 MB in the arena
    server = RunningServer("--memory-limit", "8MiB", "--slab-size", "256KiB")
    try:
        with flightdeck.connect(server.uri) as c:
            write(c, "a", one)
            first = epoch(c, "a", "global")
            write(c, "b", table(200_000, 3))
            write(c, "c", table(200_000, 4))
            assert c.describe("a").spilled
            assert epoch(c, "a", "global") == first
            stats = c.stats()
            assert stats.spills >= 2 and stats.restores >= 1
            assert stats.memory_used <= stats.memory_limit
            assert stats.spill_url == "memory://"
    finally:
        stopped(server)


def test_names_of_every_length_persist_and_come_back(tmp_path):
    """Names up to the 256-byte limit, whatever their characters, persist
    on a local disk and are served after a restart. A name is
    percent-encoded into its folder's name (`é` takes 6 bytes, `/` 3),
    and a file system allows 255: such names failed to persist (and to
    spill) with 'File name too long'."""
    names = ["é" * 128, "/" * 256, "a" * 256, "é" * 127 + "x", "ok"]
    args = ("--memory-limit", "256MiB", "--persist", "--spill-url", str(tmp_path / "store"))
    server = RunningServer(*args)
    try:
        with flightdeck.connect(server.uri) as c:
            for i, name in enumerate(names):
                write(c, name, table(1_000, i), parts=1)
                assert c.describe(name).persisted, name
    finally:
        stopped(server)
    server = RunningServer(*args)
    try:
        with flightdeck.connect(server.uri) as c:
            assert sorted(c.list_datasets()) == sorted(names)
            for i, name in enumerate(names):
                assert c.read_table(c.plan(name).shards[0]).equals(table(1_000, i)), name
    finally:
        stopped(server)


def room_for_two(store) -> RunningServer:
    """A server whose budget holds two of the `table(200_000, …)` datasets
    and spills to `store` to take a third, without waiting for memory."""
    return RunningServer("--memory-limit", "8MiB", "--admission-wait", "0",
                         "--spill-url", str(store))


def test_a_spill_store_that_fails_is_named_and_writes_go_on_once_it_has_room(tmp_path):
    """The spill store failing (a full disk; here its folder replaced by a
    file) refuses the write that needed room, naming the dataset, the
    store's error and what to do; nothing is lost, and once the store
    works again the same write spills and succeeds."""
    store = tmp_path / "store"
    server = room_for_two(store)
    try:
        with flightdeck.connect(server.uri) as c:
            write(c, "a", table(200_000, 8))  # ~3.2 MB each
            write(c, "b", table(200_000, 9))
            spill = store / "spill"
            assert not spill.exists(), "nothing spilled yet"
            spill.write_text("in the way")
            with pytest.raises(flightdeck.ResourceExhausted, match=(
                    r"spilling dataset 'a' failed: writing dataset 'a' to .*; make room in the "
                    r"spill store \(--spill-url\) or drop datasets that are no longer needed")):
                write(c, "c", table(200_000, 10))
            spill.unlink()
            c.drop("c")  # what was written of it before the refusal
            write(c, "c", table(200_000, 10))
            assert c.describe("a").spilled
            for name, seed in (("a", 8), ("b", 9), ("c", 10)):
                got = c.read_table(c.plan(name).shards[0])
                assert got.equals(table(200_000, seed)), name
    finally:
        stopped(server)


def test_a_dataset_the_store_fails_to_take_is_passed_over_for_the_next(tmp_path):
    """When the store fails to take the dataset read least recently (its
    folder in the way here; a disk with room for a smaller dataset but not
    for it), the next is spilled instead and the write that needed room
    goes on; the one passed over stays in memory, readable, and the log
    names it. (Before, the write was refused, though the store would have
    taken another dataset.)"""
    store = tmp_path / "store"
    server = room_for_two(store)
    try:
        with flightdeck.connect(server.uri) as c:
            write(c, "a", table(200_000, 8))  # ~3.2 MB each
            write(c, "b", table(200_000, 9))
            write(c, "c", table(200_000, 10))  # spills 'a'
            assert c.describe("a").spilled
            [session] = [p for p in (store / "spill").iterdir() if p.is_dir()]
            (session / "b").write_text("in the way")
            write(c, "d", table(200_000, 11))  # 'b' is read least recently
            assert not c.describe("b").spilled and c.describe("c").spilled
            for name, seed in (("a", 8), ("b", 9), ("c", 10), ("d", 11)):
                assert c.read_table(c.plan(name).shards[0]).equals(table(200_000, seed)), name
        log = "".join(server.stderr_lines)
        assert "could not spill dataset to the store" in log and "dataset=b" in log, log
    finally:
        stopped(server)


def unions(n: int) -> pa.Table:
    """A table with a union column, which Parquet (the store) cannot hold."""
    kinds = pa.array(np.arange(n) % 2, pa.int8())
    u = pa.UnionArray.from_sparse(kinds, [pa.array(np.arange(n)), pa.array(np.arange(n) * 0.5)])
    return pa.table({"id": pa.array(np.arange(n)), "u": u})


def test_a_dataset_the_store_cannot_hold_stays_in_memory_and_others_spill_past_it(tmp_path):
    """A union column cannot be written as Parquet (the writer panicked the
    call that spilled or persisted it, and every later spill chose the same
    dataset again). Without --persist such a dataset is sealed, read and
    queried from memory and never spilled: writes after it spill the
    others, and a refusal for memory names it. With --persist it is
    refused at its first write, before any row is taken, and the server
    keeps serving."""
    server = RunningServer("--memory-limit", "12MiB", "--admission-wait", "0")
    try:
        with flightdeck.connect(server.uri) as c:
            held = unions(200_000)  # ~5 MB in the arena
            write(c, "held", held)
            for name in ("a", "b", "c"):
                write(c, name, table(200_000, 5))  # each ~3.2 MB
            assert c.describe("a").spilled and not c.describe("held").spilled
            assert c.read_table(c.plan("held").shards[0]).equals(held)
            assert c.sql("SELECT count(*) AS n FROM held")["n"].to_pylist() == [200_000]
            assert epoch(c, "a", "global")[0].num_rows == 100_000
            # Nothing else left to spill: the refusal says what holds the memory.
            with pytest.raises(flightdeck.ResourceExhausted, match=r"sealed datasets the store "
                               r"cannot hold, which cannot spill: 'held' \(column 'u' is a union\)"):
                c.put_partition("big", 0, table(700_000, 6))
    finally:
        stopped(server)
    logged = "".join(server.stderr_lines)
    assert "dataset cannot spill: column 'u' is a union" in logged, logged

    args = ("--memory-limit", "64MiB", "--persist", "--spill-url", str(tmp_path / "store"))
    server = RunningServer(*args)
    try:
        with flightdeck.connect(server.uri) as c:
            nested = pa.table({"l": pa.ListArray.from_arrays([0, 1, 2], unions(2)["u"].chunk(0))})
            for name, t, said in (
                ("held", unions(1_000), "column 'u' is a union"),
                ("nested", nested, "column 'l' holds a union"),
            ):
                with pytest.raises(flightdeck.InvalidArgument, match=(
                        f"dataset '{name}' cannot be persisted: {said}, which the store "
                        r"\(Parquet\) cannot hold.*write each of its variants as a column")):
                    c.put_partition(name, 0, t)
            assert c.list_datasets() == []
            write(c, "kept", table(1_000, 7))
            assert c.describe("kept").persisted
    finally:
        stopped(server)


def test_place_without_a_driver(flightdeck_server):
    with flightdeck.connect(flightdeck_server.uri) as c:
        write(c, "d", table(100, 5))
        if c.stats().cuda_devices:
            pytest.skip("this machine has a CUDA driver; scripts/gpu-check.sh covers place")
        with pytest.raises(flightdeck.FailedPrecondition, match="no CUDA driver"):
            c.place("d", ["x"])
        assert c.evict("d").placements == []


def test_place_train_and_evict_on_a_gpu(flightdeck_server):
    """Where the server sees a CUDA device (`scripts/gpu-check.sh run`):
    `place` copies the named columns to device 0 and the server counts their
    bytes, a training job on GPU 0 trains from that copy, and `evict` gives
    them back (the count is 0 again, and the data still reads the same)."""
    with flightdeck.connect(flightdeck_server.uri) as c:
        if not c.stats().cuda_devices:
            pytest.skip("no CUDA device here: scripts/gpu-check.sh run checks place on a GPU")
        t = table(200_000, 6)
        write(c, "g", t)
        before = epoch(c, "g", "global")
        info = c.place("g", ["x", "label"])
        placed = [(p.device, sorted(p.columns), p.bytes) for p in info.placements]
        assert placed == [(0, ["label", "x"], 200_000 * 8)]
        stats = c.stats()
        assert stats.device_bytes == 200_000 * 8 and stats.host_pinned
        reports = list(c.train("g", ["x"], "label", classes=3, batch_size=1024, gpus=[0], seed=1))
        assert reports[-1].done and np.isfinite(reports[-1].loss), reports[-1]
        assert reports[-1].step == reports[-1].total_steps > 0
        assert c.evict("g").placements == []
        assert c.stats().device_bytes == 0
        assert epoch(c, "g", "global") == before


def test_a_spark_array_column_is_placed_and_trained_from_a_gpu(flightdeck_server):
    """Where the server sees a CUDA device (`scripts/gpu-check.sh run`): a
    list column whose rows all hold one number of values (what Spark writes
    for `array<float>`) is placed as its values — also by a `place` that
    names no columns — and a job on GPU 0 takes its features from that copy
    (the server's log says so) instead of host memory."""
    with flightdeck.connect(flightdeck_server.uri) as c:
        if not c.stats().cuda_devices:
            pytest.skip("no CUDA device here: scripts/gpu-check.sh run checks place on a GPU")
        rows, dim = 100_000, 8
        rng = np.random.default_rng(4)
        values = pa.array(rng.standard_normal(rows * dim).astype(np.float32))
        offsets = pa.array(np.arange(0, rows * dim + 1, dim, dtype=np.int32))
        t = pa.table(
            {
                "features": pa.ListArray.from_arrays(offsets, values),
                "label": pa.array(rng.integers(0, 3, rows).astype(np.int64)),
            }
        )
        write(c, "s", t)
        info = c.place("s")
        placed = [(p.device, sorted(p.columns), p.bytes) for p in info.placements]
        assert placed == [(0, ["features", "label"], rows * (dim * 4 + 8))]
        reports = list(c.train("s", ["features"], "label", classes=3, batch_size=1024, gpus=[0]))
        assert reports[-1].done and np.isfinite(reports[-1].loss), reports[-1]
        uploads = [line for line in flightdeck_server.stderr_lines if "uploads its rows" in line]
        assert len(uploads) == 1 and "device tier" in uploads[0], uploads


def test_a_reader_rides_out_a_restart_of_its_server(tmp_path):
    """Killed mid-epoch and started again with `--persist` on its port, the
    server's readers (`reconnect_seconds`) take their reads up where they
    stood: each rank's rows are exactly those of an uninterrupted read, in
    its order — read ahead or not, and for one of two workers of a rank."""
    import threading

    store = ("--memory-limit", "512MiB", "--persist", "--spill-url", str(tmp_path / "store"))
    server = RunningServer(*store)
    restarted = []

    def kill_and_restart():
        server.proc.kill()
        server.proc.wait()

        def later():
            time.sleep(1)
            restarted.append(RunningServer("--listen", server.addr, *store))

        threading.Thread(target=later, daemon=True).start()

    def reader(rank: int, **options) -> flightdeck.ShardedDataset:
        return flightdeck.ShardedDataset(
            server.uri,
            "kept",
            rank=rank,
            world_size=2,
            batch_rows=2000,
            read_rows=2000,
            seed=5,
            **{"reconnect_seconds": scaled(30), **options},
        )

    def ids(batches) -> list[int]:
        return [i for b in batches for i in b.column("id").to_pylist()]

    try:
        with flightdeck.connect(server.uri) as c:
            write(c, "kept", table(2_000_000, 1))
        whole = [ids(reader(r)) for r in range(2)]
        split = ids(reader(1, prefetch=0).iter_batches(split_count=2, split_index=1))
        assert sorted(whole[0] + whole[1]) == list(range(2_000_000))

        for rank, options in [(0, {}), (1, {"prefetch": 0})]:
            r = reader(rank, **options)
            got = []
            for n, batch in enumerate(r):
                got.append(batch)
                if n == 9:
                    kill_and_restart()
            assert r.reconnects == 1
            assert ids(got) == whole[rank], rank
            # The second the server was away is time the loop waited for data.
            assert r.stall_seconds >= 0.9, r.stall_seconds
            server = restarted.pop()

        r = reader(1, prefetch=0)
        got = []
        for n, batch in enumerate(r.iter_batches(split_count=2, split_index=1)):
            got.append(batch)
            if n == 4:
                kill_and_restart()
        assert r.reconnects == 1 and ids(got) == split
        server = restarted.pop()

        for bad in (-1, float("nan")):
            with pytest.raises(flightdeck.InvalidArgument, match="reconnect_seconds must be"):
                reader(0, reconnect_seconds=bad)
        # Without a wait, or past it, the read raises.
        for wait in (0, 1):
            r = flightdeck.ShardedDataset(
                server.uri,
                "kept",
                rank=0,
                world_size=2,
                batch_rows=2000,
                read_rows=2000,
                prefetch=0,
                reconnect_seconds=wait,
            )
            batches = iter(r)
            next(batches)
            server.proc.kill()
            server.proc.wait()
            started = time.monotonic()
            with pytest.raises(flightdeck.Unavailable):
                for _ in batches:
                    pass
            assert time.monotonic() - started < wait + scaled(10)
            server = RunningServer("--listen", server.addr, *store)
    finally:
        stopped(server)


def test_a_stop_sent_as_the_server_comes_up_drains_it(tmp_path):
    """SIGTERM the moment a server says it listens (while it loads what it
    persisted) stops it gracefully, exit code 0 — as Kubernetes may."""
    store = ("--memory-limit", "256MiB", "--persist", "--spill-url", str(tmp_path / "store"))
    server = RunningServer(*store)
    try:
        with flightdeck.connect(server.uri) as c:
            write(c, "kept", table(10_000, 1))
    finally:
        stopped(server)
    for _ in range(5):
        stopped(RunningServer(*store))
