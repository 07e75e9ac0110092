"""What the training benchmarks share: a release server on a free port (or
its Unix domain socket), and
a synthetic, learnable classification dataset written to it.

The dataset: `rows` × `dim` float32 features as one fixed_size_list column
`features`, and a label `label` = the arg-max of a random linear map of the
features (so a model can learn it), in 8 partitions, sealed as `bench`.
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "client" / "python"))
import flightdeck  # noqa: E402

#: The release server the benchmarks start by default.
SERVER_BIN = str(REPO / "target" / "release" / "flightdeck")


def machine() -> dict:
    """The machine a run is measured on, with the fields `flightdeck-bench`
    records: cores, architecture, CPU model (with its family and model
    numbers and widest vector extension, since hosts sold under one model
    name differ) and memory."""

    def read(path: str) -> str:
        try:
            return Path(path).read_text()
        except OSError:
            return ""

    # The first processor's `key : value` lines.
    first = read("/proc/cpuinfo").split("\n\n")[0]
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first.splitlines())}
    flags = fields.get("flags", "").split()
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None
    memory = next(
        (int(line.split()[1]) * 1024 for line in read("/proc/meminfo").splitlines() if line.startswith("MemTotal:")),
        None,
    )
    return {
        "cores": os.cpu_count(),
        "arch": platform.machine(),
        "cpu": fields.get("model name"),
        "cpu_family": fields.get("cpu family"),
        "cpu_model": fields.get("model"),
        "vector": vector,
        "memory_bytes": memory,
    }


def commit() -> str | None:
    """The repository's commit, with `+dirty` when tracked files have
    changes (as `flightdeck-bench` records its build's); None outside git."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True)
        except (OSError, subprocess.CalledProcessError):
            return None
        return out.stdout.strip()

    head = git("rev-parse", "HEAD")
    if head and git("status", "--porcelain", "--untracked-files=no"):
        head += "+dirty"
    return head


@dataclass(frozen=True)
class Server:
    """A running server: where to reach it and its process."""

    #: `grpc://HOST:PORT`, or `grpc+unix:///PATH` on its Unix socket.
    uri: str
    pid: int

    def cpu_seconds(self) -> float:
        """CPU time the server's process has used so far (user and system,
        every thread), from `/proc`."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def server(bin: str = SERVER_BIN, unix: bool = False) -> Iterator[Server]:
    """A server with an in-memory spill store, reached at `grpc://HOST:PORT`
    (with `unix`, on a Unix domain socket, at `grpc+unix:///PATH`); stopped
    on exit."""
    with tempfile.TemporaryDirectory(prefix="flightdeck-bench-") as folder:
        socket = Path(folder) / "fd.sock"
        extra = ["--unix-socket", str(socket)] if unix else []
        proc = subprocess.Popen(
            [bin, "serve", "--listen", "127.0.0.1:0", "--memory-limit", "8GiB", "--spill-url", "memory://", *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            assert proc.stdout is not None
            tcp = "grpc://" + proc.stdout.readline().split()[-1]
            yield Server(f"grpc+unix://{socket}" if unix else tcp, proc.pid)
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def write_dataset(uri: str, rows: int, dim: int, classes: int) -> tuple[np.ndarray, np.ndarray]:
    """Writes and seals `bench` on `uri`; returns its features and labels."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((dim, classes)).astype(np.float32)
    x = rng.standard_normal((rows, dim)).astype(np.float32)
    y = (x @ w).argmax(1).astype(np.int64)
    table = pa.table(
        {"features": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), dim), "label": pa.array(y)}
    )
    client = flightdeck.connect(uri)
    part = -(-rows // 8)
    for p in range(8):
        client.put_partition("bench", p, table.slice(p * part, part))
    client.seal("bench", partitions=8)
    return x, y
