"""Training throughput of the embedded runtime through `flightdeck train`.

Starts a release `flightdeck` server, writes a synthetic dataset (rows ×
`--dim` float32 features as one fixed_size_list column, labels from a
random linear map, so it is learnable), then runs one epoch per model /
device setting and prints wall time, the runtime's own samples/s and
data-stall share (from a mid-run progress report) and the final accuracy.

    cargo build --release --bin flightdeck
    .venv/bin/python bench/train_throughput.py --rows 1000000 --dim 32 --devices cpu,cpu:2
"""

from __future__ import annotations

import argparse
import subprocess
import time

import synthetic


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--models", default="linear;64", help="';'-separated: 'linear' or hidden sizes like '64,64'")
    ap.add_argument("--devices", default="cpu,cpu:2", help="comma-separated --devices values")
    ap.add_argument("--bin", default=synthetic.SERVER_BIN)
    args = ap.parse_args()

    with synthetic.server(args.bin) as srv:
        synthetic.write_dataset(srv.uri, args.rows, args.dim, args.classes)
        addr = srv.uri.removeprefix("grpc://")
        print(f"{args.rows} rows x {args.dim} features, {args.classes} classes, batch {args.batch_size}, one epoch")
        for model in args.models.split(";"):
            for devices in args.devices.split(","):
                run(args, addr, "" if model == "linear" else model, devices)


def run(args: argparse.Namespace, addr: str, hidden: str, devices: str) -> None:
    cmd = [
        args.bin, "train", "--server", f"http://{addr}", "--dataset", "bench", "--features", "features",
        "--label", "label", "--classes", str(args.classes), "--lr", "0.01",
        "--batch-size", str(args.batch_size), "--epochs", "1", "--devices", devices,
    ]
    if hidden:
        cmd += ["--hidden", hidden]
    start = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    wall = time.time() - start
    reports = [line for line in done.stderr.splitlines() if "samples/s" in line]
    mid = reports[len(reports) // 2].split("] ")[-1] if reports else "-"
    model = f"MLP [{hidden}]" if hidden else "linear"
    print(f"{model:12} {devices:6} wall {wall:6.2f} s | mid-run: {mid} | {done.stdout.strip()}")


if __name__ == "__main__":
    main()
