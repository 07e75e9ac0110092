"""Fixtures for the Python end-to-end tests.

`flightdeck_server` starts the real server binary (built by cargo) on a free
loopback port and stops it afterwards; `pb` compiles `protos/flightdeck.proto`
with grpcio-tools at test time, so these tests use nothing but `pyarrow.flight`
and the proto, like any third-party client would.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def scaled(seconds: float) -> float:
    """`seconds` times `FLIGHTDECK_TEST_TIME_SCALE` (default 1): every
    wall-clock bound in the tests goes through it, so a slower machine
    scales them all with one variable instead of failing."""
    try:
        scale = float(os.environ.get("FLIGHTDECK_TEST_TIME_SCALE", "1"))
    except ValueError:
        scale = 1.0
    return seconds * (scale if scale > 0 else 1.0)


START_TIMEOUT_S = scaled(30)


def eventually(what: str, probe, timeout: float = 30.0):
    """Waits until `probe()` returns something other than None and returns
    it, asking again after a pause that grows from 5 ms to 100 ms, within
    `scaled(timeout)` seconds; fails naming `what` otherwise. For server
    state no call waits on (live bytes): a change is seen within a pause."""
    import time

    deadline = time.monotonic() + scaled(timeout)
    pause = 0.005
    while True:
        found = probe()
        if found is not None:
            return found
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {scaled(timeout):.0f} s")
        time.sleep(pause)
        pause = min(pause * 2, 0.1)


def require_torch():
    """torch, imported; where it is not installed the calling test is
    skipped, except under CI (`CI` set), where the test environment installs
    it (`tests/python/requirements.txt`) and a missing torch is a failure,
    not a skip."""
    if os.environ.get("CI"):
        import torch

        return torch
    return pytest.importorskip("torch")


def server_name_cases() -> list[tuple[str, str | None, str]]:
    """`tests/server_names.tsv`, the table every client's parser of server
    names is tested with: (name, FLIGHTDECK_URI or None, location or
    "error")."""
    table = REPO / "tests" / "server_names.tsv"
    cases = []
    for line in table.read_text().splitlines():
        if line.startswith("#"):
            continue
        name, local, want = line.split("\t")
        cases.append((name, None if local == "-" else local, want))
    assert len(cases) >= 30
    return cases


def strided_order(per_rank: list[list], count: int | None = None) -> list:
    """The epoch order behind strided shards: global position q is the
    sample q // W of rank q % W. `count` defaults to every sample."""
    w = len(per_rank)
    count = sum(len(r) for r in per_rank) if count is None else count
    return [per_rank[q % w][q // w] for q in range(count)]


def torchrun(script: Path, node_servers: list[str], ranks_per_node: int, env=None) -> list[dict]:
    """Runs `script` as torchrun starts a job's ranks (`ranks_per_node` on
    each node, node `n`'s `FLIGHTDECK_URI` its server `node_servers[n]`,
    a gloo rendezvous on loopback) and gives the JSON object each rank
    printed last, in rank order; a rank that fails fails the test."""
    import json
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = ranks_per_node * len(node_servers)
    procs = []
    for rank in range(world):
        node = rank // ranks_per_node
        rank_env = dict(
            os.environ, **(env or {}), RANK=str(rank), WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank % ranks_per_node), LOCAL_WORLD_SIZE=str(ranks_per_node),
            GROUP_RANK=str(node), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            FLIGHTDECK_URI=node_servers[node],
        )
        procs.append(subprocess.Popen([sys.executable, str(script)], env=rank_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=scaled(300))
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def server_binary() -> Path:
    path = Path(os.environ.get("FLIGHTDECK_BIN", REPO / "target" / "debug" / "flightdeck"))
    if not path.exists():
        pytest.fail(f"server binary {path} not found: run `cargo build --bin flightdeck` first")
    return path


class RunningServer:
    """A `flightdeck serve` child process on 127.0.0.1:<free port>."""

    def __init__(self, *extra_args: str) -> None:
        if "--spill-url" not in extra_args:
            # Spills stay in memory: tests leave no files behind.
            extra_args = (*extra_args, "--spill-url", "memory://")
        # A given `--listen` (a restart on the port it had) replaces the default.
        listen = () if "--listen" in extra_args else ("--listen", "127.0.0.1:0")
        self.proc = subprocess.Popen(
            [str(server_binary()), "serve", *listen, *extra_args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stderr_lines: list[str] = []
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        #: http://HOST:PORT/metrics with `--metrics-listen`.
        self.metrics_url: str | None = None
        metrics = any(a.split("=", 1)[0] == "--metrics-listen" for a in extra_args)
        self.addr = self._wait_for_address(metrics=metrics)
        self.uri = f"grpc://{self.addr}"
        self.checkpoint_root: Path | None = None

    def _drain_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr_lines.append(line)

    def _wait_for_address(self, metrics: bool) -> str:
        found: list[str] = []

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                if line.startswith("flightdeck listening on "):
                    found.append(line.split()[-1])
                    if not metrics:
                        return
                elif line.startswith("flightdeck metrics on "):
                    self.metrics_url = line.split()[-1]
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(START_TIMEOUT_S)
        if not found:
            self.proc.kill()
            raise RuntimeError(
                "flightdeck did not report its address in time:\n" + "".join(self.stderr_lines)
            )
        return found[0]

    def stop(self) -> int:
        """SIGTERM, then wait for a graceful exit; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=scaled(15))
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture
def flightdeck_server(tmp_path):
    root = tmp_path / "checkpoints"
    server = RunningServer("--memory-limit", "512MiB", "--checkpoint-root", str(root))
    server.checkpoint_root = root
    yield server
    code = server.stop()
    assert code == 0, "server did not shut down cleanly:\n" + "".join(server.stderr_lines)


@pytest.fixture
def members():
    """Three members, each its own process; always stopped, logs kept (a
    member the test killed itself is not asked for a clean exit)."""
    servers = []
    try:
        for _ in range(3):
            servers.append(RunningServer("--memory-limit", "256MiB"))
        yield servers
    finally:
        for s in servers:
            killed = s.proc.poll() is not None  # by the test itself
            code = s.stop()
            assert killed or code == 0, "member did not stop cleanly:\n" + "".join(s.stderr_lines)


@pytest.fixture(scope="session")
def pb(tmp_path_factory):
    """`flightdeck_pb2`, compiled from protos/flightdeck.proto right now."""
    from grpc_tools import protoc

    out = tmp_path_factory.mktemp("proto")
    proto_dir = REPO / "protos"
    args = [
        "protoc",
        f"-I{proto_dir}",
        f"-I{Path(protoc.__file__).parent / '_proto'}",
        f"--python_out={out}",
        str(proto_dir / "flightdeck.proto"),
    ]
    if protoc.main(args) != 0:
        pytest.fail("grpcio-tools could not compile protos/flightdeck.proto")
    sys.path.insert(0, str(out))
    try:
        return importlib.import_module("flightdeck_pb2")
    finally:
        sys.path.remove(str(out))


#: A Spark column of every type the connectors carry, as `selectExpr`
#: expressions over `spark.range`'s `id` (the first).
TYPES = [
    "id",
    "cast(id % 100 as tinyint) as i8",
    "cast(id % 30000 as smallint) as i16",
    "cast(id as int) as i32",
    "id * 3 as i64",
    "cast(id / 3 as float) as f32",
    "id / 7 as f64",
    "id % 2 = 0 as flag",
    "case when id % 10 = 0 then null else concat('row-', id) end as name",
    "cast(concat('b', id) as binary) as bin",
    "date_add(date'2024-01-01', cast(id % 1000 as int)) as day",
    "timestamp_micros(1700000000000000 + id) as ts",
    "cast(id / 100 as decimal(12, 2)) as dec",
    "array(cast(id as float), cast(-id as float), 1.0f) as vec",
    "case when id % 7 = 0 then null else array(cast(id as int), null) end as tags",
    "named_struct('a', id, 'b', concat('s', id)) as st",
    "map('k', cast(id as int), 'j', 0) as m",
]


#: The JVM Spark connector, as `mvn -f connectors/spark package` builds it
#: (scripts/test.sh does, before the Python tests).
SPARK_JAR = REPO / "connectors" / "spark" / "target" / "flightdeck-spark-0.1.0.jar"


@pytest.fixture(scope="session")
def spark(tmp_path_factory):
    """A local Spark session: 2 threads, up to 3 attempts per task, with the
    JVM connector's jar on `spark.jars` where it has been built (so
    `format("flightdeck")` is the JVM connector; the Python data source's
    tests register it as `flightdeck_py`)."""
    pyspark = pytest.importorskip("pyspark")
    from pyspark.sql import SparkSession

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    session = (
        SparkSession.builder.master("local[2,3]")
        .appName("flightdeck-tests")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "8")
        .config("spark.sql.execution.arrow.maxRecordsPerBatch", "10000")
        # Spark's filters reach the Python data source's reader too.
        .config("spark.sql.python.filterPushdown.enabled", "true")
        .config("spark.jars", str(SPARK_JAR) if SPARK_JAR.exists() else "")
        # Tables the catalog tests make live here, not in the checkout.
        .config("spark.sql.warehouse.dir", str(tmp_path_factory.mktemp("spark-warehouse")))
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    assert pyspark.__version__
    yield session
    session.stop()


def make_test_certs(folder: Path) -> dict[str, Path]:
    """A test certificate authority and a server certificate it signed for
    127.0.0.1 and localhost, made with the `openssl` command in `folder`:
    paths `ca`, `cert` and `key`."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    run("req", "-x509", *ec, "-days", "2", "-subj", "/CN=flightdeck test CA",
        "-keyout", "ca.key", "-out", "ca.pem")
    run("req", *ec, "-subj", "/CN=localhost", "-keyout", "key.pem", "-out", "server.csr")
    (folder / "server.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
        "keyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n"
    )
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-extfile", "server.ext", "-out", "cert.pem")
    return {"ca": folder / "ca.pem", "cert": folder / "cert.pem", "key": folder / "key.pem"}


def sign_dated(folder: Path, name: str, start: str, end: str) -> Path:
    """A certificate for the key and request `make_test_certs` left in
    `folder`, self-signed and valid from `start` to `end` (`YYYYMMDDhhmmssZ`),
    made with `openssl ca` (the only openssl 3.0 command that takes dates):
    `folder / name`."""
    (folder / "index.txt").write_text("")
    (folder / "serial").write_text("01\n")
    (folder / "dated.cnf").write_text(
        "[ca]\ndefault_ca = d\n[d]\ndatabase = index.txt\nnew_certs_dir = .\n"
        "serial = serial\ndefault_md = sha256\npolicy = p\n[p]\ncommonName = supplied\n"
    )
    subprocess.run(
        ["openssl", "ca", "-batch", "-config", "dated.cnf", "-selfsign", "-keyfile", "key.pem",
         "-in", "server.csr", "-startdate", start, "-enddate", end,
         "-extfile", "server.ext", "-notext", "-out", name],
        cwd=folder, check=True, capture_output=True,
    )
    return folder / name


def sign_expired(folder: Path) -> Path:
    """`sign_dated`'s certificate valid only on 1 January 2020 (expired):
    `folder / "expired.pem"`."""
    return sign_dated(folder, "expired.pem", "20200101000000Z", "20200102000000Z")

