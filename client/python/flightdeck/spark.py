"""Spark connector: `df.write.format("flightdeck")` and
`spark.read.format("flightdeck")` (Spark 4), and `write_dataframe` (Spark
3.4/3.5, `mapInArrow`).

    from flightdeck.spark import register
    register(spark)
    (df.write.format("flightdeck")
       .option("uri", "local")          # the server on each executor's host
       .option("dataset", "features")
       .mode("overwrite")
       .save())

Each task streams its partition as attempt `TaskContext.attemptNumber()` of
partition `TaskContext.partitionId()`; the task's commit message names the
attempt and the server that holds it; the driver's `commit` seals the
dataset with exactly the winning attempts and the partition count, so
retried and speculative tasks never duplicate rows. `abort` drops what the
job wrote, naming the job's write id (made on the driver, sent with every
attempt), so that a task still running when the job failed is refused
rather than bringing the dataset back. `overwrite` replaces an existing
dataset at the end of the job: the new rows are staged beside it while the
job runs (readers keep reading the old ones; the memory holds both), the
seal puts them in its place at once, and a job that fails leaves the old
dataset as it was. `append` to an existing dataset fails, since a sealed
dataset is immutable. A server started with
`--auth-token-file` takes the `token` option (default: `FLIGHTDECK_TOKEN`
in the environment of the driver and of each executor) on every call: a
writer's token to write, a reader's to read.

Many nodes: with `uri` `local` (the default) each executor writes to its own
node's server (`FLIGHTDECK_URI`, else loopback); `uris` (comma-separated)
sends partition `p` to `uris[p % len(uris)]` instead, for clusters without a
server beside every executor (a `uris` that names none is refused). When
the partitions landed on several servers, the driver seals them as one
dataset (`Client.seal_cluster`) through the first of them. `batch_rows`
sets the rows of each record batch sent (default: the batches Spark hands
over, `spark.sql.execution.arrow.maxRecordsPerBatch` rows) or read. Any
other option is refused, naming the one meant where the spelling is close
(`fliter` would otherwise read every row), as is `filter` on a write.

Reads give a sealed dataset back as a DataFrame: one Spark partition per
stored partition, rows in the dataset's own order (partition order, then
row order), on a cluster dataset through any member (`uri`, else the first
of `uris`), each stored partition served by the member holding it. Every
task reads the dataset as it was sealed when the driver planned the read:
one dropped or written again meanwhile fails the task (`FailedPrecondition`)
rather than mixing two writes in one DataFrame. A `filter` option (a
SQL condition, as in a read plan) has the server send only the rows it
selects: on a cluster dataset each stored partition's selected rows are a
Spark partition served where they are held (the plan tells their counts);
on one server they are split evenly over as many Spark partitions. Where
the session lets Spark push its filters to Python data sources
(`spark.sql.python.filterPushdown.enabled` true when :func:`register` is
called) and Spark does not reuse a pushed read for other queries (Spark 5+,
see :func:`reuses_pushed_reads`), its comparisons, `IN` and null tests on
integer, string and boolean columns join that condition, and Spark still
evaluates them on what arrives. Spark's Python data sources cannot prune
columns: a schema given to the read
(`spark.read.schema("id long, x float")`) names the columns the server
sends, and reads a dataset with a column Spark cannot hold (a `decimal256`
wider than 38 digits) without it. Columns another Arrow writer stored as
types Spark does not hold (unsigned integers, half floats, `date64`,
dictionaries, nanosecond timestamps, …) read as Spark's Parquet reader
gives them (see `_readable`).

Spark ML vectors (`VectorUDT`) would be Spark's internal structs on the
wire, so a write refuses them: convert them first with
:func:`vectors_to_arrays` so features arrive as `array<float>`, which
`flightdeck.to_numpy` / `to_torch` turn into `(rows, D)` arrays.
"""

from __future__ import annotations

import difflib
import uuid
import warnings
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping

import pyarrow as pa
import pyarrow.compute as pc
from pyspark import TaskContext
from pyspark.sql import DataFrame, SparkSession

from . import _wire as wire
from .client import Client, connect, dataset_schema, sealed_as
from .errors import FailedPrecondition, FlightDeckError, InvalidArgument, NotFound


def parse_uris(value: str | list[str] | None) -> list[str]:
    """The `uris` option: a list, or one comma-separated string."""
    if not value:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    return [u.strip() for u in items if u.strip()]


#: Why a stream (`writeStream`, `readStream`) is refused, and what to do.
NO_STREAMS = (
    "format('flightdeck') writes and reads batches, not streams: a dataset is sealed whole "
    "and then read, so write each micro-batch of a stream as a dataset of its own with "
    "foreachBatch (df.write.format('flightdeck').option('dataset', f'clicks-{batch_id}')...)"
)

