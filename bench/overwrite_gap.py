"""How long readers cannot read a dataset while Spark overwrites it.

Starts a release `flightdeck serve` on loopback and a local Spark session
(2 threads), writes `--rows` rows (an id and 16 float32 features, 8
partitions) with `write_dataframe`, then rewrites them `--trials` times in
two ways while a reader asks for the dataset every `--poll-ms` (a plan and
its first batch, as a loader starting an epoch does):

- `overwrite`: `write_dataframe(..., mode="overwrite")`, which stages the
  new rows beside the dataset and swaps them in at the seal;
- `drop, then write`: drop the dataset and write it again (what an
  overwrite did before: the old rows are gone for the whole job).

Prints, per way, the job's time and the longest stretch the reader could
not read (no dataset, or not sealed yet), with how many of its asks failed.

    cargo build --release --bin flightdeck
    .venv/bin/python bench/overwrite_gap.py --rows 2000000 --trials 3
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "python"))

import flightdeck  # noqa: E402
from conftest import RunningServer  # noqa: E402
from flightdeck.spark import write_dataframe  # noqa: E402


class Reader(threading.Thread):
    """Asks for the dataset's first batch every `poll` seconds until
    stopped; keeps the longest stretch between two answered asks."""

    def __init__(self, uri: str, dataset: str, poll: float) -> None:
        super().__init__(daemon=True)
        self.uri, self.dataset, self.poll = uri, dataset, poll
        self.stop = threading.Event()
        self.failed = 0
        self.asked = 0
        self.longest = 0.0

    def run(self) -> None:
        with flightdeck.connect(self.uri) as c:
            last_ok = time.perf_counter()
            while not self.stop.is_set():
                self.asked += 1
                try:
                    plan = c.plan(self.dataset, batch_rows=1024)
                    next(iter(c.read_shard(plan.shards[0])))
                    now = time.perf_counter()
                    self.longest = max(self.longest, now - last_ok)
                    last_ok = now
                except flightdeck.FlightDeckError:
                    self.failed += 1
                self.stop.wait(self.poll)
            self.longest = max(self.longest, time.perf_counter() - last_ok)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--poll-ms", type=float, default=10.0)
    args = parser.parse_args()
    os.environ.setdefault("FLIGHTDECK_BIN", str(REPO / "target" / "release" / "flightdeck"))
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    features = ", ".join(f"cast(rand({i}) as float) as f{i}" for i in range(16))
    df = spark.range(args.rows, numPartitions=8).selectExpr("id", *features.split(", "))
    server = RunningServer("--memory-limit", "4GiB")
    try:
        write_dataframe(df, server.uri, "clicks")
        ways = {
            "overwrite": lambda: write_dataframe(df, server.uri, "clicks"),
            "drop, then write": lambda: (
                flightdeck.connect(server.uri).drop("clicks"),
                write_dataframe(df, server.uri, "clicks", mode="append"),
            ),
        }
        for trial in range(args.trials):
            for way, rewrite in ways.items():
                reader = Reader(server.uri, "clicks", args.poll_ms / 1000)
                reader.start()
                time.sleep(0.2)
                started = time.perf_counter()
                rewrite()
                took = time.perf_counter() - started
                time.sleep(0.2)
                reader.stop.set()
                reader.join()
                print(
                    f"trial {trial} {way:>16}: job {took:5.2f} s; reader blocked at most "
                    f"{reader.longest:5.2f} s ({reader.failed} of {reader.asked} asks failed)",
                    flush=True,
                )
    finally:
        server.stop()
        spark.stop()


if __name__ == "__main__":
    main()
