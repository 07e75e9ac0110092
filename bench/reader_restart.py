"""How long a training loop waits when its server restarts mid-epoch.

Starts a release `flightdeck serve --persist` on loopback, writes `--rows`
rows (an int64 id, a float32 and an int32 column) as 4 partitions, and
reads rank 0 of 2 with `ShardedDataset(reconnect_seconds=60)`. After
`--kill-after` batches it kills the server (SIGKILL, as a crash would) and
starts it again on the same port and store at once; the reader takes the
read up where it stood. Prints, per trial, how long the server took to say
it listens again, the longest wait between two batches the loop saw (the
restart, the reconnect and the dataset's restore from the store) against
the median one, and that the rows read equal an uninterrupted read.

    cargo build --release --bin flightdeck
    .venv/bin/python bench/reader_restart.py --rows 2000000 --trials 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "python"))

import flightdeck  # noqa: E402
from conftest import RunningServer  # noqa: E402
from test_tiers import table, write  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--batch-rows", type=int, default=2000)
    parser.add_argument("--kill-after", type=int, default=50, help="batches read before the kill")
    args = parser.parse_args()
    os.environ.setdefault("FLIGHTDECK_BIN", str(REPO / "target" / "release" / "flightdeck"))

    with tempfile.TemporaryDirectory() as tmp:
        store = ("--memory-limit", "1GiB", "--persist", "--spill-url", f"{tmp}/store")
        server = RunningServer(*store)
        try:
            with flightdeck.connect(server.uri) as c:
                write(c, "kept", table(args.rows, 1))
            for trial in range(args.trials):

                def reader() -> flightdeck.ShardedDataset:
                    return flightdeck.ShardedDataset(
                        server.uri,
                        "kept",
                        rank=0,
                        world_size=2,
                        batch_rows=args.batch_rows,
                        read_rows=args.batch_rows,
                        seed=trial,
                        reconnect_seconds=60,
                    )

                whole = [b.column("id") for b in reader()]
                r, got, waits, last = reader(), [], [], time.monotonic()
                for n, batch in enumerate(r):
                    now = time.monotonic()
                    waits.append(now - last)
                    got.append(batch.column("id"))
                    if n == args.kill_after:
                        server.proc.kill()
                        server.proc.wait()
                        started = time.monotonic()
                        server = RunningServer("--listen", server.addr, *store)
                        up = time.monotonic() - started
                    last = time.monotonic()
                same = got == whole
                print(
                    f"trial {trial}: listening again after {up * 1000:.0f} ms; the loop waited "
                    f"{max(waits) * 1000:.0f} ms at most (median "
                    f"{statistics.median(waits) * 1000:.2f} ms a batch); reconnects "
                    f"{r.reconnects}; rows as uninterrupted: {same}"
                )
        finally:
            server.stop()


if __name__ == "__main__":
    main()