#: The options a write takes (keys in any case, as Spark passes them).
WRITE_OPTIONS = ("uri", "uris", "dataset", "batch_rows", "token")
#: The options a read takes: a write's and `filter`.
READ_OPTIONS = WRITE_OPTIONS + ("filter",)
OPTIONS_TEXT = "uri, uris, dataset, batch_rows, token and, for reads, filter"
#: What Spark adds to the options of a table made with `CREATE TABLE ...
#: USING flightdeck OPTIONS (...)` (its catalog's reserved properties and the
#: table's path; `option.*` repeats the options): not the user's, so neither
#: refused nor used.
SPARK_TABLE_PROPERTIES = (
    "provider", "location", "comment", "owner", "external", "is_managed_location",
    "collation", "table_type", "path", "paths",
)


def check_options(options: Mapping[str, str], read: bool) -> None:
    """Refuses an option the data source does not take, naming the one
    meant where the spelling is close: a misspelt `filter` would otherwise
    read every row, a misspelt `uris` send every partition to this node's
    server. What Spark adds itself (:data:`SPARK_TABLE_PROPERTIES`) passes.
    `read`: whether the options are a read's (`filter` is not a write's)."""
    known = READ_OPTIONS if read else WRITE_OPTIONS
    for key in options:
        name = key.lower()
        if name in known or name in SPARK_TABLE_PROPERTIES or name.startswith("option."):
            continue
        if name == "filter":
            raise InvalidArgument(
                "option filter selects the rows a read sends; a write stores every row of the "
                "DataFrame: filter the DataFrame before writing it"
            )
        close = difflib.get_close_matches(name, READ_OPTIONS, n=1)
        raise InvalidArgument(
            f"unknown option {key!r}"
            + (f" (did you mean {close[0]!r}?)" if close else "")
            + f"; format('flightdeck') takes {OPTIONS_TEXT}"
        )


def _uris_option(options: Mapping[str, str]) -> list[str]:
    """The data source's `uris` option; refused when given but naming no
    server (an empty variable substituted into it), which would otherwise
    send every partition to this node's server."""
    value = options.get("uris")
    uris = parse_uris(value)
    if value is not None and not uris:
        raise InvalidArgument(
            f"option uris names no server ({value!r}); give the servers comma-separated, "
            "e.g. 'grpc://node1:50051,grpc://node2:50051', or leave it out to use uri"
        )
    return uris


def _batch_rows_option(options: Mapping[str, str]) -> int:
    """The `batch_rows` option: rows per record batch sent or read; 0 where
    not given."""
    rows = (options.get("batch_rows") or "").strip()
    if rows and not (rows.isdigit() and int(rows) > 0):
        raise InvalidArgument(
            f"option batch_rows must be a whole number of rows, 1 or more, not {rows!r}"
        )
    return int(rows or 0)


def rebatch(batches: Iterable[pa.RecordBatch], rows: int) -> Iterator[pa.RecordBatch]:
    """`batches` as batches of `rows` rows (the last may hold fewer): larger
    ones are sliced without a copy, smaller ones joined."""
    held: list[pa.RecordBatch] = []
    count = 0
    for batch in batches:
        start = 0
        while start < batch.num_rows:
            take = min(rows - count, batch.num_rows - start)
            held.append(batch.slice(start, take))
            count += take
            start += take
            if count == rows:
                yield _joined(held)
                held, count = [], 0
    if held:
        yield _joined(held)


def _joined(batches: list[pa.RecordBatch]) -> pa.RecordBatch:
    """One batch of `batches`' rows (itself where there is one)."""
    if len(batches) == 1:
        return batches[0]
    return pa.Table.from_batches(batches).combine_chunks().to_batches()[0]


def prepare_dataset(
    uri: str, dataset: str, overwrite: bool, uris: list[str] = (), token: str | None = None
) -> None:
    """Driver-side check before a write, on `uri` and every one of `uris`:
    each is reachable, and (append) none holds the dataset. An overwrite
    leaves the dataset alone: the write replaces it when sealed."""
    for target in list(dict.fromkeys(uris)) or [uri]:
        _prepare_one(target, dataset, overwrite, token)


def _prepare_one(uri: str, dataset: str, overwrite: bool, token: str | None) -> None:
    with connect(uri, token=token) as client:
        try:
            info = client.describe(dataset)
        except NotFound:
            return
        if overwrite:
            return
    if info.state == wire.DATASET_STATE_SEALED:
        raise FlightDeckError(
            f"cannot append to dataset '{dataset}': it already exists (sealed, {info.rows} "
            "rows) and a flightdeck dataset is immutable once sealed; use mode('overwrite') to "
            "replace it, or write to a new dataset name",
            "FAILED_PRECONDITION",
        )
    if info.state == wire.DATASET_STATE_SEALING:
        raise FlightDeckError(
            f"cannot append to dataset '{dataset}': {unfinished_seal(dataset, uri)}",
            "FAILED_PRECONDITION",
        )
    raise FlightDeckError(
        f"cannot append to dataset '{dataset}': another write of it is under way or was left "
        f"unfinished ({info.rows} rows, last written {info.written_seconds_ago:.0f}s ago, never "
        "sealed); if the job writing it is gone, mode('overwrite') replaces what it left (or "
        f"drop it first: flightdeck drop {dataset} --server {uri})",
        "FAILED_PRECONDITION",
    )


