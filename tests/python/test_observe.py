"""Observing a running server the way a cluster's tools do: Prometheus
scrapes `/metrics` (checked here with prometheus_client's OpenMetrics
parser against what the test did), and Kubernetes probes the standard gRPC
health service (checked with grpcio's health client and with `flightdeck
health`, the exec probe for TLS), which says NOT_SERVING while a drain lets
a read in flight finish."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request

import grpc
import numpy as np
import pyarrow as pa
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.openmetrics.parser import text_string_to_metric_families

import flightdeck
from conftest import RunningServer, eventually, make_test_certs, scaled, server_binary

FLIGHT_SERVICE = "arrow.flight.protocol.FlightService"


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of `/metrics`: (name, labels) → value."""
    with urllib.request.urlopen(url, timeout=scaled(10)) as response:
        assert response.headers["Content-Type"].startswith("application/openmetrics-text")
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def value(samples, name: str, **labels) -> float:
    key = (name, frozenset((k, str(v)) for k, v in labels.items()))
    assert key in samples, f"{name}{labels} not in the scrape: {sorted(k for k in samples if k[0] == name)}"
    return samples[key]


@pytest.fixture
def observed():
    server = RunningServer("--memory-limit", "256MiB", "--metrics-listen", "127.0.0.1:0")
    yield server
    assert server.stop() == 0, "".join(server.stderr_lines)


