"""The `flightdeck.v1` protobuf messages, encoded and decoded in plain Python.

The package speaks the protocol of `protos/flightdeck.proto` without a
protobuf runtime, so it installs next to whatever protobuf version a training
environment pins. The field tables below mirror the proto; the test
`tests/python/test_wire.py` compiles the proto with grpcio-tools and fails
when a name, number, type or label here drifts from it.
"""

from __future__ import annotations

import struct

from dataclasses import dataclass
from typing import Any, ClassVar

# Field kinds and their wire types.
_VARINT_KINDS = {"uint32", "uint64", "bool", "enum"}
# Bits of the unsigned kinds: a larger value would be cut to them by the
# receiver, so that partition 2**32 + 5 would silently be partition 5.
_UNSIGNED_BITS = {"uint32": 32, "uint64": 64}
_LEN_KINDS = {"string", "bytes", "message"}


@dataclass(frozen=True)
class Field:
    """One field of a message: proto name, number and kind."""

    name: str
    number: int
    kind: str
    repeated: bool = False
    optional: bool = False
    message: str | None = None  # message type name for kind == "message"


def _varint(value: int) -> bytes:
    if value < 0:
        raise ValueError(f"negative value {value} for an unsigned field")
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _read_varint(data: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


class Message:
    """Base of the generated-by-hand message classes."""

    NAME: ClassVar[str]
    FIELDS: ClassVar[tuple[Field, ...]]

    def __init__(self, **values: Any) -> None:
        for f in self.FIELDS:
            if f.repeated:
                default: Any = []
            elif f.optional or f.kind == "message":
                default = None
            elif f.kind == "string":
                default = ""
            elif f.kind == "bytes":
                default = b""
            elif f.kind == "bool":
                default = False
            elif f.kind == "double":
                default = 0.0
            else:
                default = 0
            setattr(self, f.name, default)
        names = {f.name for f in self.FIELDS}
        for key, value in values.items():
            if key not in names:
                raise TypeError(f"{self.NAME} has no field {key!r}")
            setattr(self, key, list(value) if isinstance(value, (list, tuple)) else value)

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and all(
            getattr(self, f.name) == getattr(other, f.name) for f in self.FIELDS
        )

    def __repr__(self) -> str:
        return f"{self.NAME}({', '.join(f'{f.name}={_shown(f, getattr(self, f.name))}' for f in self.FIELDS)})"

    def encode(self) -> bytes:
        """The message's protobuf encoding."""
        out = bytearray()
        for f in self.FIELDS:
            value = getattr(self, f.name)
            if f.repeated and f.kind in _VARINT_KINDS:
                # proto3 packs repeated scalars: one length-delimited run.
                if value:
                    payload = b"".join(_varint(self._unsigned(f, v)) for v in value)
                    out += _varint((f.number << 3) | 2) + _varint(len(payload)) + payload
                continue
            values = value if f.repeated else [value]
            for v in values:
                if not f.repeated and not f.optional and f.kind != "message" and not v:
                    continue  # proto3 default: not on the wire
                if v is None:
                    continue
                if f.kind in _VARINT_KINDS:
                    out += _varint(f.number << 3) + _varint(self._unsigned(f, v))
                elif f.kind == "double":
                    out += _varint((f.number << 3) | 1) + struct.pack("<d", float(v))
                else:
                    if f.kind == "string":
                        payload = v.encode("utf-8")
                    elif f.kind == "bytes":
                        payload = bytes(v)
                    else:
                        payload = v.encode()
                    out += _varint((f.number << 3) | 2) + _varint(len(payload)) + payload
        return bytes(out)

    # Protobuf-style spelling, for code written against generated classes.
    SerializeToString = encode

    def _unsigned(self, f: Field, value: Any) -> int:
        """`value` of the varint field `f` as an int, refused (`ValueError`
        naming the field) where the field cannot hold it."""
        v = int(value)
        bits = _UNSIGNED_BITS.get(f.kind)
        if v != value or v < 0 or (bits is not None and v >> bits):
            limit = f"2**{bits}" if bits else "2**64"
            raise ValueError(
                f"{f.name} must be a whole number in [0, {limit}), not {value!r} "
                f"({self.NAME}.{f.name})"
            )
        return v

    @classmethod
    def decode(cls, data: bytes | memoryview) -> Message:
        """Decodes `data`; unknown fields are skipped."""
        view = memoryview(bytes(data))
        msg = cls()
        by_number = {f.number: f for f in cls.FIELDS}
        pos = 0
        while pos < len(view):
            key, pos = _read_varint(view, pos)
            number, wire = key >> 3, key & 7
            f = by_number.get(number)
            if wire == 0:
                value, pos = _read_varint(view, pos)
            elif wire == 2:
                length, pos = _read_varint(view, pos)
                if pos + length > len(view):
                    raise ValueError(f"truncated field {number} of {cls.NAME}")
                value, pos = bytes(view[pos : pos + length]), pos + length
            elif wire == 1:
                value, pos = bytes(view[pos : pos + 8]), pos + 8
            elif wire == 5:
                value, pos = bytes(view[pos : pos + 4]), pos + 4
            else:
                raise ValueError(f"unsupported wire type {wire} in {cls.NAME}")
            if f is None:
                continue
            if f.repeated and f.kind in _VARINT_KINDS and wire == 2:
                packed, inner = memoryview(value), 0
                while inner < len(packed):
                    item, inner = _read_varint(packed, inner)
                    getattr(msg, f.name).append(bool(item) if f.kind == "bool" else item)
                continue
            expected = 0 if f.kind in _VARINT_KINDS else 1 if f.kind == "double" else 2
            if wire != expected:
                raise ValueError(f"field {f.name} of {cls.NAME} has wire type {wire}")
            if f.kind == "bool":
                value = bool(value)
            elif f.kind == "double":
                value = struct.unpack("<d", value)[0]
            elif f.kind == "string":
                value = value.decode("utf-8")
            elif f.kind == "message":
                value = MESSAGES[f.message].decode(value)
            if f.repeated:
                getattr(msg, f.name).append(value)
            else:
                setattr(msg, f.name, value)
        return msg

    @classmethod
    def FromString(cls, data: bytes) -> Message:  # noqa: N802 - protobuf spelling
        return cls.decode(data)


def _shown(field: Field, value: Any) -> str:
    """A field's value for reading: enums by name, long bytes by length."""
    if field.kind == "enum" and not field.repeated:
        names = {number: name for name, number in ENUMS.get(field.message or "", {}).items()}
        return names.get(value, repr(value))
    if field.kind == "bytes" and len(value) > 32:
        return f"<{len(value)} bytes>"
    return repr(value)


def _message(name: str, *fields: Field) -> type[Message]:
    cls = type(name, (Message,), {"NAME": name, "FIELDS": tuple(fields), "__doc__": f"flightdeck.v1.{name}"})
    MESSAGES[name] = cls
    return cls


MESSAGES: dict[str, type[Message]] = {}

# enum Shuffle
SHUFFLE_NONE, SHUFFLE_GLOBAL, SHUFFLE_BLOCK = 0, 1, 2
SHUFFLE = {"SHUFFLE_NONE": 0, "SHUFFLE_GLOBAL": 1, "SHUFFLE_BLOCK": 2}
# enum Locality
LOCALITY_GLOBAL, LOCALITY_NODE = 0, 1
LOCALITY = {"LOCALITY_GLOBAL": 0, "LOCALITY_NODE": 1}
# enum DatasetState
DATASET_STATE_UNSPECIFIED, DATASET_STATE_OPEN, DATASET_STATE_SEALED = 0, 1, 2
DATASET_STATE_SEALING = 3
DATASET_STATE = {
    "DATASET_STATE_UNSPECIFIED": 0,
    "DATASET_STATE_OPEN": 1,
    "DATASET_STATE_SEALED": 2,
    "DATASET_STATE_SEALING": 3,
}
# enum Task
TASK_CLASSIFICATION, TASK_REGRESSION = 0, 1
TASK = {"TASK_CLASSIFICATION": 0, "TASK_REGRESSION": 1}
# enum OptimizerKind
OPTIMIZER_ADAMW, OPTIMIZER_SGD = 0, 1
OPTIMIZER_KIND = {"OPTIMIZER_ADAMW": 0, "OPTIMIZER_SGD": 1}
ENUMS = {
    "Shuffle": SHUFFLE,
    "Locality": LOCALITY,
    "DatasetState": DATASET_STATE,
    "Task": TASK,
    "OptimizerKind": OPTIMIZER_KIND,
}

PutPartition = _message(
    "PutPartition",
    Field("dataset", 1, "string"),
    Field("partition", 2, "uint32"),
    Field("attempt", 3, "uint32"),
    Field("explicit_commit", 4, "bool"),
    Field("expected_bytes", 5, "uint64"),
    Field("expected_rows", 6, "uint64"),
    Field("write_id", 7, "string"),
    Field("replace", 8, "bool"),
)
PutCommit = _message("PutCommit", Field("rows", 1, "uint64", optional=True))
PutAck = _message(
    "PutAck",
    Field("dataset", 1, "string"),
    Field("partition", 2, "uint32"),
    Field("attempt", 3, "uint32"),
    Field("rows", 4, "uint64"),
    Field("bytes", 5, "uint64"),
    Field("location", 6, "string"),
)
ReadPlan = _message(
    "ReadPlan",
    Field("dataset", 1, "string"),
    Field("world_size", 2, "uint32"),
    Field("epoch", 3, "uint64"),
    Field("seed", 4, "uint64"),
    Field("shuffle", 5, "enum", message="Shuffle"),
    Field("batch_rows", 6, "uint32"),
    Field("drop_last", 7, "bool"),
    Field("columns", 8, "string", repeated=True),
    Field("start_sample", 9, "uint64"),
    Field("block_rows", 10, "uint32"),
    Field("split_count", 11, "uint32"),
    Field("split_index", 12, "uint32"),
    Field("locality", 13, "enum", message="Locality"),
    Field("ranks_per_node", 14, "uint32"),
    Field("nodes", 15, "string", repeated=True),
    Field("resume_world_size", 16, "uint32"),
    Field("filter", 17, "string"),
    Field("select", 18, "string", repeated=True),
    Field("sealed_as", 19, "uint64"),
    Field("max_rows", 20, "uint64"),
)
PlanInfo = _message("PlanInfo", Field("partition_rows", 1, "uint64", repeated=True))
ShardInfo = _message(
    "ShardInfo",
    Field("rank", 1, "uint32"),
    Field("rows", 2, "uint64"),
    Field("batches", 3, "uint64"),
)
ShardTicket = _message(
    "ShardTicket",
    Field("plan", 1, "message", message="ReadPlan"),
    Field("rank", 2, "uint32"),
    Field("generation", 3, "uint64"),
    Field("layout", 4, "uint64"),
    Field("peer", 5, "uint32", optional=True),
    Field("selected_rows", 6, "uint64", repeated=True),
)
SelectRows = _message(
    "SelectRows",
    Field("dataset", 1, "string"),
    Field("layout", 2, "uint64"),
    Field("filter", 3, "string"),
)
DeriveDataset = _message(
    "DeriveDataset",
    Field("target", 1, "string"),
    Field("sql", 2, "string"),
    Field("source", 3, "string"),
)
SqlHandle = _message("SqlHandle", Field("query", 1, "string"), Field("parameters", 2, "bytes"))
SelectedRows = _message("SelectedRows", Field("partition_rows", 1, "uint64", repeated=True))
PartitionAttempt = _message(
    "PartitionAttempt", Field("partition", 1, "uint32"), Field("attempt", 2, "uint32")
)
SealDataset = _message(
    "SealDataset",
    Field("dataset", 1, "string"),
    Field("partitions", 2, "uint32"),
    Field("attempts", 3, "message", repeated=True, message="PartitionAttempt"),
    Field("members", 4, "message", repeated=True, message="MemberPartitions"),
    Field("replace_write", 5, "string"),
)
MemberPartitions = _message(
    "MemberPartitions",
    Field("location", 1, "string"),
    Field("partitions", 2, "message", repeated=True, message="PartitionAttempt"),
)
PrepareMember = _message(
    "PrepareMember",
    Field("dataset", 1, "string"),
    Field("partitions", 2, "message", repeated=True, message="PartitionAttempt"),
    Field("check_only", 3, "bool"),
    Field("replace_write", 4, "string"),
)
MemberPrepared = _message(
    "MemberPrepared",
    Field("generation", 1, "uint64"),
    Field("schema", 2, "bytes"),
    Field("partitions", 3, "message", repeated=True, message="PartitionInfo"),
    Field("fixed_columns", 4, "bool", repeated=True),
    Field("replaces", 5, "string", repeated=True),
    Field("writes", 6, "string", repeated=True),
    Field("list_widths", 7, "uint32", repeated=True),
)
ClusterMember = _message(
    "ClusterMember",
    Field("location", 1, "string"),
    Field("generation", 2, "uint64"),
    Field("partitions", 3, "message", repeated=True, message="PartitionInfo"),
    Field("rows", 4, "uint64"),
)
ClusterLayout = _message(
    "ClusterLayout",
    Field("id", 1, "uint64"),
    Field("members", 2, "message", repeated=True, message="ClusterMember"),
    Field("schema", 3, "bytes"),
    Field("fixed_columns", 4, "bool", repeated=True),
)
CommitLayout = _message(
    "CommitLayout",
    Field("dataset", 1, "string"),
    Field("layout", 2, "message", message="ClusterLayout"),
    Field("member", 3, "uint32"),
    Field("replace_write", 4, "string"),
)
DropDataset = _message(
    "DropDataset",
    Field("dataset", 1, "string"),
    Field("member_only", 2, "bool"),
    Field("abort_write", 3, "string"),
    Field("staged", 4, "bool"),
    Field("keep_write", 5, "string"),
)
DescribeDataset = _message("DescribeDataset", Field("dataset", 1, "string"))
PartitionInfo = _message(
    "PartitionInfo",
    Field("partition", 1, "uint32"),
    Field("attempt", 2, "uint32"),
    Field("rows", 3, "uint64"),
    Field("bytes", 4, "uint64"),
    Field("committed_attempts", 5, "uint32"),
)
DatasetInfo = _message(
    "DatasetInfo",
    Field("dataset", 1, "string"),
    Field("state", 2, "enum", message="DatasetState"),
    Field("rows", 3, "uint64"),
    Field("bytes", 4, "uint64"),
    Field("committed_partitions", 5, "uint32"),
    Field("schema", 6, "bytes"),
    Field("partitions", 7, "message", repeated=True, message="PartitionInfo"),
    Field("generation", 8, "uint64"),
    Field("spilled", 9, "bool"),
    Field("persisted", 10, "bool"),
    Field("placements", 11, "message", repeated=True, message="DevicePlacement"),
    Field("layout", 12, "message", message="ClusterLayout"),
    Field("written_seconds_ago", 13, "double"),
    Field("replacements", 14, "message", repeated=True, message="StagedWrite"),
)
StagedWrite = _message(
    "StagedWrite",
    Field("dataset", 1, "string"),
    Field("write_id", 2, "string"),
    Field("rows", 3, "uint64"),
    Field("bytes", 4, "uint64"),
    Field("committed_partitions", 5, "uint32"),
    Field("written_seconds_ago", 6, "double"),
)
DevicePlacement = _message(
    "DevicePlacement",
    Field("device", 1, "uint32"),
    Field("columns", 2, "string", repeated=True),
    Field("bytes", 3, "uint64"),
)
PlaceColumns = _message(
    "PlaceColumns",
    Field("dataset", 1, "string"),
    Field("columns", 2, "string", repeated=True),
    Field("devices", 3, "uint32", repeated=True),
)
EvictColumns = _message(
    "EvictColumns",
    Field("dataset", 1, "string"),
    Field("devices", 2, "uint32", repeated=True),
)
ServerStats = _message(
    "ServerStats",
    Field("memory_used", 1, "uint64"),
    Field("memory_limit", 2, "uint64"),
    Field("datasets", 3, "uint32"),
    Field("rows", 4, "uint64"),
    Field("bytes", 5, "uint64"),
    Field("sealed_datasets", 6, "uint32"),
    Field("host_held_bytes", 7, "uint64"),
    Field("host_live_bytes", 8, "uint64"),
    Field("host_idle_bytes", 9, "uint64"),
    Field("host_pinned", 10, "bool"),
    Field("device_bytes", 11, "uint64"),
    Field("spilled_datasets", 12, "uint32"),
    Field("spills", 13, "uint64"),
    Field("restores", 14, "uint64"),
    Field("spill_url", 15, "string"),
    Field("persist", 16, "bool"),
    Field("cuda_devices", 17, "uint32"),
    Field("location", 18, "string"),
    Field("rows_served", 19, "uint64"),
    Field("bytes_served", 20, "uint64"),
    Field("rows_served_to_peers", 21, "uint64"),
    Field("bytes_served_to_peers", 22, "uint64"),
    Field("rows_fetched_from_peers", 23, "uint64"),
    Field("bytes_fetched_from_peers", 24, "uint64"),
    Field("packed_bytes", 25, "uint64"),
    Field("memory_used_peak", 26, "uint64"),
    Field("resident_peak_bytes", 27, "uint64"),
    Field("staged", 28, "message", repeated=True, message="StagedWrite"),
    Field("queries_running", 29, "uint64"),
    Field("queries_done", 30, "uint64"),
    Field("queries_failed", 31, "uint64"),
    Field("queries_given_up", 32, "uint64"),
    Field("tls_certificate_expires", 33, "uint64"),
)
TrainJob = _message(
    "TrainJob",
    Field("dataset", 1, "string"),
    Field("features", 2, "string", repeated=True),
    Field("label", 3, "string"),
    Field("task", 4, "enum", message="Task"),
    Field("classes", 5, "uint32"),
    Field("hidden", 6, "uint32", repeated=True),
    Field("optimizer", 7, "enum", message="OptimizerKind"),
    Field("learning_rate", 8, "double"),
    Field("momentum", 9, "double"),
    Field("weight_decay", 10, "double"),
    Field("batch_size", 11, "uint32"),
    Field("epochs", 12, "uint32"),
    Field("seed", 13, "uint64"),
    Field("shuffle", 14, "enum", message="Shuffle"),
    Field("block_rows", 15, "uint32"),
    Field("cpu_ranks", 16, "uint32"),
    Field("gpus", 17, "uint32", repeated=True),
    Field("checkpoint_url", 18, "string"),
    Field("checkpoint_every", 19, "uint64"),
    Field("resume_from", 20, "string"),
    Field("max_steps", 21, "uint64"),
    Field("keep_checkpoints", 22, "uint32"),
    Field("filter", 23, "string"),
)
TrainProgress = _message(
    "TrainProgress",
    Field("job", 1, "uint64"),
    Field("epoch", 2, "uint64"),
    Field("step", 3, "uint64"),
    Field("total_steps", 4, "uint64"),
    Field("loss", 5, "double"),
    Field("samples_per_second", 6, "double"),
    Field("data_stall_seconds", 7, "double"),
    Field("data_stall_fraction", 8, "double"),
    Field("accuracy", 9, "double", optional=True),
    Field("checkpoint", 10, "string"),
    Field("done", 11, "bool"),
)
JobQuery = _message("JobQuery", Field("job", 1, "uint64"))
JobStatus = _message(
    "JobStatus",
    Field("job", 1, "uint64"),
    Field("dataset", 2, "string"),
    Field("state", 3, "string"),
    Field("step", 4, "uint64"),
    Field("total_steps", 5, "uint64"),
    Field("loss", 6, "double"),
    Field("accuracy", 7, "double", optional=True),
    Field("error", 8, "string"),
    Field("checkpoint", 9, "string"),
)
JobList = _message("JobList", Field("jobs", 1, "message", repeated=True, message="JobStatus"))
