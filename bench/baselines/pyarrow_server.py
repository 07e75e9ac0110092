"""The pyarrow baseline: an in-memory Flight server in pyarrow (Arrow's C++
Flight under Python) that accepts the same `DoPut`s as flightdeck and serves
the same per-rank shards, so `flightdeck-bench` runs one workload against
both.

It understands the flightdeck commands it needs: `PutPartition` (with the
commit marker), `seal`, `drop`, and `GetFlightInfo(ReadPlan)` answered with
one endpoint per rank. Rank `r` of `W` receives rows `r, r+W, r+2W, …` of the
epoch's order (`take` of a NumPy index; a seeded permutation for `global`,
permuted blocks for `block`), with the same equal counts. Prints
`pyarrow baseline listening on 127.0.0.1:PORT` once it serves.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "client" / "python"))
from flightdeck import _wire as wire  # noqa: E402


class Baseline(flight.FlightServerBase):
    def __init__(self) -> None:
        super().__init__("grpc://127.0.0.1:0")
        self.lock = threading.Lock()
        self.parts: dict[str, dict[int, pa.Table]] = {}
        self.sealed: dict[str, pa.Table] = {}

    def do_put(self, context, descriptor, reader, writer):
        cmd = wire.PutPartition.decode(descriptor.command)
        table = reader.read_all()
        with self.lock:
            self.parts.setdefault(cmd.dataset, {})[cmd.partition] = table
        ack = wire.PutAck(dataset=cmd.dataset, partition=cmd.partition, rows=table.num_rows)
        writer.write(pa.py_buffer(ack.encode()))

    def do_action(self, context, action):
        kind, body = action.type, action.body.to_pybytes()
        with self.lock:
            if kind == "seal":
                req = wire.SealDataset.decode(body)
                parts = self.parts.pop(req.dataset)
                table = pa.concat_tables([parts[p] for p in sorted(parts)]).combine_chunks()
                self.sealed[req.dataset] = table
                reply = wire.DatasetInfo(dataset=req.dataset, rows=table.num_rows, state=2)
            elif kind == "drop":
                req = wire.DropDataset.decode(body)
                found = self.sealed.pop(req.dataset, None) or self.parts.pop(req.dataset, None)
                if found is None:
                    raise KeyError(f"dataset '{req.dataset}' does not exist")
                reply = wire.DatasetInfo(dataset=req.dataset)
            else:
                raise NotImplementedError(kind)
        return [reply.encode()]

    def get_flight_info(self, context, descriptor):
        plan = wire.ReadPlan.decode(descriptor.command)
        table = self.sealed[plan.dataset]
        n, w = table.num_rows, plan.world_size
        per_rank = -(-n // w)
        endpoints = []
        for rank in range(w):
            meta = wire.ShardInfo(rank=rank, rows=per_rank)
            ticket = wire.ShardTicket(plan=plan, rank=rank).encode()
            endpoints.append(flight.FlightEndpoint(ticket, [], app_metadata=meta.encode()))
        return flight.FlightInfo(table.schema, descriptor, endpoints, w * per_rank, -1)

    def do_get(self, context, ticket):
        t = wire.ShardTicket.decode(ticket.ticket)
        plan = t.plan
        table = self.sealed[plan.dataset]
        n, w = table.num_rows, plan.world_size
        positions = np.arange(t.rank, -(-n // w) * w, w) % n
        if plan.shuffle == wire.SHUFFLE_GLOBAL:
            order = np.random.default_rng([plan.seed, plan.epoch]).permutation(n)
            positions = order[positions]
        elif plan.shuffle == wire.SHUFFLE_BLOCK:
            k = plan.block_rows or 1024
            blocks = np.random.default_rng([plan.seed, plan.epoch]).permutation(-(-n // k))
            order = np.concatenate([np.arange(b * k, min((b + 1) * k, n)) for b in blocks])
            positions = order[positions]
        batch_rows = plan.batch_rows or 16384
        if plan.shuffle == wire.SHUFFLE_NONE and w == 1:
            shard = table
        else:
            shard = table.take(pa.array(positions))
        return flight.RecordBatchStream(
            pa.RecordBatchReader.from_batches(shard.schema, shard.to_batches(batch_rows))
        )


def main() -> None:
    server = Baseline()
    print(f"pyarrow baseline listening on 127.0.0.1:{server.port}", flush=True)
    server.serve()


if __name__ == "__main__":
    main()