def test_metrics_count_what_a_put_seal_read_and_train_did(observed):
    assert observed.metrics_url and observed.metrics_url.endswith("/metrics")
    c = flightdeck.connect(observed.uri)
    rng = np.random.default_rng(3)
    sizes = [3000, 5000, 2000]
    acks = []
    for p, n in enumerate(sizes):
        x = rng.standard_normal((n, 4)).astype(np.float32)
        table = pa.table(
            {
                "x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 4),
                "y": pa.array((x[:, 0] > 0).astype(np.int64)),
            }
        )
        acks.append(c.put_partition("m", p, table))
    c.seal("m", partitions=3)
    total = sum(sizes)
    plan = c.plan("m", world_size=4, shuffle="global", seed=1, batch_rows=1000)
    rank_rows = [sum(b.num_rows for b in c.read_shard(shard)) for shard in plan.shards]
    assert sum(rank_rows) == total
    with pytest.raises(flightdeck.NotFound):
        c.describe("missing")
    reports = list(c.train("m", "x", "y", classes=2, batch_size=500, cpu_ranks=2, epochs=2))
    assert reports[-1].done

    m = scrape(observed.metrics_url)
    # Ingest: rows and bytes exactly as the acks said.
    assert value(m, "flightdeck_committed_rows_total", dataset="m") == total
    assert value(m, "flightdeck_committed_bytes_total", dataset="m") == sum(a.bytes for a in acks)
    assert value(m, "flightdeck_attempts_total", outcome="committed") == 3
    assert value(m, "flightdeck_seals_total") == 1
    assert value(m, "flightdeck_dataset_rows", dataset="m") == total
    assert value(m, "flightdeck_dataset_sealed", dataset="m") == 1
    # Calls: by method and code, with their durations.
    assert value(m, "flightdeck_calls_total", method="DoPut", code="OK") == 3
    assert value(m, "flightdeck_calls_total", method="DoGet", code="OK") == 4
    assert value(m, "flightdeck_calls_total", method="DoAction", code="NOT_FOUND") == 1
    assert value(m, "flightdeck_call_duration_seconds_count", method="DoPut") == 3
    assert value(m, "flightdeck_call_duration_seconds_count", method="DoGet") == 4
    assert value(m, "flightdeck_read_first_batch_seconds_count") == 4
    assert value(m, "flightdeck_active_calls", method="DoGet") == 0
    # Reads: each rank's rows, bytes and time.
    for rank, rows in enumerate(rank_rows):
        assert value(m, "flightdeck_rank_rows_served_total", dataset="m", rank=rank) == rows
        assert value(m, "flightdeck_rank_bytes_served_total", dataset="m", rank=rank) > 0
        assert value(m, "flightdeck_rank_read_seconds_total", dataset="m", rank=rank) > 0
    assert value(m, "flightdeck_rows_served_total") == total
    assert value(m, "flightdeck_bytes_served_total") == sum(
        value(m, "flightdeck_rank_bytes_served_total", dataset="m", rank=r) for r in range(4)
    )
    # Memory and the budget.
    assert value(m, "flightdeck_memory_limit_bytes") == 256 << 20
    assert 0 < value(m, "flightdeck_memory_used_bytes") <= 256 << 20
    assert value(m, "flightdeck_memory_bytes", tier="live") >= sum(a.bytes for a in acks)
    assert value(m, "flightdeck_memory_bytes", tier="spilled") == 0
    assert value(m, "flightdeck_datasets") == 1
    # The training job, labelled by its id.
    steps = 2 * (total // 500)
    job = {"job": reports[-1].job, "dataset": "m"}
    assert value(m, "flightdeck_job_step", **job) == steps
    assert value(m, "flightdeck_job_running", **job) == 0
    assert value(m, "flightdeck_job_samples_per_second", **job) > 0
    assert 0 <= value(m, "flightdeck_job_data_stall_fraction", **job) <= 1
    assert value(m, "flightdeck_job_step_seconds", **job) > 0


def test_a_dropped_datasets_series_go_with_it(observed):
    """A dataset's per-dataset and per-rank series leave the scrape when it
    is dropped (a server that writes a dataset a day and drops old ones
    kept series for every one it ever held); the others' stay."""
    c = flightdeck.connect(observed.uri)
    for name in ("day-1", "day-2"):
        c.put_partition(name, 0, pa.table({"x": pa.array(np.arange(100, dtype=np.float32))}))
        c.seal(name)
        for shard in c.plan(name, world_size=3).shards:
            c.read_table(shard)

    def series(name):
        return sorted(k for k in scrape(observed.metrics_url) if ("dataset", name) in k[1])

    kept = series("day-2")
    assert len(series("day-1")) == len(kept) > 0
    assert value(scrape(observed.metrics_url), "flightdeck_rank_rows_served_total",
                 dataset="day-1", rank=2) == 34  # 100 rows, 3 equal shares
    c.drop("day-1")
    assert series("day-1") == []
    assert series("day-2") == kept


def test_metrics_show_the_newest_ended_jobs(observed):
    """`/metrics` shows the 16 newest ended training jobs (and every running
    one), not each job the server ever ran; `flightdeck jobs` lists all."""
    c = flightdeck.connect(observed.uri)
    x = np.arange(64, dtype=np.float32)
    c.put_partition("j", 0, pa.table({"x": x, "y": (x % 2).astype(np.int64)}))
    c.seal("j")
    ids = [list(c.train("j", ["x"], "y", classes=2, batch_size=16, max_steps=1))[-1].job
           for _ in range(18)]
    shown = {dict(k[1])["job"] for k in scrape(observed.metrics_url) if k[0] == "flightdeck_job_step"}
    assert shown == {str(i) for i in ids[-16:]}
    assert len(c.jobs()) == 18


def test_every_call_is_one_log_line_and_json_logs_parse():
    server = RunningServer("--log-format", "json")
    try:
        c = flightdeck.connect(server.uri)
        c.put_partition("j", 0, pa.table({"id": pa.array(range(100), pa.int64())}))
        c.seal("j")
        [shard] = c.plan("j").shards
        assert sum(b.num_rows for b in c.read_shard(shard)) == 100
    finally:
        assert server.stop() == 0, "".join(server.stderr_lines)
    events = [json.loads(line) for line in server.stderr_lines if line.strip()]
    calls = [e for e in events if e.get("message") == "call"]
    [read] = [e for e in calls if e["method"] == "DoGet"]
    assert read["dataset"] == "j" and read["rank"] == 0 and read["rows"] == 100
    assert read["code"] == "OK" and read["ms"] >= 0 and read["peer"].startswith("127.0.0.1:")
    [put] = [e for e in calls if e["method"] == "DoPut"]
    assert put["code"] == "OK" and put["dataset"] == "j" and put["partition"] == 0
    assert put["attempt"] == 0 and put["rows"] == 100 and put["bytes"] > 0
    assert all(e["level"] in ("INFO", "WARN", "ERROR", "DEBUG") for e in events)


def health_status(addr: str, service: str = "") -> int:
    with grpc.insecure_channel(addr) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=scaled(5)).status


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_health_says_not_serving_while_a_drain_finishes_a_read(sig):
    """On SIGTERM (Kubernetes) or SIGINT (Ctrl-C): health says NOT_SERVING,
    a new caller is turned away, the read under way gets its last row, and
    the server exits 0."""
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    rows = 3_000_000  # 24 MB: more than the windows hold, still sending at SIGTERM
    server = RunningServer("--default-batch-rows", "10000")
    try:
        assert health_status(server.addr) == serving
        assert health_status(server.addr, FLIGHT_SERVICE) == serving
        with flightdeck.connect(server.uri) as c:
            c.put_partition("d", 0, pa.table({"id": pa.array(np.arange(rows, dtype=np.int64))}))
            c.seal("d")
            [shard] = c.plan("d").shards
            batches = c.read_shard(shard)
            seen = [next(batches).column("id")]
            server.proc.send_signal(sig)
            eventually(
                "health to say NOT_SERVING",
                lambda: True if health_status(server.addr) == not_serving else None,
            )
            assert health_status(server.addr, FLIGHT_SERVICE) == not_serving
            probe = health_command(server.addr)
            assert probe.returncode == 1 and probe.stdout == "NOT_SERVING\n", probe
            assert "is not serving" in probe.stderr, probe
            with pytest.raises(flightdeck.Unavailable, match="shutting down"):
                with flightdeck.connect(server.uri, timeout=5) as other:
                    other.stats()
            assert server.proc.poll() is None, "".join(server.stderr_lines)
            seen += [b.column("id") for b in batches]
            ids = pa.chunked_array(seen).to_numpy()
            assert len(ids) == rows and (ids == np.arange(rows)).all()
        server.proc.wait(timeout=scaled(30))
        assert server.proc.returncode == 0, "".join(server.stderr_lines)
        assert any(f"{sig.name} received" in line for line in server.stderr_lines)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()


