"""Security: a server started with --auth-token-file (no token or a wrong
one is UNAUTHENTICATED, a reader's token reads but cannot write, a writer's
does everything; flightdeck's client takes `token=` or FLIGHTDECK_TOKEN, and
a plain pyarrow client sends the header itself), and one serving over TLS
(--tls-cert/--tls-key) to clients given its authority's certificate."""

import pyarrow as pa
import pyarrow.flight as flight
import pytest

import flightdeck
from conftest import RunningServer, make_test_certs


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
