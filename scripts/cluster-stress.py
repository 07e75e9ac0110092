"""Concurrent load on a cluster of flightdeck members, every answer checked.

Starts `--members` servers on loopback (`target/debug/flightdeck`, or
`FLIGHTDECK_BIN`), each with a small `--memory-limit`, `--persist` and a file
store under a temporary folder, and runs `--threads` clients for `--seconds`
over four datasets of 6 partitions. Each client picks at random: a write
(each partition to a random member under one write id, a refused attempt
retried as the next one up to 4 times as Spark retries a task, sealed across
members through a random one; `--replace` of them replacing writes), a read (world
size 1-4, every shuffle, `global` or `node` locality, with or without a
filter, a select list and `drop_last`, a few batch sizes, whole or split
among 2-3 readers as DataLoader workers split a rank), a SQL aggregate,
`describe` or `drop`.

Checked: a read's rows are exactly the dataset's (or the filter's), in equal
shares, of one write only; SQL sees every row of one write; a sealed dataset
describes all its rows; no call fails with INTERNAL, UNKNOWN, UNAVAILABLE
(unless `--chaos` kills members) or CANCELLED. Writes to one dataset are
serialized, as one job per dataset would be, unless `--concurrent-writers`
(two jobs writing one dataset at once). `--chaos N` kills a random member
every N seconds and restarts it on its port. `--secure` serves every member
over TLS with a token file (members call each other over TLS with the
writer's token; clients send a writer's token).

    .venv/bin/python scripts/cluster-stress.py --seconds 60 --concurrent-writers

Prints the count of each (operation, answer) and every kind of wrong answer;
exits 1 when there was one.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "python"))
import flightdeck  # noqa: E402
from conftest import RunningServer, make_test_certs  # noqa: E402
from flightdeck.errors import FlightDeckError  # noqa: E402

PARTS, DATASETS = 6, 4
EXPECTED = {"NOT_FOUND", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED", "ALREADY_EXISTS", "ABORTED"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--threads", type=int, default=6)
    ap.add_argument("--members", type=int, default=3)
    ap.add_argument("--memory-limit", default="12MiB")
    ap.add_argument("--partition-rows", type=int, default=40_000)
    ap.add_argument("--replace", type=float, default=0.5, help="share of replacing writes")
    ap.add_argument("--concurrent-writers", action="store_true")
    ap.add_argument("--chaos", type=float, default=0, help="kill a member every N seconds")
    ap.add_argument("--secure", action="store_true", help="TLS and tokens on every member")
    args = ap.parse_args()
    return Stress(args).run()


class Stress:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rows = PARTS * args.partition_rows
        self.root = tempfile.mkdtemp()
        self.secure: tuple[str, ...] = ()
        self.ca: bytes | None = None
        if args.secure:
            certs = make_test_certs(Path(self.root))
            tokens = Path(self.root) / "tokens"
            tokens.write_text("writer stress-writer\n")
            self.secure = ("--tls-cert", str(certs["cert"]), "--tls-key", str(certs["key"]),
                           "--tls-ca", str(certs["ca"]), "--auth-token-file", str(tokens))
            self.ca = certs["ca"].read_bytes()
        self.members = [RunningServer(*self.member_args(i)) for i in range(args.members)]
        scheme = "grpc+tls" if args.secure else "grpc"
        self.uris = [f"{scheme}://{m.addr}" for m in self.members]
        self.locks = [
            contextlib.nullcontext() if args.concurrent_writers else threading.Lock()
            for _ in range(DATASETS)
        ]
        self.generations = itertools.count(1)
        self.counts: Counter = Counter()
        self.wrong: Counter = Counter()
        self.logs: list[str] = []
        self.deadline = time.monotonic() + args.seconds

    def member_args(self, i: int) -> tuple[str, ...]:
        return ("--memory-limit", self.args.memory_limit, "--persist",
                "--data-dir", f"{self.root}/m{i}", "--spill-url", f"file://{self.root}/s{i}", *self.secure)

    def connect(self, uri: str) -> flightdeck.Client:
        if not self.args.secure:
            return flightdeck.connect(uri)
        return flightdeck.connect(uri, token="stress-writer", tls_root_certs=self.ca)

    def table(self, p: int, g: int) -> pa.Table:
        n = self.args.partition_rows
        return pa.table({
            "id": pa.array(range(p * n, (p + 1) * n), pa.int64()),
            "g": pa.array([g] * n, pa.int64()),
        })

    def write(self, c: flightdeck.Client, ds: int) -> None:
        name, g = f"ds{ds}", next(self.generations)
        wid, replace = f"w{g}", random.random() < self.args.replace
        with self.locks[ds]:
            try:
                layout: dict[str, dict[int, int]] = {}
                for p in range(PARTS):
                    ack = self.put(name, p, g, wid, replace)
                    layout.setdefault(ack.location, {})[p] = ack.attempt
                self.connect(random.choice(self.uris)).seal_cluster(
                    name, layout, partitions=PARTS, replace_write=wid if replace else "")
            except Exception:
                for uri in self.uris:  # as a failed Spark job's driver does
                    with contextlib.suppress(Exception):
                        self.connect(uri).drop(name, abort_write=wid, staged=replace)
                raise

    def put(self, name: str, p: int, g: int, wid: str, replace: bool):
        """Partition `p` of write `g` to a random member, retried as a Spark
        task is (the next attempt number, up to 4 attempts)."""
        for attempt in itertools.count():
            member = self.connect(random.choice(self.uris))
            try:
                return member.put_partition(name, p, self.table(p, g), attempt,
                                            write_id=wid, replace=replace)
            except FlightDeckError:
                if attempt == 3:
                    raise

    def read(self, c: flightdeck.Client, ds: int) -> None:
        name, world = f"ds{ds}", random.randint(1, 4)
        shuffle = random.choice(["none", "global", "block"])
        locality = random.choice(["global", "node"])
        filter = random.choice(["", "id % 3 = 0"])
        drop_last = random.random() < 0.3
        kw = dict(world_size=world, shuffle=shuffle, seed=random.randint(0, 9),
                  epoch=random.randint(0, 3), locality=locality, filter=filter,
                  drop_last=drop_last, block_rows=1000 if shuffle == "block" else 0,
                  batch_rows=random.choice([0, 700, 4096]))
        if random.random() < 0.3:
            kw["select"] = ["id AS id", "g AS g", "id * 2 AS twice"]
        # Split among "workers" (each reads every split) or whole.
        splits = random.choice([1, 1, 2, 3])
        if splits > 1:  # the splits' plans, made one after another, read one write
            kw["sealed_as"] = flightdeck.sealed_as(c.describe(name))
        shares, generations = [[] for _ in range(world)], set()
        for index in range(splits):
            split = dict(split_count=splits, split_index=index) if splits > 1 else {}
            plan = c.plan(name, **kw, **split)
            for r, shard in enumerate(plan.shards):
                t = c.read_table(shard)
                shares[r] += t.column("id").to_pylist()
                generations |= set(t.column("g").to_pylist())
                if "select" in kw and t.column("twice").to_pylist() != [
                        2 * i for i in t.column("id").to_pylist()]:
                    self.wrong[f"{name}: select computed wrong values"] += 1
        expected = {i for i in range(self.rows) if not filter or i % 3 == 0}
        ids = [i for share in shares for i in share]
        if len(generations) > 1:
            self.wrong[f"{name}: a read mixed writes"] += 1
        if len({len(s) for s in shares}) > 1:
            self.wrong[f"{name}: unequal shares ({locality}, {shuffle})"] += 1
        if drop_last and (len(set(ids)) != len(ids) or not set(ids) <= expected):
            self.wrong[f"{name}: drop_last read wrong rows"] += 1
        if not drop_last and set(ids) != expected:
            self.wrong[f"{name}: read wrong rows ({locality}, {shuffle}, {filter!r})"] += 1

    def sql(self, c: flightdeck.Client, ds: int) -> None:
        got = c.sql(f"SELECT count(*) AS n, count(DISTINCT g) AS writes FROM ds{ds}").to_pylist()
        if got != [{"n": self.rows, "writes": 1}]:
            self.wrong[f"ds{ds}: SQL saw {got}"] += 1

    def describe(self, c: flightdeck.Client, ds: int) -> None:
        info = c.describe(f"ds{ds}")
        if info.state == 2 and info.rows != self.rows:
            self.wrong[f"ds{ds}: sealed with {info.rows} rows"] += 1

    def drop(self, c: flightdeck.Client, ds: int) -> None:
        with self.locks[ds]:
            c.drop(f"ds{ds}")

    def client(self, seed: int) -> None:
        random.seed(seed)
        ops = [self.write] * 3 + [self.read] * 6 + [self.sql] * 2 + [self.describe, self.drop]
        while time.monotonic() < self.deadline:
            op, ds = random.choice(ops), random.randrange(DATASETS)
            c = self.connect(random.choice(self.uris))
            try:
                op(c, ds)
                self.counts[(op.__name__, "OK")] += 1
            except FlightDeckError as e:
                self.counts[(op.__name__, e.code)] += 1
                missing_table = e.code == "INVALID_ARGUMENT" and "not found" in str(e)
                allowed = EXPECTED | ({"UNAVAILABLE"} if self.args.chaos else set())
                if e.code not in allowed and not missing_table:
                    self.wrong[f"{op.__name__}: {e.code}: {str(e)[:160]}"] += 1
            finally:
                c.close()

    def chaos(self) -> None:
        every = self.args.chaos
        while time.monotonic() < self.deadline - every:
            time.sleep(every)
            i = random.randrange(len(self.members))
            killed = self.members[i]
            killed.proc.kill()
            killed.proc.wait()
            self.logs.append("".join(killed.stderr_lines))
            time.sleep(2)
            self.members[i] = RunningServer(*self.member_args(i), "--listen", killed.addr)

    def run(self) -> int:
        threads = [threading.Thread(target=self.client, args=(i,))
                   for i in range(self.args.threads)]
        if self.args.chaos:
            threads.append(threading.Thread(target=self.chaos))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for m in self.members:
            m.stop()
            self.logs.append("".join(m.stderr_lines))
        for (op, answer), n in sorted(self.counts.items()):
            print(f"{op:9} {answer:20} {n}")
        panics = [line for log in self.logs for line in log.splitlines() if "panicked" in line]
        for line in panics[:5]:
            self.wrong[f"a member panicked: {line[:160]}"] += 1
        print(f"wrong answers: {sum(self.wrong.values())}")
        for what, n in self.wrong.most_common():
            print(f"  {n} × {what}")
        return 1 if self.wrong else 0


if __name__ == "__main__":
    sys.exit(main())
