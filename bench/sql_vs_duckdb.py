"""SQL over the cache against the same query elsewhere, in one run.

Writes a synthetic table (an int64 `label` of 100 classes and float32
features) into a flightdeck server, then times, with the same Arrow data:

- flightdeck answering `SELECT label, count(*), avg(f0) ... GROUP BY label`
  over Flight SQL (ADBC's driver), the result fetched as Arrow;
- DuckDB and pyarrow running the same aggregate on the table already in this
  process's memory (the floor: no transfer at all);
- DuckDB and pyarrow after reading the dataset out of flightdeck first
  (DoGet of every row, then the query) — what a user does without SQL in
  the server.

Also times a filtered `SELECT count(*) ... WHERE f0 < 0.5` the same ways.
Medians of `--reps` repetitions; `--json` writes every figure.

    cargo build --release --bin flightdeck
    .venv/bin/python bench/sql_vs_duckdb.py --rows 2000000 --features 16 --reps 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "python"))

import flightdeck  # noqa: E402
from conftest import RunningServer  # noqa: E402

GROUP = "SELECT label, count(*) AS n, avg(f0) AS m FROM {t} GROUP BY label"
FILTER = "SELECT count(*) AS n FROM {t} WHERE f0 < 0.5"


def synthetic(rows: int, features: int, seed: int = 1) -> pa.Table:
    rng = np.random.default_rng(seed)
    cols = {"label": pa.array(rng.integers(0, 100, rows), pa.int64())}
    for i in range(features):
        cols[f"f{i}"] = pa.array(rng.random(rows, dtype=np.float32))
    return pa.table(cols)


def timed(fn, reps: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--features", type=int, default=16)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import adbc_driver_flightsql.dbapi as adbc
    import duckdb

    table = synthetic(args.rows, args.features)
    server = RunningServer("--memory-limit", f"{max(1, table.nbytes * 4 >> 30)}GiB")
    try:
        client = flightdeck.connect(server.uri)
        step = -(-args.rows // args.partitions)
        for p in range(args.partitions):
            client.put_partition("bench", p, table.slice(p * step, step))
        client.seal("bench", partitions=args.partitions)
        conn = adbc.connect(server.uri)
        duck = duckdb.connect()

        def flight_sql(sql):
            with conn.cursor() as cur:
                cur.execute(sql.format(t="bench"))
                return cur.fetch_arrow_table()

        def read_out():
            return client.read_table(client.plan("bench").shards[0])

        def duck_on(t, sql):
            # DuckDB finds the Arrow table `t` among this frame's variables.
            return duck.sql(sql.format(t="t")).to_arrow_table()

        def pyarrow_group(t):
            return t.group_by("label").aggregate([("label", "count"), ("f0", "mean")])

        def pyarrow_filter(t):
            import pyarrow.compute as pc

            return pc.sum(pc.less(t["f0"], 0.5)).as_py()

        figures = {}
        for name, sql, pa_fn in [("group_by", GROUP, pyarrow_group), ("filter_count", FILTER, pyarrow_filter)]:
            flight_sql(sql)  # warm-up: first plan, first scan
            figures[f"{name}/flightdeck_sql"], res = timed(lambda: flight_sql(sql), args.reps)
            figures[f"{name}/duckdb_in_memory"], dres = timed(lambda: duck_on(table, sql), args.reps)
            figures[f"{name}/pyarrow_in_memory"], _ = timed(lambda: pa_fn(table), args.reps)

            def load_then_duck():
                return duck_on(read_out(), sql)

            def load_then_pyarrow():
                return pa_fn(read_out())

            figures[f"{name}/read_out_then_duckdb"], _ = timed(load_then_duck, args.reps)
            figures[f"{name}/read_out_then_pyarrow"], _ = timed(load_then_pyarrow, args.reps)
            assert res.num_rows == dres.num_rows, (name, res.num_rows, dres.num_rows)
        conn.close()
    finally:
        server.stop()

    print(f"{args.rows} rows x {args.features} float32 features + label, medians of {args.reps}")
    print(f"{'query / path':48} {'seconds':>9}")
    for k, v in figures.items():
        print(f"{k:48} {v:9.4f}")
    for name in ("group_by", "filter_count"):
        fd = figures[f"{name}/flightdeck_sql"]
        print(
            f"{name}: flightdeck SQL / read out + DuckDB = "
            f"{fd / figures[f'{name}/read_out_then_duckdb']:.2f}x the time; "
            f"/ DuckDB in memory = {fd / figures[f'{name}/duckdb_in_memory']:.2f}x"
        )
    if args.json:
        args.json.write_text(json.dumps({"rows": args.rows, "features": args.features, "seconds": figures}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
