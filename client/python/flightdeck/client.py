"""The flightdeck client on `pyarrow.flight`: the same verbs as the Rust
client — put_partition, seal, drop, describe, stats, list_datasets, plan,
read_shard, sql, derive."""

from __future__ import annotations

import collections
import ipaddress
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, Union

import pyarrow as pa
import pyarrow.flight as flight

from . import _shm as shm
from . import _wire as wire
from .errors import FlightDeckError, InvalidArgument, translate

#: Port a flightdeck server listens on by default.
DEFAULT_PORT = 50051

#: Processes that opened a Flight connection. gRPC does not survive fork(): a
#: child forked from one of these hangs when it opens a connection of its own.
_CONNECTED_PIDS: set[int] = set()


def check_not_forked_after_connect() -> None:
    """Raises instead of hanging when this process was forked from one that
    had already opened a Flight connection (gRPC cannot be used after fork)."""
    if _CONNECTED_PIDS and os.getpid() not in _CONNECTED_PIDS:
        raise RuntimeError(
            "this process was forked after a flightdeck connection was opened, and gRPC does "
            "not work after fork(); start worker processes with 'spawn' or 'forkserver' "
            "(DataLoader(..., multiprocessing_context='spawn'))"
        )

#: Rows per message when a whole Table is written.
_TABLE_CHUNK_ROWS = 65_536

#: What a partition is written from: Arrow data, or a DataFrame (pandas,
#: Polars, anything with `__arrow_c_stream__`; see `_arrow_data`).
Data = Union[pa.Table, pa.RecordBatch, pa.RecordBatchReader, Iterable[pa.RecordBatch], Any]


def normalize_uri(uri: str, local: str | None = None) -> str:
    """The location a server name names, `grpc://HOST:PORT`,
    `grpc+tls://HOST:PORT` or `grpc+unix:///PATH`: `local` (this node's server: the location in
    `FLIGHTDECK_URI` where it is set, as a DaemonSet's pod template sets it on
    every executor and training pod, else 127.0.0.1), `local:PORT`, `HOST`,
    `HOST:PORT`, IPv6 literals (`[::1]:PORT`, or `::1` without a port), and
    `grpc://`, `grpc+tcp://`, `http://`, `grpc+tls://` or `https://` followed
    by any of those; port 50051 wherever none is given; `grpc+unix://` or
    `unix://` followed by the absolute path of a server's `--unix-socket`
    (this machine's server without the TCP stack). The Rust client reads
    names the same way (one table of cases tests both:
    `tests/server_names.tsv`). `local` overrides `FLIGHTDECK_URI`."""
    name = uri.strip()

    def bad() -> InvalidArgument:
        return InvalidArgument(
            f"{uri!r} does not name a server: give host[:port], grpc://host[:port], "
            f"grpc+tls://host[:port], grpc+unix:///path or local (the default port is {DEFAULT_PORT})"
        )

    if name == "local":
        target = (os.environ.get("FLIGHTDECK_URI", "") if local is None else local).strip()
        if not target or target == "local" or target.startswith("local:"):
            return f"grpc://127.0.0.1:{DEFAULT_PORT}"
        return normalize_uri(target, "")
    if name.startswith("local:"):
        port = _port(name[len("local:"):])
        if port is None:
            raise bad()
        return f"grpc://127.0.0.1:{port}"
    scheme, rest = name.split("://", 1) if "://" in name else ("grpc", name)
    if scheme in ("grpc+unix", "unix"):
        # A socket's absolute path, nothing that could be read as a host.
        absolute = rest.startswith("/") and len(rest) > 1 and not rest.endswith("/")
        if not absolute or any(c.isspace() for c in rest):
            raise bad()
        return f"grpc+unix://{rest}"
    if scheme in ("grpc", "grpc+tcp", "http"):
        scheme = "grpc"
    elif scheme in ("grpc+tls", "https"):
        scheme = "grpc+tls"
    else:
        raise bad()
    authority = rest[:-1] if rest.endswith("/") else rest
    parts = _split_authority(authority)
    if parts is None:
        raise bad()
    return f"{scheme}://{parts[0]}:{parts[1]}"


def _port(s: str) -> int | None:
    """A port number: digits only, 1 to 65535."""
    if not s or not all("0" <= c <= "9" for c in s):
        return None
    port = int(s)
    return port if 0 < port < 65536 else None


def _ipv6(s: str) -> bool:
    try:
        ipaddress.IPv6Address(s)
    except ValueError:
        return False
    return True


def _split_authority(a: str) -> tuple[str, int] | None:
    """`HOST[:PORT]` (IPv6 hosts in brackets, or bare without a port) as the
    host to put in a URI and the port."""
    if not a or any(c in a for c in "/?#@") or any(c.isspace() for c in a):
        return None
    if a.startswith("["):
        host, sep, after = a[1:].partition("]")
        if not sep or not _ipv6(host):
            return None
        if not after:
            return f"[{host}]", DEFAULT_PORT
        port = _port(after[1:]) if after.startswith(":") else None
        return None if port is None else (f"[{host}]", port)
    if a.count(":") > 1:
        return (f"[{a}]", DEFAULT_PORT) if _ipv6(a) else None
    host, sep, port_text = a.partition(":")
    if not host:
        return None
    if not sep:
        return host, DEFAULT_PORT
    port = _port(port_text)
    return None if port is None else (host, port)


