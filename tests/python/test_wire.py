"""The package's hand-written protocol messages match protos/flightdeck.proto:
same names, numbers, types and labels, and byte-compatible encodings."""

from __future__ import annotations

import pytest
from google.protobuf.descriptor import FieldDescriptor

from flightdeck import _wire as wire

KINDS = {
    FieldDescriptor.TYPE_STRING: "string",
    FieldDescriptor.TYPE_BYTES: "bytes",
    FieldDescriptor.TYPE_UINT32: "uint32",
    FieldDescriptor.TYPE_UINT64: "uint64",
    FieldDescriptor.TYPE_BOOL: "bool",
    FieldDescriptor.TYPE_DOUBLE: "double",
    FieldDescriptor.TYPE_ENUM: "enum",
    FieldDescriptor.TYPE_MESSAGE: "message",
}


def test_every_message_and_field_matches_the_proto(pb):
    proto_messages = pb.DESCRIPTOR.message_types_by_name
    assert set(proto_messages) == set(wire.MESSAGES), "messages added or removed"
    for name, desc in proto_messages.items():
        ours = {f.name: f for f in wire.MESSAGES[name].FIELDS}
        assert set(ours) == {f.name for f in desc.fields}, name
        for f in desc.fields:
            mine = ours[f.name]
            where = f"{name}.{f.name}"
            assert mine.number == f.number, where
            assert mine.kind == KINDS[f.type], where
            assert mine.repeated == f.is_repeated, where
            proto_optional = f.has_presence and f.type != FieldDescriptor.TYPE_MESSAGE
            assert mine.optional == proto_optional, where
            if f.type == FieldDescriptor.TYPE_MESSAGE:
                assert mine.message == f.message_type.name, where
            if f.type == FieldDescriptor.TYPE_ENUM:
                assert mine.message == f.enum_type.name, where
    for enum_name, enum in pb.DESCRIPTOR.enum_types_by_name.items():
        assert wire.ENUMS[enum_name] == {v.name: v.number for v in enum.values}, enum_name


def test_encodings_are_interchangeable(pb):
    plan = dict(
        dataset="dé",
        world_size=8,
        epoch=2**40,
        seed=2**64 - 1,
        shuffle=2,
        batch_rows=1,
        drop_last=True,
        columns=["a", "b"],
        start_sample=7,
        block_rows=3,
        split_count=2,
        split_index=1,
    )
    ours = wire.ReadPlan(**plan)
    theirs = pb.ReadPlan(**plan)
    assert pb.ReadPlan.FromString(ours.encode()) == theirs
    assert wire.ReadPlan.decode(theirs.SerializeToString()) == ours

    seal = wire.SealDataset(
        dataset="d", partitions=3, attempts=[wire.PartitionAttempt(partition=1, attempt=2)]
    )
    assert pb.SealDataset.FromString(seal.encode()).attempts[0].attempt == 2
    ticket = pb.ShardTicket(plan=theirs, rank=3, generation=9)
    decoded = wire.ShardTicket.decode(ticket.SerializeToString())
    assert decoded.plan == ours and decoded.rank == 3

    # proto3 optional: zero is still on the wire.
    zero = wire.PutCommit(rows=0).encode()
    assert zero == pb.PutCommit(rows=0).SerializeToString() != b""
    assert wire.PutCommit.decode(zero).rows == 0
    assert wire.PutCommit.decode(b"").rows is None

    # Unknown fields are skipped, as protobuf does.
    stats = pb.ServerStats(memory_used=5).SerializeToString() + b"\xf8\x07\x01"
    assert wire.ServerStats.decode(stats).memory_used == 5

    # Repeated scalars are packed both ways; unpacked input still decodes.
    place = wire.PlaceColumns(dataset="d", columns=["x"], devices=[0, 3, 300])
    assert place.encode() == pb.PlaceColumns(dataset="d", columns=["x"], devices=[0, 3, 300]).SerializeToString()
    assert wire.PlaceColumns.decode(place.encode()) == place
    unpacked = b"\x10\x01\x10\x02"  # field 2 (devices) twice, one varint each
    assert wire.EvictColumns.decode(unpacked).devices == [1, 2]
    info = pb.DatasetInfo(
        dataset="d", spilled=True, placements=[pb.DevicePlacement(device=1, columns=["a"], bytes=8)]
    )
    decoded = wire.DatasetInfo.decode(info.SerializeToString())
    assert decoded.spilled and decoded.placements[0].columns == ["a"]

    # Doubles and proto3 optional doubles.
    progress = pb.TrainProgress(job=3, loss=0.25, accuracy=0.0, done=True)
    ours = wire.TrainProgress.decode(progress.SerializeToString())
    assert (ours.loss, ours.accuracy, ours.done) == (0.25, 0.0, True)
    assert wire.TrainProgress.decode(pb.TrainProgress(loss=1.5).SerializeToString()).accuracy is None
    job = wire.TrainJob(dataset="d", features=["a"], learning_rate=1e-3, hidden=[8, 4], gpus=[1])
    assert pb.TrainJob.FromString(job.encode()) == pb.TrainJob(
        dataset="d", features=["a"], learning_rate=1e-3, hidden=[8, 4], gpus=[1]
    )


def test_a_number_its_field_cannot_hold_is_refused_naming_the_field(pb):
    """protobuf cuts a uint32 to its low 32 bits, so partition 2**32 + 5
    would arrive as partition 5: the encoder refuses it instead."""
    top = wire.PutPartition(dataset="d", partition=2**32 - 1, attempt=3).encode()
    assert pb.PutPartition.FromString(top).partition == 2**32 - 1
    assert pb.ReadPlan.FromString(wire.ReadPlan(seed=2**64 - 1).encode()).seed == 2**64 - 1
    for message, field, value, limit in [
        (wire.PutPartition, "partition", 2**32 + 5, "2**32"),
        (wire.PutPartition, "attempt", -1, "2**32"),
        (wire.ReadPlan, "epoch", 2**64, "2**64"),
        (wire.ReadPlan, "batch_rows", 1.5, "2**32"),
    ]:
        with pytest.raises(ValueError) as err:
            message(**{field: value}).encode()
        assert str(err.value) == (
            f"{field} must be a whole number in [0, {limit}), not {value!r} "
            f"({message.NAME}.{field})"
        )
    # Packed repeated fields too.
    with pytest.raises(ValueError, match=r"partition_rows must be .* not -2 \(PlanInfo"):
        wire.PlanInfo(partition_rows=[1, -2]).encode()