def health_command(server: str, *flags: str, env: dict | None = None):
    """`flightdeck health --server SERVER`, as an exec probe runs it."""
    return subprocess.run(
        [str(server_binary()), "health", "--server", server, *flags],
        capture_output=True, text=True, timeout=scaled(30), env=env,
    )


def test_the_health_command_probes_where_the_kubelet_cannot(tmp_path):
    """The kubelet's gRPC probe speaks plaintext TCP only: a server on TLS
    (or a Unix socket) is probed by `flightdeck health` as an exec probe —
    SERVING exits 0 with no token; no server, or one that does not answer
    within --timeout, exits 1 saying so, in bounded time."""
    certs = make_test_certs(tmp_path)
    tokens = tmp_path / "tokens"
    tokens.write_text("writer health-test-writer-token\n")
    sock = tmp_path / "fd.sock"
    server = RunningServer(
        "--tls-cert", str(certs["cert"]), "--tls-key", str(certs["key"]),
        "--auth-token-file", str(tokens), "--unix-socket", str(sock),
    )
    env = {k: v for k, v in os.environ.items() if k != "FLIGHTDECK_TOKEN"}
    try:
        for where in (f"grpc+tls://{server.addr}", f"grpc+unix://{sock}"):
            probe = health_command(where, env={**env, "FLIGHTDECK_TLS_ROOT_CERTS": str(certs["ca"])})
            assert probe.returncode == 0 and probe.stdout == "SERVING\n", probe
    finally:
        assert server.stop() == 0, "".join(server.stderr_lines)
    probe = health_command(server.addr, env=env)
    assert probe.returncode == 1 and "cannot reach" in probe.stderr, probe
    # A port that takes connections and never answers: bounded by --timeout.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        started = time.monotonic()
        probe = health_command(f"127.0.0.1:{port}", "--timeout", "1s", env=env)
        assert time.monotonic() - started < scaled(20)
    assert probe.returncode == 1 and "within 1s" in probe.stderr, probe