def target_uri(uri: str, uris: list[str], partition: int) -> str:
    """Where partition `partition` is written: `uris[p % len(uris)]`, else
    `uri` (`local`: this node's server)."""
    return uris[partition % len(uris)] if uris else uri


def _put_task_partition(
    uri: str,
    dataset: str,
    batches: Iterator[pa.RecordBatch],
    schema: pa.Schema | None,
    uris: list[str] = (),
    write_id: str = "",
    token: str | None = None,
    replace: bool = False,
) -> tuple[int, int, int, str]:
    ctx = TaskContext.get()
    if ctx is None:
        raise RuntimeError("flightdeck's Spark writer must run inside a Spark task")
    partition, attempt = ctx.partitionId(), ctx.attemptNumber()
    target = target_uri(uri, list(uris), partition)
    with connect(target, token=token) as client:
        ack = client.put_partition(
            dataset, partition, batches, attempt, schema=schema, write_id=write_id, replace=replace
        )
        # The server's own name for itself: what other members reach it at.
        location = ack.location or client.uri
    return partition, attempt, ack.rows, location


def seal_winners(
    uri: str,
    dataset: str,
    partitions: int,
    winners: dict[int, tuple[int, str]],
    token: str | None = None,
    replace_write: str = "",
    uris: list[str] = (),
) -> None:
    """Seals `dataset` naming the winning attempt of every partition and the
    server that holds it: one server's seal when all are on one, else a
    cluster seal through the first of them. With `replace_write`, what that
    write staged takes the dataset's place, and the servers of `uris` the
    write routed no partition to lose their older copies of it (see
    `drop_older_copies`)."""
    missing = sorted(set(range(partitions)) - set(winners))
    if missing:
        raise FlightDeckError(
            f"no committed task for partitions {missing} of dataset '{dataset}'", "INTERNAL"
        )
    if not winners:
        raise FlightDeckError(f"no task committed a partition of dataset '{dataset}'", "INTERNAL")
    members: dict[str, dict[int, int]] = {}
    for p, (attempt, location) in sorted(winners.items()):
        members.setdefault(location or uri, {})[p] = attempt
    first = next(iter(members))
    with connect(first, token=token) as client:
        if len(members) == 1:
            client.seal(
                dataset, partitions=partitions, attempts=members[first], replace_write=replace_write
            )
        else:
            client.seal_cluster(dataset, members, partitions=partitions, replace_write=replace_write)
    if replace_write:
        used = {target_uri(uri, list(uris), p) for p in winners}
        unused = [u for u in dict.fromkeys(uris) if u not in used]
        drop_older_copies(unused, dataset, replace_write, token)


def drop_older_copies(uris: list[str], dataset: str, write_id: str, token: str | None) -> None:
    """After overwrite `write_id` sealed `dataset`: drops the copies of it
    on `uris` (servers the write routed no rows to), which would otherwise
    go on serving the rows it replaced to readers there — a copy written
    there alone, or a cluster layout of other servers. The swap already
    dropped every layout one of its own servers was part of; a server that
    holds what `write_id` swapped in (a member named twice) keeps it. A
    server that cannot be reached keeps its copy, with a warning."""
    for target in uris:
        try:
            with connect(target, token=token) as client:
                client.drop(dataset, keep_write=write_id)
        except (NotFound, FailedPrecondition):
            pass
        except FlightDeckError as e:
            warnings.warn(
                f"dataset '{dataset}' was overwritten, but the older copy on {target} could not "
                f"be dropped ({e}); drop it there: flightdeck drop {dataset} --server {target}",
                stacklevel=2,
            )


def new_write_id() -> str:
    """An id for one write job, shared by its tasks."""
    return uuid.uuid4().hex


def drop_quietly(
    uris: list[str],
    dataset: str,
    write_id: str = "",
    token: str | None = None,
    staged: bool = False,
) -> None:
    """Drops what a failed job wrote, if anything, on every server named,
    and has each refuse the job's attempts from now on. With `staged` (an
    overwrite), only what the job staged goes: the dataset stays."""
    for uri in dict.fromkeys(uris):
        try:
            with connect(uri, token=token) as client:
                client.drop(dataset, abort_write=write_id, staged=staged)
        except FlightDeckError:
            pass


def refuse_vectors(schema) -> None:
    """Refuses a Spark ML vector column (`VectorUDT`): it would be stored as
    Spark's internal struct (type, size, indices, values), which no reader
    trains on; :func:`vectors_to_arrays` makes it the `array<float>` a
    feature column is."""
    for field in schema.fields:
        udt = type(field.dataType)
        if udt.__name__ == "VectorUDT" and udt.__module__.startswith("pyspark."):
            raise InvalidArgument(
                f"column {field.name!r} is a Spark ML vector, which would be stored as Spark's "
                "internal struct (type, size, indices, values) that no reader trains on: "
                "convert it to an array first, flightdeck.spark.vectors_to_arrays(df) "
                "(array<float>)"
            )


