"""PyTorch fed by flightdeck vs PyTorch on an in-memory tensor, same model.

Starts a release `flightdeck` server, writes a synthetic dataset (rows ×
`--dim` float32 features as one fixed_size_list column, int64 labels from a
random linear map), then trains one epoch of the same model (an MLP with one
hidden layer, AdamW, batch `--batch-size`, `--threads` torch threads) three
ways and prints samples/s: on an in-memory tensor (the compute floor), and
through `FlightDeckIterableDataset` with `prefetch=0` and `--prefetch`
batches read ahead, with the loop's stall (`stall_seconds`) as a share of
the epoch.

    cargo build --release --bin flightdeck
    .venv/bin/python bench/reader_throughput.py --rows 1000000 --dim 32
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import synthetic
from flightdeck.torch import FlightDeckIterableDataset


def model(dim: int, hidden: int, classes: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, classes)
    )
    return net, torch.optim.AdamW(net.parameters(), lr=1e-3)


def step(net, opt, x, y) -> None:
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(net(x), y).backward()
    opt.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bin", default=synthetic.SERVER_BIN)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    with synthetic.server(args.bin) as uri:
        x, y = synthetic.write_dataset(uri, args.rows, args.dim, args.classes)
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)
        results: dict[str, list[float]] = {}
        stalls: dict[str, list[float]] = {}
        for _ in range(args.reps):
            net, opt = model(args.dim, args.hidden, args.classes)
            # Shuffled once before the clock: the floor is the compute alone.
            perm = torch.randperm(args.rows)
            xs, ys = xt[perm].contiguous(), yt[perm].contiguous()
            start = time.perf_counter()
            for i in range(0, args.rows, args.batch_size):
                step(net, opt, xs[i : i + args.batch_size], ys[i : i + args.batch_size])
            results.setdefault("in-memory tensor", []).append(args.rows / (time.perf_counter() - start))
            for depth in (0, args.prefetch):
                name = f"FlightDeckIterableDataset prefetch={depth}"
                data = FlightDeckIterableDataset(
                    uri, "bench", rank=0, world_size=1, batch_rows=args.batch_size, seed=1, prefetch=depth
                )
                net, opt = model(args.dim, args.hidden, args.classes)
                start = time.perf_counter()
                rows = 0
                for batch in data:
                    step(net, opt, batch["features"], batch["label"])
                    rows += len(batch["label"])
                took = time.perf_counter() - start
                assert rows == args.rows, rows
                results.setdefault(name, []).append(rows / took)
                stalls.setdefault(name, []).append(data.stall_seconds / took)
        floor = float(np.median(results["in-memory tensor"]))
        print(f"{args.rows} rows x {args.dim} float32, MLP {args.hidden}, AdamW, batch {args.batch_size}, "
              f"{args.threads} torch threads, {args.reps} reps (medians)")
        print("| path | samples/s | of the in-memory floor | loop waiting for data |")
        print("| --- | ---: | ---: | ---: |")
        for name, rates in results.items():
            rate = float(np.median(rates))
            stall = f"{float(np.median(stalls[name])) * 100:.0f} %" if name in stalls else "—"
            print(f"| {name} | {rate / 1e6:.2f} M | {rate / floor:.2f}× | {stall} |")


if __name__ == "__main__":
    main()
