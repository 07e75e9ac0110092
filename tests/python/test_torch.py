"""PyTorch: zero-copy tensors and a DataLoader with worker processes that
together yield every row of a rank's shard exactly once. Runs where torch is
installed, and always under CI (`conftest.require_torch`)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from conftest import require_torch, strided_order

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
