"""PyTorch integration: `FlightDeckIterableDataset` for `DataLoader`.

Import is optional: the rest of the package works without torch.

    loader = DataLoader(FlightDeckIterableDataset(uri, "features", batch_rows=4096),
                        batch_size=None, num_workers=2, multiprocessing_context="spawn")

With `batch_size=None` every item is one batch of the rank's shard, a dict of
column name → tensor. With `num_workers = n > 1` worker `i` reads only the
batches `b % n == i` of its rank's stream (the server sends each worker just
its part), so together they yield every row of the shard once, and
DataLoader's round-robin puts them back in stream order. Worker processes
must be started with `spawn` or `forkserver`: gRPC, under every Flight
client, does not work in a process forked after a connection was opened (the
dataset raises a clear error instead of hanging). Persistent workers
(`persistent_workers=True`) keep the copy of the dataset they started with;
what `set_epoch` and `load_state_dict` change in the training process reaches
them through shared memory, so each epoch they read is the one set.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

import pyarrow as pa
import torch
import torch.utils.data

import os
import time

from . import _wire as wire
from .client import connect, sealed_as as seal_of
from .dataset import ShardedDataset, env_ranks_per_node
from .errors import FailedPrecondition, NotFound
from .tensors import to_torch


def batch_to_tensors(batch: pa.RecordBatch) -> dict[str, torch.Tensor]:
    """Every column as a tensor sharing Arrow's memory (see `to_torch`)."""
    return {name: to_torch(batch, name) for name in batch.schema.names}


def _distributed_rank_and_size() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _check_launched_ranks_have_a_group(dist_size: int) -> None:
    """Refuses to take rank 0 of 1 in a process a launcher (torchrun) started
    as one rank of several (`WORLD_SIZE` above 1) before its process group
    is initialised: every rank would then read every row, training on each
    sample once per rank, with nothing to say so."""
    launched = os.environ.get("WORLD_SIZE", "1").strip()
    if dist_size > 1 or not launched.isdigit() or int(launched) <= 1:
        return
    raise FailedPrecondition(
        f"this process is rank {os.environ.get('RANK', '?')} of {launched} (the launcher's RANK "
        "and WORLD_SIZE), but torch.distributed is not initialised, so every rank would read "
        "every row: call torch.distributed.init_process_group() before building the dataset, "
        "or pass rank= and world_size= (rank=0, world_size=1 reads every row here)"
    )


#: The gloo group object collectives run on where the default process
#: group has no gloo backend, made once per default group: `(world, group)`.
_gloo: tuple[Any, Any] | None = None


def object_group():
    """The process group this module's object collectives run on: the
    default one where it has a gloo backend, else a gloo group over the same
    ranks, made on first use (by every rank, as the collectives are). NCCL
    runs object collectives on each rank's current CUDA device, and a
    dataset built before `torch.cuda.set_device` would have every rank of a
    node on device 0: NCCL refuses that, or hangs."""
    import torch.distributed as dist

    global _gloo
    if "gloo" in str(dist.get_backend()):
        return None
    world = dist.group.WORLD
    if _gloo is None or _gloo[0] is not world:
        _gloo = (world, dist.new_group(backend="gloo"))
    return _gloo[1]