@dataclass(frozen=True)
class Shard:
    """One rank's part of a plan."""

    rank: int
    #: Exact rows this stream carries.
    rows: int
    #: Record batches the stream carries.
    batches: int
    #: Opaque ticket for :meth:`Client.read_shard`.
    ticket: bytes
    #: The member serving this rank (datasets sealed across servers); None:
    #: the server that made the plan.
    location: str | None = None


@dataclass(frozen=True)
class Plan:
    """The answer to :meth:`Client.plan`: the projected schema and one shard
    per rank, in rank order."""

    schema: pa.Schema
    shards: list[Shard]
    #: Rows of the plan's row space (its filter's selection, else every
    #: row) in each stored partition, in partition order: partition i's
    #: rows are positions [sum of those before, + its count) of an
    #: unshuffled read (plan one with `start_sample` and `max_rows`).
    partition_rows: list[int] = field(default_factory=list)

    @property
    def total_rows(self) -> int:
        return sum(s.rows for s in self.shards)


def shuffle_mode(shuffle: str | int) -> int:
    """`"none"`, `"global"` or `"block"` (or the proto enum value)."""
    if isinstance(shuffle, int):
        return shuffle
    try:
        return wire.SHUFFLE["SHUFFLE_" + shuffle.upper()]
    except KeyError:
        raise InvalidArgument(
            f"unknown shuffle {shuffle!r}: use 'none', 'global' or 'block'"
        ) from None


def locality_mode(locality: str | int) -> int:
    """`"global"` or `"node"` (or the proto enum value)."""
    if isinstance(locality, int):
        return locality
    try:
        return wire.LOCALITY["LOCALITY_" + locality.upper()]
    except KeyError:
        raise InvalidArgument(f"unknown locality {locality!r}: use 'global' or 'node'") from None


def dataset_schema(info: wire.Message) -> pa.Schema | None:
    """The Arrow schema in a `DatasetInfo`, or None before the first commit."""
    if not info.schema:
        return None
    return pa.ipc.read_schema(pa.py_buffer(info.schema))


def sealed_as(info: wire.Message) -> int:
    """What identifies this seal of a dataset, from its `DatasetInfo`: the
    layout id of a dataset sealed across servers (the same on every
    member), else its generation. Give it to :meth:`Client.plan` to read
    the dataset only as it was then."""
    layout = info.layout
    return layout.id if layout is not None and layout.id else info.generation


def _describe_dataset(info: wire.Message) -> str:
    """`print(info)` of a `DatasetInfo`: one summary line, then the schema as
    Arrow prints it."""
    state = {
        wire.DATASET_STATE_OPEN: "open",
        wire.DATASET_STATE_SEALED: "sealed",
        wire.DATASET_STATE_SEALING: "sealing (its seal across members did not finish here)",
    }.get(info.state, "unknown state")
    where = []
    if info.spilled:
        where.append("spilled")
    if info.persisted:
        where.append("persisted")
    if info.placements:
        where.append(f"on GPUs {sorted(p.device for p in info.placements)}")
    if info.layout is not None:
        where.append(f"across {len(info.layout.members)} servers")
    for w in info.replacements:
        where.append(f"being replaced by write {w.write_id!r} ({w.rows:,} rows staged)")
    line = (
        f"dataset {info.dataset!r}: {state}, {info.rows:,} rows, {info.bytes:,} bytes in memory, "
        f"{info.committed_partitions} partitions" + "".join(f", {w}" for w in where)
    )
    schema = dataset_schema(info)
    return line if schema is None else f"{line}\n{schema.to_string(show_schema_metadata=False)}"


# What `seal()`, `describe()`, `place()` and `evict()` return prints readably.
wire.DatasetInfo.__str__ = _describe_dataset  # type: ignore[method-assign]


def _arrow_data(data: Data) -> Data:
    """`data` as Arrow: a pandas DataFrame as a table of its columns (its
    index left out), and any other DataFrame that hands over its data as an
    Arrow stream (Polars, DuckDB, …: the `__arrow_c_stream__` protocol) as
    the table of that stream; Arrow data as it is."""
    if isinstance(data, (pa.Table, pa.RecordBatch, pa.RecordBatchReader)):
        return data
    if type(data).__module__.split(".")[0] == "pandas":
        return pa.Table.from_pandas(data, preserve_index=False)
    if hasattr(data, "__arrow_c_stream__"):
        return pa.table(data)
    return data


