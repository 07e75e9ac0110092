"""A dataset sealed across three members, read the way a Spark read's tasks
read it: one stream per stored partition, from the partition's first row,
stopped after its last.

Starts three release `flightdeck` servers on loopback, writes `--rows`
rows (an int64 id and `--cols` float32 columns) as 12 partitions held
6 / 4 / 2, seals them as one dataset, and times reading every partition in
turn two ways, alternated `--reps` times (the first of each left out of the
median):

- `to the end`: each stream planned at one member from the partition's
  first row and cancelled after its rows (what both Spark connectors did
  before `max_rows`): the serving member merges rows from the others, which
  push their read-ahead until the cancel;
- `held`: each stream planned with `max_rows` = the partition's rows and a
  node map naming the member that holds it (what the connectors do now).

With `--filter SQL` the reads are of the rows it selects, the two ways
a Spark read of a filter can split them:

- `to the end`: the selected rows in 12 equal parts, each a stream with
  `max_rows` planned at one member (what both connectors did before plans
  told each partition's selected rows): that member merges the others';
- `held`: one stream per stored partition of its selected rows (the
  plan's `partition_rows`), served by its holder.

It prints the seconds for all 12 partitions and the rows the members
fetched from each other during one such read (the `stats` counters).

    cargo build --release --bin flightdeck
    .venv/bin/python bench/cluster_partition_reads.py --rows 2000000 --cols 32
    .venv/bin/python bench/cluster_partition_reads.py --rows 2000000 --cols 32 \
        --filter "hash_bucket(id) < 50"
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "python"))

import flightdeck  # noqa: E402
from conftest import RunningServer  # noqa: E402

PARTITIONS = 12
HOLDER = [0, 0, 0, 1, 1, 2]  # member of partition p: HOLDER[p % 6]


def write(members, rows: int, cols: int) -> None:
    per = rows // PARTITIONS
    rng = np.random.default_rng(0)
    held: dict[str, dict[int, int]] = {}
    for p in range(PARTITIONS):
        m = members[HOLDER[p % 6]]
        table = {"id": pa.array(np.arange(p * per, (p + 1) * per, dtype=np.int64))}
        for j in range(cols):
            table[f"f{j}"] = pa.array(rng.random(per, dtype=np.float32))
        with flightdeck.connect(m.uri) as c:
            ack = c.put_partition("e", p, pa.table(table).to_batches(max_chunksize=10_000))
        held.setdefault(ack.location or m.uri, {})[p] = 0
    with flightdeck.connect(members[0].uri) as c:
        c.seal_cluster("e", held, partitions=PARTITIONS)


def fetched(members) -> int:
    total = 0
    for m in members:
        with flightdeck.connect(m.uri) as c:
            total += c.stats().rows_fetched_from_peers
    return total


def spans(members, held: bool, filter: str) -> list[tuple[int, int, dict]]:
    """`(start, rows, plan arguments)` of each stream of one read."""
    with flightdeck.connect(members[2].uri) as c:
        layout = c.describe("e").layout
        planned = c.plan("e", filter=filter) if filter else None
    holder = {p.partition: m.location for m in layout.members for p in m.partitions}
    parts = sorted((p.partition, p.rows) for m in layout.members for p in m.partitions)
    if planned is not None and not held:
        total = planned.total_rows
        bounds = [total * i // PARTITIONS for i in range(PARTITIONS + 1)]
        return [(a, b - a, dict(max_rows=b - a)) for a, b in zip(bounds, bounds[1:]) if b > a]
    if planned is not None:
        parts = [(p, n) for (p, _), n in zip(parts, planned.partition_rows)]
    out, start = [], 0
    for partition, rows in parts:
        where = dict(nodes=[holder[partition]], ranks_per_node=1, max_rows=rows) if held else {}
        if rows:
            out.append((start, rows, where))
        start += rows
    return out


def read_partitions(members, held: bool, filter: str = "") -> tuple[float, int]:
    """Seconds to read every partition in turn, and rows fetched between
    members meanwhile."""
    streams = spans(members, held, filter)
    before = fetched(members)
    t0 = time.perf_counter()
    for start, rows, where in streams:
        with flightdeck.connect(members[2].uri) as c:
            plan = c.plan("e", start_sample=start, filter=filter, **where)
            got = 0
            stream = c.read_shard(plan.shards[0])
            for batch in stream:
                got += batch.num_rows
                if got >= rows:
                    break
            stream.close()
            if got < rows:
                raise RuntimeError(f"rows from {start}: {got} of {rows}")
    seconds = time.perf_counter() - t0
    time.sleep(0.3)  # let cancelled peer streams settle before counting
    return seconds, fetched(members) - before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--cols", type=int, default=32)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--filter", default="", help="read the rows this SQL condition selects")
    ap.add_argument("--server", default=str(REPO / "target" / "release" / "flightdeck"))
    args = ap.parse_args()
    os.environ["FLIGHTDECK_BIN"] = args.server
    members = [RunningServer("--memory-limit", "4GiB") for _ in range(3)]
    try:
        write(members, args.rows, args.cols)
        runs: dict[str, list[tuple[float, int]]] = {"to the end": [], "held": []}
        for _ in range(args.reps):
            for name in runs:
                runs[name].append(read_partitions(members, name == "held", args.filter))
        for name, r in runs.items():
            times = [t for t, _ in r]
            print(
                f"{name:>10}: median {statistics.median(times[1:] or times):.3f} s "
                f"(all: {' '.join(f'{t:.3f}' for t in times)}), "
                f"rows fetched between members per read: {r[-1][1]}"
            )
    finally:
        for m in members:
            m.stop()


if __name__ == "__main__":
    main()