def test_health_answers_probes_without_a_token(tmp_path):
    """Kubernetes probes carry no token: health answers them on a server
    whose every Flight call needs one."""
    tokens = tmp_path / "tokens"
    tokens.write_text("reader probe-test-reader-token\nwriter probe-test-writer-token\n")
    server = RunningServer("--auth-token-file", str(tokens))
    try:
        assert health_status(server.addr) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(flightdeck.Unauthenticated):
            with flightdeck.connect(server.uri, token="") as c:
                c.stats()
    finally:
        assert server.stop() == 0, "".join(server.stderr_lines)


def test_metrics_show_a_spill_and_a_restore():
    server = RunningServer("--memory-limit", "16MiB", "--metrics-listen", "127.0.0.1:0")
    try:
        c = flightdeck.connect(server.uri)
        rows = 1_500_000  # 12 MB: two do not fit in 16 MiB
        for name in ("a", "b"):
            c.put_partition(name, 0, pa.table({"id": pa.array(np.arange(rows, dtype=np.int64))}))
            c.seal(name)
        m = scrape(server.metrics_url)
        assert value(m, "flightdeck_spills_total") == 1
        assert value(m, "flightdeck_spill_duration_seconds_count") == 1
        assert value(m, "flightdeck_spilled_datasets") == 1
        assert value(m, "flightdeck_memory_bytes", tier="spilled") == c.describe("a").bytes
        [shard] = c.plan("a").shards
        assert sum(b.num_rows for b in c.read_shard(shard)) == rows
        m = scrape(server.metrics_url)
        assert value(m, "flightdeck_restores_total") == 1
        assert value(m, "flightdeck_restore_duration_seconds_count") == 1
    finally:
        assert server.stop() == 0, "".join(server.stderr_lines)


def test_metrics_show_the_spill_store_tended(tmp_path):
    """The spill files a killed server left (here: a session folder without
    a record, last written an hour ago) are removed by the next server on
    the store and counted. A server started with --persist rewrites its
    record every 10 s and counts it; with the store gone it counts the
    failure — what to alert on before the next spill or persist fails."""
    store = tmp_path / "store"
    left = store / "spill" / "1-1" / "d" / "1" / "data.parquet"
    left.parent.mkdir(parents=True)
    left.write_bytes(b"PAR1")
    an_hour_ago = time.time() - 3600
    os.utime(left, (an_hour_ago, an_hour_ago))
    server = RunningServer("--persist", "--spill-url", str(store), "--metrics-listen", "127.0.0.1:0")

    def counted(name: str, at_least: float, **labels):
        def probe():
            m = scrape(server.metrics_url)
            key = (name, frozenset((k, str(v)) for k, v in labels.items()))
            return True if m.get(key, 0) >= at_least else None
        return probe

    try:
        eventually("the left spill folder removed",
                   counted("flightdeck_stopped_sessions_removed_total", 1))
        assert not left.exists()
        assert (store / "datasets" / "server.json").exists()
        eventually("a beat", counted("flightdeck_store_beats_total", 1, outcome="ok"))
        shutil.rmtree(store)
        store.write_text("in the way")
        eventually("a failed beat", counted("flightdeck_store_beats_total", 1, outcome="failed"))
        store.unlink()
    finally:
        assert server.stop() == 0, "".join(server.stderr_lines)


