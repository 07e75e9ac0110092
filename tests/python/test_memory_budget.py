"""The memory budget holds under concurrent writers offering twice the
limit: accounting never exceeds it, refused writers get RESOURCE_EXHAUSTED
and leave nothing, the server's resident memory stays within the limit plus
a fixed overhead, and dropping returns the memory to the arena's pool."""

from __future__ import annotations

import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import pyarrow as pa

import flightdeck
from conftest import RunningServer, scaled, server_binary

LIMIT = 64 << 20
#: Allowance above the limit for the process itself and in-flight messages:
#: the binary and its runtime (~20 MiB here) plus up to one undecoded 1 MiB
#: message per writer and read buffers.
OVERHEAD = 96 << 20


def test_budget_holds_under_eight_writers_offering_twice_the_limit():
    server = RunningServer("--memory-limit", str(LIMIT))
    try:
        uri = server.uri
        rows = (2 * LIMIT // 8) // 8  # each writer offers a quarter of the limit
        table = pa.table({"v": pa.array(np.arange(rows, dtype=np.int64))})
        stop = threading.Event()
        seen: list[int] = []

        def watch():
            with flightdeck.connect(uri) as c:
                while not stop.is_set():
                    seen.append(c.stats().memory_used)

        def write(p: int):
            with flightdeck.connect(uri) as c:
                try:
                    # 1 MiB messages, so writers interleave inside the budget.
                    c.put_partition("d", p, iter(table.to_batches(max_chunksize=1 << 17)))
                    return "ok"
                except flightdeck.ResourceExhausted:
                    return "refused"

        watcher = threading.Thread(target=watch)
        watcher.start()
        with ThreadPoolExecutor(8) as pool:
            outcomes = list(pool.map(write, range(8)))
        stop.set()
        watcher.join()

        client = flightdeck.connect(uri)
        stats = client.stats()
        committed = outcomes.count("ok")
        # At most four quarter-limit attempts fit; which ones win is timing.
        assert committed <= 4 and outcomes.count("refused") == 8 - committed
        # The server's own high-water mark: no poll can miss a peak.
        assert max(seen) <= stats.memory_used_peak <= LIMIT
        assert stats.memory_used <= LIMIT
        # Refused writers left nothing: what is live is exactly the committed attempts.
        info = client.describe("d")
        assert info.committed_partitions == committed
        assert stats.host_live_bytes == info.bytes
        assert committed * rows * 8 <= info.bytes <= committed * rows * 8 * 1.01
        # The budget counts the slabs that hold them.
        assert stats.memory_used == stats.host_held_bytes >= stats.host_live_bytes
        rss = stats.resident_peak_bytes
        assert rss > 0, "the server reports its peak resident memory"
        print(f"committed {committed}/8, max memory_used {max(seen)}, peak RSS {rss}")
        assert rss <= LIMIT + OVERHEAD

        client.drop("d")
        after = client.stats()
        assert after.host_live_bytes == 0
        # Kept for reuse: the slab being filled and at most two idle ones.
        slab = LIMIT // 16
        assert after.memory_used == after.host_held_bytes <= 3 * slab
        # The freed budget is usable again.
        client.put_partition("again", 0, table)
        again = client.stats()
        assert rows * 8 <= again.host_live_bytes <= again.memory_used <= LIMIT
    finally:
        assert server.stop() == 0


def rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status").read().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize("writers", [8, 32])
def test_writers_that_say_their_size_are_admitted_whole_or_refused(writers):
    limit = 256 << 20
    server = RunningServer("--memory-limit", str(limit), "--admission-wait", "1s")
    try:
        uri = server.uri
        start_rss = rss(server.proc.pid)
        # 64 MiB a writer, in 1 MiB messages; all that fit (3 with the
        # server's alignment allowance) are admitted, the rest wait a second
        # and are refused before they send anything more.
        table = pa.table({"v": pa.array(np.arange(8 << 20, dtype=np.int64))})

        def write(p: int):
            with flightdeck.connect(uri) as c:
                try:
                    c.put_partition("d", p, table)
                    return "ok"
                except flightdeck.ResourceExhausted as e:
                    assert "admission-wait" in str(e), e
                    return "refused"

        with ThreadPoolExecutor(writers) as pool:
            outcomes = list(pool.map(write, range(writers)))
        client = flightdeck.connect(uri)
        stats = client.stats()
        committed = outcomes.count("ok")
        assert committed >= 3 and outcomes.count("refused") == writers - committed, outcomes
        assert stats.memory_used_peak <= limit
        # Never a partial attempt: what is held is exactly the admitted ones.
        info = client.describe("d")
        assert info.committed_partitions == committed
        assert info.rows == committed * table.num_rows
        growth = stats.resident_peak_bytes - start_rss
        print(f"{writers} writers: {committed} admitted, peak RSS growth {growth >> 20} MiB")
        assert growth <= limit + (64 << 20)
    finally:
        assert server.stop() == 0


def test_a_refusal_names_the_unsealed_datasets_that_hold_the_memory():
    """Open datasets cannot spill: a writer refused for memory is told which
    ones hold it (largest first, with how long ago each was last written)
    and what to do; sealed ones spill and are not named."""
    server = RunningServer("--memory-limit", "16MiB", "--admission-wait", "0")
    try:
        c = flightdeck.connect(server.uri)
        part = pa.table({"v": pa.array(np.arange(1 << 19, dtype=np.int64))})  # 4 MiB
        for p in range(3):
            c.put_partition("abandoned", p, part)
        c.put_partition("left", 0, part.slice(0, 1 << 17))
        c.put_partition("kept", 0, part.slice(0, 1 << 17))
        c.seal("kept", partitions=1)
        with pytest.raises(flightdeck.ResourceExhausted) as refused:
            c.put_partition("next", 0, part)
        said = str(refused.value)
        assert "held by datasets written but never sealed" in said, said
        assert said.index("'abandoned' (12.0MiB, last written") < said.index("'left' ("), said
        assert "'kept'" not in said and "`flightdeck drop NAME`" in said, said
        c.drop("abandoned")
        c.put_partition("next", 0, part)
    finally:
        assert server.stop() == 0


def test_an_overwrite_whose_job_is_gone_is_named_and_dropped_by_its_write():
    """What an overwrite staged cannot spill either: a refusal names it by
    its dataset and write, with the command that drops it alone (the
    dataset it would have replaced stays)."""
    server = RunningServer("--memory-limit", "16MiB", "--admission-wait", "0")
    try:
        c = flightdeck.connect(server.uri)
        part = pa.table({"v": pa.array(np.arange(1 << 19, dtype=np.int64))})  # 4 MiB
        c.put_partition("kept", 0, part.slice(0, 1 << 17))
        c.seal("kept", partitions=1)
        for p in range(3):
            c.put_partition("kept", p, part, write_id="gone", replace=True)
        with pytest.raises(flightdeck.ResourceExhausted) as refused:
            c.put_partition("next", 0, part)
        said = str(refused.value)
        assert "what write 'gone' staged to replace 'kept' (12.0MiB, last written" in said, said
        assert "`flightdeck drop kept --staged-by gone` if its job is gone" in said, said
        def cli(*args):
            return subprocess.run(
                [str(server_binary()), *args, "--server", server.uri],
                capture_output=True, text=True, timeout=scaled(30),
            )

        listed = cli("datasets")
        assert "being written (each takes its dataset's place when sealed)" in listed.stdout
        assert listed.stdout.split("\n")[-2].split()[:5] == ["kept", "gone", "1572864", "3",
                                                             "12.0MiB"], listed.stdout
        run = cli("drop", "kept", "--staged-by", "gone")
        assert run.returncode == 0, run.stderr
        assert run.stdout.startswith(
            "dropped what write 'gone' staged to replace 'kept': 1572864 rows, 12.0MiB"
        ), run.stdout
        assert c.describe("kept").rows == 1 << 17
        assert "being written" not in cli("datasets").stdout
        c.put_partition("next", 0, part)
        with pytest.raises(flightdeck.Aborted, match="write 'gone'"):
            c.put_partition("kept", 3, part, write_id="gone", replace=True)
    finally:
        assert server.stop() == 0


def test_an_overwrite_larger_than_the_room_left_spills_the_dataset_it_replaces():
    """Old and new rows are both held while an overwrite runs: when the
    budget cannot hold both, the old (sealed) dataset spills, stays
    readable from the store, and the overwrite goes through."""
    server = RunningServer("--memory-limit", "16MiB", "--admission-wait", "0")
    try:
        c = flightdeck.connect(server.uri)
        part = pa.table({"v": pa.array(np.arange(1 << 20, dtype=np.int64))})  # 8 MiB
        c.put_partition("big", 0, part)
        c.seal("big")
        before = c.plan("big")
        new = pa.table({"v": pa.array(np.arange(1 << 20, dtype=np.int64) * 2)})
        c.put_partition("big", 0, new, write_id="w", replace=True)
        assert c.describe("big").spilled and c.stats().spills == 1
        assert c.read_table(before.shards[0]).equals(part)
        c.seal("big", replace_write="w")
        assert c.read_table(c.plan("big").shards[0]).equals(new)
        assert c.stats().datasets == 1
    finally:
        assert server.stop() == 0