def node_locations(uri: str, dataset: str, ranks_per_node: int) -> tuple[list[str], str]:
    """Each node's server, in node order, from every rank's own server
    `uri` (a collective: every rank calls it), and the server this rank
    plans its reads through: `uri` where that holds the dataset, else
    another node's server that does — a node whose server holds none of it
    (a small dataset Spark wrote from some nodes' executors only) gets ""
    in the map. The map is [] when the dataset is held by one server or
    without a process group; raises :class:`NotFound` on every rank when
    no rank's server holds it."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or ranks_per_node < 1:
        return [], uri
    mine, members, held, failure = "", [], False, None
    try:
        with connect(uri) as client:
            mine = client.location
            try:
                info = client.describe(dataset)
            except NotFound:
                pass  # another node's server holds it, or none does
            else:
                held = True
                layout = info.layout.members if info.layout else []
                members = sorted(m.location for m in layout)
    except Exception as e:  # raised by the gather, after the collective
        failure = e
    node = int(os.environ.get("GROUP_RANK", dist.get_rank() // ranks_per_node))
    everyone = gather_looks(
        (node, mine, held, members),
        failure,
        f"reach its flightdeck server to learn the node map of dataset '{dataset}'",
    )
    holders = [location for _, location, has, _ in everyone if has]
    if not holders:
        servers = ", ".join(sorted({location for _, location, _, _ in everyone}))
        raise NotFound(
            f"dataset '{dataset}' is on none of this job's flightdeck servers ({servers}): "
            "write it first, or check its name"
        )
    through = uri if held else holders[0]
    known = {location for *_, listed in everyone for location in listed}
    if not known:
        return [], through
    nodes = [""] * ((dist.get_world_size() + ranks_per_node - 1) // ranks_per_node)
    for n, location, _, _ in everyone:
        if 0 <= n < len(nodes) and location in known:
            nodes[n] = location
    return nodes, through


def gather_looks(mine: Any, failure: Exception | None, what: str) -> list:
    """What every rank of the process group looked up (a collective: every
    rank calls it, even one whose own look failed — `failure`, raised here
    after the others got its word — or they would wait in it for ever); a
    rank whose look did not fail raises where another's did, saying it could
    not `what`."""
    import torch.distributed as dist

    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (mine, failure is not None), group=object_group())
    if failure is not None:
        raise failure
    if any(failed for _, failed in everyone):
        raise RuntimeError(f"another rank could not {what}; see that rank's error")
    return [looked for looked, _ in everyone]


def agreed_seal(dataset: str, mine: int) -> int:
    """The seal of `dataset` every rank of the process group saw (a
    collective: every rank calls it; 0 where none saw it sealed). Raises on
    every rank where ranks saw two different writes."""
    import torch.distributed as dist

    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine, group=object_group())
    seen = {seal for seal in everyone if seal}
    if len(seen) > 1:
        raise _two_writes(dataset, seen, "building their readers")
    return seen.pop() if seen else 0


#: How often the ranks look again where they saw two writes of a dataset
#: they follow (one landed between their looks), and the pause between.
FOLLOW_ROUNDS, FOLLOW_PAUSE_SECONDS = 5, 0.2


def newest_agreed_seal(dataset: str, look: Callable[[], int]) -> int:
    """The newest seal of `dataset`, the same on every rank of the process
    group (a collective: every rank calls it). Each rank `look()`s at its
    own server; where they saw two writes (a seal landed between their
    looks) they look again, together, a few times before raising on every
    rank. A rank whose look fails raises its error, the others say so."""
    for _ in range(FOLLOW_ROUNDS):
        seal, failure = 0, None
        try:
            seal = look()
        except Exception as e:  # raised by the gather, after the collective
            failure = e
        everyone = gather_looks(
            seal,
            failure,
            f"look up dataset '{dataset}' on its flightdeck server for the next epoch",
        )
        seen = {s for s in everyone if s}
        if len(seen) <= 1:
            return seen.pop() if seen else 0
        time.sleep(FOLLOW_PAUSE_SECONDS)
    raise _two_writes(dataset, seen, "moving to the next epoch")


def _two_writes(dataset: str, seen: set[int], when: str) -> RuntimeError:
    return RuntimeError(
        f"dataset '{dataset}' was written again while the ranks were {when} (they saw "
        f"seals {sorted(seen)}): build the readers again, on every rank"
    )


class FlightDeckIterableDataset(torch.utils.data.IterableDataset):
    """This rank's shard of each epoch as an `IterableDataset` of batches.

    `rank` and `world_size` default to `torch.distributed`'s when a process
    group is initialised, else 0 and 1 — except in a process a launcher
    started as one rank of several (torchrun's `WORLD_SIZE` above 1), which
    is refused until its process group is initialised (every rank would
    otherwise read every row). `transform` turns each
    `pyarrow.RecordBatch` into what the training loop wants (default: a dict
    of tensors).

    On a dataset sealed across servers, under torchrun (`LOCAL_WORLD_SIZE`,
    `GROUP_RANK`) with a process group, the ranks learn every node's server
    from each other when the dataset is built (a collective: build it on
    every rank), so each rank reads from its own node's server, and
    `locality="node"` reads each node's own rows. The ranks of a node whose
    server holds none of the dataset read through a server that does.

    Every epoch reads the dataset as it was sealed when this object was
    built (see `ShardedDataset`'s `sealed_as`), taken in this process so
    that worker processes and :meth:`state_dict` count rows of the same
    write. Where `rank` and `world_size` come from the process group, the
    ranks agree on it when the dataset is built (a collective: build it on
    every rank); a write that lands while they start fails every rank's
    build instead of giving ranks different data.

    With `follow_writes=True` a dataset rewritten while training runs (a
    nightly Spark job) is followed instead: each :meth:`set_epoch` that
    starts another epoch moves to the newest write — where `rank` and
    `world_size` come from the process group, every rank to the same one,
    agreed as at the build (and a cluster's node map is learnt again) — so
    the next epoch reads the new rows on every rank and the epoch under way
    finishes on the rows it started with. Resuming the epoch a state was
    saved in (:meth:`load_state_dict`, then `set_epoch` of that epoch)
    keeps to the write the reader holds. These collectives run on
    gloo: under an NCCL process group, on a gloo group of the same ranks
    made once (so the dataset may be built before `torch.cuda.set_device`).

    DataLoader worker processes read what this object was set to when
    they start each epoch — persistent ones (`persistent_workers=True`),
    which keep the copy they were started with, included: the epoch set,
    the state loaded and the write followed reach them through shared
    memory (see `Published`).

    About `prefetch` batches, or the next message where that holds more,
    are read ahead on a background thread (see
    `ShardedDataset`, also for `read_rows`, the rows a message from the
    server carries), and `transform` runs there too; `stall_seconds` is
    how long this process's iteration waited for data this epoch. Training
    on the CPU cores the server runs on, read on the loop's own thread
    instead (`prefetch=0`, or in bursts with `burst_bytes=64 << 20`; see
    `ShardedDataset`).

    `reconnect_seconds=120` rides out a restart of the server (started with
    `--persist`) mid-epoch: the read is taken up where this rank stood once
    the server is back (see `ShardedDataset`).

    `pin_memory=True` (needs CUDA) copies every tensor of each batch into
    page-locked host memory on that thread, the way DataLoader's
    `pin_memory` does, so the loop's `tensor.to("cuda", non_blocking=True)`
    is an asynchronous copy that overlaps the step. (Arrow's buffers are
    pageable; without pinning a host-to-device copy waits for itself.)

    `device="cuda"` (or `"cuda:N"`, a `torch.device`) hands over batches
    already on that GPU (without an index: the device current where
    iteration begins): the read-ahead thread copies each message's tensors
    there once, through page-locked memory, asynchronously on the stream
    that was current when iteration began, and each batch is a view of
    them — the loop's step neither copies nor launches a copy. A
    `transform`'s tensors are copied a batch at a time. It needs the
    training process's own iteration (`num_workers=0`): DataLoader worker
    processes cannot hand over GPU memory this way.
    """

    def __init__(
        self,
        uri: str,
        dataset: str,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        batch_rows: int = 1024,
        shuffle: str = "global",
        seed: int = 0,
        drop_last: bool = False,
        columns: Sequence[str] | None = None,
        block_rows: int = 0,
        transform: Callable[[pa.RecordBatch], Any] = batch_to_tensors,
        timeout: float | None = None,
        locality: str = "global",
        ranks_per_node: int | None = None,
        nodes: Sequence[str] | None = None,
        prefetch: int = 2,
        pin_memory: bool = False,
        device: str | torch.device | None = None,
        filter: str = "",
        select: Sequence[str] = (),
        read_rows: int | None = None,
        burst_bytes: int = 0,
        sealed_as: int | None = None,
        reconnect_seconds: float = 0.0,
        follow_writes: bool = False,
    ) -> None:
        super().__init__()
        if follow_writes and sealed_as is not None:
            raise ValueError(
                f"follow_writes moves the reader to each new write of '{dataset}' and "
                f"sealed_as={sealed_as} keeps it to one: pass one of them"
            )
        if pin_memory and not torch.cuda.is_available():
            raise ValueError(
                "pin_memory=True needs CUDA, and torch.cuda.is_available() is False here; "
                "leave pin_memory off on a machine without a GPU"
            )
        self.pin_memory = pin_memory
        #: Where batches are handed over (None: host memory, as read).
        self.device = on_device(device)
        dist_rank, dist_size = _distributed_rank_and_size()
        if rank is None or world_size is None:
            _check_launched_ranks_have_a_group(dist_size)
        # Built on every rank of the group: the ranks agree on the seal.
        from_group = rank is None and world_size is None and dist_size > 1
        rank = dist_rank if rank is None else rank
        world_size = dist_size if world_size is None else world_size
        self.shards = ShardedDataset(
            uri,
            dataset,
            rank=rank,
            world_size=world_size,
            batch_rows=batch_rows,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            columns=columns,
            block_rows=block_rows,
            timeout=timeout,
            locality=locality,
            ranks_per_node=ranks_per_node,
            nodes=nodes,
            prefetch=prefetch,
            filter=filter,
            select=select,
            read_rows=read_rows,
            burst_bytes=burst_bytes,
            sealed_as=sealed_as,
            reconnect_seconds=reconnect_seconds,
        )
        #: This rank's own server (the one `uri` names).
        self._own_uri = uri
        if nodes is None:
            self._learn_nodes()
        try:
            self.shards.pin()
        except Exception:  # not there yet, or unreachable: the first read says so
            pass
        if from_group and sealed_as is None:
            self.shards.sealed_as = agreed_seal(dataset, self.shards.sealed_as or 0) or None
        self.transform = transform
        #: Whether each new epoch moves to the dataset's newest write (see
        #: the class's description).
        self.follow_writes = follow_writes
        self._from_group = from_group
        # The node map is learnt again with each write followed where the
        # ranks learnt it from each other (a collective, as the agreement).
        self._nodes_learnt = from_group and nodes is None
        self._published = Published()

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch the next iteration reads (with `follow_writes`,
        another epoch than the one under way also moves to the dataset's
        newest write: a collective where the ranks come from the process
        group, so call it on every rank)."""
        moving = self.follow_writes and epoch != self.shards.epoch
        self.shards.set_epoch(epoch)
        if moving:
            self._follow()
        self._published.publish(self.shards._position())

    def _follow(self) -> None:
        """Takes the dataset's newest seal (every rank the same one)."""
        shards = self.shards

        def look() -> int:
            # A server holding none of the new write (a node it left out,
            # or a dataset dropped) saw nothing, as at the build.
            try:
                info = shards.client.describe(shards.dataset)
            except NotFound:
                return 0
            return seal_of(info) if info.state == wire.DATASET_STATE_SEALED else 0

        seal = newest_agreed_seal(shards.dataset, look) if self._from_group else look()
        if seal != shards.sealed_as:
            shards.read_seal(seal)
            if self._nodes_learnt:
                self._learn_nodes()

    def _learn_nodes(self) -> None:
        """Learns the node map from the other ranks (a collective), and
        reads through another node's server where this one's holds none of
        the dataset (see `node_locations`)."""
        shards = self.shards
        shards.nodes, through = node_locations(self._own_uri, shards.dataset, shards.ranks_per_node)
        shards.read_through(through)

    @property
    def stall_seconds(self) -> float:
        """How long this process's iteration waited for batches this epoch
        (with worker processes, each worker's own figure stays in it)."""
        return self.shards.stall_seconds

    def state_dict(self, batches: int | None = None) -> dict[str, int]:
        """Where this epoch stands. With worker processes this object does
        not see what they read: pass `batches`, the batches each rank's
        training loop consumed this epoch."""
        return self.shards.state_dict(batches)

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resumes mid-epoch, with this or another world size."""
        self.shards.load_state_dict(state)
        self._published.publish(self.shards._position())

    def __len__(self) -> int:
        return len(self.shards)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        if info is not None:
            # A persistent worker's copy may hold an epoch set before.
            position = self._published.newer()
            if position is not None:
                self.shards._take_position(position)
        split = (0, 0) if info is None or info.num_workers <= 1 else (info.num_workers, info.id)
        prepare = transform = self.transform
        device = self.device
        if device is not None and device.type == "cuda":
            if info is not None:
                raise ValueError(
                    f"device='{device}' hands batches over in GPU memory, which DataLoader "
                    "worker processes cannot pass on: iterate in the training process "
                    "(num_workers=0), or leave device unset and copy in the loop"
                )
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            # The loop's stream, where it stands now: the copies are queued
            # on it, so its kernels run after them without an event.
            stream = torch.cuda.current_stream(device)

            def prepare(batch: pa.RecordBatch) -> Any:
                with torch.cuda.stream(stream):
                    return moved(pinned(transform(batch)), device)

        elif self.pin_memory:

            def prepare(batch: pa.RecordBatch) -> Any:
                return pinned(transform(batch))

        # The default transform's tensors are sliced per batch out of one
        # conversion of each message; a caller's transform sees each batch.
        cut = sliced_tensors if self.transform is batch_to_tensors else None
        yield from self.shards.iter_batches(*split, prepare=prepare, slice_prepared=cut)


class Published:
    """The reader's position as the training process last set it, in shared
    memory for its DataLoader worker processes: a persistent worker
    (`persistent_workers=True`) keeps the copy of the dataset it started
    with, so an epoch set, a state loaded or a write followed afterwards
    reaches it only this way. A version and a JSON document: each copy
    knows the version it holds and takes a newer one when it starts an
    epoch."""

    #: Bytes of shared memory: a version and a length (8 bytes each), then
    #: the document (its node map is what may grow).
    SIZE = 1 << 16

    def __init__(self) -> None:
        self._memory = torch.zeros(self.SIZE, dtype=torch.uint8).share_memory_()
        self._seen = 0

    def _head(self) -> torch.Tensor:
        return self._memory[:16].view(torch.int64)

    def publish(self, position: dict[str, Any]) -> None:
        """Makes `position` the one every copy takes at its next epoch."""
        body = json.dumps(position).encode()
        if len(body) > self.SIZE - 16:
            raise ValueError(
                f"the reader's position takes {len(body)} bytes, more than the "
                f"{self.SIZE - 16} its worker processes are handed: pass fewer nodes"
            )
        head = self._head()
        self._memory[16 : 16 + len(body)] = torch.tensor(list(body), dtype=torch.uint8)
        head[1] = len(body)
        head[0] += 1
        self._seen = int(head[0])

    def newer(self) -> dict[str, Any] | None:
        """The position published since this copy last took one, if any."""
        head = self._head()
        version = int(head[0])
        if version == self._seen:
            return None
        body = bytes(self._memory[16 : 16 + int(head[1])].tolist())
        self._seen = version
        return json.loads(body)


def sliced_tensors(tensors: dict[str, torch.Tensor], start: int, rows: int) -> dict[str, torch.Tensor]:
    """Rows `start..start + rows` of each tensor (views, no copy)."""
    return {name: t[start : start + rows] for name, t in tensors.items()}


def on_device(device: str | torch.device | None) -> torch.device | None:
    """`device` as a `torch.device`, checked: a GPU needs CUDA here."""
    if device is None:
        return None
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r} is not a device torch knows: {e}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device='{device}': batches can be handed over on 'cpu' or 'cuda' only")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device='{device}' needs CUDA, and torch.cuda.is_available() is False here; "
            "leave device unset on a machine without a GPU"
        )
    return device


def moved(item: Any, device: torch.device) -> Any:
    """`item` with every tensor in it copied to `device` without blocking
    (page-locked sources: asynchronously)."""
    return each_tensor(item, lambda t: t.to(device, non_blocking=True))


def pinned(item: Any) -> Any:
    """`item` with every tensor in it copied into page-locked memory."""
    return each_tensor(item, torch.Tensor.pin_memory)


def each_tensor(item: Any, change: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`item` with `change` applied to every tensor in it (alone, or in
    dicts, lists and tuples, nested); anything else as it is."""
    if isinstance(item, torch.Tensor):
        return change(item)
    if isinstance(item, dict):
        return {k: each_tensor(v, change) for k, v in item.items()}
    if isinstance(item, (list, tuple)):
        return type(item)(each_tensor(v, change) for v in item)
    return item
