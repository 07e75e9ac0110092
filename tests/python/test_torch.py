"""PyTorch: zero-copy tensors and a DataLoader with worker processes that
together yield every row of a rank's shard exactly once. Runs where torch is
installed, and always under CI (`conftest.require_torch`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pyarrow as pa
import pytest

from conftest import require_torch, scaled, strided_order, torchrun

torch = require_torch()

import flightdeck  # noqa: E402
from flightdeck import to_torch  # noqa: E402
from flightdeck.torch import FlightDeckIterableDataset  # noqa: E402


def test_to_torch_shares_the_arrow_buffer():
    n, d = 64, 8
    values = pa.array([float(i) for i in range(n * d)], pa.float32())
    column = pa.FixedSizeListArray.from_arrays(values, d)
    tensor = to_torch(column)
    assert tensor.shape == (n, d) and tensor.dtype == torch.float32
    assert tensor.data_ptr() == values.buffers()[1].address
    assert tensor[3, 2].item() == 26.0
    batch = pa.record_batch({"y": pa.array(range(n), pa.int64()), "x": column})
    assert to_torch(batch, "y").data_ptr() == batch.column("y").buffers()[1].address
    # Variable-size lists of one length (Spark's array<float>) too.
    offsets = pa.array(range(0, n * d + 1, d), pa.int32())
    lists = pa.ListArray.from_arrays(offsets, values)
    assert to_torch(lists).data_ptr() == values.buffers()[1].address


@pytest.mark.parametrize("burst_bytes", [0, 20_000])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_workers_yield_each_row_once(flightdeck_server, num_workers, burst_bytes):
    client = flightdeck.connect(flightdeck_server.uri)
    n = 10_007
    for p, (lo, hi) in enumerate([(0, 5000), (5000, 5001), (5001, n)]):
        client.put_partition(
            "t",
            p,
            pa.table(
                {
                    "id": pa.array(range(lo, hi), pa.int64()),
                    "x": pa.FixedSizeListArray.from_arrays(
                        pa.array([float(i) for i in range(lo, hi) for _ in range(4)], pa.float32()), 4
                    ),
                }
            ),
        )
    client.seal("t", partitions=3)
    seen = []
    # Read ahead on a thread (the default), or in bursts on the loop's (each
    # worker's) own thread.
    reading = {"prefetch": 0, "burst_bytes": burst_bytes} if burst_bytes else {}
    for rank in range(2):
        ds = FlightDeckIterableDataset(
            flightdeck_server.uri, "t", rank=rank, world_size=2, batch_rows=500, seed=4, **reading
        )
        ds.set_epoch(3)
        context = "spawn" if num_workers else None
        loader = torch.utils.data.DataLoader(
            ds, batch_size=None, num_workers=num_workers, multiprocessing_context=context
        )
        rank_ids = []
        for batch in loader:
            assert batch["x"].shape == (len(batch["id"]), 4)
            assert torch.equal(batch["x"][:, 0], batch["id"].to(torch.float32))
            rank_ids.extend(batch["id"].tolist())
        assert len(rank_ids) == -(-n // 2)
        assert len(loader) == -(-len(rank_ids) // 500)
        seen.append(rank_ids)
    order = strided_order(seen, n)
    assert sorted(order) == list(range(n))


def test_forked_workers_fail_clearly_instead_of_hanging(flightdeck_server):
    client = flightdeck.connect(flightdeck_server.uri)
    client.put_partition("f", 0, pa.table({"id": pa.array(range(10), pa.int64())}))
    client.seal("f")
    ds = FlightDeckIterableDataset(flightdeck_server.uri, "f", rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=1, multiprocessing_context="fork"
    )
    with pytest.raises(RuntimeError, match="spawn"):
        list(loader)


def test_the_dataset_reads_the_write_it_was_built_on(flightdeck_server):
    """Built in the training process, the dataset takes the seal there (so
    worker processes and `state_dict` count rows of one write): a write that
    lands before the first epoch fails it instead of being read."""
    client = flightdeck.connect(flightdeck_server.uri)
    client.put_partition("built", 0, pa.table({"id": pa.array(range(40), pa.int64())}))
    client.seal("built")
    seal = flightdeck.sealed_as(client.describe("built"))
    ds = FlightDeckIterableDataset(flightdeck_server.uri, "built", rank=0, world_size=1)
    assert ds.shards.sealed_as == seal
    client.drop("built")
    client.put_partition("built", 0, pa.table({"id": pa.array(range(60), pa.int64())}))
    client.seal("built")
    with pytest.raises(flightdeck.FailedPrecondition, match="build a new reader"):
        list(torch.utils.data.DataLoader(ds, batch_size=None))
    fresh = FlightDeckIterableDataset(flightdeck_server.uri, "built", rank=0, world_size=1)
    assert sum(len(b["id"]) for b in torch.utils.data.DataLoader(fresh, batch_size=None)) == 60

    # Not there yet when built: the seal is taken at the first read.
    later = FlightDeckIterableDataset(flightdeck_server.uri, "not-yet", rank=0, world_size=1)
    assert later.shards.sealed_as is None


def test_a_launched_rank_without_a_process_group_is_refused(flightdeck_server, monkeypatch):
    """Built under torchrun (WORLD_SIZE 2) before `init_process_group`, the
    dataset would have taken rank 0 of 1 and read every row on every rank;
    it is refused saying what to do, and ranks given explicitly still read."""
    client = flightdeck.connect(flightdeck_server.uri)
    client.put_partition("launched", 0, pa.table({"id": pa.array(range(40), pa.int64())}))
    client.seal("launched")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(flightdeck.FailedPrecondition, match=r"this process is rank 1 of 2 .* "
                       r"call torch\.distributed\.init_process_group\(\) before building"):
        FlightDeckIterableDataset(flightdeck_server.uri, "launched", batch_rows=10)
    half = FlightDeckIterableDataset(flightdeck_server.uri, "launched", rank=1, world_size=2,
                                     batch_rows=10)
    assert sum(len(b["id"]) for b in half) == 20
    whole = FlightDeckIterableDataset(flightdeck_server.uri, "launched", rank=0, world_size=1,
                                      batch_rows=10)
    assert sum(len(b["id"]) for b in whole) == 40


def test_ranks_agree_on_one_write_or_all_refuse(monkeypatch):
    import torch.distributed as dist

    from flightdeck.torch import agreed_seal

    def gathered(seals):
        def all_gather_object(out, mine, group=None):
            out[:] = seals

        monkeypatch.setattr(dist, "get_world_size", lambda: len(seals))
        monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
        monkeypatch.setattr(dist, "get_backend", lambda: "gloo")

    gathered([7, 7, 0])  # one rank saw it before the seal
    assert agreed_seal("d", 0) == 7
    gathered([0, 0])
    assert agreed_seal("d", 0) == 0
    gathered([7, 9, 7])
    with pytest.raises(RuntimeError, match=r"'d' was written again.*\[7, 9\]"):
        agreed_seal("d", 7)


def test_object_collectives_run_on_gloo_beside_an_nccl_group(monkeypatch):
    """Under an NCCL process group the node map and the seal are gathered
    on a gloo group of the same ranks (NCCL's object collectives need each
    rank's CUDA device set), made once and reused."""
    import torch.distributed as dist

    from flightdeck import torch as fd_torch

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert fd_torch.object_group() is None, "gloo itself gathers objects"
        made = []
        new_group = dist.new_group

        def counted(*args, **kwargs):
            made.append(kwargs.get("backend"))
            return new_group(*args, **kwargs)

        monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
        monkeypatch.setattr(dist, "new_group", counted)
        group = fd_torch.object_group()
        assert group is not None and made == ["gloo"]
        assert fd_torch.object_group() is group and made == ["gloo"], "made once"
        out = [None]
        dist.all_gather_object(out, 5, group=group)
        assert out == [5]
        assert fd_torch.agreed_seal("d", 9) == 9
    finally:
        dist.destroy_process_group()
        fd_torch._gloo = None


def put_vectors(client, name: str, n: int) -> None:
    """`name`: ids 0..n and a 4-wide float vector [id]*4, sealed."""
    client.put_partition(
        name,
        0,
        pa.table(
            {
                "id": pa.array(range(n), pa.int64()),
                "x": pa.FixedSizeListArray.from_arrays(
                    pa.array([float(i) for i in range(n) for _ in range(4)], pa.float32()), 4
                ),
            }
        ),
    )
    client.seal(name)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_transform_runs_on_the_read_ahead_thread(flightdeck_server, prefetch):
    import threading

    client = flightdeck.connect(flightdeck_server.uri)
    put_vectors(client, "th", 3000)
    threads = []

    def transform(batch):
        threads.append(threading.current_thread().name)
        return batch.column("id").to_pylist()

    ds = FlightDeckIterableDataset(
        flightdeck_server.uri, "th", rank=0, world_size=1, batch_rows=500, seed=2,
        transform=transform, prefetch=prefetch,
    )
    it = iter(ds)
    first = next(it)
    assert len(first) == 500
    # Only what was handed out counts, whatever the thread has read ahead.
    assert ds.state_dict()["start_sample"] == 500
    ids = first + [i for batch in it for i in batch]
    assert sorted(ids) == list(range(3000))
    expected = "flightdeck-prefetch" if prefetch else threading.main_thread().name
    assert set(threads) == {expected}


def test_pin_memory_hands_over_page_locked_tensors(flightdeck_server):
    """With CUDA (always under `FLIGHTDECK_GPU_TESTS=1`, as
    `scripts/gpu-check.sh run` sets): every tensor arrives pinned and copies
    to the GPU without blocking, equal to the data. Without: a clear error
    when the dataset is made."""
    import os

    client = flightdeck.connect(flightdeck_server.uri)
    put_vectors(client, "pin", 2000)
    make = lambda: FlightDeckIterableDataset(  # noqa: E731
        flightdeck_server.uri, "pin", rank=0, world_size=1, batch_rows=256, pin_memory=True
    )
    if not torch.cuda.is_available():
        assert not os.environ.get("FLIGHTDECK_GPU_TESTS"), "FLIGHTDECK_GPU_TESTS is set but torch sees no GPU"
        with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
            make()
        return
    seen = []
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for batch in make():
            assert batch["x"].is_pinned() and batch["id"].is_pinned()
            x = batch["x"].to("cuda", non_blocking=True)
            ids = batch["id"].to("cuda", non_blocking=True)
            assert torch.equal(x[:, 3], ids.to(torch.float32))
            seen.extend(ids.tolist())
    assert sorted(seen) == list(range(2000))


def test_device_hands_over_batches_already_on_the_gpu(flightdeck_server):
    """`device="cuda"` (with CUDA: always under `FLIGHTDECK_GPU_TESTS=1`):
    every tensor arrives on the GPU, equal to the data and in the same
    order, the batches of a message views of one copy, `state_dict` counting
    only what was handed out, a transform's tensors moved too, and worker
    processes refused. `device="cpu"` reads as without it; a device torch
    does not know, or CUDA where there is none, is a clear error."""
    import os

    uri = flightdeck_server.uri
    put_vectors(flightdeck.connect(uri), "dev", 3000)

    def make(**kw):
        return FlightDeckIterableDataset(uri, "dev", rank=0, world_size=1, batch_rows=256, seed=4, **kw)

    plain = [b["id"].tolist() for b in make()]
    assert len(plain) == 12 and sorted(i for b in plain for i in b) == list(range(3000))
    assert [b["id"].tolist() for b in make(device="cpu")] == plain
    with pytest.raises(ValueError, match="not a device torch knows"):
        make(device="gpu7")
    if not torch.cuda.is_available():
        assert not os.environ.get("FLIGHTDECK_GPU_TESTS"), "FLIGHTDECK_GPU_TESTS is set but torch sees no GPU"
        with pytest.raises(ValueError, match="device='cuda' needs CUDA"):
            make(device="cuda")
        return
    for prefetch in (0, 2):
        ds = make(device="cuda", prefetch=prefetch)
        it = iter(ds)
        first = next(it)
        assert ds.state_dict()["start_sample"] == 256
        batches = [first, *it]
        assert all(t.is_cuda for b in batches for t in b.values())
        assert [b["id"].tolist() for b in batches] == plain
        assert all(torch.equal(b["x"][:, 3], b["id"].to(torch.float32)) for b in batches)
        copies = {b["id"].untyped_storage().data_ptr() for b in batches}
        assert len(copies) < len(batches), "each batch copied on its own"
    moved = [t for (t,) in make(device="cuda", transform=lambda b: (to_torch(b, "id"),))]
    assert all(t.is_cuda for t in moved) and [t.tolist() for t in moved] == plain
    # One worker: a second one still starting when the first's error ends
    # the loader would die later, failing whichever test runs then.
    loader = torch.utils.data.DataLoader(
        make(device="cuda"), batch_size=None, num_workers=1, multiprocessing_context="spawn"
    )
    with pytest.raises(ValueError, match="num_workers=0"):
        list(loader)


def overwrite(client, name: str, ids: range, write_id: str) -> None:
    """Replaces dataset `name` by one partition of `ids`, as a Spark
    overwrite does: staged beside it, swapped in at the seal."""
    table = pa.table({"id": pa.array(ids, pa.int64())})
    client.put_partition(name, 0, table, write_id=write_id, replace=True)
    client.seal(name, partitions=1, replace_write=write_id)


def epoch_ids(ds) -> list[int]:
    return [i for b in torch.utils.data.DataLoader(ds, batch_size=None) for i in b["id"].tolist()]


def test_a_reader_following_writes_moves_to_the_newest_at_each_new_epoch(flightdeck_server):
    """A dataset rewritten while training runs (a nightly overwrite): with
    `follow_writes` the next epoch reads the new write and the epoch under
    way ends on the rows it began with; without it the next epoch refuses."""
    uri = flightdeck_server.uri
    client = flightdeck.connect(uri)
    client.put_partition("nightly", 0, pa.table({"id": pa.array(range(4000), pa.int64())}))
    client.seal("nightly")
    # One batch a message: the epoch under way is still streaming at the
    # overwrite.
    kw = dict(rank=0, world_size=1, batch_rows=8, read_rows=8, seed=3)
    follows = FlightDeckIterableDataset(uri, "nightly", follow_writes=True, **kw)
    pinned = FlightDeckIterableDataset(uri, "nightly", **kw)
    assert sorted(epoch_ids(follows)) == sorted(epoch_ids(pinned)) == list(range(4000))

    # Rewritten in the middle of epoch 1: the epoch goes on with the old rows.
    follows.set_epoch(1)
    pinned.set_epoch(1)
    batches = iter(torch.utils.data.DataLoader(follows, batch_size=None))
    first = next(batches)["id"].tolist()
    overwrite(client, "nightly", range(100, 160), "w1")
    rest = [i for b in batches for i in b["id"].tolist()]
    assert sorted(first + rest) == list(range(4000))
    with pytest.raises(flightdeck.FailedPrecondition, match="build a new reader"):
        epoch_ids(pinned)

    follows.set_epoch(2)
    assert len(follows) == 60 // 8 + 1
    assert sorted(epoch_ids(follows)) == list(range(100, 160))
    # Setting the epoch under way again (as a resume does) stays on its write.
    overwrite(client, "nightly", range(200, 210), "w2")
    follows.set_epoch(2)
    with pytest.raises(flightdeck.FailedPrecondition, match="written again"):
        epoch_ids(follows)
    follows.set_epoch(3)
    assert sorted(epoch_ids(follows)) == list(range(200, 210))
    # Worker processes read the write their epoch moved to.
    overwrite(client, "nightly", range(300, 333), "w3")
    follows.set_epoch(4)
    loader = torch.utils.data.DataLoader(
        follows, batch_size=None, num_workers=2, multiprocessing_context="spawn"
    )
    assert sorted(i for b in loader for i in b["id"].tolist()) == list(range(300, 333))
    # Dropped: the next epoch finds nothing to move to and its read says so;
    # written anew, the epoch after reads it.
    client.drop("nightly")
    follows.set_epoch(5)
    with pytest.raises(flightdeck.NotFound):
        epoch_ids(follows)
    client.put_partition("nightly", 0, pa.table({"id": pa.array(range(7), pa.int64())}))
    client.seal("nightly")
    follows.set_epoch(6)
    assert sorted(epoch_ids(follows)) == list(range(7))

    with pytest.raises(ValueError, match="pass one of them"):
        FlightDeckIterableDataset(uri, "nightly", follow_writes=True, sealed_as=0, **kw)


def test_ranks_following_writes_look_again_until_they_see_the_same_one(monkeypatch):
    """Ranks that saw two writes (a seal landed between their looks) look
    again together; every rank raises where that never settles, and where
    one rank's look failed."""
    import torch.distributed as dist

    from flightdeck import torch as fd_torch

    rounds: list[list] = []

    def all_gather_object(out, mine, group=None):
        others = rounds.pop(0)
        out[:] = [mine, *others]

    monkeypatch.setattr(dist, "get_world_size", lambda: 3)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(fd_torch, "FOLLOW_PAUSE_SECONDS", 0.0)
    looks = iter([7, 9])
    rounds[:] = [[(9, False), (9, False)], [(9, False), (9, False)]]
    assert fd_torch.newest_agreed_seal("d", lambda: next(looks)) == 9
    assert rounds == [], "looked twice"

    rounds[:] = [[(9, False), (0, False)]] * fd_torch.FOLLOW_ROUNDS
    with pytest.raises(RuntimeError, match=r"'d' was written again .*next epoch.*\[7, 9\]"):
        fd_torch.newest_agreed_seal("d", lambda: 7)
    assert rounds == []

    rounds[:] = [[(0, True), (7, False)]]
    with pytest.raises(RuntimeError, match="another rank could not look up dataset 'd'"):
        fd_torch.newest_agreed_seal("d", lambda: 7)

    def fails():
        raise flightdeck.NotFound("dataset 'd' does not exist")

    rounds[:] = [[(7, False), (7, False)]]
    with pytest.raises(flightdeck.NotFound):
        fd_torch.newest_agreed_seal("d", fails)
    assert rounds == [], "the failing rank still entered the collective"


FOLLOWER = textwrap.dedent(
    """
    import json, os
    import pyarrow as pa
    import torch.distributed as dist
    from torch.utils.data import DataLoader
    import flightdeck
    from flightdeck.torch import FlightDeckIterableDataset

    def write(ids, write_id=""):
        # Partition p on server p % n, sealed across them where n > 1.
        servers = os.environ["FOLLOW_SERVERS"].split(",")
        parts = [ids[i::4] for i in range(4)]
        layout = {}
        for p, part in enumerate(parts):
            server = servers[p % len(servers)]
            table = pa.table({"id": pa.array(part, pa.int64())})
            flightdeck.connect(server).put_partition(
                "followed", p, table, write_id=write_id, replace=bool(write_id))
            layout.setdefault(server, {})[p] = 0
        c = flightdeck.connect(servers[0])
        if len(servers) > 1:
            c.seal_cluster("followed", layout, partitions=4, replace_write=write_id)
        else:
            c.seal("followed", partitions=4, replace_write=write_id)

    if os.environ.get("FOLLOW_WRITE_FIRST"):
        write(list(range(80)))
        raise SystemExit(0)
    dist.init_process_group("gloo")
    data = FlightDeckIterableDataset("local", "followed", batch_rows=10, seed=1,
                                     follow_writes=True)
    epochs = []
    for epoch in range(3):
        data.set_epoch(epoch)
        epochs.append([i for b in DataLoader(data, batch_size=None) for i in b["id"].tolist()])
        dist.barrier()
        if dist.get_rank() == 0 and epoch < 2:  # tonight's Spark job
            start = 1000 * (epoch + 1)
            write(list(range(start, start + 100 + 50 * epoch)), f"night{epoch}")
        dist.barrier()
    print(json.dumps({"rank": dist.get_rank(), "epochs": epochs, "nodes": data.shards.nodes}))
    dist.destroy_process_group()
    """
)


@pytest.mark.parametrize("nodes", [1, 2], ids=["one server", "two nodes"])
def test_ddp_ranks_following_writes_move_together_with_equal_steps(request, nodes, tmp_path):
    """Gloo ranks started the way torchrun starts them (two per node), the
    dataset rewritten between epochs by rank 0 (on two nodes, across both
    servers): every epoch all ranks read the same write, equal counts, each
    of its rows once."""
    if nodes == 1:
        servers = [request.getfixturevalue("flightdeck_server").uri]
    else:
        servers = [m.uri for m in request.getfixturevalue("members")[:2]]
    script = tmp_path / "follower.py"
    script.write_text(FOLLOWER)
    env = dict(FOLLOW_SERVERS=",".join(servers))
    first = dict(os.environ, **env, FOLLOW_WRITE_FIRST="1")
    subprocess.run([sys.executable, str(script)], env=first, check=True, timeout=scaled(120))
    results = torchrun(script, servers, ranks_per_node=2, env=env)
    world = 2 * nodes
    writes = [range(80), range(1000, 1100), range(2000, 2150)]
    for epoch, ids in enumerate(writes):
        ranks = [r["epochs"][epoch] for r in results]
        assert [len(r) for r in ranks] == [-(-len(ids) // world)] * world, "equal steps"
        assert sorted(set(sum(ranks, []))) == list(ids)
    if nodes > 1:
        assert all(r["nodes"] == servers for r in results)


def test_persistent_workers_read_the_epoch_set_and_the_state_loaded(flightdeck_server):
    """`persistent_workers=True` keeps the dataset copies the workers started
    with: each epoch they read is still the one set in the training process
    (its own order), a loaded state resumes where it says, and a followed
    write is read."""
    uri = flightdeck_server.uri
    client = flightdeck.connect(uri)
    client.put_partition("kept", 0, pa.table({"id": pa.array(range(600), pa.int64())}))
    client.seal("kept")
    kw = dict(rank=0, world_size=1, batch_rows=10, seed=5)
    ds = FlightDeckIterableDataset(uri, "kept", follow_writes=True, **kw)
    reference = FlightDeckIterableDataset(uri, "kept", **kw)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=2, multiprocessing_context="spawn", persistent_workers=True
    )

    def read() -> list[int]:
        return [i for b in loader for i in b["id"].tolist()]

    def expected(epoch: int) -> list[int]:
        reference.set_epoch(epoch)
        return epoch_ids(reference)

    assert read() == expected(0)
    ds.set_epoch(1)
    assert read() == expected(1) != expected(0)
    ds.load_state_dict({"epoch": 2, "start_sample": 300, "world_size": 1})
    ds.set_epoch(2)
    assert read() == expected(2)[300:]
    ds.set_epoch(3)
    assert read() == expected(3)
    overwrite(client, "kept", range(1000, 1077), "w1")
    ds.set_epoch(4)
    assert sorted(read()) == list(range(1000, 1077))
