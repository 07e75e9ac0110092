"""Training inside the server from Python and from the `flightdeck train`
command line: a sealed dataset written with the Python client, a softmax
regression that separates three classes, progress that streams, a bad job
refused with INVALID_ARGUMENT, a checkpoint written and resumed, a job that trains on the rows a filter
selects (the labelled rows of a partly labelled dataset among them), Spark's
`array<float>` features (also of a derived part of a dataset), and `flightdeck train --regression` stopped and continued with
`--resume-from`."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pyarrow as pa
import pytest

import flightdeck
from conftest import server_binary, scaled


def three_classes(n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    centers = np.array([[2.0, 0.0], [-1.0, 1.7], [-1.0, -1.7]], dtype=np.float32)
    label = rng.integers(0, 3, n)
    points = centers[label] + rng.normal(0, 0.35, (n, 2)).astype(np.float32)
    return pa.table(
        {
            "features": pa.FixedSizeListArray.from_arrays(pa.array(points.reshape(-1)), 2),
            "label": pa.array(label.astype(np.int32)),
        }
    )


@pytest.fixture
def sealed(flightdeck_server):
    with flightdeck.connect(flightdeck_server.uri) as c:
        t = three_classes(4000, 1)
        for p in range(4):
            c.put_partition("blobs", p, t.slice(p * 1000, 1000))
        c.seal("blobs", partitions=4)
    return flightdeck_server


def test_python_client_trains_and_streams_progress(sealed, tmp_path):
    with flightdeck.connect(sealed.uri) as c:
        reports = list(
            c.train("blobs", ["features"], "label", classes=3, lr=0.05, batch_size=100, epochs=3, cpu_ranks=2)
        )
        assert reports[-1].done and reports[-1].accuracy >= 0.95
        assert [r.step for r in reports] == sorted(r.step for r in reports)
        assert reports[-1].total_steps == 3 * 40
        assert c.jobs(reports[-1].job)[0].state == "finished"

        with pytest.raises(flightdeck.InvalidArgument, match="not divisible by the 3 ranks"):
            list(c.train("blobs", ["features"], "label", classes=3, batch_size=100, cpu_ranks=3))

        with pytest.raises(flightdeck.PermissionDenied, match="outside this server's checkpoint root"):
            list(c.train("blobs", ["features"], "label", classes=3, batch_size=100,
                         checkpoint_url=f"file://{tmp_path}"))

        # One feature column may be named as a string.
        assert list(c.train("blobs", "features", "label", classes=3, batch_size=100,
                            max_steps=2))[-1].done

        url = f"file://{sealed.checkpoint_root}/run"
        first = list(
            c.train("blobs", ["features"], "label", classes=3, lr=0.05, batch_size=100, epochs=3,
                    checkpoint_url="run", checkpoint_every=20, keep_checkpoints=1, max_steps=50)
        )
        assert first[-1].checkpoint == f"{url}/step-0000000050.safetensors"
        # Steps 20 and 40 were written, then deleted as newer ones came.
        assert [p.name for p in (sealed.checkpoint_root / "run").iterdir()] == [
            "step-0000000050.safetensors"
        ]
        resumed = list(
            c.train("blobs", ["features"], "label", classes=3, lr=0.05, batch_size=100, epochs=3,
                    resume_from=first[-1].checkpoint)
        )
        whole = list(
            c.train("blobs", ["features"], "label", classes=3, lr=0.05, batch_size=100, epochs=3)
        )
        assert resumed[-1].loss == pytest.approx(whole[-1].loss, rel=1e-6)


def test_a_filter_chooses_the_rows_a_job_trains_on(sealed):
    labels = three_classes(4000, 1).column("label").to_numpy()
    selected = int((labels < 2).sum())
    with flightdeck.connect(sealed.uri) as c:
        # Class 2 is outside classes=2: refused over every row, accepted when
        # the filter leaves it out; the steps count the selected rows.
        with pytest.raises(flightdeck.InvalidArgument, match="outside the 2 classes"):
            list(c.train("blobs", ["features"], "label", classes=2, batch_size=100))
        reports = list(
            c.train("blobs", ["features"], "label", classes=2, lr=0.05, batch_size=100, epochs=2,
                    cpu_ranks=2, filter="label < 2", checkpoint_url="two", checkpoint_every=10)
        )
        assert reports[-1].done and reports[-1].accuracy >= 0.95
        assert reports[-1].total_steps == 2 * (selected // 2 // 50)
        # A checkpoint records the filter: resuming with another is refused.
        with pytest.raises(flightdeck.FailedPrecondition,
                           match="the checkpoint has filter \"label < 2\", this job has filter \"\""):
            list(c.train("blobs", ["features"], "label", classes=3, lr=0.05, batch_size=100,
                         epochs=2, cpu_ranks=2, resume_from=reports[-1].checkpoint))
        with pytest.raises(flightdeck.InvalidArgument, match="selects none of the dataset's rows"):
            list(c.train("blobs", ["features"], "label", classes=3, batch_size=100, filter="label > 5"))


def test_a_filter_trains_on_the_labelled_rows_of_a_partly_labelled_dataset(flightdeck_server):
    t = three_classes(2000, 2)
    labels = t.column("label").to_numpy()
    mask = np.arange(2000) % 4 == 1  # a quarter of the rows unlabelled
    partly = t.set_column(1, "label", pa.array(labels, mask=mask))
    with flightdeck.connect(flightdeck_server.uri) as c:
        c.put_partition("partly", 0, partly)
        c.seal("partly", partitions=1)
        with pytest.raises(flightdeck.InvalidArgument, match="label column 'label' has nulls.*IS NOT NULL"):
            list(c.train("partly", ["features"], "label", classes=3, batch_size=100))
        reports = list(c.train("partly", ["features"], "label", classes=3, lr=0.05, batch_size=100,
                               epochs=3, filter='"label" IS NOT NULL'))
        assert reports[-1].done and reports[-1].accuracy >= 0.95
        assert reports[-1].total_steps == 3 * (1500 // 100)
        with pytest.raises(flightdeck.InvalidArgument, match="label column 'label' is null at row 1, "):
            list(c.train("partly", ["features"], "label", classes=3, batch_size=100,
                         filter="hash_bucket(label, 2) >= 0 OR label IS NULL"))


def test_an_array_column_as_spark_writes_it_trains(flightdeck_server):
    """Spark writes `array<float>` as a list column, not a fixed_size_list:
    it trains as one when its rows all hold the same number of values (it
    was refused as not numeric), the same losses step by step, and ragged
    rows are refused naming two that differ."""
    t = three_classes(2000, 3)
    points = t.column("features").combine_chunks().flatten().to_numpy().reshape(-1, 2)
    as_spark = t.set_column(0, "features", pa.array(list(points), pa.list_(pa.float32())))
    ragged = as_spark.set_column(0, "features", pa.array(
        [list(p) + [0.0] * (i == 1500) for i, p in enumerate(points)], pa.list_(pa.float32())))
    with flightdeck.connect(flightdeck_server.uri) as c:
        for name, table in (("fixed", t), ("spark", as_spark), ("ragged", ragged)):
            for p in range(2):
                c.put_partition(name, p, table.slice(p * 1000, 1000))
            c.seal(name, partitions=2)
        job = dict(classes=3, lr=0.05, batch_size=100, epochs=2, cpu_ranks=2, seed=4)
        fixed = list(c.train("fixed", ["features"], "label", **job))
        spark = list(c.train("spark", ["features"], "label", **job))
        assert [r.loss for r in spark] == [r.loss for r in fixed]
        assert spark[-1].done and spark[-1].accuracy >= 0.95
        with pytest.raises(flightdeck.InvalidArgument, match=(
                r"feature column 'features' is a list whose rows hold different numbers of "
                r"values \(row 1000 holds 2, row 1500 holds 3\)")):
            list(c.train("ragged", ["features"], "label", **job))


def test_an_array_column_of_a_derived_part_trains_on_its_own_rows(flightdeck_server):
    """A dataset derived with `LIMIT … OFFSET …` holds slices of the source's
    stored batches: its `array<float>` features are its own rows' (they were
    the first rows' of each batch), so it trains exactly as the same rows
    written as a dataset of their own."""
    t = three_classes(4000, 5)
    points = t.column("features").combine_chunks().flatten().to_numpy().reshape(-1, 2)
    t = t.set_column(0, "features", pa.array(list(points), pa.list_(pa.float32())))
    with flightdeck.connect(flightdeck_server.uri) as c:
        c.put_partition("all", 0, t)
        c.seal("all", partitions=1)
        c.derive("part", "SELECT * FROM \"all\" LIMIT 1000 OFFSET 1500")
        c.put_partition("written", 0, t.slice(1500, 1000))
        c.seal("written", partitions=1)
        job = dict(classes=3, lr=0.05, batch_size=100, seed=4, shuffle="none")
        part = list(c.train("part", ["features"], "label", **job))
        written = list(c.train("written", ["features"], "label", **job))
        assert [r.loss for r in part] == [r.loss for r in written]
        assert part[-1].accuracy == written[-1].accuracy


def test_the_train_command(sealed):
    run = subprocess.run(
        [
            # host:port, as Python takes it too.
            str(server_binary()), "train", "--server", sealed.uri.replace("grpc://", ""),
            "--dataset", "blobs", "--features", "features", "--label", "label", "--classes", "3",
            "--hidden", "8", "--lr", "0.02", "--batch-size", "64", "--epochs", "2", "--devices", "cpu:2",
        ],
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert run.returncode == 0, run.stderr
    assert "step 124/124" in run.stderr  # a progress line per report on a pipe
    done = run.stdout.strip()
    assert done.startswith("job ") and " done: 124 steps" in done, done
    accuracy = float(done.split("training accuracy ")[1].split(",")[0])
    assert accuracy >= 0.95

    # --json: each report a line of JSON on stdout, the last one done.
    as_json = subprocess.run(
        [str(server_binary()), "train", "--server", sealed.uri, "--json",
         "--dataset", "blobs", "--features", "features", "--label", "label", "--classes", "3",
         "--batch-size", "64", "--epochs", "1", "--seed", "3"],
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert as_json.returncode == 0, as_json.stderr
    reports = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert reports and all(not r["done"] for r in reports[:-1]), as_json.stdout
    last = reports[-1]
    assert last["done"] and last["step"] == last["total_steps"] == 62, last
    assert {"loss", "epoch", "samples_per_second", "data_stall_fraction", "accuracy"} <= set(last)
    assert "step " not in as_json.stderr, "no bar beside the JSON"

    bad = subprocess.run(
        [str(server_binary()), "train", "--server", sealed.uri.replace("grpc://", "http://"),
         "--dataset", "blobs", "--features", "nope", "--label", "label", "--classes", "3"],
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert bad.returncode == 1
    # Said once, as the server said it, with the code's name.
    assert bad.stderr.count("feature column 'nope' is not in the dataset") == 1, bad.stderr
    assert "(InvalidArgument)" in bad.stderr, bad.stderr

    missing = subprocess.run(
        [str(server_binary()), "train", "--server", sealed.uri,
         "--dataset", "nope", "--features", "features", "--label", "label", "--classes", "3"],
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert missing.returncode == 1
    # The server's advice in terms a person at the command line acts on.
    assert "dataset 'nope' does not exist; write it first" in missing.stderr, missing.stderr
    assert "(NotFound)" in missing.stderr, missing.stderr
    for word in ("DoPut", "ListFlights"):
        assert word not in missing.stderr, missing.stderr


def train_command(server, *args: str) -> str:
    """Runs `flightdeck train` against `server`; its one line on stdout."""
    run = subprocess.run(
        [str(server_binary()), "train", "--server", server.uri, *args],
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_the_train_command_regresses_and_resumes(flightdeck_server):
    # label = 3a − 2b + 0.5 exactly: a plane a linear regression can reach.
    rng = np.random.default_rng(4)
    ab = rng.uniform(-1, 1, (2000, 2)).astype(np.float32)
    label = (3 * ab[:, 0] - 2 * ab[:, 1] + 0.5).astype(np.float32)
    t = pa.table({"a": ab[:, 0], "b": ab[:, 1], "y": label})
    with flightdeck.connect(flightdeck_server.uri) as c:
        for p in range(2):
            c.put_partition("plane", p, t.slice(p * 1000, 1000))
        c.seal("plane", partitions=2)

    job = ["--dataset", "plane", "--features", "a,b", "--label", "y", "--regression",
           "--optimizer", "sgd", "--lr", "0.05", "--batch-size", "50", "--epochs", "3",
           "--devices", "cpu:2"]
    whole = train_command(flightdeck_server, *job)
    assert " done: 120 steps, loss " in whole and "accuracy" not in whole, whole
    loss = float(whole.split("loss ")[1].split(",")[0])
    assert loss < 1e-3, whole  # from a label spread of about 4.5

    first = train_command(flightdeck_server, *job, "--max-steps", "45", "--checkpoint-url", "run")
    checkpoint = first.split("checkpoint ")[1]
    assert " done: 45 steps" in first and checkpoint.endswith("/run/step-0000000045.safetensors")
    rest = train_command(flightdeck_server, *job, "--resume-from", checkpoint)
    assert " done: 120 steps" in rest, rest
    # The rest of the run continues the same run: the same final loss.
    assert float(rest.split("loss ")[1].split(",")[0]) == pytest.approx(loss, rel=1e-4, abs=1e-9)

    # A resume of another job is refused, naming what differs.
    other = subprocess.run(
        [str(server_binary()), "train", "--server", flightdeck_server.uri, *job,
         "--seed", "9", "--resume-from", checkpoint],
        capture_output=True, text=True, timeout=scaled(60),
    )
    assert other.returncode == 1 and "seed" in other.stderr, other.stderr