def _not_data(data: object, item: object = None) -> InvalidArgument:
    got = type(data).__name__ + ("" if item is None else f" of {type(item).__name__}")
    return InvalidArgument(
        f"a partition's data is a pyarrow Table, RecordBatch or RecordBatchReader, an iterable "
        f"of RecordBatches, or a DataFrame (pandas, Polars); got {got}"
    )


def _expected(data: Data) -> tuple[int, int]:
    """Bytes and rows `data` will send, where it holds them already (a
    table, a batch or a list of batches); 0, 0 for a stream."""
    if isinstance(data, (pa.Table, pa.RecordBatch)):
        return data.nbytes, data.num_rows
    if isinstance(data, (list, tuple)) and all(isinstance(b, pa.RecordBatch) for b in data):
        return sum(b.nbytes for b in data), sum(b.num_rows for b in data)
    return 0, 0


def _schema_and_batches(
    data: Data, schema: pa.Schema | None
) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    if isinstance(data, pa.Table):
        # Bounded messages: a table may be one huge chunk.
        return data.schema, iter(data.to_batches(max_chunksize=_TABLE_CHUNK_ROWS))
    if isinstance(data, pa.RecordBatch):
        return data.schema, iter([data])
    if isinstance(data, pa.RecordBatchReader):
        return data.schema, iter(data)
    if isinstance(data, (str, bytes, Mapping)) or not hasattr(data, "__iter__"):
        raise _not_data(data)
    batches = iter(data)
    if schema is not None:
        return schema, batches
    try:
        first = next(batches)
    except StopIteration:
        raise InvalidArgument(
            "cannot infer the schema of an empty partition: pass schema=, or a Table"
        ) from None
    if not isinstance(first, pa.RecordBatch):
        raise _not_data(data, first)

    def chained() -> Iterator[pa.RecordBatch]:
        yield first
        yield from batches

    return first.schema, chained()


#: HTTP/2 pings on every connection: a server that stops answering them
#: (hung, or its node cut off) fails the calls waiting on it with
#: UNAVAILABLE within about 50 s — which `ShardedDataset`'s
#: `reconnect_seconds` then rides out or reports — instead of holding a
#: training rank, and the DDP job with it, forever.
KEEPALIVE = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.ping_timeout_ms", 20_000),
)


