"""Spark → training data path, measured end to end on this machine.

Compares, on one Spark `local[N]` session and one flightdeck server:

- `floor`: Spark exports the DataFrame as Arrow into a no-op `mapInArrow`
  sink — the least any Arrow-based writer can cost.
- `flightdeck write`: the Python data source (`register(spark,
  "flightdeck_py")`) until the dataset is sealed; `flightdeck write jvm`:
  the JVM connector (`connectors/spark`'s jar on `spark.jars`,
  `format("flightdeck")`), same DataFrame, same run (`--writer`).
- `flightdeck read`: one epoch read by `--ranks` ranks (threads, one
  connection each), globally shuffled; `flightdeck read none` unshuffled.
- `parquet write` + `parquet read`: the path users take today,
  `df.write.parquet` then `--ranks` readers each reading their files.
- `spark read` (`spark read jvm`): Spark reads the sealed dataset back
  through the Python data source (the JVM connector) into Spark's no-op
  sink; `parquet spark read`: Spark reads the Parquet files the same way.

The DataFrame is cached first so generating it is not measured. Every
phase first runs `--warmup` times unmeasured (the first run of each pays
JIT compilation and first-touch allocation in Spark's JVM and the server:
about 2× the later ones), then `--reps` times; medians are reported. Usage:

    .venv/bin/python bench/spark_to_ddp.py --rows 2000000 --cols 32 \
        --server target/release/flightdeck --json bench/spark_to_ddp.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]


def start_server(binary: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [binary, "serve", "--listen", "127.0.0.1:0", "--memory-limit", "8GiB"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("flightdeck listening on "):
        proc.kill()
        raise RuntimeError(f"server did not start: {line!r}")
    return proc, "grpc://" + line.split()[-1]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--cols", type=int, default=32)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured runs of every phase first")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--batch-rows", type=int, default=8192)
    ap.add_argument("--arrow-batch", type=int, default=10000,
                    help="spark.sql.execution.arrow.maxRecordsPerBatch (Spark's default 10000)")
    ap.add_argument("--server", default=str(REPO / "target" / "release" / "flightdeck"))
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--writer", choices=("python", "jvm", "both"), default="both",
                    help="the Spark writers to measure (jvm needs `mvn -q -f connectors/spark "
                         "package`)")
    ap.add_argument("--jar", default=str(REPO / "connectors" / "spark" / "target"
                                         / "flightdeck-spark-0.1.0.jar"))
    args = ap.parse_args()

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    import flightdeck
    from flightdeck.spark import register

    spark = (
        SparkSession.builder.master(args.master)
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.memory", "6g")
        .config("spark.sql.execution.arrow.maxRecordsPerBatch", str(args.arrow_batch))
        .config("spark.jars", args.jar if args.writer != "python" else "")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    if args.writer != "python" and not Path(args.jar).exists():
        sys.exit(f"{args.jar} not built: mvn -q -f connectors/spark package")
    register(spark, "flightdeck_py")
    writers = {"python": ["flightdeck_py"], "jvm": ["flightdeck"],
               "both": ["flightdeck_py", "flightdeck"]}[args.writer]
    cols = [f"cast(rand({i}) as float) as f{i}" for i in range(args.cols)]
    df = spark.range(args.rows, numPartitions=args.partitions).selectExpr("id", *cols).cache()
    df.count()
    payload = args.rows * (8 + 4 * args.cols)

    proc, uri = start_server(args.server)
    client = flightdeck.connect(uri)
    tmp = Path(tempfile.mkdtemp(prefix="flightdeck-bench-"))
    names = {"flightdeck_py": "flightdeck_write", "flightdeck": "flightdeck_write_jvm"}
    read_names = {"flightdeck_py": "spark_read", "flightdeck": "spark_read_jvm"}
    results: dict[str, list[float]] = {k: [] for k in (
        "floor", *(names[w] for w in writers), "flightdeck_read", "flightdeck_read_none",
        *(read_names[w] for w in writers), "parquet_write", "parquet_read",
        "parquet_spark_read")}

    def noop(batches):
        for _ in batches:
            pass
        return iter(())

    def fd_write(fmt):
        (df.write.format(fmt).option("uri", uri).option("dataset", "bench")
         .mode("overwrite").save())

    def fd_read(shuffle="global"):
        def rank(r):
            with flightdeck.connect(uri) as c:
                plan = c.plan("bench", world_size=args.ranks, shuffle=shuffle, seed=1,
                              batch_rows=args.batch_rows)
                return sum(b.num_rows for b in c.read_shard(plan.shards[r]))
        with ThreadPoolExecutor(args.ranks) as pool:
            rows = sum(pool.map(rank, range(args.ranks)))
        assert rows >= args.rows

    def spark_read(fmt):
        back = spark.read.format(fmt).option("uri", uri).option("dataset", "bench").load()
        back.write.format("noop").mode("overwrite").save()

    def pq_spark_read():
        spark.read.parquet(str(tmp / "pq")).write.format("noop").mode("overwrite").save()

    def pq_write():
        shutil.rmtree(tmp / "pq", ignore_errors=True)
        df.write.parquet(str(tmp / "pq"))

    def pq_read():
        files = sorted((tmp / "pq").glob("*.parquet"))

        def rank(r):
            return sum(pq.read_table(f).num_rows for f in files[r::args.ranks])
        with ThreadPoolExecutor(args.ranks) as pool:
            rows = sum(pool.map(rank, range(args.ranks)))
        assert rows == args.rows

    try:
        for _ in range(args.warmup):
            df.mapInArrow(noop, "id long").count()
            for w in writers:
                fd_write(w)
            fd_read()
            fd_read("none")
            for w in writers:
                spark_read(w)
            pq_write()
            pq_read()
            pq_spark_read()
        for rep in range(args.reps):
            results["floor"].append(timed(lambda: df.mapInArrow(noop, "id long").count()))
            for w in writers:
                results[names[w]].append(timed(lambda: fd_write(w)))
            results["flightdeck_read"].append(timed(fd_read))
            results["flightdeck_read_none"].append(timed(lambda: fd_read("none")))
            for w in writers:
                results[read_names[w]].append(timed(lambda: spark_read(w)))
            results["parquet_write"].append(timed(pq_write))
            results["parquet_read"].append(timed(pq_read))
            results["parquet_spark_read"].append(timed(pq_spark_read))
            print(f"rep {rep + 1}/{args.reps}: " + ", ".join(
                f"{k} {v[-1]:.2f}s" for k, v in results.items()), file=sys.stderr, flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)
        spark.stop()

    med = {k: statistics.median(v) for k, v in results.items()}
    write = med.get("flightdeck_write_jvm", med.get("flightdeck_write"))
    fd_total = write + med["flightdeck_read"]
    pq_total = med["parquet_write"] + med["parquet_read"]
    summary = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "rows": args.rows, "cols": args.cols, "payload_bytes": payload,
        "partitions": args.partitions, "ranks": args.ranks, "reps": args.reps,
        "warmup": args.warmup,
        "arrow_batch": args.arrow_batch,
        "median_s": med, "runs_s": results,
        "write_vs_floor": write / med["floor"],
        "jvm_vs_python_write": (med["flightdeck_write_jvm"] / med["flightdeck_write"]
                                if len(writers) == 2 else None),
        "parquet_vs_flightdeck_e2e": pq_total / fd_total,
        "parquet_vs_flightdeck_e2e_python": (
            pq_total / (med["flightdeck_write"] + med["flightdeck_read"])
            if "flightdeck_write" in med else None),
        "parquet_e2e_vs_floor": pq_total / med["floor"],
    }
    print(f"{'phase':<18}{'median s':>10}{'MB/s':>10}")
    for k, v in med.items():
        print(f"{k:<18}{v:>10.2f}{payload / v / 1e6:>10.0f}")
    which = "JVM" if "flightdeck_write_jvm" in med else "Python"
    print(f"flightdeck write ({which}) / Spark Arrow floor: {summary['write_vs_floor']:.2f}x")
    if summary["jvm_vs_python_write"] is not None:
        print(f"JVM write / Python write: {summary['jvm_vs_python_write']:.2f}x (target <= 0.6x)")
    print(f"parquet e2e / flightdeck e2e ({which} write): "
          f"{summary['parquet_vs_flightdeck_e2e']:.2f}x (target >= 1.5x; >= 2x with the JVM "
          "writer)")
    if which == "JVM" and summary["parquet_vs_flightdeck_e2e_python"] is not None:
        print(f"parquet e2e / flightdeck e2e (Python write): "
              f"{summary['parquet_vs_flightdeck_e2e_python']:.2f}x")
    print(f"parquet e2e / Spark Arrow floor: {summary['parquet_e2e_vs_floor']:.2f}x "
          "(the most any writer behind Spark's Python Arrow export can reach)")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
