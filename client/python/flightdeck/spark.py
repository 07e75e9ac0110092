"""Spark connector: `df.write.format("flightdeck")` (Spark 4) and
`write_dataframe` (Spark 3.4/3.5, `mapInArrow`).

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
rather than bringing the dataset back. `overwrite` replaces an existing dataset; `append` to an existing
dataset fails, since a sealed dataset is immutable.

Many nodes: with `uri` `local` (the default) each executor writes to its own
node's server (`FLIGHTDECK_URI`, else loopback); `uris` (comma-separated)
sends partition `p` to `uris[p % len(uris)]` instead, for clusters without a
server beside every executor. When the partitions landed on several servers,
the driver seals them as one dataset (`Client.seal_cluster`) through the
first of them.

Spark ML vectors (`VectorUDT`) are structs on the wire: convert them first
with :func:`vectors_to_arrays` so features arrive as `array<float>`, which
`flightdeck.to_numpy` / `to_torch` turn into `(rows, D)` arrays.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Iterator

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql import DataFrame, SparkSession

from .client import connect
from .errors import FlightDeckError, InvalidArgument, NotFound


def parse_uris(value: str | list[str] | None) -> list[str]:
    """The `uris` option: a list, or one comma-separated string."""
    if not value:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    return [u.strip() for u in items if u.strip()]


def prepare_dataset(uri: str, dataset: str, overwrite: bool, uris: list[str] = ()) -> None:
    """Driver-side check before a write, on `uri` and every one of `uris`:
    drop for overwrite, refuse append to an existing dataset."""
    for target in list(dict.fromkeys(uris)) or [uri]:
        _prepare_one(target, dataset, overwrite)


def _prepare_one(uri: str, dataset: str, overwrite: bool) -> None:
    client = connect(uri)
    try:
        info = client.describe(dataset)
    except NotFound:
        return
    if overwrite:
        try:
            client.drop(dataset)
        except NotFound:  # dropped by another member's cascade meanwhile
            pass
        return
    state = "sealed" if info.state == 2 else "being written"
    raise FlightDeckError(
        f"cannot append to dataset '{dataset}': it already exists ({state}, {info.rows} rows) "
        "and a flightdeck dataset is immutable once sealed; use mode('overwrite') to replace "
        "it, or write to a new dataset name",
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
) -> tuple[int, int, int, str]:
    ctx = TaskContext.get()
    if ctx is None:
        raise RuntimeError("flightdeck's Spark writer must run inside a Spark task")
    partition, attempt = ctx.partitionId(), ctx.attemptNumber()
    target = target_uri(uri, list(uris), partition)
    with connect(target) as client:
        ack = client.put_partition(
            dataset, partition, batches, attempt, schema=schema, write_id=write_id
        )
        # The server's own name for itself: what other members reach it at.
        location = ack.location or client.uri
    return partition, attempt, ack.rows, location


def seal_winners(
    uri: str, dataset: str, partitions: int, winners: dict[int, tuple[int, str]]
) -> None:
    """Seals `dataset` naming the winning attempt of every partition and the
    server that holds it: one server's seal when all are on one, else a
    cluster seal through the first of them."""
    missing = sorted(set(range(partitions)) - set(winners))
    if missing:
        raise FlightDeckError(
            f"no committed task for partitions {missing} of dataset '{dataset}'", "INTERNAL"
        )
    members: dict[str, dict[int, int]] = {}
    for p, (attempt, location) in sorted(winners.items()):
        members.setdefault(location or uri, {})[p] = attempt
    first = next(iter(members))
    with connect(first) as client:
        if len(members) == 1:
            client.seal(dataset, partitions=partitions, attempts=members[first])
        else:
            client.seal_cluster(dataset, members, partitions=partitions)


def new_write_id() -> str:
    """An id for one write job, shared by its tasks."""
    return uuid.uuid4().hex


def drop_quietly(uris: list[str], dataset: str, write_id: str = "") -> None:
    """Drops what a failed job wrote, if anything, on every server named,
    and has each refuse the job's attempts from now on."""
    for uri in dict.fromkeys(uris):
        try:
            with connect(uri) as client:
                client.drop(dataset, abort_write=write_id)
        except FlightDeckError:
            pass


def _arrow_schema(schema) -> pa.Schema | None:
    try:
        from pyspark.sql.pandas.types import to_arrow_schema

        return to_arrow_schema(schema)
    except Exception:  # a type Arrow cannot express: let the data speak
        return None


