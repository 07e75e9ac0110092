"""PyTorch fed by flightdeck, PyTorch on an in-memory tensor, and
flightdeck's embedded trainer: the same model on the same data.

Starts a release `flightdeck` server, writes a synthetic dataset (rows ×
`--dim` float32 features as one fixed_size_list column, int64 labels from a
random linear map), then trains one epoch of each model (linear, and an MLP
with one hidden layer of `--hidden`; AdamW, batch `--batch-size`) five ways
and prints samples/s: PyTorch (`--threads` threads) on an in-memory tensor
(the compute floor), PyTorch through `FlightDeckIterableDataset` with
`prefetch=0`, with `--prefetch` batches read ahead on a background thread,
and read in bursts of `--burst-mib` MiB on the loop's thread (each with the
loop's stall, `stall_seconds`, as a share of the epoch), on the reader's
batches read before the loop (the compute alone, on them), and the embedded
trainer on 1 and 2 CPU ranks (with its data stall). Each row also gives
the split of the two cores: CPU seconds of the epoch in the server's
process and in this one (PyTorch, the reader and its threads; the
embedded trainer's include its final evaluation pass). The reader takes
its batches through the server's shared memory, as it does on the
server's machine, but in the row marked "over the socket"
(`FLIGHTDECK_SHM=0`); a last table reads an epoch alone both ways.

    cargo build --release --bin flightdeck
    .venv/bin/python bench/reader_throughput.py --rows 1000000 --dim 32

The tables are medians over `--reps` repetitions (each row also lists
every repetition's ratio to the same repetition's floor); `--json PATH`
writes every repetition's figures with the commit, date and machine, for
`bench/tables.py` to render in `bench/RESULTS.md`.

`--unix` reads over the server's `--unix-socket` instead of loopback TCP.
`--device cuda` trains on the GPU: the floor's tensor lives on the device,
the reader hands batches over already there (`device="cuda"`: its
read-ahead thread copies each message once), plus a row where it lands them
in pinned memory (`pin_memory=True`) and the loop copies each batch with
`non_blocking=True`; the embedded trainer runs on GPU 0 instead of CPU
ranks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch

import flightdeck
import synthetic
import tables
from flightdeck.torch import FlightDeckIterableDataset


def model(
    dim: int, hidden: int, classes: int, device: str = "cpu"
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model in PyTorch on `device`: an MLP with one hidden layer of
    `hidden`, or linear with `hidden` 0; AdamW."""
    torch.manual_seed(0)
    if hidden:
        net = torch.nn.Sequential(
            torch.nn.Linear(dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, classes)
        )
    else:
        net = torch.nn.Linear(dim, classes)
    net = net.to(device)
    return net, torch.optim.AdamW(net.parameters(), lr=1e-3)


def step(net, opt, x, y) -> None:
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(net(x), y).backward()
    opt.step()


def embedded(
    uri: str, args: argparse.Namespace, hidden: int, ranks: int, gpus: tuple[int, ...] = ()
) -> tuple[float, float]:
    """One epoch of the same model in flightdeck's embedded trainer on
    `ranks` CPU ranks (or on `gpus`): samples/s up to the last step's report
    (before the final evaluation pass, which PyTorch's rows do not run
    either) and the data stall of the last report."""
    client = flightdeck.connect(uri)
    start = time.perf_counter()
    reports = client.train(
        "bench", "features", "label", classes=args.classes, hidden=[hidden] if hidden else [],
        lr=1e-3, batch_size=args.batch_size, cpu_ranks=ranks, gpus=gpus, seed=1,
    )
    for report in reports:
        if report.step == report.total_steps and not report.done:
            took = time.perf_counter() - start
            stall = report.data_stall_fraction
    return report.step * args.batch_size / took, stall


