"""`ShardedDataset`: one training rank's balanced, shuffled shard of every
epoch, resumable mid-epoch — also with a different world size."""

from __future__ import annotations

import collections
import os
import time
from typing import Any, Callable, Iterator, Sequence, TypeVar

import pyarrow as pa

from . import _wire as wire
from .client import (
    Client,
    Prefetched,
    connect,
    locality_mode,
    prepared_slices,
    sealed_as,
    shuffle_mode,
)
from .errors import FailedPrecondition, InvalidArgument, Unavailable

#: Most rows, and bytes, a message from the server carries when
#: `ShardedDataset` chooses (its `read_rows`).
MESSAGE_ROWS = 16384
MESSAGE_BYTES = 4 << 20

_T = TypeVar("_T")


def env_ranks_per_node() -> int:
    """torchrun's `LOCAL_WORLD_SIZE` (ranks per node), or 0 where unset."""
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    except ValueError:
        return 0


class ShardedDataset:
    """Iterable of `pyarrow.RecordBatch`: rank `rank`'s share of one epoch.

    Every rank yields the same number of batches of `batch_rows` rows (the
    last may be shorter), so data-parallel ranks step in lockstep. Call
    :meth:`set_epoch` before each epoch for a new order. :meth:`state_dict`
    records the epoch and the global samples consumed; a job that loads it —
    with any world size — reads exactly the samples not yet seen.

    A background thread reads ahead of the loop — about `prefetch` batches,
    or the next message of `read_rows` rows where that is more (0: none,
    each batch is read when asked for) — so the next batch arrives while the
    loop works on this one. Prefetched batches not yet handed out
    are not counted by :meth:`state_dict`. :attr:`stall_seconds` is how long
    the loop has waited for batches this epoch: the time training spent
    waiting for data (without a read-ahead thread, everything it took to
    hand a batch out: reading, decoding, `prepare` and slicing).

    Where training runs on the CPU cores the server runs on, each
    CPU-second of reading while the loop computes costs the loop about a
    second or more (a core taken from one of PyTorch's threads stalls the
    others at their next barrier). There, read on the loop's own thread:
    `prefetch=0`, or `prefetch=0, burst_bytes=64 << 20`, which reads that
    many bytes of messages at once (the server and this process then use
    every core while the loop waits) and hands out all their batches
    before it reads again, so little reading happens while the loop
    computes. Batches read in a burst but not yet handed out are not
    counted by :meth:`state_dict` either.

    On a dataset sealed across several servers, each rank reads from the
    member its plan names (its own node's, by torchrun's convention: rank r
    runs on node r // `ranks_per_node`, default `LOCAL_WORLD_SIZE`).
    `locality="node"` reads each node's own rows (shuffled within the node)
    plus the least transfer that keeps counts equal; such an epoch resumes
    only at the world size it started with. `nodes` names each node's
    server, in node order (see `FlightDeckIterableDataset`, which fills it).

    Every epoch reads the dataset as it was sealed when this object first
    read it (`sealed_as`: the seal, see :func:`flightdeck.sealed_as`; None:
    taken at the first read; 0: whatever is sealed at each epoch's start).
    Once the dataset is dropped or written again, the next epoch raises
    :class:`FailedPrecondition` instead of reading another write under
    this one's positions. Ranks that build their datasets apart may
    each pin a different write if one lands while they start: give them
    all the same `sealed_as` (`FlightDeckIterableDataset` agrees on it
    under torchrun). To move to a new write between epochs, call
    :meth:`read_seal` with a seal the ranks agreed on
    (`FlightDeckIterableDataset(follow_writes=True)` does it at each
    `set_epoch`).

    With `reconnect_seconds`, a read cut off because its server (or a
    member its rows come from) went away — a restart, an upgrade — is taken
    up again where this rank stands once the server answers again, waiting
    up to that long: each remaining row is read once, none twice (the server
    must come back with the same rows: started with `--persist`). Meanwhile
    the loop waits for its next batch; past the wait, or at 0 (the default),
    the read raises :class:`Unavailable`.

    `filter` and `select` read a query of the dataset (see `Client.plan`):
    `filter="hash_bucket(id) < 90"` trains on 90 % and holds out the rest.

    The server sends `read_rows` rows a message (a multiple of
    `batch_rows`; default: as many batches as fit in 16 384 rows and 4 MiB),
    and each message is sliced into batches of `batch_rows` without a copy:
    the same batches, in the same order, for a fraction of the per-message
    work on both ends. A worker split (`iter_batches` with a
    `split_count`) reads `batch_rows` a message, since it splits the
    stream by batch, and so does a `select` list unless `read_rows` is
    given (derived rows may be wider than stored ones).

    From a server on this machine the messages come through its shared
    memory, and the batches are views of it, not copies (bursts copy): a
    message's place there is given back once nothing refers to its
    batches. A loop that keeps batches (a list of them, a tensor it holds
    on to) gets the same batches; once the shared ring is full of kept
    ones, the rest come over the socket.
    """

    def __init__(
        self,
        uri: str | Client,
        dataset: str,
        *,
        rank: int,
        world_size: int,
        batch_rows: int = 1024,
        shuffle: str = "global",
        seed: int = 0,
        drop_last: bool = False,
        columns: Sequence[str] | None = None,
        block_rows: int = 0,
        timeout: float | None = None,
        locality: str = "global",
        ranks_per_node: int | None = None,
        nodes: Sequence[str] | None = None,
        prefetch: int = 2,
        filter: str = "",
        select: Sequence[str] = (),
        read_rows: int | None = None,
        burst_bytes: int = 0,
        sealed_as: int | None = None,
        reconnect_seconds: float = 0.0,
    ) -> None:
        if world_size < 1:
            raise InvalidArgument(f"world_size must be at least 1, not {world_size}")
        if not 0 <= rank < world_size:
            raise InvalidArgument(f"rank {rank} must be in [0, world_size={world_size})")
        if batch_rows < 1:
            raise InvalidArgument("batch_rows must be at least 1")
        if read_rows is not None and (read_rows < 1 or read_rows % batch_rows):
            raise InvalidArgument(
                f"read_rows ({read_rows}) must be a positive multiple of batch_rows ({batch_rows})"
            )
        if prefetch < 0:
            raise InvalidArgument("prefetch must be 0 (off) or more batches")
        if burst_bytes < 0:
            raise InvalidArgument("burst_bytes must be 0 (one message at a time) or more bytes")
        if sealed_as is not None and sealed_as < 0:
            raise InvalidArgument(
                f"sealed_as must be a seal (see flightdeck.sealed_as), 0 (any) or None, "
                f"not {sealed_as}"
            )
        if not reconnect_seconds >= 0:
            raise InvalidArgument(
                f"reconnect_seconds must be 0 (off) or more seconds, not {reconnect_seconds}"
            )
        if burst_bytes and prefetch:
            raise InvalidArgument(
                f"burst_bytes reads on the loop's own thread and prefetch={prefetch} on a "
                "background one: pass prefetch=0 with burst_bytes"
            )
        shuffle_mode(shuffle)  # validate early
        locality_mode(locality)
        self._client = uri if isinstance(uri, Client) else None
        # Whether `_client` is this object's to close (not one it was given).
        self._owns_client = self._client is None
        self.uri = uri.uri if isinstance(uri, Client) else uri
        self.timeout = timeout
        self.dataset = dataset
        self.rank = rank
        self.world_size = world_size
        self.batch_rows = batch_rows
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.columns = list(columns) if columns else None
        self.block_rows = block_rows
        self.locality = locality
        self.ranks_per_node = env_ranks_per_node() if ranks_per_node is None else ranks_per_node
        self.nodes = list(nodes) if nodes else []
        #: SQL condition rows must meet (see `Client.plan`): the epoch,
        #: its shares and its resume are over the selected rows.
        self.filter = filter
        #: SQL expressions read instead of the stored columns.
        self.select = list(select)
        self.epoch = 0
        # The world size `_start_sample` was consumed at (a loaded state's).
        self._resume_world_size = 0
        # Global samples of this epoch consumed before this iteration started
        # (from load_state_dict), and this rank's samples handed out since.
        self._start_sample = 0
        self._yielded = 0
        self._rows: int | None = None
        self.prefetch = prefetch
        #: With `prefetch=0`: bytes of messages read at a time before any of
        #: their batches is handed out (0: one message at a time).
        self.burst_bytes = burst_bytes
        #: Rows a message from the server carries (None: chosen at the
        #: first iteration, see the class's description).
        self.read_rows = read_rows
        #: Seconds the loop has waited for batches this epoch.
        self.stall_seconds = 0.0
        #: The background reader of the running iteration, if any.
        self._reader: Prefetched | None = None
        #: The seal every epoch reads (see the class's description): None
        #: until the first read takes it, 0 for any.
        self.sealed_as = sealed_as
        #: How long a read cut off by its server going away waits for it to
        #: answer again before it raises (0: it raises at once).
        self.reconnect_seconds = reconnect_seconds
        #: Reads taken up again after their server went away (see
        #: `reconnect_seconds`), since this object was made.
        self.reconnects = 0

    # Plumbing

    @property
    def client(self) -> Client:
        """The connection, opened on first use (and again after pickling,
        as DataLoader workers do)."""
        if self._client is None:
            self._client = connect(self.uri, timeout=self.timeout)
            self._owns_client = True
        return self._client

    def read_through(self, uri: str) -> None:
        """Plans this rank's reads through the server `uri` from now on
        (each shard is still read where its plan says); the connection to
        the server before, where this object opened it, is closed."""
        if uri == self.uri:
            return
        if self._client is not None and self._owns_client:
            self._client.close()
        self._client, self._owns_client = None, True
        self.uri = uri

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_client"] = None
        return state

    def _describe(self) -> wire.Message:
        """The dataset's `DatasetInfo`; takes its seal where none is
        pinned yet and it is sealed."""
        info = self.client.describe(self.dataset)
        self._rows = info.rows
        if self.sealed_as is None and info.state == wire.DATASET_STATE_SEALED:
            self.sealed_as = sealed_as(info)
        return info

    def read_seal(self, seal: int) -> None:
        """Reads write `seal` of the dataset from now on (a seal from
        :func:`flightdeck.sealed_as`; 0: the one sealed at the next read),
        its row count looked up again. Between epochs: a read resumed
        mid-epoch on another write would not be that epoch."""
        self.sealed_as = seal or None
        self._rows = None

    def pin(self) -> int:
        """Takes the dataset's seal now, where none is pinned (see the
        class's description), and returns the seal read (0: any)."""
        if self.sealed_as is None:
            self._describe()
        return self.sealed_as or 0

    def _plan(
        self,
        split_count: int = 0,
        split_index: int = 0,
        batch_rows: int | None = None,
        start_sample: int | None = None,
    ):
        """This epoch's plan from where it resumes (`start_sample`: from
        there instead, at this world size)."""
        seal = self.pin()
        try:
            return self.client.plan(
                self.dataset,
                world_size=self.world_size,
                epoch=self.epoch,
                seed=self.seed,
                shuffle=self.shuffle,
                batch_rows=batch_rows or self.batch_rows,
                drop_last=self.drop_last,
                columns=self.columns,
                start_sample=self._start_sample if start_sample is None else start_sample,
                block_rows=self.block_rows,
                split_count=split_count,
                split_index=split_index,
                locality=self.locality,
                ranks_per_node=self.ranks_per_node,
                nodes=self.nodes,
                resume_world_size=self._resume_world_size if self._start_sample else 0,
                filter=self.filter,
                select=self.select,
                sealed_as=seal,
            )
        except FailedPrecondition as e:
            if not seal or "since this read began" not in e.message:
                raise
            said = e.message.removesuffix("; start the read again")
            raise FailedPrecondition(
                f"{said}. This reader's epochs and resume positions count rows of the "
                f"write it first read (sealed_as {seal}): build a new reader to train on the "
                "new write (a state saved on the old one does not carry over), or pass "
                "sealed_as=0 to read whatever is sealed at each epoch's start (in one process; "
                "FlightDeckIterableDataset(follow_writes=True) moves every rank to each new "
                "write together, at the epoch after it lands)"
            ) from None

    @property
    def num_rows(self) -> int:
        """Rows in the dataset."""
        if self._rows is None:
            self._describe()
        return self._rows

    def _message_rows(self, split_count: int) -> int:
        """Rows per message from the server: `read_rows`, else as many
        batches as fit in `MESSAGE_ROWS` rows and `MESSAGE_BYTES` bytes (at
        least one); one batch when a split shares the stream out by batch."""
        if split_count > 1:
            return self.batch_rows
        if self.read_rows is not None:
            return self.read_rows
        if self.select:
            # Derived columns may be wider than the stored rows: their size
            # is not known here.
            return self.batch_rows
        info = self._describe()
        if not info.bytes:
            # Spilled (its size is not held): one batch a message this time.
            return self.batch_rows
        row_bytes = max(1, info.bytes // max(1, info.rows))
        fit = min(MESSAGE_ROWS, MESSAGE_BYTES // row_bytes) // self.batch_rows
        self.read_rows = self.batch_rows * max(1, fit)
        return self.read_rows

    # Epochs and resume

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch (and so the order) the next iteration reads from
        its start; a state loaded for this very epoch is kept."""
        epoch = _count(epoch, "epoch")
        if epoch != self.epoch:
            self.epoch = epoch
            self._start_sample = 0
            self._resume_world_size = 0
        self._yielded = 0
        self.stall_seconds = 0.0

    def samples_consumed(self, batches: int | None = None) -> int:
        """Global samples of this epoch consumed once every rank has taken
        `batches` batches of this iteration (default: what this rank took)."""
        rows = self._yielded if batches is None else batches * self.batch_rows
        return min(self._start_sample + rows * self.world_size, self.num_rows)

    def state_dict(self, batches: int | None = None) -> dict[str, int]:
        """Where this epoch stands: `{"epoch", "start_sample", "world_size"}`.
        `batches` overrides how many batches each rank consumed (for loaders
        that prefetch). Add `"sealed_as": reader.pin()` to have a resume
        refuse another write of the dataset (see :meth:`load_state_dict`)."""
        consumed = self.samples_consumed(batches)
        # Samples consumed before this iteration were taken at the loaded
        # state's world size; a NODE epoch resumes only at one size.
        world = self._resume_world_size if consumed == self._start_sample and consumed else 0
        return {
            "epoch": self.epoch,
            "start_sample": consumed,
            "world_size": world or self.world_size,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resumes from :meth:`state_dict`, possibly saved at another world
        size (a `locality="node"` epoch: only at the same one). A state
        with a `"sealed_as"` reads only that write of the dataset."""
        missing = [k for k in ("epoch", "start_sample") if k not in state]
        if missing:
            raise ValueError(
                f"a state to resume from needs {missing}: pass what state_dict() returned "
                f"(got the keys {sorted(state)})"
            )
        epoch = _count(state["epoch"], "epoch")
        start = _count(state["start_sample"], "start_sample")
        resume_world_size = _count(state.get("world_size"), "world_size")
        sealed_as = _count(state.get("sealed_as"), "sealed_as")
        self.epoch = epoch
        if sealed_as:
            self.sealed_as = sealed_as
        self._start_sample = start
        self._resume_world_size = resume_world_size
        self._yielded = 0

    def _position(self) -> dict[str, Any]:
        """What a copy of this reader in another process needs to read the
        epoch this one would read next (see :meth:`_take_position`)."""
        return {
            "epoch": self.epoch,
            "start_sample": self._start_sample,
            "resume_world_size": self._resume_world_size,
            "sealed_as": self.sealed_as or 0,
            "nodes": self.nodes,
        }

    def _take_position(self, position: dict[str, Any]) -> None:
        """Reads from `position` (another copy's :meth:`_position`) on."""
        self.epoch = position["epoch"]
        self._start_sample = position["start_sample"]
        self._resume_world_size = position["resume_world_size"]
        if (position["sealed_as"] or None) != self.sealed_as:
            self.read_seal(position["sealed_as"])
        self.nodes = list(position["nodes"])
        self._yielded = 0

    # Iteration

    def __len__(self) -> int:
        """Batches this rank yields this epoch (from where it resumes)."""
        return self._plan().shards[self.rank].batches

    def iter_batches(
        self,
        split_count: int = 0,
        split_index: int = 0,
        prepare: Callable[[pa.RecordBatch], Any] | None = None,
        slice_prepared: Callable[[Any, int, int], Any] | None = None,
    ) -> Iterator[Any]:
        """This rank's batches, or with a split only batches
        `b % split_count == split_index` (one of several readers of a rank).
        With `prepare`, yields `prepare(batch)` instead of each batch, run on
        the read-ahead thread when there is one (so that turning batches into
        tensors overlaps the loop too). With `slice_prepared(prepared,
        start, rows)` too, `prepare` runs once per message from the server
        and each batch is sliced out of its result."""
        message_rows = self._message_rows(split_count)
        start, index = self._start_sample, split_index
        waited_since, tries = None, 0
        while True:
            handed = handed_rows = 0
            try:
                shard = self._plan(split_count, index, message_rows, start).shards[self.rank]
                for batch, item in self._read(shard, prepare, slice_prepared):
                    if waited_since is not None:
                        self.reconnects += 1
                        waited_since, tries = None, 0
                    handed += 1
                    handed_rows += batch.num_rows
                    self._yielded += batch.num_rows
                    yield item
                return
            except Unavailable:
                if not self.reconnect_seconds:
                    raise
                if handed and handed_rows == shard.rows:
                    return  # cut off after its last batch
                now = time.monotonic()
                waited_since = now if waited_since is None else waited_since
                if now - waited_since > self.reconnect_seconds:
                    raise
            # Take the read up again after what was handed out: this rank's
            # samples are positions start + rank + k·W of the epoch, so
            # from start + k·W on, at the same world size. A split's next
            # batch is the plan's batch index + handed·split_count; the
            # plan from it starts with that batch.
            if split_count > 1:
                start += (index + handed * split_count) * self.batch_rows * self.world_size
                index = 0
            else:
                start += handed_rows * self.world_size
            # A connection of its own: one it was given may serve other
            # readers still, and is left to them.
            fresh = self.client._sibling(self.client.uri)
            if self._owns_client:
                self.client.close()
            self._client, self._owns_client = fresh, True
            # At once the first time (a member may be back already), then
            # 50 ms doubling up to a second.
            pause = 0.0 if tries == 0 else min(1.0, 0.05 * 2 ** (tries - 1))
            time.sleep(min(pause, max(0.0, waited_since + self.reconnect_seconds - now)))
            tries += 1
            # The loop waits for data meanwhile.
            self.stall_seconds += time.monotonic() - now

    def _read(
        self,
        shard,
        prepare: Callable[[pa.RecordBatch], Any] | None,
        slice_prepared: Callable[[Any, int, int], Any] | None,
    ) -> Iterator[tuple[pa.RecordBatch, Any]]:
        """`shard`'s batches, each with what to hand out for it (itself, or
        what `prepare` makes of it), read as :meth:`iter_batches` describes."""
        # The loop drops each batch once it trained on it, so batches from
        # the server's shared memory are lent rather than copied; a burst
        # holds many at once, so it copies.
        if self.prefetch == 0:
            messages = self.client.read_shard(shard, lend=not self.burst_bytes)
            if self.burst_bytes:
                messages = _bursts(messages, self.burst_bytes)
            slices = (
                pair
                for message in messages
                for pair in prepared_slices(message, self.batch_rows, prepare, slice_prepared)
            )
            # On the loop's thread, reading, decoding, `prepare` and slicing
            # are all time the loop waits for its batch.
            for batch, item in _timed(slices, self):
                yield batch, batch if prepare is None else item
            return
        reader = Prefetched(
            self.client._do_get(shard, lend=True), self.prefetch, prepare, self.batch_rows, slice_prepared
        )
        self._reader = reader
        try:
            before = self.stall_seconds
            for item in reader:
                self.stall_seconds = before + reader.stall
                # Counted by the caller when handed out: a state taken after
                # the caller processed this batch must not replay it (and
                # batches read ahead but not handed out are not counted).
                yield (item, item) if prepare is None else item
            self.stall_seconds = before + reader.stall
        finally:
            reader.close()
            self._reader = None

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        self._yielded = 0
        self.stall_seconds = 0.0
        return self.iter_batches()


def _bursts(messages: Iterator[pa.RecordBatch], limit: int) -> Iterator[pa.RecordBatch]:
    """`messages`, read in bursts of at least `limit` bytes (or to the end):
    a burst is read whole before its first message is handed out, and the
    next one only after its last."""
    held: collections.deque[pa.RecordBatch] = collections.deque()
    while True:
        size = 0
        for message in messages:
            held.append(message)
            size += message.nbytes
            if size >= limit:
                break
        if not held:
            return
        while held:
            yield held.popleft()


def _timed(items: Iterator[_T], owner: ShardedDataset) -> Iterator[_T]:
    """`items` (never None), adding the time each took to come to
    `owner.stall_seconds`."""
    while True:
        started = time.perf_counter()
        item = next(items, None)
        owner.stall_seconds += time.perf_counter() - started
        if item is None:
            return
        yield item


def _count(value: Any, name: str) -> int:
    """`value` (None: 0) as a count: a whole number, at least 0; anything
    else is refused naming it `name`."""
    if value is None:
        return 0
    try:
        count = int(value)
    except (TypeError, ValueError):
        count = -1
    if count < 0 or (isinstance(value, float) and count != value):
        raise ValueError(f"{name} must be a whole number, at least 0, not {value!r}")
    return count