try:  # Spark 4: Python data sources
    from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, WriterCommitMessage

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
            self.uri = options.get("uri", "local")
            self.uris = parse_uris(options.get("uris"))
            self.dataset = options.get("dataset")
            if not self.dataset:
                raise InvalidArgument("set the dataset to write: .option('dataset', NAME)")
            self.schema = _arrow_schema(schema)
            self.write_id = new_write_id()
            # Runs on the driver, before any task.
            prepare_dataset(self.uri, self.dataset, overwrite, self.uris)

        def write(self, iterator: Iterator[pa.RecordBatch]) -> FlightDeckCommitMessage:
            partition, attempt, rows, location = _put_task_partition(
                self.uri, self.dataset, iterator, self.schema, self.uris, self.write_id
            )
            return FlightDeckCommitMessage(partition, attempt, rows, location)

        def commit(self, messages) -> None:
            winners = {m.partition: (m.attempt, m.location) for m in messages}
            seal_winners(self.uri, self.dataset, len(messages), winners)

        def abort(self, messages) -> None:
            written = [m.location for m in messages if m is not None and m.location]
            drop_quietly([*written, *self.uris] or [self.uri], self.dataset, self.write_id)

    class FlightDeckDataSource(DataSource):
        """`format("flightdeck")`: options `uri` (default `local`), `uris`
        (comma-separated; partition p goes to the (p mod n)-th) and `dataset`."""

        @classmethod
        def name(cls) -> str:
            return "flightdeck"

        def writer(self, schema, overwrite: bool) -> FlightDeckWriter:
            return FlightDeckWriter(self.options, schema, overwrite)

    HAVE_DATA_SOURCES = True
except ImportError:  # Spark 3.4/3.5: use write_dataframe
    HAVE_DATA_SOURCES = False


def register(spark: SparkSession, name: str = "flightdeck") -> None:
    """Registers this Python data source with a Spark 4 session as
    `format(name)`. Where the JVM connector's jar is on `spark.jars` too,
    `format("flightdeck")` finds the JVM one (Spark looks for JVM sources
    first); register this one under another name to use it beside it, e.g.
    `register(spark, "flightdeck_py")` and `format("flightdeck_py")`."""
    if not HAVE_DATA_SOURCES:
        raise RuntimeError(
            "this Spark has no Python data sources (Spark 4 needed); use "
            "flightdeck.spark.write_dataframe"
        )
    if name == FlightDeckDataSource.name():
        spark.dataSource.register(FlightDeckDataSource)
        return
    named = type(
        "FlightDeckDataSource_" + "".join(c if c.isalnum() else "_" for c in name),
        (FlightDeckDataSource,),
        {"name": classmethod(lambda cls: name)},
    )
    spark.dataSource.register(named)


def write_dataframe(
    df: DataFrame,
    uri: str,
    dataset: str,
    *,
    mode: str = "overwrite",
    uris: list[str] | str | None = None,
) -> int:
    """Writes `df` to `dataset` with `mapInArrow` (Spark 3.4+), with the same
    commit rule and `uri`/`uris` routing as the data source; returns the
    rows written."""
    if mode not in ("overwrite", "append"):
        raise InvalidArgument(f"mode must be 'overwrite' or 'append', not {mode!r}")
    targets = parse_uris(uris)
    prepare_dataset(uri, dataset, mode == "overwrite", targets)
    schema = _arrow_schema(df.schema)
    write_id = new_write_id()

    def put(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        partition, attempt, rows, location = _put_task_partition(
            uri, dataset, batches, schema, targets, write_id
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

    partitions = df.rdd.getNumPartitions()
    try:
        results = df.mapInArrow(
            put, "partition int, attempt int, rows long, location string"
        ).collect()
    except BaseException:
        drop_quietly(targets or [uri], dataset, write_id)
        raise
    winners = {r["partition"]: (r["attempt"], r["location"]) for r in results}
    seal_winners(uri, dataset, partitions, winners)
    return sum(r["rows"] for r in results)


def vectors_to_arrays(df: DataFrame, dtype: str = "float32") -> DataFrame:
    """Every Spark ML vector column as `array<float>` (or `dtype`), so it
    reaches flightdeck as a list column instead of a struct."""
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
            cols.append(vector_to_array(F.col(field.name), dtype).alias(field.name))
        else:
            cols.append(F.col(field.name))
    return df.select(*cols)