class Client:
    """A connection to one flightdeck server.

    Errors from the server are raised as :class:`flightdeck.FlightDeckError`
    subclasses that keep the gRPC code and message.
    """

    def __init__(
        self,
        uri: str,
        *,
        timeout: float | None = None,
        headers: Mapping[str, str] | None = None,
        token: str | None = None,
        tls_root_certs: bytes | None = None,
    ) -> None:
        self.uri = normalize_uri(uri)
        # Servers started with --auth-token-file need a bearer token.
        token = token if token is not None else os.environ.get("FLIGHTDECK_TOKEN") or None
        if token:
            headers = {**(headers or {}), "authorization": f"Bearer {token}"}
        check_not_forked_after_connect()
        roots_file = os.environ.get("FLIGHTDECK_TLS_ROOT_CERTS")
        if tls_root_certs is None and roots_file:
            with open(roots_file, "rb") as f:
                tls_root_certs = f.read()
        if self.uri.startswith("grpc+tls://") and not tls_root_certs:
            raise InvalidArgument(
                f"{self.uri} is served over TLS: pass its root certificates (tls_root_certs)"
            )
        self._tls_root_certs = tls_root_certs
        # A Unix socket is never served over TLS; over one, gRPC would name
        # the socket's escaped path as the authority, which the server's
        # HTTP/2 stack refuses as malformed: name this machine instead.
        unix = self.uri.startswith("grpc+unix://")
        generic = list(KEEPALIVE)
        if unix:
            generic.append(("grpc.default_authority", "localhost"))
        options: dict = {"generic_options": generic}
        if tls_root_certs and not unix:
            options["tls_root_certs"] = tls_root_certs
        self._connection = translate(lambda: flight.FlightClient(self.uri, **options))
        self._pid = os.getpid()
        _CONNECTED_PIDS.add(self._pid)
        pairs = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
        self._options = flight.FlightCallOptions(timeout=timeout, headers=pairs)
        # Reads ask for the server's shared memory where it is on this
        # machine (`FLIGHTDECK_SHM=0`: never); dropped after a ring this
        # process cannot map.
        self._shm_options = (
            flight.FlightCallOptions(timeout=timeout, headers=[*pairs, (shm.REQUEST_HEADER, b"1")])
            if _on_this_machine(self.uri) and os.environ.get("FLIGHTDECK_SHM", "1") != "0"
            else None
        )
        self._timeout, self._headers = timeout, headers
        # Connections to other members, for shards they serve.
        self._members: dict[str, Client] = {}
        # The location this server advertises, once asked (see `_serving`).
        self._advertised: str | None = None

    @property
    def _flight(self) -> flight.FlightClient:
        """The connection, in the process that opened it. A process forked
        from that one (a DataLoader worker started with `fork`, after the
        parent touched the dataset) gets the clear error instead: its copy of
        the connection would hang, and gRPC cannot open a new one after fork
        either."""
        if os.getpid() != self._pid:
            check_not_forked_after_connect()
        return self._connection

    def close(self) -> None:
        """Closes the connection (and those opened to other members)."""
        for member in self._members.values():
            member.close()
        self._members.clear()
        # A forked child leaves the parent's connection alone.
        if os.getpid() == self._pid:
            self._connection.close()

    def _sibling(self, uri: str) -> Client:
        """A new connection to `uri` with this one's settings (timeout,
        headers, token, TLS roots); this one is left as it is. Another
        member's server, or this one again: after a server went away, a new
        connection reaches it as soon as it is back, where gRPC's would wait
        out its backoff."""
        # The token, if any, is in the headers already.
        return Client(
            uri,
            timeout=self._timeout,
            headers=self._headers,
            token="",
            tls_root_certs=self._tls_root_certs,
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def flight(self) -> flight.FlightClient:
        """The underlying `pyarrow.flight.FlightClient`."""
        return self._flight

    # Writing

    def put_partition(
        self,
        dataset: str,
        partition: int,
        data: Data,
        attempt: int = 0,
        *,
        schema: pa.Schema | None = None,
        write_id: str = "",
        replace: bool = False,
    ) -> wire.Message:
        """Streams one attempt of one partition; returns the `PutAck` once
        the server committed it. `data` is a pyarrow Table, RecordBatch or
        RecordBatchReader, an iterable of RecordBatches, or a DataFrame (a
        pandas one's index is left out; Polars and others that export an
        Arrow stream). `write_id` names the write (a Spark job) the
        attempt belongs to: once `drop(..., abort_write=write_id)` has been
        sent, the server refuses every attempt of it.

        With `replace`, the write (its `write_id`, which it then needs)
        replaces the dataset: its attempts are staged beside the dataset,
        which readers keep reading until `seal(..., replace_write=write_id)`
        puts the new rows in its place at once; `drop(dataset,
        abort_write=write_id, staged=True)` drops only what it staged.

        The stream ends with a commit marker carrying the row count, so an
        exception while producing `data` (or a lost connection) leaves
        nothing on the server: the attempt is committed whole or not at all.

        When `data` is a table, a batch or a list of batches, its size goes
        with the request: the server sets the attempt's memory aside before
        reading it, so under a full budget the attempt waits for room (up to
        the server's ``--admission-wait``) and is then admitted whole or
        refused with :class:`ResourceExhausted` before it is sent.
        """
        data = _arrow_data(data)
        expected_bytes, expected_rows = _expected(data)
        schema, batches = _schema_and_batches(data, schema)
        cmd = wire.PutPartition(
            dataset=dataset,
            partition=partition,
            attempt=attempt,
            explicit_commit=True,
            expected_bytes=expected_bytes,
            expected_rows=expected_rows,
            write_id=write_id,
            replace=replace,
        )
        descriptor = flight.FlightDescriptor.for_command(cmd.encode())
        writer, reader = translate(
            lambda: self._flight.do_put(descriptor, schema, options=self._options)
        )
        rows = 0
        try:
            for batch in batches:
                translate(lambda: writer.write_batch(batch))
                rows += batch.num_rows
            translate(lambda: writer.write_metadata(wire.PutCommit(rows=rows).encode()))
            translate(writer.done_writing)
            meta = translate(reader.read)
        except BaseException:
            # Without the commit marker the server stores nothing; it answers
            # the close with ABORTED, which is not the error to report.
            try:
                writer.close()
            except Exception:
                pass
            raise
        translate(writer.close)
        if meta is None:
            raise FlightDeckError("DoPut returned no PutAck", "INTERNAL")
        return wire.PutAck.decode(meta.to_pybytes())

    # Actions

    def _action(self, kind: str, body: wire.Message | None, reply: type[wire.Message]):
        payload = body.encode() if body is not None else b""
        results = translate(
            lambda: list(self._flight.do_action(flight.Action(kind, payload), options=self._options))
        )
        if len(results) != 1:
            raise FlightDeckError(f"action {kind!r} returned {len(results)} results", "INTERNAL")
        return reply.decode(results[0].body.to_pybytes())

    def seal(
        self,
        dataset: str,
        partitions: int = 0,
        attempts: Mapping[int, int] | Sequence[tuple[int, int]] | None = None,
        *,
        replace_write: str = "",
    ) -> wire.Message:
        """Seals `dataset`. `partitions`: expected count (0 = don't check);
        `attempts`: winning attempt per partition (others: first committed).
        `replace_write`: seal what that replacing write staged (see
        `put_partition`'s `replace`) and put it in the dataset's place."""
        pairs = attempts.items() if isinstance(attempts, Mapping) else (attempts or [])
        body = wire.SealDataset(
            dataset=dataset,
            partitions=partitions,
            attempts=[wire.PartitionAttempt(partition=p, attempt=a) for p, a in pairs],
            replace_write=replace_write,
        )
        return self._action("seal", body, wire.DatasetInfo)

    def seal_cluster(
        self,
        dataset: str,
        members: Mapping[str, Mapping[int, int]],
        partitions: int = 0,
        *,
        replace_write: str = "",
    ) -> wire.Message:
        """Seals a dataset written to several servers. `members` maps each
        server's location (its `PutAck.location`) to the winning attempt of
        each partition it holds; this server (any, member or not) seals every
        member and hands each the whole layout. Sealing again with the same
        layout is a no-op, so a seal cut short can simply be sent again.
        `replace_write`: as for `seal`, on every member; members of the
        replaced dataset that the new layout leaves out drop their part."""
        body = wire.SealDataset(
            dataset=dataset,
            partitions=partitions,
            replace_write=replace_write,
            members=[
                wire.MemberPartitions(
                    location=location,
                    partitions=[
                        wire.PartitionAttempt(partition=p, attempt=a) for p, a in sorted(parts.items())
                    ],
                )
                for location, parts in sorted(members.items())
            ],
        )
        return self._action("seal", body, wire.DatasetInfo)

    def drop(
        self, dataset: str, *, abort_write: str = "", staged: bool = False, keep_write: str = ""
    ) -> wire.Message:
        """Drops `dataset` and frees its memory (on every member, for a
        dataset sealed across servers); returns what it was. `abort_write`
        names a failed write: the server refuses its attempts from now on, so
        a task still running cannot bring the dataset back. With `staged`,
        only what that (replacing) write staged is dropped; the dataset
        stays as it was. With `keep_write`, a dataset that (replacing) write
        swapped in is left as it is (`FailedPrecondition`): only an older
        copy goes."""
        body = wire.DropDataset(
            dataset=dataset, abort_write=abort_write, staged=staged, keep_write=keep_write
        )
        return self._action("drop", body, wire.DatasetInfo)

    def derive(self, target: str, sql: str, *, source: str = "") -> wire.Message:
        """Runs the SQL query `sql` over the server's sealed datasets (each
        a table by its name; `source`, when given, is also the table
        `source`) and keeps the result as the new sealed dataset `target`:
        a hold-out split (`SELECT * FROM source WHERE hash_bucket(id) >= 90`),
        derived features, a sample — without a Spark round trip. Returns the
        target's info; refused if `target` exists."""
        body = wire.DeriveDataset(target=target, sql=sql, source=source)
        return self._action("derive", body, wire.DatasetInfo)

    def sql(self, query: str) -> pa.Table:
        """Runs a read-only SQL query over the server's sealed datasets (each
        a table by its name; a cluster dataset's rows come from every
        member) and returns its result. It goes through the server's Arrow
        Flight SQL endpoint, as ADBC's driver would, without needing one:
        ``c.sql("SELECT label, count(*) AS n FROM clicks GROUP BY label")``.
        """
        command = _len_field(1, query.encode())
        descriptor = flight.FlightDescriptor.for_command(
            _len_field(1, _STATEMENT_QUERY) + _len_field(2, command)
        )
        info = translate(lambda: self._flight.get_flight_info(descriptor, options=self._options))
        tables = [
            translate(lambda e=e: self._flight.do_get(e.ticket, options=self._options).read_all())
            for e in info.endpoints
        ]
        return pa.concat_tables(tables) if tables else info.schema.empty_table()

    def describe(self, dataset: str) -> wire.Message:
        """State, rows, bytes, partitions and schema (see :func:`dataset_schema`)."""
        return self._action("describe", wire.DescribeDataset(dataset=dataset), wire.DatasetInfo)

    def place(
        self,
        dataset: str,
        columns: Sequence[str] = (),
        devices: Sequence[int] = (),
    ) -> wire.Message:
        """Copies numeric columns of a sealed dataset to GPUs (`columns` empty:
        every numeric column — numbers, fixed-size lists of them, and lists
        whose rows all hold one number of them, as Spark's `array<float>`;
        `devices` empty: device 0). A server without a
        CUDA driver raises :class:`FailedPrecondition`."""
        body = wire.PlaceColumns(dataset=dataset, columns=list(columns), devices=list(devices))
        return self._action("place", body, wire.DatasetInfo)

    def evict(self, dataset: str, devices: Sequence[int] = ()) -> wire.Message:
        """Frees a dataset's GPU copies on `devices` (empty: all)."""
        body = wire.EvictColumns(dataset=dataset, devices=list(devices))
        return self._action("evict", body, wire.DatasetInfo)

    def train(
        self,
        dataset: str,
        features: Sequence[str],
        label: str,
        *,
        classes: int | None = None,
        hidden: Sequence[int] = (),
        optimizer: str = "adamw",
        lr: float = 1e-3,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        batch_size: int = 256,
        epochs: int = 1,
        seed: int = 0,
        shuffle: str | int = "global",
        cpu_ranks: int = 1,
        gpus: Sequence[int] = (),
        checkpoint_url: str = "",
        checkpoint_every: int = 0,
        resume_from: str = "",
        max_steps: int = 0,
        keep_checkpoints: int = 0,
        filter: str = "",
    ) -> Iterator[wire.Message]:
        """Trains a model on a sealed dataset inside the server and yields its
        `TrainProgress` reports; the last has `done` set (and, for
        classification, the training `accuracy`). `classes=None` means
        regression. Checkpoints go to `checkpoint_url` every `checkpoint_every`
        steps and at the end; the newest `keep_checkpoints` stay (0 = 3).
        `filter` (a SQL condition, as in `plan`) trains on the rows it selects
        only — `hash_bucket(id, 10) < 8` keeps a stable 80 % for training,
        `'"label" IS NOT NULL'` the labelled rows (only the rows trained on
        must be free of nulls). Closing the iterator early cancels the job."""
        if isinstance(features, str):
            features = [features]  # one column, not its letters
        if optimizer not in ("adamw", "sgd"):
            raise InvalidArgument(f"unknown optimizer {optimizer!r}: use 'adamw' or 'sgd'", "INVALID_ARGUMENT")
        job = wire.TrainJob(
            dataset=dataset,
            features=list(features),
            label=label,
            task=wire.TASK_REGRESSION if classes is None else wire.TASK_CLASSIFICATION,
            classes=classes or 0,
            hidden=list(hidden),
            optimizer=wire.OPTIMIZER_SGD if optimizer == "sgd" else wire.OPTIMIZER_ADAMW,
            learning_rate=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            batch_size=batch_size,
            epochs=epochs,
            seed=seed,
            shuffle=shuffle_mode(shuffle),
            cpu_ranks=cpu_ranks,
            gpus=list(gpus),
            checkpoint_url=checkpoint_url,
            checkpoint_every=checkpoint_every,
            resume_from=resume_from,
            max_steps=max_steps,
            keep_checkpoints=keep_checkpoints,
            filter=filter,
        )
        results = translate(
            lambda: self._flight.do_action(flight.Action("train", job.encode()), options=self._options)
        )
        while True:
            item = translate(lambda: next(results, None))
            if item is None:
                return
            yield wire.TrainProgress.decode(item.body.to_pybytes())

    def jobs(self, job: int = 0) -> list[wire.Message]:
        """Status of training job `job`, or of every job since the server started."""
        return self._action("job", wire.JobQuery(job=job), wire.JobList).jobs

    def stats(self) -> wire.Message:
        """Memory per tier (host arena, devices, spills) and limit, datasets,
        rows, bytes; rows served to ranks, to and from other members."""
        return self._action("stats", None, wire.ServerStats)

    @property
    def location(self) -> str:
        """Where other members and ranks reach this server (its `--advertise`)."""
        return self.stats().location

    def list_datasets(self, prefix: str = "") -> list[str]:
        """Names of the datasets on the server, those starting with `prefix`
        when one is given (`ListFlights` with `prefix` as its criteria)."""
        criteria = prefix.encode()
        infos = translate(
            lambda: list(self._flight.list_flights(criteria, options=self._options))
        )
        return [i.descriptor.path[0].decode() for i in infos if i.descriptor.path]

    # Reading

    def plan(
        self,
        dataset: str,
        *,
        world_size: int = 1,
        epoch: int = 0,
        seed: int = 0,
        shuffle: str | int = "none",
        batch_rows: int = 0,
        drop_last: bool = False,
        columns: Sequence[str] | None = None,
        start_sample: int = 0,
        block_rows: int = 0,
        split_count: int = 0,
        split_index: int = 0,
        locality: str | int = "global",
        ranks_per_node: int = 0,
        nodes: Sequence[str] = (),
        resume_world_size: int = 0,
        filter: str = "",
        select: Sequence[str] = (),
        sealed_as: int = 0,
        max_rows: int = 0,
    ) -> Plan:
        """Plans one epoch of a sealed dataset for `world_size` ranks.

        On a dataset sealed across servers, `locality="global"` gives the
        order of one server holding everything; `"node"` has each rank read
        its own node's rows. Rank r runs on node r // `ranks_per_node`
        (torchrun's convention; 0 = ranks spread over the members), and
        `nodes` names each node's server (default: the members in layout
        order). Each shard's `location` is the member that serves it.

        `filter` is a SQL condition over the dataset's columns (DataFusion's
        dialect, plus `hash_bucket(value [, buckets])`): only the rows where
        it is true are read, and everything above (equal shares, orders,
        `start_sample`, `drop_last`) applies to them as to a dataset of
        that many rows. `select` lists SQL expressions with aliases
        (`"CAST(price AS FLOAT) / 100 AS price_eur"`) read instead of the
        stored columns; it cannot be given with `columns`.

        `sealed_as` (see :func:`sealed_as`; 0: any) plans the dataset only
        as it was sealed when the reader first looked at it: once it is
        dropped or written again the plan raises
        :class:`FailedPrecondition`, so the parts of one read planned at
        different times never mix two writes. `max_rows` (0: none) ends
        each rank's stream after that many rows, the order unchanged: a
        reader of one slice of the order is sent no more (`"global"` only)."""
        cmd = wire.ReadPlan(
            dataset=dataset,
            world_size=world_size,
            epoch=epoch,
            seed=seed,
            shuffle=shuffle_mode(shuffle),
            batch_rows=batch_rows,
            drop_last=drop_last,
            columns=list(columns or []),
            start_sample=start_sample,
            block_rows=block_rows,
            split_count=split_count,
            split_index=split_index,
            locality=locality_mode(locality),
            ranks_per_node=ranks_per_node,
            nodes=list(nodes),
            resume_world_size=resume_world_size,
            filter=filter,
            select=list(select),
            sealed_as=sealed_as,
            max_rows=max_rows,
        )
        descriptor = flight.FlightDescriptor.for_command(cmd.encode())
        info = translate(lambda: self._flight.get_flight_info(descriptor, options=self._options))
        shards = []
        for endpoint in info.endpoints:
            meta = wire.ShardInfo.decode(endpoint.app_metadata)
            location = endpoint.locations[0].uri.decode() if endpoint.locations else None
            shards.append(Shard(meta.rank, meta.rows, meta.batches, endpoint.ticket.ticket, location))
        counts = wire.PlanInfo.decode(info.app_metadata).partition_rows if info.app_metadata else []
        return Plan(info.schema, shards, list(counts))

    def _serving(self, shard: Shard) -> Client:
        """The client for the member that serves `shard`."""
        if shard.location is None or self._serves(shard.location):
            return self
        if shard.location not in self._members:
            self._members[shard.location] = self._sibling(shard.location)
        return self._members[shard.location]

    def _serves(self, location: str) -> bool:
        """Whether `location` (the member an endpoint names) is this
        client's server: the same server name, or, for a client on a Unix
        socket, the network location that server advertises (asked once)."""
        named = normalize_uri(location)
        if named == self.uri:
            return True
        if not self.uri.startswith("grpc+unix://"):
            return False
        if self._advertised is None:
            self._advertised = normalize_uri(self.location)
        return named == self._advertised

    def _do_get(self, shard: Shard, lend: bool = False) -> flight.FlightStreamReader | shm.RingReader:
        """The shard's stream; from a server on this machine, its record
        batches through shared memory where the server offers it (the same
        batches: see `_shm`; with `lend`, views of its ring rather than
        copies), else over the connection."""
        member = self._serving(shard)
        ticket = flight.Ticket(shard.ticket)
        options = member._shm_options
        if options is not None:
            ring = shm.RingReader(
                translate(lambda: member._flight.do_get(ticket, options=options)), lend=lend
            )
            try:
                translate(ring.start)
                return ring
            except shm.CannotAttach:
                # Not this machine's shared memory after all (another
                # container's, another user's): over the connection from now on.
                member._shm_options = None
                ring.cancel()
        return translate(lambda: member._flight.do_get(ticket, options=member._options))

    def read_shard(self, shard: Shard, lend: bool = False) -> Iterator[pa.RecordBatch]:
        """Streams a shard's record batches in order (`ShardedDataset` reads
        ahead of its loop with `Prefetched`). Closing the iterator before
        its end cancels the call, so the server stops sending. With `lend`,
        batches from the server's shared memory are views of it rather than
        copies, for a caller that drops each batch before long (one that
        keeps them all gets the rest of the stream over the socket: see
        `_shm`)."""
        reader = self._do_get(shard, lend)
        ended = False
        try:
            while True:
                try:
                    chunk = translate(reader.read_chunk)
                except StopIteration:
                    ended = True
                    return
                yield chunk.data
        finally:
            if not ended:
                try:
                    reader.cancel()
                except Exception:  # already failed or ended
                    pass

    def read_table(self, shard: Shard) -> pa.Table:
        """A whole shard as one table."""
        return translate(self._do_get(shard).read_all)


_END = object()

# The type of Flight SQL's `CommandStatementQuery`, as its `Any` names it.
_STATEMENT_QUERY = b"type.googleapis.com/arrow.flight.protocol.sql.CommandStatementQuery"


def _len_field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field: tag, length, `payload`."""
    return wire._varint(number << 3 | 2) + wire._varint(len(payload)) + payload


def prepared_slices(
    message: pa.RecordBatch,
    rows: int | None,
    prepare: Callable[[pa.RecordBatch], Any] | None = None,
    slice_prepared: Callable[[Any, int, int], Any] | None = None,
) -> Iterator[tuple[pa.RecordBatch, Any]]:
    """`message` as batches of `rows` rows (all of it: `rows` None), each
    with what `prepare` makes of it, as `(batch, prepared)` (zero-copy
    slices). With `slice_prepared(prepared, start, length)`, `prepare` runs
    once on the whole message and each batch's part is sliced out of its
    result (cheaper than preparing every slice)."""
    n = message.num_rows
    step = rows or n or 1
    if step >= n:
        yield message, None if prepare is None else prepare(message)
        return
    whole = prepare(message) if prepare is not None and slice_prepared is not None else None
    for start in range(0, n, step):
        batch = message.slice(start, step)
        if prepare is None:
            yield batch, None
        elif slice_prepared is not None:
            yield batch, slice_prepared(whole, start, batch.num_rows)
        else:
            yield batch, prepare(batch)


class Prefetched:
    """A `DoGet` stream read on a background thread ahead of its consumer.
    Iterating yields the batches in order; `stall` is the time the consumer
    has waited for them (seconds), and `received` how many the thread has
    read. With `slice_rows`, each message is handed out as slices of that
    many rows (zero-copy), each counted as a batch (see `prepared_slices`,
    also for `slice_prepared`). The thread reads the next message whenever
    fewer than `depth` batches, or fewer than the last message held, wait:
    at most about `depth` batches or two messages ahead, and it hands over
    a message's batches at once (one exchange with the consumer a message,
    not one a batch: each costs both threads the GIL).
    With `prepare`, iterating yields pairs `(batch, prepare(batch))`,
    `prepare` run on the background thread too (turning a batch into
    tensors, pinning them). `close()` (also on the iterator's end, or when a
    generator iterating it is closed) cancels the stream and joins the
    thread."""

    def __init__(
        self,
        reader: flight.FlightStreamReader,
        depth: int,
        prepare: Callable[[pa.RecordBatch], Any] | None = None,
        slice_rows: int | None = None,
        slice_prepared: Callable[[Any, int, int], Any] | None = None,
    ) -> None:
        self._reader = reader
        self._depth = max(1, depth)
        self._prepare = prepare
        self._slice_rows = slice_rows
        self._slice_prepared = slice_prepared
        self._ready: collections.deque = collections.deque()
        self._changed = threading.Condition()
        # Batches of the last message read: the thread reads on while fewer wait.
        self._message = 1
        self._stop = threading.Event()
        self.received = 0
        self.stall = 0.0
        self._thread = threading.Thread(target=self._run, name="flightdeck-prefetch", daemon=True)
        self._thread.start()

    def _wanted(self) -> bool:
        """Whether the thread should read another message (lock held)."""
        return len(self._ready) < max(self._depth, self._message)

    def _hand_over(self, items: list) -> None:
        with self._changed:
            self._ready.extend(items)
            self._changed.notify_all()

    def _run(self) -> None:
        try:
            while True:
                with self._changed:
                    self._changed.wait_for(lambda: self._stop.is_set() or self._wanted())
                if self._stop.is_set():
                    return
                try:
                    chunk = translate(self._reader.read_chunk)
                except StopIteration:
                    break
                items = [
                    item if self._prepare is not None else item[0]
                    for item in prepared_slices(
                        chunk.data, self._slice_rows, self._prepare, self._slice_prepared
                    )
                ]
                self._message = max(1, len(items))
                self.received += len(items)
                self._hand_over(items)
            self._hand_over([_END])
        except BaseException as exc:  # handed to the consumer
            if not self._stop.is_set():
                self._hand_over([exc])

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        try:
            while True:
                with self._changed:
                    if not self._ready:
                        started = time.perf_counter()
                        self._changed.wait_for(lambda: bool(self._ready))
                        self.stall += time.perf_counter() - started
                    item = self._ready.popleft()
                    if self._wanted():
                        self._changed.notify_all()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.close()

    def close(self) -> None:
        """Cancels the stream and waits for the thread to end."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self._reader.cancel()
        except Exception:
            pass
        with self._changed:
            self._changed.notify_all()
        self._thread.join()
        self._ready.clear()


def _on_this_machine(uri: str) -> bool:
    """Whether the server `uri` names (normalized) is on this machine: its
    Unix socket, or a loopback address."""
    if uri.startswith("grpc+unix://"):
        return True
    host = uri.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def connect(
    uri: str,
    *,
    timeout: float | None = None,
    headers: Mapping[str, str] | None = None,
    token: str | None = None,
    tls_root_certs: bytes | None = None,
) -> Client:
    """Connects to a flightdeck server: `host`, `host:port`, `grpc://…`,
    `grpc+tls://…`, or `local` for this node's server (`FLIGHTDECK_URI`, else
    loopback); port 50051 wherever none is given (see `normalize_uri`).

    `token` (default: the `FLIGHTDECK_TOKEN` environment variable) is sent as
    a bearer token on every call; servers started with `--auth-token-file`
    need one. `grpc+tls://host:port` connects over TLS, checking the server
    against `tls_root_certs` (PEM; default: the file `FLIGHTDECK_TLS_ROOT_CERTS`
    names). Both variables reach the Spark connector's executors through
    `spark.executorEnv.*`."""
    return Client(uri, timeout=timeout, headers=headers, token=token, tls_root_certs=tls_root_certs)
