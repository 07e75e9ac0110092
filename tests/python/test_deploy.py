"""What deploys the server, checked without a container daemon (none exists
on these machines, so no image is built here): the Kubernetes manifests
validate against the schemas of a current release, the compose file and
the Dockerfile parse, every path they copy exists, every flag they pass is
one `flightdeck serve` takes and starts with, the compose client's script
runs against three members, and the Prometheus alerting rules parse and
and the Grafana dashboard read metrics the server exports, with label
values they take."""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import kubernetes_validate
import promql_parser
import pytest
import yaml
from dockerfile_parse import DockerfileParser
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from conftest import REPO, RunningServer, eventually, make_test_certs, scaled, server_binary

DOCKER = REPO / "docker"
K8S_VERSION = kubernetes_validate.latest_version()


def manifests() -> list[tuple[str, dict]]:
    found = []
    for path in sorted((DOCKER / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                found.append((path.name, doc))
    return found


def serve_help() -> str:
    return subprocess.run(
        [str(server_binary()), "serve", "--help"], capture_output=True, text=True, check=True,
        timeout=scaled(30),
    ).stdout


def flag_names(args: list[str]) -> list[str]:
    return [name for name, _ in parse_flags(args)]


def parse_flags(args: list[str]) -> list[tuple[str, str | None]]:
    """`--name=value`, `--name value` and `--switch` as (name, value)."""
    flags, i = [], 0
    while i < len(args):
        name, eq, value = args[i].partition("=")
        if not eq and i + 1 < len(args) and not args[i + 1].startswith("--"):
            value, i = args[i + 1], i + 1
        flags.append((name, value if eq or value else None))
        i += 1
    return flags


def runnable(args: list[str], data_dir: Path) -> list[str]:
    """`args` made safe to run here: addresses on loopback, a small memory
    limit, the data in a temporary folder; `--listen` left to RunningServer."""
    replaced = {
        "--metrics-listen": "127.0.0.1:0",
        "--advertise": "grpc://127.0.0.1:50051",
        "--memory-limit": "256MiB",
        "--data-dir": str(data_dir),
    }
    return [
        name if value is None else f"{name}={replaced.get(name, value)}"
        for name, value in parse_flags(args)
        if name != "--listen"
    ]


def starts_with(args: list[str], tmp_path: Path) -> None:
    """`flightdeck serve` starts with `args` (made runnable), answers, and
    serves its metrics where asked."""
    import flightdeck

    server = RunningServer(*runnable(args, tmp_path))
    try:
        with flightdeck.connect(server.uri) as c:
            assert c.stats().datasets == 0
        if "--metrics-listen" in flag_names(args):
            assert server.metrics_url is not None
    finally:
        assert server.stop() == 0, "".join(server.stderr_lines)


def test_every_manifest_validates_against_the_kubernetes_schemas():
    found = manifests()
    kinds = {doc["kind"] for _, doc in found}
    assert {"DaemonSet", "Service", "Pod", "Job", "Namespace"} <= kinds
    for name, doc in found:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    # The check can fail: a misspelt field is refused.
    [(_, daemonset)] = [(n, d) for n, d in found if d["kind"] == "DaemonSet"]
    broken = copy.deepcopy(daemonset)
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"grpc": {"port": 50051}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_the_daemonset_runs_the_server_it_describes(tmp_path):
    [daemonset] = [d for _, d in manifests() if d["kind"] == "DaemonSet"]
    pod = daemonset["spec"]["template"]["spec"]
    [container] = pod["containers"]
    args = container["args"]
    help_text = serve_help()
    for flag in flag_names(args):
        assert flag in help_text, f"the DaemonSet passes {flag}, which `flightdeck serve` does not take"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    listen = next(a for a in args if a.startswith("--listen="))
    metrics = next(a for a in args if a.startswith("--metrics-listen="))
    assert listen.endswith(f":{ports['flight']}") and metrics.endswith(f":{ports['metrics']}")
    assert container["readinessProbe"]["grpc"]["port"] == ports["flight"]
    assert container["livenessProbe"]["tcpSocket"]["port"] == ports["flight"]
    # The container's memory limit leaves room above the server's budget.
    limit = next(a for a in args if a.startswith("--memory-limit=")).split("=")[1]
    assert limit.endswith("GiB") and container["resources"]["limits"]["memory"].endswith("Gi")
    assert int(container["resources"]["limits"]["memory"][:-2]) > int(limit[:-3])
    # Stream idle timeout (10 minutes by default) bounds a drain.
    assert pod["terminationGracePeriodSeconds"] >= 600
    env = {e["name"]: e for e in container["env"]}
    assert env["HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    assert "$(HOST_IP)" in next(a for a in args if a.startswith("--advertise="))
    starts_with(args, tmp_path)


def test_the_spark_driver_executors_and_ranks_get_their_nodes_server():
    spark_containers = set()
    for name, doc in manifests():
        if doc["kind"] not in ("Pod", "Job"):
            continue
        spec = doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]
        for container in spec["containers"]:
            env = {e["name"]: e for e in container["env"]}
            assert env["HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP", name
            assert env["FLIGHTDECK_URI"]["value"] == "grpc://$(HOST_IP):50051", name
            if doc["kind"] == "Pod":
                spark_containers.add(container["name"])
    # The names Spark gives its pods' main containers.
    assert spark_containers == {"spark-kubernetes-driver", "spark-kubernetes-executor"}


def test_the_dockerfile_copies_what_exists_and_starts_with_its_flags(tmp_path):
    parser = DockerfileParser(path=str(DOCKER / "Dockerfile"))
    instructions = parser.structure
    stages = [i for i in instructions if i["instruction"] == "FROM"]
    assert len(stages) == 2, "a build stage and a runtime stage"
    for i in instructions:
        if i["instruction"] != "COPY" or "--from=" in i["value"]:
            continue
        *sources, _dest = i["value"].split()
        for source in sources:
            assert (REPO / source).exists(), f"the Dockerfile copies {source}, which does not exist"
    import json

    entrypoint = json.loads(next(i["value"] for i in instructions if i["instruction"] == "ENTRYPOINT"))
    cmd = json.loads(next(i["value"] for i in instructions if i["instruction"] == "CMD"))
    assert entrypoint == ["flightdeck", "serve"]
    assert [i["value"] for i in instructions if i["instruction"] == "USER"] == ["10001"]
    help_text = serve_help()
    for flag in flag_names(cmd):
        assert flag in help_text, f"the image passes {flag}, which `flightdeck serve` does not take"
    starts_with(cmd, tmp_path)
    ignored = (REPO / ".dockerignore").read_text().split()
    assert "target/" in ignored and ".venv/" in ignored


def test_the_compose_file_parses_and_names_what_exists(tmp_path):
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    members = [s for s in services if s.startswith("member-")]
    assert len(members) == 3 and "spark" in services
    help_text = serve_help()
    for name, service in services.items():
        build = service["build"]
        context = (DOCKER / build["context"]).resolve()
        assert (context / build["dockerfile"]).is_file(), name
        if name in members:
            for flag in flag_names(service["command"]):
                assert flag in help_text, f"{name} passes {flag}"
            assert f"grpc://{name}:50051" in service["command"]
            assert service["volumes"][0].split(":")[0] in compose["volumes"]
    uris = services["spark"]["environment"]["FLIGHTDECK_URIS"].split(",")
    assert uris == [f"grpc://{m}:50051" for m in members]
    starts_with(services[members[0]]["command"], tmp_path)
    # The client image copies its script.
    client = DockerfileParser(path=str(DOCKER / "spark-client.Dockerfile")).structure
    for i in client:
        if i["instruction"] == "COPY":
            assert (REPO / i["value"].split()[0]).exists(), i["value"]


def test_the_compose_clients_script_runs_against_three_members():
    servers = [RunningServer("--memory-limit", "256MiB") for _ in range(3)]
    try:
        env = dict(os.environ, FLIGHTDECK_URIS=",".join(s.uri for s in servers), PYSPARK_PYTHON=sys.executable)
        run = subprocess.run(
            [sys.executable, str(DOCKER / "try_cluster.py")], env=env, capture_output=True,
            text=True, timeout=scaled(300),
        )
        assert run.returncode == 0, run.stdout + run.stderr
        assert "1000000 rows over 3 members" in run.stdout, run.stdout
        assert "4 ranks read 1000000 rows, each once" in run.stdout, run.stdout
    finally:
        for s in servers:
            assert s.stop() == 0, "".join(s.stderr_lines)


def documented_metrics() -> dict[str, str]:
    """The README's metrics table: every metric it names, with the
    `flightdeck_` prefix, to its row (labels, their values, what it says)."""
    lines = (REPO / "README.md").read_text().splitlines()
    start = lines.index("| metric | labels | what it says |") + 2
    rows = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        names = line.split(" | ")[0]
        for name in re.findall(r"`([a-z_]+)`", names):
            rows[f"flightdeck_{name}"] = line
    return rows


def exported_sample_names(url: str) -> set[str]:
    with urllib.request.urlopen(url, timeout=scaled(10)) as response:
        text = response.read().decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


#: Labels Prometheus gives every sample it scrapes: the target's
#: `instance`, and `exported_job` — the metrics' own `job` (a training job's
#: id), renamed because it meets the scrape's `job`.
PROMETHEUS_LABELS = {"instance", "exported_job"}


def watched(expr: str, where: str, documented: dict[str, str]) -> set[str]:
    """The flightdeck metrics PromQL `expr` reads, after checking that it
    parses, that each is in the README's table and that each label it
    matches is one the metric has, with values it takes."""
    parsed = str(promql_parser.parse(expr))
    selectors = re.findall(r"\b(flightdeck_[a-z_]+)(\{[^}]*\})?", parsed)
    assert selectors, f"{where} reads no flightdeck metric: {parsed}"
    codes = {c.name for c in grpc.StatusCode}
    for metric, matchers in selectors:
        base = re.sub(r"_(count|sum|bucket)$", "", metric)
        row = documented.get(metric) or documented.get(base)
        assert row, f"{where}: {metric} is not in the README's metrics table"
        for label, op, value in re.findall(r'(\w+)(=~|!=|!~|=)"([^"]*)"', matchers):
            if label in PROMETHEUS_LABELS or (base.endswith("_seconds") and label == "le"):
                continue
            assert f"`{label}`" in row, f"{where}: {metric} has no label {label}"
            for one in value.split("|") if op == "=~" else [value]:
                if label == "code":
                    assert one in codes, f"{where}: {one} is not a gRPC code"
                elif label == "method":
                    assert one in {"DoPut", "DoGet", "DoAction", "GetFlightInfo"}, one
                else:
                    assert f"`{one}`" in row, f"{where}: {metric} has no {label}={one}"
    return {metric for metric, _ in selectors}


def test_the_alert_rules_and_the_dashboard_read_what_the_server_exports(tmp_path):
    """`docker/prometheus/alerts.yaml`: every rule has a name, a PromQL
    expression that parses, a severity, and a summary and a description
    (what to do). `docker/grafana/flightdeck.json`: every panel has a title,
    a description, a unit and queries that parse (Grafana's variables
    replaced as it does), and sits on the grid without overlapping
    another. Every metric either reads is in the README's table and in the
    scrape of a server that did what they watch (TLS, a write and a read,
    a training job, a refused credential file, a store beat), and every
    label value it matches is one that metric takes."""
    documented = documented_metrics()
    rules = [r for g in yaml.safe_load((DOCKER / "prometheus" / "alerts.yaml").read_text())["groups"]
             for r in g["rules"]]
    assert len(rules) >= 8
    reads = set()
    for rule in rules:
        name = rule["alert"]
        assert re.fullmatch(r"Flightdeck[A-Z][A-Za-z]+", name), name
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, name
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name
        assert rule["annotations"]["summary"] and len(rule["annotations"]["description"]) > 40
        assert "$labels.job " not in rule["annotations"]["summary"], "exported_job, not job"
        reads |= watched(rule["expr"], name, documented)

    dashboard = json.loads((DOCKER / "grafana" / "flightdeck.json").read_text())
    assert dashboard["uid"] and dashboard["title"]
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    taken: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        title = panel["title"]
        assert panel["description"] and panel["fieldConfig"]["defaults"]["unit"], title
        grid = panel["gridPos"]
        cells = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                 for y in range(grid["y"], grid["y"] + grid["h"])}
        assert grid["x"] + grid["w"] <= 24 and not cells & taken, f"{title} overlaps"
        taken |= cells
        assert panel["targets"], title
        for target in panel["targets"]:
            expr = target["expr"]
            for var in re.findall(r"\$(\w+)", expr):
                assert var in variables or var == "__rate_interval", f"{title}: ${var}"
            expr = expr.replace("$__rate_interval", "5m").replace('"$instance"', '".*"')
            reads |= watched(expr, title, documented)
        if "exported_job" not in json.dumps(panel["targets"]):
            assert "{{job}}" not in json.dumps(panel["targets"]), f"{title}: exported_job"
    assert {"flightdeck_job_data_stall_fraction", "flightdeck_rank_read_seconds_total"} <= reads

    import flightdeck
    import pyarrow as pa

    certs = make_test_certs(tmp_path)
    cert = tmp_path / "live.pem"
    cert.write_bytes(certs["cert"].read_bytes())
    server = RunningServer(
        "--memory-limit", "256MiB", "--persist", "--spill-url", str(tmp_path / "store"),
        "--tls-cert", str(cert), "--tls-key", str(certs["key"]), "--metrics-listen", "127.0.0.1:0",
    )
    try:
        uri = f"grpc+tls://{server.addr}"
        with flightdeck.connect(uri, tls_root_certs=certs["ca"].read_bytes()) as c:
            x = pa.array([float(i % 7) for i in range(2000)], pa.float32())
            c.put_partition("d", 0, pa.table({"x": pa.FixedSizeListArray.from_arrays(x, 1),
                                              "y": pa.array([i % 2 for i in range(2000)])}))
            c.seal("d")
            c.read_table(c.plan("d").shards[0])
            list(c.train("d", "x", "y", classes=2, batch_size=500, cpu_ranks=1, epochs=1))
        cert.write_text("not a certificate\n")
        server.proc.send_signal(signal.SIGHUP)

        def missing() -> set[str]:
            return reads - exported_sample_names(server.metrics_url)

        try:
            eventually("every watched metric exported", lambda: None if missing() else True,
                       timeout=30)
        except pytest.fail.Exception:
            assert not missing(), f"watched, not exported: {sorted(missing())}"
            raise
    finally:
        assert server.stop() == 0, "".join(server.stderr_lines)

