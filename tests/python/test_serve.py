"""`flightdeck serve` as its flags say: `--default-batch-rows` sizes the
batches of a plan that asks for none, `--no-cuda` leaves the GPU alone
whatever the machine has, a bad flag is refused with the reason, and a
server that cannot start says why without first saying it listens; in a
container, the default budget is half its memory limit. (What
SIGINT and SIGTERM do is tested with the health service, in
test_observe.py.)"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import flightdeck
from conftest import RunningServer, scaled, server_binary


def write(client: flightdeck.Client, name: str, rows: int) -> None:
    t = pa.table(
        {
            "id": pa.array(np.arange(rows, dtype=np.int64)),
            "x": pa.array(np.linspace(-1, 1, rows, dtype=np.float32)),
        }
    )
    half = rows // 2
    client.put_partition(name, 0, t.slice(0, half))
    client.put_partition(name, 1, t.slice(half))
    client.seal(name, partitions=2)


def test_default_batch_rows_sizes_a_plan_that_says_none():
    server = RunningServer("--default-batch-rows", "1000")
    try:
        with flightdeck.connect(server.uri) as c:
            write(c, "d", 10_500)
            [shard] = c.plan("d").shards
            assert [b.num_rows for b in c.read_shard(shard)] == [1000] * 10 + [500]
            # A plan's own batch size wins.
            [shard] = c.plan("d", batch_rows=4000).shards
            assert [b.num_rows for b in c.read_shard(shard)] == [4000, 4000, 2500]
    finally:
        assert server.stop() == 0, "".join(server.stderr_lines)


def test_no_cuda_leaves_the_gpu_alone():
    server = RunningServer("--no-cuda")
    try:
        with flightdeck.connect(server.uri) as c:
            write(c, "d", 100)
            stats = c.stats()
            assert stats.cuda_devices == 0 and not stats.host_pinned
            # Said the same on a machine with GPUs and on one without.
            with pytest.raises(flightdeck.FailedPrecondition, match="started with --no-cuda"):
                c.place("d", ["x"])
            with pytest.raises(flightdeck.FailedPrecondition, match="started with --no-cuda"):
                list(c.train("d", ["x"], "id", gpus=[0]))
    finally:
        assert server.stop() == 0, "".join(server.stderr_lines)


def test_a_bad_flag_is_refused_with_the_reason():
    run = subprocess.run(
        [str(server_binary()), "serve", "--default-batch-rows", "many"],
        capture_output=True, text=True, timeout=scaled(30),
    )
    assert run.returncode == 2
    assert "--default-batch-rows" in run.stderr and "many" in run.stderr


@pytest.mark.parametrize(
    "flags, reason",
    [
        (["--spill-url", "bogus://x"], "--spill-url 'bogus://x' is not usable"),
        (["--tls-cert", "/nonexistent/cert.pem", "--tls-key", "/nonexistent/key.pem"], "/nonexistent/cert.pem"),
    ],
)
def test_a_server_that_cannot_start_never_says_it_is_listening(flags, reason):
    """A spill store or TLS files the server cannot use end it with the
    reason — before the "listening" line scripts wait for, which would tell
    them a server is there when none will be."""
    run = subprocess.run(
        [str(server_binary()), "serve", "--listen", "127.0.0.1:0", "--no-cuda", *flags],
        capture_output=True, text=True, timeout=scaled(30),
    )
    assert run.returncode == 1, run.stderr
    assert "cannot start" in run.stderr and reason in run.stderr, run.stderr
    assert "listening" not in run.stdout, run.stdout


def memory_cgroup(tmp_name: str, limit: int):
    """A cgroup (v2, else v1's memory hierarchy) limited to `limit` bytes,
    as a container runtime makes one: its `cgroup.procs` file, or None
    where this machine gives no writable cgroup file system (not root)."""
    for root, limit_file in (
        (Path("/sys/fs/cgroup"), "memory.max"),
        (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),
    ):
        group = root / tmp_name
        if not (root / "cgroup.procs").exists():
            continue  # not a cgroup file system (a tmpfs holding v1's)
        try:
            group.mkdir()
        except OSError:
            continue
        try:
            (group / limit_file).write_text(str(limit))
            return group
        except OSError:
            group.rmdir()
    return None


def test_the_default_budget_fits_the_container_and_a_larger_one_is_refused():
    """In a container (a pod's memory limit, `docker run --memory`) the
    machine's memory is not what the server may use: past its cgroup's
    limit the kernel kills it, and its cache with it. The default budget is
    half that limit, and a --memory-limit above it is refused at start with
    the reason. (Before, the default was half the machine's memory.)"""
    group = memory_cgroup(f"flightdeck-test-{os.getpid()}", 2 << 30)
    if group is None:
        pytest.skip("no writable cgroup file system here to run a server inside a memory limit")
    join = f"echo $$ > {group / 'cgroup.procs'} && exec \"$0\" \"$@\""
    try:
        refused = subprocess.run(
            ["sh", "-c", join, str(server_binary()), "serve", "--listen", "127.0.0.1:0",
             "--no-cuda", "--memory-limit", "4GiB"],
            capture_output=True, text=True, timeout=scaled(30),
        )
        assert refused.returncode == 1, refused.stderr
        assert "--memory-limit 4.0GiB is more than this server's container may use (2.0GiB" \
            in refused.stderr, refused.stderr
        proc = subprocess.Popen(
            ["sh", "-c", join, str(server_binary()), "serve", "--listen", "127.0.0.1:0",
             "--no-cuda", "--spill-url", "memory://"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith("flightdeck listening on "), line
            with flightdeck.connect("grpc://" + line.split()[-1]) as c:
                assert c.stats().memory_limit == 1 << 30
        finally:
            proc.terminate()
            proc.wait(timeout=scaled(15))
    finally:
        group.rmdir()
