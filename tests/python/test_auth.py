"""Security: a server started with --auth-token-file (no token or a wrong
one is UNAUTHENTICATED, a reader's token reads but cannot write, a writer's
does everything; flightdeck's client takes `token=` or FLIGHTDECK_TOKEN, and
a plain pyarrow client sends the header itself), and one serving over TLS
(--tls-cert/--tls-key) to clients given its authority's certificate; both
rotate while the server runs (SIGHUP, or on their own within 10 s); a
certificate that has expired is refused, and one about to is warned of."""

import os
import re
import signal
import ssl
import subprocess
import time
import urllib.request

import pyarrow as pa
import pyarrow.flight as flight
import pytest

import flightdeck
from conftest import (
    RunningServer, eventually, make_test_certs, scaled, server_binary, sign_dated, sign_expired,
)


@pytest.fixture
def guarded(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("# roles\nwriter w-py\nreader r-py\n")
    server = RunningServer("--memory-limit", "256MiB", "--auth-token-file", str(tokens))
    yield server
    assert server.stop() == 0


def test_tokens_give_roles(guarded, monkeypatch):
    monkeypatch.delenv("FLIGHTDECK_TOKEN", raising=False)
    table = pa.table({"id": pa.array(range(100), pa.int64())})
    with flightdeck.connect(guarded.uri) as c:
        with pytest.raises(flightdeck.Unauthenticated, match="needs a token"):
            c.stats()
    with flightdeck.connect(guarded.uri, token="w-pyX") as c:
        with pytest.raises(flightdeck.Unauthenticated, match="not one this server accepts"):
            c.list_datasets()
    with flightdeck.connect(guarded.uri, token="w-py") as w:
        w.put_partition("d", 0, table)
        w.seal("d", partitions=1)
    with flightdeck.connect(guarded.uri, token="r-py") as r:
        with pytest.raises(flightdeck.PermissionDenied, match="a reader token may not call DoPut"):
            r.put_partition("e", 0, table)
        with pytest.raises(flightdeck.PermissionDenied, match="action 'drop'"):
            r.drop("d")
        plan = r.plan("d", world_size=2)
        assert sum(r.read_table(s).num_rows for s in plan.shards) == 100
    monkeypatch.setenv("FLIGHTDECK_TOKEN", "r-py")
    with flightdeck.connect(guarded.uri) as r:
        assert r.describe("d").rows == 100

    plain = flight.FlightClient(guarded.uri)
    with pytest.raises(flight.FlightUnauthenticatedError):
        list(plain.list_flights())
    options = flight.FlightCallOptions(headers=[(b"authorization", b"Bearer r-py")])
    assert [i.descriptor.path for i in plain.list_flights(options=options)] == [[b"d"]]
    plain.close()


def test_tls_serves_clients_that_trust_it(tmp_path):
    certs = make_test_certs(tmp_path)
    server = RunningServer(
        "--memory-limit", "256MiB", "--tls-cert", str(certs["cert"]), "--tls-key", str(certs["key"])
    )
    try:
        uri = f"grpc+tls://{server.addr}"
        ca = certs["ca"].read_bytes()
        table = pa.table({"id": pa.array(range(300), pa.int64())})
        with flightdeck.connect(uri, tls_root_certs=ca) as c:
            c.put_partition("d", 0, table)
            c.seal("d", partitions=1)
            assert c.stats().location == uri
            plan = c.plan("d", world_size=3, shuffle="global")
            assert sum(c.read_table(s).num_rows for s in plan.shards) == 300

        with pytest.MonkeyPatch.context() as env:
            # As a Spark executor gets it: through the environment.
            env.setenv("FLIGHTDECK_TLS_ROOT_CERTS", str(certs["ca"]))
            with flightdeck.connect(uri) as c:
                assert c.describe("d").rows == 300

        plain = flight.FlightClient(uri, tls_root_certs=ca)
        assert [i.descriptor.path for i in plain.list_flights()] == [[b"d"]]
        plain.close()

        with pytest.raises(flightdeck.InvalidArgument, match="tls_root_certs"):
            flightdeck.connect(uri)
        # Plaintext against TLS fails; it never hangs or reads data.
        with flightdeck.connect(f"grpc://{server.addr}", timeout=5) as c:
            with pytest.raises(flightdeck.FlightDeckError):
                c.stats()
    finally:
        assert server.stop() == 0


def read_again(server: RunningServer) -> str:
    """Sends SIGHUP and waits (bounded) for the server's line saying it read
    its credential files again; returns that line."""
    said = "SIGHUP received: credential files read again"
    before = sum(said in line for line in server.stderr_lines)
    server.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + scaled(10)
    while time.monotonic() < deadline:
        lines = [line for line in server.stderr_lines if said in line]
        if len(lines) > before:
            return lines[-1]
        time.sleep(0.05)
    raise AssertionError("no reload line after SIGHUP:\n" + "".join(server.stderr_lines))


def test_tokens_and_certificates_rotate_without_a_restart(tmp_path):
    """An operator replaces the token file and the certificate while the
    server holds a dataset: after SIGHUP, calls check the new tokens and new
    connections get the new certificate; the cache is kept, a connection
    opened before goes on, and files that cannot be used are refused by name
    while the server goes on with what it had. (Before, the files were read
    once at start: rotating meant a restart, which empties a server's cache.)"""
    for name in ("old", "new", "live"):
        (tmp_path / name).mkdir()
    old, new = make_test_certs(tmp_path / "old"), make_test_certs(tmp_path / "new")
    live = tmp_path / "live"
    cert, key, tokens = live / "cert.pem", live / "key.pem", live / "tokens"
    cert.write_bytes(old["cert"].read_bytes())
    key.write_bytes(old["key"].read_bytes())
    tokens.write_text("writer w-old\nreader r-old\n")
    server = RunningServer(
        "--memory-limit", "256MiB", "--tls-cert", str(cert), "--tls-key", str(key),
        "--auth-token-file", str(tokens), "--metrics-listen", "127.0.0.1:0",
    )
    try:
        uri = f"grpc+tls://{server.addr}"
        table = pa.table({"id": pa.array(range(300), pa.int64())})
        before = flightdeck.connect(uri, tls_root_certs=old["ca"].read_bytes(), token="w-old")
        before.put_partition("d", 0, table)
        before.seal("d", partitions=1)

        # Step 1: the new token beside the old one, the new certificate.
        tokens.write_text("writer w-old\nwriter w-new\nreader r-new\n")
        cert.write_bytes(new["cert"].read_bytes())
        key.write_bytes(new["key"].read_bytes())
        line = read_again(server)
        assert "tokens=true" in line and "certificate=true" in line, line
        assert before.describe("d").rows == 300, "the connection opened before goes on"
        with flightdeck.connect(uri, tls_root_certs=new["ca"].read_bytes(), token="w-new") as c:
            plan = c.plan("d", world_size=2, shuffle="global")
            assert sum(c.read_table(s).num_rows for s in plan.shards) == 300
        with flightdeck.connect(uri, tls_root_certs=new["ca"].read_bytes(), token="r-new") as r:
            with pytest.raises(flightdeck.PermissionDenied, match="action 'drop'"):
                r.drop("d")
        # A new connection trusting only the old authority is refused.
        with flightdeck.connect(uri, tls_root_certs=old["ca"].read_bytes(), token="w-new",
                                timeout=5) as c:
            with pytest.raises(flightdeck.FlightDeckError):
                c.stats()

        # Step 2: the old token gone.
        tokens.write_text("writer w-new\nreader r-new\n")
        assert "tokens=true" in read_again(server)
        with pytest.raises(flightdeck.Unauthenticated, match="not one this server accepts"):
            before.describe("d")

        # Files that cannot be used: refused by name, the last ones kept.
        tokens.write_text("writer\n")
        key.write_bytes(old["key"].read_bytes())
        line = read_again(server)
        assert "refused=2" in line and "tokens=false" in line, line
        log = "".join(server.stderr_lines)
        assert f"--auth-token-file {tokens}" in log and "must be 'writer TOKEN'" in log, log
        assert f"--tls-key {key} cannot serve --tls-cert {cert}" in log, log
        assert "not the private key" in log, log
        assert "w-new" not in log, "tokens are never logged"
        with flightdeck.connect(uri, tls_root_certs=new["ca"].read_bytes(), token="w-new") as c:
            assert c.describe("d").rows == 300
        # What an alert watches: tokens, certificate and member roots (the
        # certificate's file, without --tls-ca) taken, then tokens; two refused.
        with urllib.request.urlopen(server.metrics_url, timeout=scaled(10)) as response:
            scraped = response.read().decode()
        assert 'flightdeck_credential_reloads_total{outcome="taken"} 4' in scraped, scraped
        assert 'flightdeck_credential_reloads_total{outcome="refused"} 2' in scraped, scraped
        # Both still refused: what the alert watches, until the files are fixed.
        assert "flightdeck_credential_files_refused 2" in scraped, scraped
        key.write_bytes(new["key"].read_bytes())
        assert "certificate=true" in read_again(server), "the key fixed: taken again"
        with urllib.request.urlopen(server.metrics_url, timeout=scaled(10)) as response:
            assert "flightdeck_credential_files_refused 1" in response.read().decode()
    finally:
        assert server.stop() == 0


def test_an_expired_certificate_is_refused_and_one_expiring_soon_is_warned_of(tmp_path):
    """A certificate past its notAfter is refused by name at start (every
    client that checks it would refuse the server, with a handshake error
    that names nothing) and when a rotation brings one (the server goes on
    with the certificate it had); one that expires within 14 days is warned
    of, and the metrics say when the certificate in use expires."""
    certs = make_test_certs(tmp_path)
    expired = sign_expired(tmp_path)
    started = subprocess.run(
        [str(server_binary()), "serve", "--listen", "127.0.0.1:0", "--spill-url", "memory://",
         "--tls-cert", str(expired), "--tls-key", str(certs["key"])],
        capture_output=True, text=True, timeout=scaled(30),
    )
    assert started.returncode != 0, started
    assert f"--tls-cert {expired} expired at 2020-01-02T00:00:00Z" in started.stderr, started.stderr
    assert "install a renewed certificate and key" in started.stderr, started.stderr

    live = tmp_path / "live.pem"
    live.write_bytes(certs["cert"].read_bytes())
    server = RunningServer(
        "--memory-limit", "256MiB", "--tls-cert", str(live), "--tls-key", str(certs["key"]),
        "--metrics-listen", "127.0.0.1:0",
    )
    try:
        # make_test_certs signs for 2 days: 1 whole day and some hours left.
        eventually("the warning", lambda: next(
            (line for line in server.stderr_lines if "expires in 1 day:" in line), None))
        not_after = subprocess.run(
            ["openssl", "x509", "-in", str(live), "-noout", "-enddate"],
            capture_output=True, text=True, check=True,
        ).stdout.strip().split("=", 1)[1]
        gauge = f"flightdeck_tls_certificate_expiry_timestamp_seconds {ssl.cert_time_to_seconds(not_after)}"

        def scrape() -> str:
            with urllib.request.urlopen(server.metrics_url, timeout=scaled(10)) as response:
                return response.read().decode()

        assert gauge in scrape()
        uri = f"grpc+tls://{server.addr}"
        with flightdeck.connect(uri, tls_root_certs=certs["ca"].read_bytes()) as c:
            assert c.stats().tls_certificate_expires == ssl.cert_time_to_seconds(not_after)
        shown = subprocess.run(
            [str(server_binary()), "stats", "--server", uri],
            env={**os.environ, "FLIGHTDECK_TLS_ROOT_CERTS": str(certs["ca"])},
            capture_output=True, text=True, timeout=scaled(30),
        )
        assert shown.returncode == 0, shown.stderr
        tls = next(line for line in shown.stdout.splitlines() if line.startswith("tls "))
        assert re.fullmatch(r"tls +certificate expires \S+Z, in 1d2[23]h", tls), tls

        live.write_bytes(expired.read_bytes())
        line = read_again(server)
        assert "refused=1" in line and "certificate=false" in line, line
        log = "".join(server.stderr_lines)
        assert f"--tls-cert {live} expired at 2020-01-02T00:00:00Z" in log, log
        with flightdeck.connect(f"grpc+tls://{server.addr}",
                                tls_root_certs=certs["ca"].read_bytes()) as c:
            assert c.stats().location == f"grpc+tls://{server.addr}", "the old certificate serves"
        assert gauge in scrape()
    finally:
        assert server.stop() == 0


def test_a_certificate_not_valid_yet_is_served_and_warned_of_until_one_is(tmp_path):
    """A certificate whose notBefore is still ahead (this node's clock behind
    its issuer's, or one issued for later) is served — refusing it would keep
    the server down past the moment it becomes valid — but warned of, saying
    from when and what to check, and the server says when the certificate in
    use is valid again."""
    certs = make_test_certs(tmp_path)
    later = sign_dated(tmp_path, "later.pem", "20400101000000Z", "20400201000000Z")
    server = RunningServer(
        "--memory-limit", "256MiB", "--tls-cert", str(later), "--tls-key", str(certs["key"]),
    )
    try:
        line = eventually("the warning", lambda: next(
            (line for line in server.stderr_lines if "is not valid yet" in line), None))
        assert "valid_from=2040-01-01T00:00:00Z" in line, line
        assert "check this node's clock against the issuer's" in line, line
        later.write_bytes(certs["cert"].read_bytes())
        line = read_again(server)
        assert "certificate=true" in line, line
        assert any("the certificate (--tls-cert) is valid now" in line
                   for line in server.stderr_lines), "".join(server.stderr_lines)
    finally:
        assert server.stop() == 0


def test_the_members_authorities_are_warned_of_as_they_expire(tmp_path):
    """The authorities a server checks other members' certificates against
    (--tls-ca) are watched as its own certificate is: one that expires within
    14 days is warned of, naming it, and so is a file that changes to hold an
    expired one beside it (a rotation half done); the server serves on."""
    certs = make_test_certs(tmp_path)
    expired = sign_expired(tmp_path)
    authorities = tmp_path / "authorities.pem"
    authorities.write_bytes(certs["ca"].read_bytes())
    server = RunningServer(
        "--memory-limit", "256MiB", "--tls-cert", str(certs["cert"]),
        "--tls-key", str(certs["key"]), "--tls-ca", str(authorities),
    )
    try:
        # make_test_certs' authority is valid for 2 days.
        line = eventually("the warning", lambda: next(
            (line for line in server.stderr_lines if "an authority of --tls-ca" in line), None))
        assert "expires in 1 day: this server's calls to the members" in line, line
        assert "authority=CN=flightdeck test CA" in line, line
        authorities.write_bytes(certs["ca"].read_bytes() + expired.read_bytes())
        assert "member_roots=true" in read_again(server)
        line = eventually("the expiry", lambda: next(
            (line for line in server.stderr_lines if "an authority of --tls-ca has expired" in line),
            None))
        assert "authority=CN=localhost" in line and "expires=2020-01-02T00:00:00Z" in line, line
        with flightdeck.connect(f"grpc+tls://{server.addr}",
                                tls_root_certs=certs["ca"].read_bytes()) as c:
            assert c.list_datasets() == []
    finally:
        assert server.stop() == 0


def test_the_token_file_is_read_again_without_a_signal(tmp_path):
    """Where nothing sends SIGHUP (a Kubernetes secret updated in place), the
    server reads its credential files again on its own, every 10 s."""
    tokens = tmp_path / "tokens"
    tokens.write_text("writer w-1\n")
    server = RunningServer("--memory-limit", "256MiB", "--auth-token-file", str(tokens))
    try:
        with flightdeck.connect(server.uri, token="w-1") as c:
            assert c.list_datasets() == []
        tokens.write_text("writer w-2\n")
        deadline = time.monotonic() + scaled(25)
        while True:
            try:
                with flightdeck.connect(server.uri, token="w-2") as c:
                    assert c.list_datasets() == []
                break
            except flightdeck.Unauthenticated:
                assert time.monotonic() < deadline, "".join(server.stderr_lines)
                time.sleep(0.5)
        assert "read again: new tokens in use" in "".join(server.stderr_lines)
    finally:
        assert server.stop() == 0


def test_members_rotate_the_token_they_share(tmp_path):
    """Members send their token file's first writer token to each other:
    after the file is rotated everywhere, the cluster seals and reads with
    the new one (a member sending the token it started with would be
    refused by the others)."""
    tokens = tmp_path / "tokens"
    tokens.write_text("writer w-1\n")
    members = [RunningServer("--memory-limit", "256MiB", "--auth-token-file", str(tokens))
               for _ in range(2)]
    try:
        tokens.write_text("writer w-2\n")
        for m in members:
            assert "tokens=true" in read_again(m)
        layout = {}
        for p, m in enumerate(members):
            table = pa.table({"id": pa.array(range(p * 100, (p + 1) * 100), pa.int64())})
            flightdeck.connect(m.uri, token="w-2").put_partition("c", p, table)
            layout[m.uri] = {p: 0}
        with flightdeck.connect(members[0].uri, token="w-2") as c:
            assert c.seal_cluster("c", layout, partitions=2).rows == 200
            # One rank on the first member: half its rows come from the other.
            plan = c.plan("c", world_size=1, shuffle="global")
            read = c.read_table(plan.shards[0])
            assert sorted(read.column("id").to_pylist()) == list(range(200))
    finally:
        # Every member stopped before any is judged: none is left running.
        assert [m.stop() for m in members] == [0] * len(members)


def test_members_on_tls_advertise_where_other_nodes_reach_them(tmp_path):
    """Members on other nodes are reached at `--advertise` (the listen
    address is not it): a TLS member advertises `grpc+tls://HOST` (the port
    it listens on added), and ranks and other members follow that location
    over TLS. (Before, only `grpc://` was taken, so a TLS cluster across
    nodes could not say where it was.)"""
    certs = make_test_certs(tmp_path)
    tls = ("--tls-cert", str(certs["cert"]), "--tls-key", str(certs["key"]),
           "--tls-ca", str(certs["ca"]))
    members = [RunningServer("--memory-limit", "256MiB", *tls, "--advertise", "grpc+tls://localhost")
               for _ in range(2)]
    ca = certs["ca"].read_bytes()
    try:
        layout = {}
        for p, m in enumerate(members):
            port = m.addr.rsplit(":", 1)[1]
            with flightdeck.connect(f"grpc+tls://{m.addr}", tls_root_certs=ca) as c:
                ack = c.put_partition(
                    "c", p, pa.table({"id": pa.array(range(p * 100, (p + 1) * 100), pa.int64())})
                )
            assert ack.location == f"grpc+tls://localhost:{port}", ack
            layout[ack.location] = {p: 0}
        first = next(iter(layout))
        with flightdeck.connect(first, tls_root_certs=ca) as c:
            assert c.seal_cluster("c", layout, partitions=2).rows == 200
            # One rank: the member it reads through fetches the other's rows.
            [shard] = c.plan("c", world_size=1, shuffle="global").shards
            assert sorted(c.read_table(shard).column("id").to_pylist()) == list(range(200))
            shards = c.plan("c", world_size=2).shards
        assert sorted(s.location for s in shards) == sorted(layout)
        for shard in shards:
            with flightdeck.connect(shard.location, tls_root_certs=ca) as r:
                assert r.read_table(shard).num_rows == 100
        with pytest.raises(RuntimeError, match="says plaintext, but this server speaks TLS"):
            RunningServer("--memory-limit", "256MiB", *tls, "--advertise", "grpc://localhost")
    finally:
        # Every member stopped before any is judged: none is left running.
        assert [m.stop() for m in members] == [0] * len(members)

    # Without --tls-ca a member trusts only its own certificate: one signed
    # by an authority is refused, saying which flag is missing (not that a
    # member is down and should be restarted).
    members = [RunningServer("--memory-limit", "256MiB", *tls[:4]) for _ in range(2)]
    try:
        layout = {}
        for p, m in enumerate(members):
            with flightdeck.connect(f"grpc+tls://{m.addr}", tls_root_certs=ca) as c:
                layout[c.put_partition("c", p, pa.table({"id": [p]})).location] = {p: 0}
        with flightdeck.connect(next(iter(layout)), tls_root_certs=ca) as c:
            with pytest.raises(flightdeck.FailedPrecondition, match="give every member --tls-ca"):
                c.seal_cluster("c", layout, partitions=2)
    finally:
        # Every member stopped before any is judged: none is left running.
        assert [m.stop() for m in members] == [0] * len(members)
