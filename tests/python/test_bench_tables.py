"""The benchmark figures in bench/RESULTS.md and README.md are the ones in
the runs' JSON files: `bench/tables.py` regenerates them, and its ratios
compare rates by median and by best run."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from conftest import REPO, scaled


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
