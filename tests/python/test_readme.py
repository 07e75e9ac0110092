"""Every Python block of the README runs as written, in order, against a
fresh server that `local` names (`FLIGHTDECK_URI`): `>>>` sessions as
doctests (their printed results checked), other blocks as scripts. A block
that needs what this machine lacks (a Spark cluster, GPUs,
torch.distributed) is marked `<!-- not run by the README test: why -->` on
the line before it; any other block must run. Then the shell blocks that
use the server (`flightdeck train …`, `flightdeck datasets`, …) run against
it, with the built binary on `PATH`, every command of a block required to
succeed; the others build, serve or benchmark, which the test command does
itself."""

from __future__ import annotations

import doctest
import io
import os
import re
import subprocess
from pathlib import Path

from conftest import RunningServer, scaled, server_binary

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCK = re.compile(r"(?P<before>[^\n]*)\n```python\n(?P<code>.*?)\n```", re.S)
NOT_RUN = re.compile(r"<!-- not run by the README test: (?P<why>.+?) -->")
SHELL = re.compile(r"\n```sh\n(?P<code>flightdeck .*?)\n```", re.S)


def python_blocks() -> list[tuple[int, str, str | None]]:
    """Each block: its first line in the README, its code, and why it is not
    run (None: it runs)."""
    text = README.read_text()
    out = []
    for m in BLOCK.finditer(text):
        line = text.count("\n", 0, m.start("code")) + 1
        mark = NOT_RUN.search(m.group("before"))
        out.append((line, m.group("code"), mark.group("why") if mark else None))
    return out


def test_every_python_block_of_the_readme_runs_as_written(tmp_path, monkeypatch):
    blocks = python_blocks()
    assert len(blocks) >= 6, "the README's Python blocks were not found"
    server = RunningServer(
        "--memory-limit", "512MiB", "--spill-url", str(tmp_path / "store"),
        "--checkpoint-root", str(tmp_path / "checkpoints"),
    )
    try:
        monkeypatch.setenv("FLIGHTDECK_URI", server.uri)
        names: dict = {}
        ran = []
        for line, code, why in blocks:
            if why is not None:
                continue
            where = f"README.md:{line}"
            if code.lstrip().startswith(">>>"):
                test = doctest.DocTestParser().get_doctest(code, names, where, str(README), line)
                runner = doctest.DocTestRunner(
                    optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
                )
                report = io.StringIO()
                runner.run(test, out=report.write, clear_globs=False)
                assert runner.failures == 0, f"{where}:\n{report.getvalue()}"
                names.update(test.globs)  # later blocks use what a session made
            else:
                exec(compile(code, where, "exec"), names)
            ran.append(line)
        assert len(ran) >= 2, ran
        commands = [m.group("code") for m in SHELL.finditer(README.read_text())]
        assert commands, "the README's flightdeck commands were not found"
        path = f"{server_binary().parent}{os.pathsep}{os.environ['PATH']}"
        for command in commands:
            run = subprocess.run(
                ["bash", "-e", "-c", command], env={**os.environ, "PATH": path},
                capture_output=True, text=True, timeout=scaled(300),
            )
            assert run.returncode == 0, f"{command}\n{run.stderr}"
    finally:
        assert server.stop() == 0