def _arrow_schema(schema) -> pa.Schema | None:
    try:
        from pyspark.sql.pandas.types import to_arrow_schema

        return to_arrow_schema(schema)
    except Exception:  # a type Arrow cannot express: let the data speak
        return None


def read_parts(partition_rows: list[int], selected: int | None = None) -> list[tuple[int, int]]:
    """How a read splits a dataset into Spark partitions, as `(start, rows)`
    in the dataset's row order: one per stored partition (`partition_rows`,
    in partition order), or, when a filter selects `selected` rows, those
    rows in as many equal parts as there are stored partitions, none empty."""
    if selected is None:
        parts, start = [], 0
        for rows in partition_rows:
            parts.append((start, rows))
            start += rows
        return parts
    n = max(1, len(partition_rows))
    bounds = [selected * i // n for i in range(n + 1)]
    return [(a, b - a) for a, b in zip(bounds, bounds[1:]) if b > a]


def _kind(data_type) -> str:
    """How a Spark column's comparisons translate: `integral`, `string`,
    `boolean`, or `other` (left to Spark)."""
    from pyspark.sql import types as T

    if isinstance(data_type, (T.ByteType, T.ShortType, T.IntegerType, T.LongType)):
        return "integral"
    if isinstance(data_type, T.StringType):
        return "string"
    if isinstance(data_type, T.BooleanType):
        return "boolean"
    return "other"


def column_kinds(schema) -> dict[str, str]:
    """Each top-level column of a Spark schema by its :func:`_kind`."""
    return {f.name: _kind(f.dataType) for f in schema.fields}


def _literal(value, kind: str) -> str | None:
    if kind == "string":
        return "'" + value.replace("'", "''") + "'" if isinstance(value, str) else None
    if kind == "boolean":
        return ("TRUE" if value else "FALSE") if isinstance(value, bool) else None
    integral = isinstance(value, int) and not isinstance(value, bool)
    # (-2**63's digits overflow before its minus applies.)
    return str(value) if kind == "integral" and integral and value != -(2**63) else None


def quote(name: str) -> str:
    """A column name as a SQL identifier (case kept, quotes doubled)."""
    return '"' + name.replace('"', '""') + '"'


_COMPARISONS = {
    "EqualTo": "=",
    "GreaterThan": ">",
    "GreaterThanOrEqual": ">=",
    "LessThan": "<",
    "LessThanOrEqual": "<=",
}


def filter_sql(f, kinds: Mapping[str, str]) -> str | None:
    """Spark's pushed filter `f` as a read plan's SQL condition selecting the
    same rows, or None where its meaning could differ on the server: only
    comparisons, `IN` and null tests on top-level integer, string and
    boolean columns (`kinds`, from :func:`column_kinds`), and `NOT` of them,
    translate. Floating-point and temporal columns stay with Spark (NaN,
    signed zero and literal formats differ)."""
    kind = type(f).__name__
    if kind == "Not":
        inner = filter_sql(f.child, kinds)
        return None if inner is None else f"(NOT {inner})"
    path = getattr(f, "attribute", ())
    if len(path) != 1 or path[0] not in kinds:
        return None  # a nested field, or no column of the read's schema
    column, type_kind = quote(path[0]), kinds[path[0]]
    if kind in ("IsNull", "IsNotNull"):
        return f"({column} IS {'NOT ' if kind == 'IsNotNull' else ''}NULL)"
    if kind in _COMPARISONS:
        literal = _literal(f.value, type_kind)
        return None if literal is None else f"({column} {_COMPARISONS[kind]} {literal})"
    if kind == "In" and f.value:
        values = [_literal(v, type_kind) for v in f.value]
        return None if None in values else f"({column} IN ({', '.join(values)}))"
    return None


def _readable(t: pa.DataType) -> pa.DataType | None:
    """The Arrow type Spark reads a stored type as; None where it has none.

    Types Spark holds stay; the others that convert without losing values
    become the type Spark's own Parquet reader gives them (the reader's
    batches are cast to it): Arrow's view layouts (`string_view`,
    `binary_view`) plain strings and bytes, unsigned integers the next
    signed type (`uint64` `decimal128(20, 0)`), half floats `float32`,
    `date64` `date32`, `time32` `time64[ns]`, dictionaries their values —
    at any depth in lists, structs and maps. A `decimal256` wider than 38
    digits has none."""
    if pa.types.is_string_view(t):
        return pa.string()
    if pa.types.is_binary_view(t):
        return pa.binary()
    if pa.types.is_unsigned_integer(t):
        wider = {8: pa.int16(), 16: pa.int32(), 32: pa.int64()}
        return wider.get(t.bit_width, pa.decimal128(20, 0))
    if pa.types.is_float16(t):
        return pa.float32()
    if pa.types.is_date64(t):
        return pa.date32()
    if pa.types.is_time32(t):
        return pa.time64("ns")
    if pa.types.is_decimal256(t):
        return pa.decimal128(t.precision, t.scale) if t.precision <= 38 else None
    if pa.types.is_dictionary(t):
        return _readable(t.value_type)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        item = _readable(t.value_type)
        if item is None:
            return None
        item = t.value_field.with_type(item)
        if pa.types.is_fixed_size_list(t):
            return pa.list_(item, t.list_size)
        return pa.large_list(item) if pa.types.is_large_list(t) else pa.list_(item)
    if pa.types.is_map(t):
        key, item = _readable(t.key_type), _readable(t.item_type)
        if key is None or item is None:
            return None
        return pa.map_(t.key_field.with_type(key), t.item_field.with_type(item))
    if pa.types.is_struct(t):
        types = [_readable(f.type) for f in t]
        if None in types:
            return None
        return pa.struct([f.with_type(ty) for f, ty in zip(t, types)])
    return t


def _read_schema(info, dataset: str, location: str):
    """The Spark schema of a sealed dataset, from its description."""
    from pyspark.sql.pandas.types import from_arrow_type
    from pyspark.sql.types import StructField, StructType

    schema = dataset_schema(info)
    fields = []
    for field in schema or []:
        try:
            readable = _readable(field.type)
            spark_type = from_arrow_type(readable) if readable is not None else None
        except Exception:  # Spark has no type for it
            spark_type = None
        if spark_type is None:
            raise InvalidArgument(
                f"column '{field.name}' of dataset '{dataset}' on {location} is {field.type}, "
                "which Spark cannot hold; give the read a schema naming the columns to read "
                "without it, e.g. spark.read.schema(\"id long\")"
            )
        fields.append(StructField(field.name, spark_type, field.nullable))
    return StructType(fields)


def unfinished_seal(dataset: str, uri: str) -> str:
    """What a dataset whose seal across servers did not finish on `uri`
    needs."""
    return (
        f"dataset '{dataset}' on {uri} is being sealed across servers and its seal did not "
        "finish there (the job that wrote it failed while sealing, or is sealing it now); "
        f"write it again with mode('overwrite'), or drop it: flightdeck drop {dataset} "
        f"--server {uri}"
    )


def _sealed(client: Client, dataset: str):
    """`dataset`'s description, refusing one that is missing or unsealed."""
    try:
        info = client.describe(dataset)
    except NotFound:
        raise NotFound(
            f"dataset '{dataset}' does not exist on {client.uri}; write it first "
            "(df.write.format(\"flightdeck\"))"
        ) from None
    if info.state == wire.DATASET_STATE_SEALING:
        raise FailedPrecondition(unfinished_seal(dataset, client.uri))
    if info.state != wire.DATASET_STATE_SEALED:
        raise FailedPrecondition(
            f"dataset '{dataset}' is still being written; read it once its write has been sealed"
        )
    return info


def _token(options: Mapping[str, str]) -> str | None:
    """The `token` option; None (unset or empty): `FLIGHTDECK_TOKEN` where the
    connection is made."""
    return options.get("token") or None


def _refuse_a_path(options: Mapping[str, str]) -> None:
    """A read or write given a path (`save(PATH)`, `load(PATH)`) but no
    dataset: says that the dataset is an option, named by that path."""
    path = options.get("path")
    if path:
        raise InvalidArgument(
            f"format('flightdeck') names its dataset with an option, not a path: "
            f".option('dataset', {path!r}) instead of save({path!r}) or load({path!r})"
        )


def _read_options(options: Mapping[str, str]) -> tuple[str, str, int, str]:
    """A read's `uri`, `dataset`, `batch_rows` and `filter` options;
    refuses any other (:func:`check_options`)."""
    check_options(options, read=True)
    if not options:
        raise InvalidArgument(
            "the read was given no options: set .option('dataset', NAME). (Through a table "
            "made with CREATE TABLE ... USING a Python data source Spark hands the reader none "
            "of the table's options, so such a table cannot be read: use spark.read.format(...)"
            ".option(...), or the JVM connector, whose tables read.)"
        )
    dataset = options.get("dataset")
    if not dataset:
        _refuse_a_path(options)
        raise InvalidArgument("set the dataset to read: .option('dataset', NAME)")
    rows = _batch_rows_option(options)
    filter = (options.get("filter") or "").strip()
    # As a write takes it: `uri`, else the first of `uris`, else this node's.
    uri = options.get("uri") or next(iter(_uris_option(options)), "local")
    return uri, dataset, rows, filter


def holders(info) -> dict[int, str]:
    """The member holding each partition of a dataset sealed across servers
    (from its `DatasetInfo`); empty for a dataset on one server."""
    layout = info.layout
    if layout is None:
        return {}
    return {p.partition: m.location for m in layout.members for p in m.partitions}


try:  # Spark 4: Python data sources
    from pyspark.sql.datasource import (
        DataSource,
        DataSourceArrowWriter,
        DataSourceReader,
        InputPartition,
        WriterCommitMessage,
    )

    @dataclass
    class FlightDeckCommitMessage(WriterCommitMessage):
        """What a task tells the driver: which attempt holds its partition,
        and on which server (its advertised location)."""

        partition: int
        attempt: int
        rows: int
        location: str = ""

    class FlightDeckWriter(DataSourceArrowWriter):
        """Streams each task's partition; seals on commit, drops on abort."""

        def __init__(self, options: dict, schema, overwrite: bool) -> None:
            check_options(options, read=False)
            self.uri = options.get("uri", "local")
            self.uris = _uris_option(options)
            self.token = _token(options)
            self.dataset = options.get("dataset")
            if not self.dataset:
                _refuse_a_path(options)
                raise InvalidArgument("set the dataset to write: .option('dataset', NAME)")
            self.batch_rows = _batch_rows_option(options)
            refuse_vectors(schema)
            self.schema = _arrow_schema(schema)
            self.write_id = new_write_id()
            self.overwrite = overwrite
            # Runs on the driver, before any task.
            prepare_dataset(self.uri, self.dataset, overwrite, self.uris, self.token)

        def write(self, iterator: Iterator[pa.RecordBatch]) -> FlightDeckCommitMessage:
            batches = rebatch(iterator, self.batch_rows) if self.batch_rows else iterator
            partition, attempt, rows, location = _put_task_partition(
                self.uri,
                self.dataset,
                batches,
                self.schema,
                self.uris,
                self.write_id,
                self.token,
                self.overwrite,
            )
            return FlightDeckCommitMessage(partition, attempt, rows, location)

        def commit(self, messages) -> None:
            winners = {m.partition: (m.attempt, m.location) for m in messages}
            replace_write = self.write_id if self.overwrite else ""
            seal_winners(
                self.uri,
                self.dataset,
                len(messages),
                winners,
                self.token,
                replace_write,
                self.uris,
            )

        def abort(self, messages) -> None:
            written = [m.location for m in messages if m is not None and m.location]
            targets = [*written, *self.uris] or [self.uri]
            drop_quietly(targets, self.dataset, self.write_id, self.token, self.overwrite)

    @dataclass
    class FlightDeckReadPartition(InputPartition):
        """`rows` rows of a read from row `start` of the dataset's order (of
        the rows its filter selects, where it has one)."""

        start: int
        rows: int
        #: The dataset's seal the read was planned on (see `sealed_as`).
        sealed_as: int = 0
        #: The member holding these rows, which serves them (a stored
        #: partition of a dataset sealed across servers); "": any.
        holder: str = ""

    class FlightDeckReader(DataSourceReader):
        """Reads a sealed dataset as the module's overview says: one Spark
        partition per stored partition, each an unshuffled read plan from
        its first row, stopped after its last."""

        def __init__(self, options: Mapping[str, str], schema) -> None:
            from pyspark.sql.pandas.types import to_arrow_schema

            self.uri, self.dataset, self.batch_rows, self.filter = _read_options(options)
            self.token = _token(options)
            self.spark_schema = schema
            self.columns = list(schema.fieldNames())
            self.kinds = column_kinds(schema)
            # Exactly the batches' schema Spark takes back.
            self.arrow = to_arrow_schema(schema, timezone="UTC")

        def partitions(self) -> list:
            with connect(self.uri, token=self.token) as client:
                info = _sealed(client, self.dataset)
                stored = dataset_schema(info)
                missing = [c for c in self.columns if c not in stored.names]
                if missing:
                    raise InvalidArgument(
                        f"the read's schema names {missing}, which dataset '{self.dataset}' "
                        f"does not have; its columns are {stored.names}"
                    )
                seal = sealed_as(info)
                stored = sorted(info.partitions, key=lambda p: p.partition)
                counts, selected = [p.rows for p in stored], None
                held = holders(info)
                if self.filter:
                    plan = client.plan(
                        self.dataset, columns=self.columns, filter=self.filter, sealed_as=seal
                    )
                    if held and len(plan.partition_rows) == len(stored):
                        # On a cluster, the rows the filter selects in each
                        # stored partition, read where they are held.
                        counts = plan.partition_rows
                    else:
                        # One server: equal parts, so a filter that selects
                        # from few partitions still makes as many tasks.
                        selected, held = plan.total_rows, {}
            spans = read_parts(counts, selected)
            # Unless split evenly, Spark partition i is stored partition i
            # (its selected rows, with a filter): its member serves it,
            # with nothing fetched from the others.
            at = [held.get(p.partition, "") for p in stored] if held else [""] * len(spans)
            parts = [
                FlightDeckReadPartition(a, n, seal, h)
                for (a, n), h in zip(spans, at)
                if n or not self.filter
            ]
            return parts or [FlightDeckReadPartition(0, 0, seal)]

        def read(self, partition: FlightDeckReadPartition) -> Iterator[pa.RecordBatch]:
            remaining = partition.rows
            if not remaining:
                return
            with connect(self.uri, token=self.token) as client:
                plan = client.plan(
                    self.dataset,
                    start_sample=partition.start,
                    # The stream ends with the partition.
                    max_rows=partition.rows,
                    batch_rows=self.batch_rows,
                    columns=self.columns,
                    filter=self.filter,
                    # Every partition reads the write the driver planned on.
                    sealed_as=partition.sealed_as,
                    # Served by the member holding the rows, where known.
                    nodes=[partition.holder] if partition.holder else (),
                    ranks_per_node=1 if partition.holder else 0,
                )
                stream = client.read_shard(plan.shards[0])
                try:
                    for batch in stream:
                        batch = batch.slice(0, remaining)
                        remaining -= batch.num_rows
                        yield self._for_spark(batch)
                        if remaining == 0:
                            break  # the rest of the order is the next partitions'
                finally:
                    stream.close()
            if remaining:
                # Never a partition cut short as if complete.
                raise FlightDeckError(
                    f"the stream of dataset '{self.dataset}' from row {partition.start} ended "
                    f"{remaining} rows short of its partition; read the dataset again",
                    "INTERNAL",
                )

        def _for_spark(self, batch: pa.RecordBatch) -> pa.RecordBatch:
            """`batch` with the Arrow types Spark expects of the read's
            schema. Timestamps and durations finer than Spark's microseconds
            drop the digits below them, as Spark does for pandas'
            nanoseconds; every other conversion must keep the values."""
            if batch.schema.equals(self.arrow):
                return batch
            try:
                columns = [
                    pc.cast(column, options=pc.CastOptions(field.type, allow_time_truncate=True))
                    for column, field in zip(batch.columns, self.arrow)
                ]
                return pa.RecordBatch.from_arrays(columns, schema=self.arrow)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise InvalidArgument(
                    f"dataset '{self.dataset}' cannot be read as {self.spark_schema.simpleString()}"
                    f": {e}; give the read a schema with types its columns convert to"
                ) from None

    class FlightDeckFilteringReader(FlightDeckReader):
        """A :class:`FlightDeckReader` that takes Spark's filters too. Spark
        offers them only where `spark.sql.python.filterPushdown.enabled` is
        true, and refuses a reader that has `pushFilters` where it is not, so
        the data source returns this one only where it was."""

        def pushFilters(self, filters: list) -> Iterable:
            pushed = [sql for sql in (filter_sql(f, self.kinds) for f in filters) if sql]
            if pushed:
                given = [f"({self.filter})"] if self.filter else []
                self.filter = " AND ".join(given + pushed)
            # Spark evaluates every filter again on what arrives.
            return filters

    class FlightDeckDataSource(DataSource):
        """`format("flightdeck")`: options `uri` (default `local`), `uris`
        (comma-separated; partition p goes to the (p mod n)-th), `dataset`
        `token` (default: `FLIGHTDECK_TOKEN` where each call is made) and
        `batch_rows` (rows per record batch sent or read; default: the
        batches Spark hands over, `spark.sql.execution.arrow.maxRecordsPerBatch`,
        for writes, the server's `--default-batch-rows` for reads); for
        reads, `filter` too."""

        #: Whether reads take Spark's filters (:func:`register` sets it from
        #: the session's `spark.sql.python.filterPushdown.enabled`).
        push_filters = False

        @classmethod
        def name(cls) -> str:
            return "flightdeck"

        def schema(self):
            uri, dataset, _, _ = _read_options(self.options)
            with connect(uri, token=_token(self.options)) as client:
                return _read_schema(_sealed(client, dataset), dataset, client.uri)

        def reader(self, schema) -> FlightDeckReader:
            kind = FlightDeckFilteringReader if self.push_filters else FlightDeckReader
            return kind(self.options, schema)

        def writer(self, schema, overwrite: bool) -> FlightDeckWriter:
            return FlightDeckWriter(self.options, schema, overwrite)

        def streamWriter(self, schema, overwrite: bool):  # noqa: N802 (Spark's name)
            raise InvalidArgument(NO_STREAMS)

        def streamReader(self, schema):  # noqa: N802 (Spark's name)
            raise InvalidArgument(NO_STREAMS)

    HAVE_DATA_SOURCES = True
except ImportError:  # Spark 3.4/3.5: use write_dataframe
    HAVE_DATA_SOURCES = False


#: The session setting under which Spark offers its filters to Python data sources.
PUSHDOWN_CONF = "spark.sql.python.filterPushdown.enabled"


def reuses_pushed_reads(version: str) -> bool:
    """Whether Spark `version` keeps the read planned by a Python data
    source's last filter pushdown on the data source and gives it to later
    scans of the same DataFrame that push no filter (Spark 4; upstream
    keeps it on the scan from Spark 5), so that server-side filtering of
    pushed filters would drop rows of those scans."""
    try:
        return int(version.split(".")[0]) < 5
    except ValueError:
        return True


def register(spark: SparkSession, name: str = "flightdeck") -> None:
    """Registers this Python data source with a Spark 4 session as
    `format(name)`. Where the JVM connector's jar is on `spark.jars` too,
    `format("flightdeck")` finds the JVM one (Spark looks for JVM sources
    first); register this one under another name to use it beside it, e.g.
    `register(spark, "flightdeck_py")` and `format("flightdeck_py")`.

    Reads take Spark's own filters where `spark.sql.python.filterPushdown.enabled`
    is true when this is called (Spark refuses a reader that takes them
    while it is false): set it first, or register again after changing it.
    Spark 4 keeps the read that a scan's pushed filters planned and gives
    it to later scans of the same DataFrame that push none (`df.where("id < 10")
    .count()` then `df.count()` counted 10), so on Spark 4 this source
    takes none and Spark filters what arrives (a warning says so); the
    `filter` option still filters on the server."""
    if not HAVE_DATA_SOURCES:
        raise RuntimeError(
            "this Spark has no Python data sources (Spark 4 needed); use "
            "flightdeck.spark.write_dataframe"
        )
    push = str(spark.conf.get(PUSHDOWN_CONF, "false")).strip().lower() == "true"
    if push and reuses_pushed_reads(spark.version):
        warnings.warn(
            f"Spark {spark.version} gives later queries of a DataFrame the read that an "
            "earlier query's pushed filters planned, which would drop their rows: format"
            f"({name!r}) takes no pushed filters here (Spark filters what arrives). Use the "
            "read's `filter` option to filter on the server, or the JVM connector",
            stacklevel=2,
        )
        push = False
    registered = type(
        "FlightDeckDataSource_" + "".join(c if c.isalnum() else "_" for c in name),
        (FlightDeckDataSource,),
        {"name": classmethod(lambda cls: name), "push_filters": push},
    )
    spark.dataSource.register(registered)


def write_dataframe(
    df: DataFrame,
    uri: str,
    dataset: str,
    *,
    mode: str = "overwrite",
    uris: list[str] | str | None = None,
    token: str | None = None,
) -> int:
    """Writes `df` to `dataset` with `mapInArrow` (Spark 3.4+, Spark Connect
    too), with the same commit rule and `uri`/`uris` routing as the data
    source; returns the rows written. `token` (default: `FLIGHTDECK_TOKEN`,
    on the driver and on each executor) is sent as the bearer token."""
    if mode not in ("overwrite", "append"):
        raise InvalidArgument(f"mode must be 'overwrite' or 'append', not {mode!r}")
    targets = parse_uris(uris)
    replace = mode == "overwrite"
    refuse_vectors(df.schema)
    prepare_dataset(uri, dataset, replace, targets, token)
    schema = _arrow_schema(df.schema)
    write_id = new_write_id()

    def put(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        partition, attempt, rows, location = _put_task_partition(
            uri, dataset, batches, schema, targets, write_id, token, replace
        )
        yield pa.RecordBatch.from_pydict(
            {"partition": [partition], "attempt": [attempt], "rows": [rows], "location": [location]},
            schema=pa.schema(
                [
                    ("partition", pa.int32()),
                    ("attempt", pa.int32()),
                    ("rows", pa.int64()),
                    ("location", pa.string()),
                ]
            ),
        )

    def run(frame: DataFrame) -> list:
        try:
            return frame.mapInArrow(
                put, "partition int, attempt int, rows long, location string"
            ).collect()
        except BaseException:
            drop_quietly(targets or [uri], dataset, write_id, token, replace)
            raise

    # Every task reports its partition, so the job itself says how many
    # there are: asking `df.rdd` first ran the plan's shuffles a second
    # time, and Spark Connect has no RDDs.
    results = run(df)
    if not results:
        # A DataFrame without partitions (one built from no rows) still
        # writes one empty partition, as Spark's own writers do, so that
        # the dataset exists, with its schema, and holds no rows.
        results = run(df.sparkSession.createDataFrame([], df.schema))
    partitions = 1 + max(r["partition"] for r in results)
    winners = {r["partition"]: (r["attempt"], r["location"]) for r in results}
    seal_winners(uri, dataset, partitions, winners, token, write_id if replace else "", targets)
    return sum(r["rows"] for r in results)


def vectors_to_arrays(df: DataFrame, dtype: str = "float32") -> DataFrame:
    """Every Spark ML vector column as `array<float>` (or `dtype`), so it
    reaches flightdeck as a list column instead of a struct; a null vector
    becomes a null array (Spark's `vector_to_array` fails the job on one)."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import functions as F

    try:
        from pyspark.mllib.linalg import VectorUDT as OldVectorUDT
    except ImportError:  # pragma: no cover
        OldVectorUDT = VectorUDT
    cols = []
    for field in df.schema.fields:
        if isinstance(field.dataType, (VectorUDT, OldVectorUDT)):
            v = F.col(field.name)
            array = F.when(v.isNotNull(), vector_to_array(v, dtype))
            cols.append(array.alias(field.name))
        else:
            cols.append(F.col(field.name))
    return df.select(*cols)
