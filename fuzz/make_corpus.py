"""Writes the fuzz targets' seed corpora (valid inputs to start from):
`corpus/commands` holds protobuf commands, action bodies and a framed DoGet
request; `corpus/ingest` holds schema and record batch IPC messages of
several column types. Run with the test environment's Python:
`.venv/bin/python fuzz/make_corpus.py`."""

import struct
from pathlib import Path

import pyarrow as pa

from flightdeck import _wire as w

HERE = Path(__file__).parent


def message(buf: pa.Buffer) -> tuple[bytes, bytes]:
    """(flatbuffer header, body) of an encapsulated IPC message."""
    b = buf.to_pybytes()
    assert b[:4] == b"\xff\xff\xff\xff"
    (n,) = struct.unpack("<i", b[4:8])
    return b[8 : 8 + n], b[8 + n :]


def ingest_seed(table: pa.Table) -> bytes:
    schema, _ = message(table.schema.serialize())
    batch = table.to_batches()[0]
    header, body = message(batch.serialize())
    return (
        struct.pack("<H", len(schema)) + schema + struct.pack("<H", len(header)) + header + body
    )


def main() -> None:
    commands = {
        "read_plan": w.ReadPlan(dataset="d", world_size=4, epoch=1, seed=7, shuffle=1,
                                batch_rows=128, columns=["a", "b"]).encode(),
        "put": w.PutPartition(dataset="d", partition=3, attempt=1).encode(),
        "seal": w.SealDataset(dataset="d", partitions=4,
                              attempts=[w.PartitionAttempt(partition=1, attempt=2)]).encode(),
        "train": w.TrainJob(dataset="d", features=["x"], label="y", classes=3,
                            hidden=[16, 16], cpu_ranks=2).encode(),
        "place": w.PlaceColumns(dataset="d", columns=["x"], devices=[0]).encode(),
        "commit": w.PutCommit(rows=10).encode(),
    }
    ticket = w.ShardTicket(plan=w.ReadPlan(dataset="d", world_size=2), rank=1).encode()
    commands["doget"] = b"\x00" + struct.pack(">I", len(ticket)) + ticket
    out = HERE / "corpus" / "commands"
    out.mkdir(parents=True, exist_ok=True)
    for name, data in commands.items():
        (out / name).write_bytes(data)

    tables = {
        "ints_strings": pa.table({"id": pa.array(range(20), pa.int64()),
                                  "name": pa.array([None if i % 3 == 0 else f"r{i}" for i in range(20)])}),
        "lists": pa.table({"tags": pa.array([[i, None, i + 1][: i % 4] for i in range(10)],
                                            pa.list_(pa.int32())),
                           "vec": pa.FixedSizeListArray.from_arrays(
                               pa.array([float(i) for i in range(40)], pa.float32()), 4)}),
        "mixed": pa.table({"flag": pa.array([i % 2 == 0 for i in range(8)]),
                           "ts": pa.array(range(8), pa.timestamp("us", tz="UTC")),
                           "n": pa.nulls(8)}),
    }
    out = HERE / "corpus" / "ingest"
    out.mkdir(parents=True, exist_ok=True)
    for name, table in tables.items():
        (out / name).write_bytes(ingest_seed(table))


if __name__ == "__main__":
    main()
