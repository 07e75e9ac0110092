"""Tables of benchmark figures, generated from the JSON of each run.

Every figure in ``bench/RESULTS.md`` and ``README.md`` that comes from
``flightdeck-bench`` (or from ``bench/reader_throughput.py --json``) sits
between two markers naming the run's JSON file:

    <!-- table bench/runs/get-65col.json -->
    ...generated...
    <!-- end table -->

``python bench/tables.py`` rewrites what is between them from the JSON (the
commit, date and machine it was measured on, median and best-of times and
rates for every phase and target, and the ratios the targets are stated in,
by median and by best-of; for the reader's runs, samples/s and the ratio
to the in-memory floor by median and in every repetition, the loop's wait
for data and the CPU seconds of each side); ``--check`` only reports stale
tables and exits 1 if there are any (the test suite runs it).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "bench" / "RESULTS.md", ROOT / "README.md"]
MARKED = re.compile(
    r"(<!-- table (?P<path>\S+) -->\n)(?P<body>.*?)(<!-- end table -->)", re.DOTALL
)

# (label, numerator (phase, target), denominator (phase, target)): rates
# compared, higher is faster for the numerator.
RATIOS = [
    ("get global / get none", ("get/global", "flightdeck"), ("get/none", "flightdeck")),
    ("get none / pyarrow's get none", ("get/none", "flightdeck"), ("get/none", "pyarrow")),
    ("get global / pyarrow's get global", ("get/global", "flightdeck"), ("get/global", "pyarrow")),
    ("get none / loopback limit", ("get/none", "flightdeck"), ("limit/tcp", "limit")),
    (
        "get none through shared memory / over the connection",
        ("get/none", "flightdeck-shm"),
        ("get/none", "flightdeck"),
    ),
    (
        "get global through shared memory / over the connection",
        ("get/global", "flightdeck-shm"),
        ("get/global", "flightdeck"),
    ),
    ("get none / Unix socket limit", ("get/none", "flightdeck"), ("limit/unix", "limit")),
    ("put / pyarrow's put", ("put", "flightdeck"), ("put", "pyarrow")),
    ("e2e / the Parquet path's e2e", ("e2e", "flightdeck"), ("e2e", "parquet")),
    (
        "NODE, one node / one server unshuffled, same ranks",
        ("cluster/node", "flightdeck"),
        ("cluster/single-node-ranks", "flightdeck"),
    ),
    (
        "NODE, one node / one server unshuffled, the node's rows",
        ("cluster/node", "flightdeck"),
        ("cluster/single-node-rows", "flightdeck"),
    ),
    (
        "NODE, one node / one server shuffled, same ranks",
        ("cluster/node", "flightdeck"),
        ("cluster/single-node-ranks-global", "flightdeck"),
    ),
    (
        "NODE, every node at once / one server unshuffled, same rows and ranks",
        ("cluster/node-all", "flightdeck"),
        ("cluster/single-none", "flightdeck"),
    ),
    (
        "GLOBAL unshuffled / one server unshuffled",
        ("cluster/global-none", "flightdeck"),
        ("cluster/single-none", "flightdeck"),
    ),
    (
        "GLOBAL shuffled / one server unshuffled",
        ("cluster/global-global", "flightdeck"),
        ("cluster/single-none", "flightdeck"),
    ),
    (
        "gather, global shuffle / unshuffled (in process, one thread a batch)",
        ("gather/global/threads-1", "flightdeck"),
        ("gather/none/threads-1", "flightdeck"),
    ),
] + [
    (
        f"gather on {t} threads a batch / on 1",
        (f"gather/global/threads-{t}", "flightdeck"),
        ("gather/global/threads-1", "flightdeck"),
    )
    for t in (2, 4, 8)
]


def node_ratios(found: dict) -> list:
    """The cluster phase's per-node ratios, one for each node the run
    recorded (`cluster/node/nG` against `cluster/single-node-rows/nG`)."""
    nodes = sorted(
        int(m.group(1)) for phase, _ in found if (m := re.fullmatch(r"cluster/node/n(\d+)", phase))
    )
    return [
        (
            f"NODE, node {g} / one server unshuffled, that node's member's rows",
            (f"cluster/node/n{g}", "flightdeck"),
            (f"cluster/single-node-rows/n{g}", "flightdeck"),
        )
        for g in nodes
    ]


def median(values: list[float]) -> float:
    """The median by nearest rank, as the bench takes it (of an even count,
    the lower middle value): the one a run's `median_s` and ratios use."""
    return sorted(values)[(len(values) - 1) // 2]


def rates(result: dict) -> tuple[float, float]:
    """Median and best GB/s of payload for one phase and target."""
    size = result["payload_bytes"] / 1e9
    return size / median(result["runs_s"]), size / min(result["runs_s"])


def run_line(run: dict, name: str, what: str) -> str:
    """A run's first line: its file, commit, date and where it was measured
    (`N cores (CPU, family F model M, vector width, memory)`, with what the
    run recorded of it), then `what` it measured."""
    machine = run.get("machine", {})
    cpu = machine.get("cpu") or machine.get("arch", "?")
    if machine.get("cpu_family") is not None:
        cpu += f", family {machine['cpu_family']} model {machine.get('cpu_model', '?')}"
    if machine.get("vector"):
        cpu += f", {machine['vector']}"
    memory = machine.get("memory_bytes")
    memory = f", {memory / 2**30:.0f} GiB" if memory else ""
    commit = (run.get("commit") or "unknown")[:12]
    return (
        f"Run `{name}`: commit `{commit}`, {run.get('date', 'date unknown')}, "
        f"{machine.get('cores', '?')} cores ({cpu}{memory}); {what}."
    )


def render(run: dict, name: str) -> str:
    """The markdown for one run."""
    if run.get("bench") == "reader_throughput":
        return render_reader(run, name)
    shape = f"{run['rows']:,} rows × "
    if run.get("vector"):
        shape += f"(int64 label + fixed_size_list<float32>[{run['features']}])"
    elif run.get("list"):
        shape += f"(int64 label + list<float32> of {run['features']} values a row)"
    else:
        shape += f"(int64 label + {run['features']} float32 columns)"
    lines = [
        run_line(run, name, shape),
        "",
        "```sh",
        run["command"],
        "```",
        "",
        "| phase | target | median s | best s | GB/s (median) | GB/s (best) | runs s |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    found = {}
    for r in run["results"]:
        found[(r["phase"], r["target"])] = r
        median, best = rates(r)
        runs = " ".join(f"{s:.3f}" for s in r["runs_s"])
        lines.append(
            f"| {r['phase']} | {r['target']} | {r['median_s']:.3f} | {min(r['runs_s']):.3f} "
            f"| {median:.3f} | {best:.3f} | {runs} |"
        )
    ratios = [
        (label, rates(found[a]), rates(found[b]))
        for label, a, b in RATIOS + node_ratios(found)
        if a in found and b in found
    ]
    if ratios:
        lines += ["", "| ratio of rates | by median | best of each |", "| --- | ---: | ---: |"]
        for label, (am, ab), (bm, bb) in ratios:
            lines.append(f"| {label} | {am / bm:.2f}× | {ab / bb:.2f}× |")
    # The short reads' figure is each read's time, not a rate.
    short = [r for r in run["results"] if r["phase"].startswith("small/")]
    if short:
        lines += ["", "| short reads | target | p50 ms | p99 ms |", "| --- | --- | ---: | ---: |"]
        for r in short:
            lines.append(
                f"| {r['phase']} | {r['target']} | {r['latency_p50_ms']:.2f} | {r['latency_p99_ms']:.2f} |"
            )
    rss = run.get("ratios", {}).get("peak_rss_e2e_bytes")
    bound = run.get("ratios", {}).get("peak_rss_bound_bytes")
    if rss and bound:
        lines += ["", f"Server peak RSS through e2e: {rss / 1e9:.3f} GB (bound {bound / 1e9:.3f} GB)."]
    return "\n".join(lines) + "\n"


#: The reader bench's floor: the row every other row is a ratio of.
READER_FLOOR = "PyTorch, in-memory tensor"


def render_reader(run: dict, name: str) -> str:
    """The markdown for one run of `bench/reader_throughput.py`: each
    model's paths by median samples/s, their ratio to the floor (of the
    medians, and of each repetition to the same repetition's floor), the
    loop's wait for data as a share of its epoch, and the CPU seconds of the
    server's process and PyTorch's; then an epoch read alone."""
    where = "the Unix socket" if run.get("transport") == "unix" else "loopback TCP"
    device = run.get("device", "cpu")
    if run.get("device_name"):
        device += f" ({run['device_name']})"
    lines = [
        run_line(
            run,
            name,
            f"{run['rows']:,} rows × {run['dim']} float32, {run['classes']} classes, AdamW, "
            f"batch {run['batch_size']}, one epoch, {run['threads']} torch threads, "
            f"PyTorch on {device}, read over {where}; medians of {run['reps']} repetitions",
        ),
        "",
        "```sh",
        run["command"],
        "```",
        "",
        "| model | path | samples/s | of the floor | each repetition, of its floor "
        "| waiting for data | CPU s: server / PyTorch's process |",
        "| --- | --- | ---: | ---: | --- | ---: | ---: |",
    ]
    floors = {
        r["model"]: r["samples_per_s"] for r in run["results"] if r["path"] == READER_FLOOR
    }
    for r in run["results"]:
        model = f"MLP [{r['hidden']}]" if r["hidden"] else "linear"
        per_s = r["samples_per_s"]
        floor = floors.get(r["model"])
        if floor:
            of_floor = f"{median(per_s) / median(floor):.2f}×"
            each = " ".join(f"{a / b:.2f}" for a, b in zip(per_s, floor))
        else:
            of_floor, each = "—", "—"
        stall = f"{median(r['stall']) * 100:.0f} %" if r.get("stall") else "—"
        cpu = f"{median(r['cpu_server_s']):.2f} / {median(r['cpu_process_s']):.2f}"
        lines.append(
            f"| {model} | {r['path']} | {median(per_s) / 1e6:.2f} M | {of_floor} | {each} | {stall} | {cpu} |"
        )
    if run.get("alone"):
        lines += [
            "",
            "An epoch read alone (no model; `ShardedDataset`, prefetch=0, medians):",
            "",
            "| path | wall s | CPU s: this process | CPU s: server |",
            "| --- | ---: | ---: | ---: |",
        ]
        for r in run["alone"]:
            lines.append(
                f"| {r['path']} | {median(r['wall_s']):.3f} | {median(r['cpu_process_s']):.3f} "
                f"| {median(r['cpu_server_s']):.3f} |"
            )
    return "\n".join(lines) + "\n"


def regenerate(text: str) -> str:
    """`text` with every marked table rendered from its JSON."""

    def table(m: re.Match) -> str:
        path = m.group("path")
        run = json.loads((ROOT / path).read_text())
        return m.group(1) + render(run, Path(path).name) + m.group(4)

    return MARKED.sub(table, text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report stale tables, change nothing")
    args = parser.parse_args()
    stale = []
    for doc in DOCS:
        text = doc.read_text()
        fresh = regenerate(text)
        if fresh != text:
            stale.append(doc.relative_to(ROOT))
            if not args.check:
                doc.write_text(fresh)
    if args.check and stale:
        print(
            "stale benchmark tables in " + ", ".join(map(str, stale)) + "; run: python bench/tables.py",
            file=sys.stderr,
        )
        return 1
    for doc in stale:
        print(f"rewrote the tables of {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