def test_metrics_show_a_packed_copy_built_once_for_shuffled_epochs():
    """A dataset's shuffled reads wait for its packed copy once: the build
    is observed (count and seconds) at the second shuffled epoch, and the
    epochs after it read the same copy without building again."""
    server = RunningServer("--metrics-listen", "127.0.0.1:0")
    try:
        c = flightdeck.connect(server.uri)
        rows = 20_000
        features = {f"f{i}": pa.array(np.full(rows, i, dtype=np.float32)) for i in range(4)}
        c.put_partition("d", 0, pa.table({"id": pa.array(np.arange(rows, dtype=np.int64)), **features}))
        c.seal("d")

        def epoch(e: int) -> None:
            plan = c.plan("d", world_size=2, epoch=e, seed=5, shuffle="global")
            ids = [b.column("id") for s in plan.shards for b in c.read_shard(s)]
            assert sorted(pa.chunked_array(ids).to_numpy()) == list(range(rows))

        builds = []
        for e in range(4):
            epoch(e)
            m = scrape(server.metrics_url)
            builds.append(value(m, "flightdeck_pack_duration_seconds_count"))
            packed = value(m, "flightdeck_memory_bytes", tier="packed")
        assert builds == [0, 1, 1, 1]
        assert value(m, "flightdeck_pack_duration_seconds_sum") > 0
        assert packed == rows * (8 + 4 * 4)
    finally:
        assert server.stop() == 0, "".join(server.stderr_lines)


def test_an_overwrite_under_way_shows_what_it_staged(observed):
    c = flightdeck.connect(observed.uri)
    c.put_partition("o", 0, pa.table({"v": pa.array(range(100), pa.int64())}))
    c.seal("o")
    staged = c.put_partition(
        "o", 0, pa.table({"v": pa.array(range(5000), pa.int64())}), write_id="w", replace=True
    )
    m = scrape(observed.metrics_url)
    assert value(m, "flightdeck_overwrite_staged_bytes", dataset="o") == staged.bytes
    assert value(m, "flightdeck_datasets") == 1
    assert value(m, "flightdeck_dataset_rows", dataset="o") == 100
    c.seal("o", replace_write="w")
    m = scrape(observed.metrics_url)
    assert not [k for k in m if k[0] == "flightdeck_overwrite_staged_bytes"]
    assert value(m, "flightdeck_dataset_rows", dataset="o") == 5000


def test_operator_commands_give_up_on_a_server_that_does_not_answer():
    """`flightdeck stats` against a port that takes connections and never
    answers, and against one whose connections are never taken (a host
    dropping packets): each fails within a bound, saying so, instead of
    hanging (the first forever, the second for the two minutes TCP gives
    up after). `sql` and `train` against the silent port say the same."""
    with socket.socket() as silent, socket.socket() as full:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        # A backlog of one, filled and never accepted: later connections'
        # SYNs go unanswered, as from a host that drops them.
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        filling = []
        for _ in range(3):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(full.getsockname())
            filling.append(s)
        started = time.monotonic()
        at = [f"127.0.0.1:{sock.getsockname()[1]}" for sock in (silent, full)]
        commands = [
            ["stats", "--server", at[0]],
            ["stats", "--server", at[1]],
            ["sql", "--server", at[0], "SELECT 1"],
            ["train", "--server", at[0], "--dataset", "d", "--features", "x", "--label", "y",
             "--classes", "2"],
        ]
        probes = [
            subprocess.Popen([str(server_binary()), *command],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for command in commands
        ]
        try:
            said = [p.communicate(timeout=scaled(90))[1] for p in probes]
        finally:
            for p in probes:
                p.kill()
            for s in filling:
                s.close()
        assert time.monotonic() - started < scaled(60)
    assert [p.returncode for p in probes] == [1] * len(commands), said
    for silent_said in (said[0], *said[2:]):
        assert f"{at[0]} (grpc://{at[0]}) did not answer" in silent_said, silent_said
        assert "keep-alive timed out" in silent_said, silent_said
    assert "cannot reach" in said[1] and "deadline has elapsed" in said[1], said[1]
