"""The benchmark figures in bench/RESULTS.md and README.md are the ones in
the runs' JSON files: `bench/tables.py` regenerates them, and its ratios
compare rates by median and by best run. `bench/reader_throughput.py`
runs end to end on a tiny dataset and writes the JSON its table comes
from."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

from conftest import REPO, require_torch, scaled, server_binary


def load_tables():
    spec = importlib.util.spec_from_file_location("tables", REPO / "bench" / "tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_documents_tables_match_the_runs():
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "tables.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert proc.returncode == 0, proc.stderr


def test_ratios_by_median_and_by_best():
    tables = load_tables()
    result = lambda phase, target, runs: {  # noqa: E731
        "phase": phase, "target": target, "runs_s": runs,
        "median_s": sorted(runs)[len(runs) // 2], "payload_bytes": 1_000_000_000,
    }
    run = {
        "command": "flightdeck-bench", "rows": 10, "features": 2, "commit": "abc",
        "date": "d", "machine": {"cores": 2},
        "results": [
            result("get/none", "flightdeck", [1.0, 2.0, 4.0]),
            result("get/global", "flightdeck", [2.0, 4.0, 8.0]),
        ],
    }
    text = tables.render(run, "r.json")
    # Rates: none 0.5 GB/s by median, 1.0 best; global 0.25 and 0.5.
    assert "| get global / get none | 0.50× | 0.50× |" in text
    assert "| get/none | flightdeck | 2.000 | 1.000 | 0.500 | 1.000 | 1.000 2.000 4.000 |" in text
    # Pairs without both sides are left out.
    assert "pyarrow" not in text
    marked = "x\n<!-- table bench/runs/full.json -->\nold\n<!-- end table -->\ny\n"
    fresh = tables.regenerate(marked)
    assert fresh.startswith("x\n<!-- table bench/runs/full.json -->\nRun `full.json`")
    assert fresh.endswith("<!-- end table -->\ny\n") and "old" not in fresh


def test_an_even_count_of_runs_has_the_benchs_median_in_every_column():
    # Two runs (a read's warm-up epochs): the bench's median is the lower
    # middle value by nearest rank, so the time and the rate agree.
    tables = load_tables()
    assert tables.median([2.0, 0.5]) == 0.5
    assert tables.median([4.0, 1.0, 3.0, 2.0]) == 2.0
    assert tables.median([3.0]) == 3.0
    result = {
        "phase": "get/none/first", "target": "flightdeck", "runs_s": [2.0, 0.5],
        "median_s": 0.5, "payload_bytes": 1_000_000_000,
    }
    run = {
        "command": "flightdeck-bench", "rows": 10, "features": 2, "commit": "abc",
        "date": "d", "machine": {"cores": 2}, "results": [result],
    }
    assert "| get/none/first | flightdeck | 0.500 | 0.500 | 2.000 | 2.000 | 2.000 0.500 |" in (
        tables.render(run, "r.json")
    )


def test_the_machine_line_names_the_cpus_family_model_and_vector_width():
    # Hosts sold under one model name differ (runs on two kinds of "AMD
    # EPYC" read differently); runs from before the fields say what they can.
    tables = load_tables()
    run = {
        "command": "flightdeck-bench", "rows": 10, "features": 2, "commit": "abc",
        "date": "d", "results": [],
        "machine": {
            "cores": 2, "cpu": "AMD EPYC", "cpu_family": "25", "cpu_model": "17",
            "vector": "AVX-512", "memory_bytes": 24 * 2**30,
        },
    }
    assert "2 cores (AMD EPYC, family 25 model 17, AVX-512, 24 GiB)" in tables.render(run, "r.json")
    run["machine"] = {"cores": 2, "cpu": "AMD EPYC"}
    assert "2 cores (AMD EPYC);" in tables.render(run, "r.json")


def test_short_reads_are_given_by_each_reads_time():
    # The small phase's figure is a read's latency; runs without it keep
    # their tables as they were.
    tables = load_tables()
    small = {
        "phase": "small/global", "target": "flightdeck", "runs_s": [0.2, 0.1],
        "median_s": 0.1, "payload_bytes": 1000, "latency_p50_ms": 0.5, "latency_p99_ms": 1.25,
    }
    run = {
        "command": "flightdeck-bench", "rows": 10, "features": 2, "commit": "abc",
        "date": "d", "machine": {"cores": 2}, "results": [small],
    }
    text = tables.render(run, "r.json")
    assert "| short reads | target | p50 ms | p99 ms |" in text
    assert "| small/global | flightdeck | 0.50 | 1.25 |" in text
    run["results"] = [dict(small, phase="get/none")]
    assert "short reads" not in tables.render(run, "r.json")


def test_a_reader_run_gives_each_path_against_the_floor_by_median_and_by_repetition():
    # `bench/reader_throughput.py --json`: the ratio to the floor of the
    # medians, and of each repetition to its own floor; paths without a
    # stall (the floor, compute alone) show none.
    tables = load_tables()
    row = lambda path, rates, stall=None: {  # noqa: E731
        "model": "linear", "hidden": 0, "path": path, "samples_per_s": rates, "stall": stall,
        "cpu_server_s": [0.1, 0.3, 0.2], "cpu_process_s": [1.0, 1.2, 1.1],
    }
    run = {
        "bench": "reader_throughput", "command": "python bench/reader_throughput.py", "commit": "abc",
        "date": "d", "machine": {"cores": 2}, "rows": 1000, "dim": 4, "classes": 3, "batch_size": 10,
        "threads": 2, "reps": 3, "transport": "tcp", "device": "cpu",
        "results": [
            row(tables.READER_FLOOR, [2e6, 1e6, 4e6]),
            row("PyTorch, FlightDeckIterableDataset prefetch=0", [1e6, 0.8e6, 3e6], [0.1, 0.3, 0.2]),
        ],
        "alone": [{"path": "shared memory", "wall_s": [0.3, 0.1, 0.2], "cpu_process_s": [0.01, 0.03, 0.02],
                   "cpu_server_s": [0.05, 0.04, 0.06]}],
    }
    text = tables.render(run, "reader.json")
    assert text.startswith("Run `reader.json`: commit `abc`, d, 2 cores (?); 1,000 rows × 4 float32")
    assert "read over loopback TCP; medians of 3 repetitions." in text
    assert "| linear | PyTorch, in-memory tensor | 2.00 M | 1.00× | 1.00 1.00 1.00 | — | 0.20 / 1.10 |" in text
    # Medians 1.0 M of 2.0 M; each repetition 0.5, 0.8, 0.75 of its floor.
    assert (
        "| linear | PyTorch, FlightDeckIterableDataset prefetch=0 | 1.00 M | 0.50× | 0.50 0.80 0.75 | 20 % "
        "| 0.20 / 1.10 |"
    ) in text
    assert "| shared memory | 0.200 | 0.020 | 0.050 |" in text
    run["transport"], run["device"], run["device_name"] = "unix", "cuda", "NVIDIA H200"
    assert "PyTorch on cuda (NVIDIA H200), read over the Unix socket" in tables.render(run, "r.json")


def test_the_python_benches_record_the_machine_as_the_rust_bench_does():
    spec = importlib.util.spec_from_file_location("synthetic", REPO / "bench" / "synthetic.py")
    synthetic = importlib.util.module_from_spec(spec)
    # Registered first: its dataclass looks its module up by name.
    sys.modules.setdefault("synthetic", synthetic)
    spec.loader.exec_module(synthetic)
    machine = synthetic.machine()
    assert set(machine) == {"cores", "arch", "cpu", "cpu_family", "cpu_model", "vector", "memory_bytes"}
    assert machine["cores"] >= 1
    commit = synthetic.commit()
    assert commit is None or len(commit.removesuffix("+dirty")) == 40


def test_the_reader_bench_runs_and_its_json_renders_as_it_printed(tmp_path):
    # A tiny run of `bench/reader_throughput.py` against the test binary:
    # every path of the model, each repetition recorded, and the table it
    # prints is the one `bench/tables.py` renders from its JSON.
    require_torch()
    out = tmp_path / "reader.json"
    proc = subprocess.run(
        [
            sys.executable, str(REPO / "bench" / "reader_throughput.py"), "--rows", "3000", "--dim", "4",
            "--batch-size", "256", "--models", "linear", "--reps", "2", "--bin", str(server_binary()),
            "--json", str(out),
        ],
        capture_output=True, text=True, timeout=scaled(300),
    )
    assert proc.returncode == 0, proc.stderr
    run = json.loads(out.read_text())
    paths = [r["path"] for r in run["results"]]
    assert paths[0] == "PyTorch, in-memory tensor" and len(paths) == 8, paths
    assert all(len(r["samples_per_s"]) == 2 and min(r["samples_per_s"]) > 0 for r in run["results"])
    assert [r["path"] for r in run["alone"]] == ["shared memory", "the socket"]
    assert run["rows"] == 3000 and run["machine"]["cores"] >= 1
    assert load_tables().render(run, "reader.json") in proc.stdout
    # Repetition progress goes to standard error, the table alone to output.
    assert "linear: repetition 2 of 2" in proc.stderr


def test_the_reader_bench_refuses_bad_arguments_before_starting_a_server(tmp_path):
    require_torch()  # the script imports it first
    for args, words in [
        (["--models", "cnn"], "--models: unknown cnn"),
        (["--reps", "0"], "--reps: give at least 1"),
        (["--json", str(tmp_path / "missing" / "r.json")], "--json: no folder"),
    ]:
        proc = subprocess.run(
            [sys.executable, str(REPO / "bench" / "reader_throughput.py"), "--bin", "/nonexistent", *args],
            capture_output=True, text=True, timeout=scaled(60),
        )
        assert proc.returncode == 2 and words in proc.stderr, (args, proc.stderr)
