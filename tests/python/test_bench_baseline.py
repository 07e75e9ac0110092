"""The benchmark tool's pyarrow baseline serves the same workload as
flightdeck: same rows written, same equal shares read, in every mode."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO, scaled


def test_pyarrow_baseline_runs_the_same_workload(tmp_path):
    bench = REPO / "target" / "debug" / "flightdeck-bench"
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            str(bench), "--rows", "3000", "--features", "4", "--partitions", "3",
            "--ranks", "4", "--batch-rows", "256", "--reps", "1", "--phases", "put,get",
            "--baseline", "pyarrow", "--in-process", "--python", sys.executable,
            "--json", str(out),
        ],
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())["results"]
    by = {(r["phase"], r["target"]): r for r in results}
    for phase in ("put", "get/none", "get/global", "get/block"):
        assert by[(phase, "pyarrow")]["rows"] == by[(phase, "flightdeck")]["rows"], phase
    assert by[("get/global", "pyarrow")]["rows"] == 3000