def command_line() -> str:
    """How this run was started, with paths inside the repository relative
    to it (the way `bench/RESULTS.md` gives commands)."""

    def short(path: str) -> str:
        full = Path(path).absolute()
        return str(full.relative_to(synthetic.REPO)) if full.is_relative_to(synthetic.REPO) else path

    return shlex.join([short(sys.executable), short(sys.argv[0]), *sys.argv[1:]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--models", default="linear,mlp", help="comma-separated: linear, mlp")
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--burst-mib", type=int, default=64, help="burst_bytes of the burst row, in MiB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bin", default=synthetic.SERVER_BIN)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where PyTorch trains")
    ap.add_argument(
        "--unix", action="store_true", help="read over the server's Unix domain socket instead of TCP"
    )
    ap.add_argument("--json", type=Path, help="also write every repetition's figures here")
    args = ap.parse_args()
    models = args.models.split(",")
    if unknown := sorted(set(models) - {"linear", "mlp"}):
        ap.error(f"--models: unknown {', '.join(unknown)}; name linear, mlp or both")
    if args.reps < 1:
        ap.error("--reps: give at least 1")
    if args.json and not args.json.parent.is_dir():
        ap.error(f"--json: no folder {args.json.parent} to write {args.json.name} in")
    torch.set_num_threads(args.threads)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch.cuda.is_available() is False on this machine")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    run = {
        "bench": "reader_throughput",
        "command": command_line(),
        "commit": synthetic.commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": synthetic.machine(),
        "rows": args.rows,
        "dim": args.dim,
        "classes": args.classes,
        "batch_size": args.batch_size,
        "threads": args.threads,
        "reps": args.reps,
        "transport": "unix" if args.unix else "tcp",
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else None,
        "results": [],
        "alone": [],
    }

    def progress(what: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)

    with synthetic.server(args.bin, unix=args.unix) as srv:
        uri = srv.uri
        progress(f"writing {args.rows} rows")
        x, y = synthetic.write_dataset(uri, args.rows, args.dim, args.classes)
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)

        def reader(kind, **options):
            """One rank's reader (`kind`) of the whole dataset, in the
            same order every time."""
            return kind(uri, "bench", rank=0, world_size=1, batch_rows=args.batch_size, seed=1, **options)

        def timed(work):
            """Runs `work`: what it returned, the wall-clock seconds it
            took, and the CPU seconds of the server's process and of this
            one meanwhile."""
            server, this = srv.cpu_seconds(), time.process_time()
            start = time.perf_counter()
            result = work()
            sync()
            took = time.perf_counter() - start
            return result, took, (srv.cpu_seconds() - server, time.process_time() - this)

        for name in models:
            hidden = {"linear": 0, "mlp": args.hidden}[name]
            # Each path's figures, one per repetition, in the order first run.
            rows_of: dict[str, dict] = {}

            def record(path: str, rate: float, stall: float | None, cpu: tuple[float, float]) -> None:
                """Notes one repetition of `path`: samples/s, the loop's
                wait as a share of its epoch (None where nothing is read
                while it trains) and the CPU seconds (server, this process)."""
                row = rows_of.setdefault(path, {
                    "model": name, "hidden": hidden, "path": path, "samples_per_s": [],
                    "stall": None if stall is None else [], "cpu_server_s": [], "cpu_process_s": [],
                })
                row["samples_per_s"].append(rate)
                if stall is not None:
                    row["stall"].append(stall)
                row["cpu_server_s"].append(cpu[0])
                row["cpu_process_s"].append(cpu[1])

            for rep in range(args.reps):
                progress(f"{name}: repetition {rep + 1} of {args.reps}")
                net, opt = model(args.dim, hidden, args.classes, device)
                # Shuffled (and on the device) before the clock: the floor is
                # the compute alone.
                perm = torch.randperm(args.rows)
                xs, ys = xt[perm].contiguous().to(device), yt[perm].contiguous().to(device)
                sync()

                def floor_epoch() -> None:
                    for i in range(0, args.rows, args.batch_size):
                        step(net, opt, xs[i : i + args.batch_size], ys[i : i + args.batch_size])

                _, took, cpu = timed(floor_epoch)
                record(tables.READER_FLOOR, args.rows / took, None, cpu)
                # On a GPU the batches arrive there (device=); one row pins
                # them and copies each in the loop instead.
                on = {"device": device} if device == "cuda" else {}
                # Every row reads through the server's shared memory (the
                # reader's default on the server's machine) but the one
                # that says it reads over the socket.
                readers = [(f"prefetch={depth}", depth, 0, on, "1") for depth in (0, args.prefetch)]
                readers.append(
                    (f"prefetch={args.prefetch} over the socket", args.prefetch, 0, on, "0")
                )
                readers.append((f"in {args.burst_mib} MiB bursts", 0, args.burst_mib << 20, on, "1"))
                if device == "cuda":
                    readers.append(
                        (f"prefetch={args.prefetch}, pinned, copied in the loop", args.prefetch, 0,
                         {"pin_memory": True}, "1")
                    )
                for how, depth, burst, handover, shm in readers:
                    # Read when the dataset connects, at its first batch.
                    os.environ["FLIGHTDECK_SHM"] = shm
                    data = reader(FlightDeckIterableDataset, prefetch=depth, burst_bytes=burst, **handover)
                    net, opt = model(args.dim, hidden, args.classes, device)

                    def read_epoch() -> int:
                        rows = 0
                        for batch in data:
                            x = batch["features"].to(device, non_blocking=True)
                            y = batch["label"].to(device, non_blocking=True)
                            step(net, opt, x, y)
                            rows += len(batch["label"])
                        return rows

                    rows, took, cpu = timed(read_epoch)
                    assert rows == args.rows, rows
                    record(f"PyTorch, FlightDeckIterableDataset {how}", rows / took, data.stall_seconds / took, cpu)
                    del os.environ["FLIGHTDECK_SHM"]
                # The loop's compute on the reader's own batches, read
                # beforehand: what is left of the gap to the floor is then
                # not the batches but the reading.
                read = list(reader(FlightDeckIterableDataset, prefetch=0, **on))
                net, opt = model(args.dim, hidden, args.classes, device)

                def read_before() -> None:
                    for batch in read:
                        step(net, opt, batch["features"].to(device), batch["label"].to(device))

                _, took, cpu = timed(read_before)
                record(
                    "PyTorch on FlightDeckIterableDataset's batches read before the loop",
                    args.rows / took, None, cpu,
                )
                del read
                trainers = [((), r, f"{r} CPU rank{'s' if r > 1 else ''}") for r in (1, 2)]
                if device == "cuda":
                    trainers = [((0,), 1, "GPU 0")]
                for gpus, ranks, where in trainers:
                    (rate, stall), _, cpu = timed(lambda: embedded(uri, args, hidden, ranks, gpus))
                    record(f"flightdeck's embedded trainer, {where}", rate, stall, cpu)
            run["results"] += rows_of.values()
        alone: dict[str, dict] = {}
        for rep in range(args.reps):
            progress(f"an epoch read alone: repetition {rep + 1} of {args.reps}")
            for shm, path in (("1", "shared memory"), ("0", "the socket")):
                os.environ["FLIGHTDECK_SHM"] = shm
                data = reader(flightdeck.ShardedDataset, prefetch=0)
                rows, took, (server, this) = timed(lambda: sum(b.num_rows for b in data))
                assert rows == args.rows, rows
                row = alone.setdefault(path, {"path": path, "wall_s": [], "cpu_process_s": [], "cpu_server_s": []})
                row["wall_s"].append(took)
                row["cpu_process_s"].append(this)
                row["cpu_server_s"].append(server)
                del os.environ["FLIGHTDECK_SHM"]
        run["alone"] = list(alone.values())
    if args.json:
        args.json.write_text(json.dumps(run, indent=2) + "\n")
        progress(f"wrote {args.json}")
    print(tables.render_reader(run, args.json.name if args.json else "(not written)"))


if __name__ == "__main__":
    main()
