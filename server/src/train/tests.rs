//! Tests of the runtime on the CPU backend: gradients against finite
//! differences, equal results on 1, 2 and 4 ranks, resume from a
//! checkpoint, and the checks a job gets before it starts.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::AtomicBool;

use arrow::array::{
    ArrayRef, AsArray, FixedSizeListArray, Float32Array, Int32Array, RecordBatch, StringArray,
};
use arrow::datatypes::{DataType, Field, Float32Type, Schema};

use super::*;
use crate::catalog::{AttemptKey, SealedData};

/// `n` rows: a 2-vector of features, a scalar feature, a class in 0..3 and
/// a regression target; in batches of 97 rows so rows straddle batches.
fn dataset(n: usize) -> SealedData {
    let schema = Arc::new(Schema::new(vec![
        Field::new(
            "vec",
            DataType::FixedSizeList(Arc::new(Field::new("item", DataType::Float32, false)), 2),
            false,
        ),
        Field::new("s", DataType::Float32, false),
        Field::new("class", DataType::Int32, false),
        Field::new("target", DataType::Float32, false),
        Field::new("name", DataType::Utf8, false),
    ]));
    let mut batches = Vec::new();
    let mut start = 0;
    while start < n {
        let end = (start + 97).min(n);
        let rows: Vec<usize> = (start..end).collect();
        let a = |i: usize| ((i * 7919) % 1000) as f32 / 500.0 - 1.0;
        let bb = |i: usize| ((i * 104_729) % 1000) as f32 / 500.0 - 1.0;
        let vec_values: Vec<f32> = rows.iter().flat_map(|&i| [a(i), bb(i)]).collect();
        let vec = FixedSizeListArray::new(
            Arc::new(Field::new("item", DataType::Float32, false)),
            2,
            Arc::new(Float32Array::from(vec_values)),
            None,
        );
        let class = Int32Array::from_iter_values(rows.iter().map(|&i| {
            let (x, y) = (a(i), bb(i));
            if x + y > 0.5 {
                0
            } else if x - y > 0.0 {
                1
            } else {
                2
            }
        }));
        batches.push(
            RecordBatch::try_new(
                schema.clone(),
                vec![
                    Arc::new(vec),
                    Arc::new(Float32Array::from_iter_values(
                        rows.iter().map(|&i| (i % 5) as f32 * 0.1),
                    )),
                    Arc::new(class),
                    Arc::new(Float32Array::from_iter_values(
                        rows.iter().map(|&i| 2.0 * a(i) - bb(i) + 0.5),
                    )),
                    Arc::new(StringArray::from_iter_values(
                        rows.iter().map(|i| i.to_string()),
                    )),
                ],
            )
            .expect("batch"),
        );
        start = end;
    }
    one_partition(schema, batches)
}

/// `batches` sealed as partition 0, attempt 0.
fn one_partition(schema: Arc<Schema>, batches: Vec<RecordBatch>) -> SealedData {
    SealedData::from_batches(
        schema,
        vec![AttemptKey {
            partition: 0,
            attempt: 0,
        }],
        batches,
    )
}

fn spec(world: u32) -> JobSpec {
    JobSpec {
        dataset: "d".into(),
        features: vec!["vec".into(), "s".into()],
        label: "class".into(),
        task: TaskSpec::Classification(3),
        hidden: vec![8],
        optimizer: Optimizer::AdamW,
        lr: 0.01,
        weight_decay: 0.01,
        global_batch: 32,
        epochs: 1,
        seed: 3,
        shuffle: Shuffle::Global,
        devices: Devices::Cpu(world),
        checkpoint_url: None,
        checkpoint_every: 0,
        keep_checkpoints: DEFAULT_KEEP_CHECKPOINTS,
        resume_from: None,
        max_steps: 0,
        filter: String::new(),
    }
}

/// [`Job::prepare`] with the selection of the spec's filter.
fn prepare(s: JobSpec, data: &SealedData) -> Result<Job> {
    let selection = if s.filter.is_empty() {
        None
    } else {
        let filter = crate::query::Filter::compile(data.schema(), &s.filter, &s.dataset)?;
        let rows = crate::query::Selection::select(data, &filter, &s.dataset)?;
        Some(Arc::new(crate::query::Selection::of(rows)))
    };
    Job::prepare(s, data, selection)
}

fn quiet(_: &Progress) {}

/// Hooks that report nothing, write no checkpoint and stop on `cancel`.
fn quiet_hooks(cancel: &AtomicBool) -> Hooks<'_> {
    Hooks {
        progress: &quiet,
        cancel,
        checkpoint: None,
    }
}

fn run(job: &Job, resume: Option<&Checkpoint>) -> Outcome {
    let cancel = AtomicBool::new(false);
    let hooks = quiet_hooks(&cancel);
    job.run(resume, &hooks).expect("job runs")
}

fn max_rel_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(&x, &y)| {
            (f64::from(x) - f64::from(y)).abs() / f64::from(x.abs().max(y.abs())).max(1e-3)
        })
        .fold(0.0, f64::max)
}

/// The loss of the model at `params` on a fixed batch (mean over rows).
fn batch_loss(model: &Model, params: &[Vec<f32>], x: &[f32], y: &[f32], rows: usize) -> f64 {
    let mut b = Cpu::new(0, CpuGroup::new(1));
    let p: Vec<Vec<f32>> = params.to_vec();
    let (loss, _) = model.evaluate(&mut b, &p, x.to_vec(), &y.to_vec(), rows);
    loss / rows as f64
}

fn check_gradients(model: &Model, x: &[f32], y: &[f32], rows: usize) {
    let mut b = Cpu::new(0, CpuGroup::new(1));
    let params = model.init(11);
    let (grads, _, _) = model.gradients(&mut b, &params, x.to_vec(), &y.to_vec(), rows);
    let eps = 1e-3f32;
    let mut checked = 0;
    for (t, tensor) in params.iter().enumerate() {
        for i in 0..tensor.len() {
            let mut plus = params.clone();
            plus[t][i] += eps;
            let mut minus = params.clone();
            minus[t][i] -= eps;
            let numeric = (batch_loss(model, &plus, x, y, rows)
                - batch_loss(model, &minus, x, y, rows))
                / (2.0 * f64::from(eps));
            let analytic = f64::from(grads[t][i]);
            assert!(
                (numeric - analytic).abs() <= 2e-3 + 2e-2 * analytic.abs(),
                "tensor {t} index {i}: finite difference {numeric}, backward {analytic} ({:?})",
                model.dims
            );
            checked += 1;
        }
    }
    assert!(checked > 10);
}

#[test]
fn gradients_of_every_op_match_finite_differences() {
    let data = dataset(40);
    let d = TrainData::new(
        &data,
        &["vec".into(), "s".into()],
        "class",
        data::LabelKind::Classes(3),
        None,
    )
    .expect("data");
    let (x, y) = d.gather(0..16);
    // Linear layer (matmul, bias) + softmax cross-entropy.
    check_gradients(
        &Model::new(3, &[], Task::Classification { classes: 3 }),
        &x,
        &y,
        16,
    );
    // Two hidden layers: ReLU and the input gradient of a matmul too.
    check_gradients(
        &Model::new(3, &[5, 4], Task::Classification { classes: 3 }),
        &x,
        &y,
        16,
    );
    // Squared error.
    let r = TrainData::new(
        &data,
        &["vec".into(), "s".into()],
        "target",
        data::LabelKind::Values,
        None,
    )
    .expect("data");
    let (x, y) = r.gather(3..19);
    check_gradients(
        &Model::new(3, &[6], Task::Regression { outputs: 1 }),
        &x,
        &y,
        16,
    );
}

#[test]
fn one_two_and_four_ranks_end_with_the_same_parameters() {
    let data = dataset(1000);
    for (opt, shuffle) in [
        (Optimizer::AdamW, Shuffle::Global),
        (
            Optimizer::Sgd { momentum: 0.9 },
            Shuffle::Block { block_rows: 64 },
        ),
    ] {
        let outcome = |world: u32| {
            let mut s = spec(world);
            s.optimizer = opt;
            s.shuffle = shuffle;
            let job = Job::prepare(s, &data, None).expect("valid job");
            assert_eq!(job.steps_per_epoch, 1000 / 32);
            run(&job, None)
        };
        let one = outcome(1);
        for world in [2, 4] {
            let other = outcome(world);
            let diff = max_rel_diff(&one.params, &other.params);
            assert!(
                diff <= 1e-5,
                "{world} ranks differ from 1 by {diff} ({opt:?})"
            );
        }
        // Training moved the parameters.
        let job = Job::prepare(spec(1), &data, None).expect("valid job");
        assert!(max_rel_diff(&one.params, &job.model.init(3)) > 1e-2);
    }
}

#[test]
fn stop_and_resume_reproduces_the_uninterrupted_run() {
    let data = dataset(700);
    let mut full = spec(2);
    full.epochs = 3;
    let job = Job::prepare(full.clone(), &data, None).expect("valid job");
    let uninterrupted = run(&job, None);

    // Stop after 13 steps (mid-epoch), keeping the checkpoint written there.
    let mut first = full.clone();
    first.max_steps = 13;
    let first = Job::prepare(first, &data, None).expect("valid job");
    let saved: Mutex<Vec<(u64, Checkpoint)>> = Mutex::new(Vec::new());
    let write = |step: u64, c: &Checkpoint| -> Result<String> {
        let bytes = c.encode()?;
        saved
            .lock()
            .expect("lock")
            .push((step, Checkpoint::decode(&bytes)?));
        Ok(format!("memory://ckpt/step-{step}"))
    };
    let cancel = AtomicBool::new(false);
    let hooks = Hooks {
        progress: &quiet,
        cancel: &cancel,
        checkpoint: Some(&write),
    };
    let stopped = first.run(None, &hooks).expect("runs");
    assert_eq!(stopped.steps, 13);
    let (step, ckpt) = saved
        .lock()
        .expect("lock")
        .pop()
        .expect("a checkpoint at the end");
    assert_eq!(step, 13);
    // 700 rows / 32 = 21 steps per epoch: step 13 is mid-epoch 0.
    assert_eq!(ckpt.meta_u64("epoch").expect("epoch"), 0);
    assert_eq!(ckpt.meta_u64("sample_position").expect("position"), 13 * 32);

    // Resume on the same ranks: the uninterrupted run, to the bit here.
    let rest = Job::prepare(full.clone(), &data, None).expect("valid job");
    let resumed = run(&rest, Some(&ckpt));
    assert_eq!(resumed.steps, uninterrupted.steps);
    let diff = max_rel_diff(&uninterrupted.params, &resumed.params);
    assert!(diff <= 1e-6, "resumed run differs by {diff}");
    // Resume on another number of ranks: the same samples per step, so the
    // same run up to summation order.
    let mut other_world = full.clone();
    other_world.devices = Devices::Cpu(4);
    let other_world = Job::prepare(other_world, &data, None).expect("valid job");
    let resumed = run(&other_world, Some(&ckpt));
    let diff = max_rel_diff(&uninterrupted.params, &resumed.params);
    assert!(diff <= 1e-5, "resumed on 4 ranks differs by {diff}");

    // A checkpoint of another model is refused.
    let mut other = full;
    other.hidden = vec![4];
    let other = Job::prepare(other, &data, None).expect("valid job");
    let err = other.check_resume(&ckpt).expect_err("other model");
    assert!(err.to_string().contains("dims"), "{err}");
}

/// The checkpoint `spec` writes after `steps` steps over `data`.
fn checkpoint_after(spec: &JobSpec, data: &SealedData, steps: u64) -> Checkpoint {
    let mut s = spec.clone();
    s.max_steps = steps;
    let job = Job::prepare(s, data, None).expect("valid job");
    let saved: Mutex<Option<Checkpoint>> = Mutex::new(None);
    let write = |_: u64, c: &Checkpoint| -> Result<String> {
        *saved.lock().expect("lock") = Some(Checkpoint::decode(&c.encode()?)?);
        Ok("memory://ckpt".into())
    };
    let cancel = AtomicBool::new(false);
    let hooks = Hooks {
        progress: &quiet,
        cancel: &cancel,
        checkpoint: Some(&write),
    };
    job.run(None, &hooks).expect("runs");
    saved.into_inner().expect("lock").expect("a checkpoint")
}

/// A resume continues only the job that wrote the checkpoint: every field
/// that changes the model or what the step and sample position mean is
/// checked, and a mismatch is FAILED_PRECONDITION naming the field and both
/// values (another world size is allowed: positions are global).
#[test]
fn a_resume_that_would_continue_elsewhere_is_refused_naming_the_field() {
    let data = dataset(700);
    let mut base = spec(2);
    base.epochs = 2;
    let ckpt = checkpoint_after(&base, &data, 13);
    type Change = fn(&mut JobSpec);
    let cases: [(&str, Change, &[&str]); 9] = [
        (
            "dataset",
            |s| s.dataset = "e".into(),
            &["dataset \"d\"", "dataset \"e\""],
        ),
        (
            "filter",
            |s| s.filter = "s < 0.3".into(),
            &["filter \"\"", "filter \"s < 0.3\""],
        ),
        ("seed", |s| s.seed = 4, &["seed \"3\"", "seed \"4\""]),
        (
            "shuffle",
            |s| s.shuffle = Shuffle::None,
            &["shuffle \"Global\"", "\"None\""],
        ),
        (
            "global batch",
            |s| s.global_batch = 64,
            &["global_batch \"32\"", "\"64\""],
        ),
        ("model", |s| s.hidden = vec![4], &["dims"]),
        (
            "optimizer",
            |s| s.optimizer = Optimizer::Sgd { momentum: 0.9 },
            &["optimizer \"adamw\"", "\"sgd\""],
        ),
        (
            "step past the end",
            |s| s.max_steps = 5,
            &["step 13, past this job's 5 steps"],
        ),
        ("world size (allowed)", |s| s.devices = Devices::Cpu(4), &[]),
    ];
    for (what, change, needles) in cases {
        let mut s = base.clone();
        change(&mut s);
        let job = prepare(s, &data).expect("valid job");
        match job.check_resume(&ckpt) {
            Ok(step) => {
                assert!(needles.is_empty(), "{what}: accepted");
                assert_eq!(step, 13);
            }
            Err(Error::FailedPrecondition(m)) => {
                assert!(!needles.is_empty(), "{what}: refused: {m}");
                for n in needles {
                    assert!(m.contains(n), "{what}: {m:?} should name {n:?}");
                }
            }
            Err(other) => panic!("{what}: expected FAILED_PRECONDITION, got {other}"),
        }
    }
    // The same job over a dataset of another size: other steps per epoch.
    let job = Job::prepare(base.clone(), &dataset(800), None).expect("valid job");
    let err = job.check_resume(&ckpt).expect_err("other rows");
    assert!(err.to_string().contains("rows \"700\""), "{err}");
    // A checkpoint from before jobs took a filter trained on every row.
    let mut before_filters = ckpt.clone();
    before_filters
        .metadata
        .remove("filter")
        .expect("records its filter");
    let job = Job::prepare(base.clone(), &data, None).expect("valid job");
    assert_eq!(job.check_resume(&before_filters).expect("resumes"), 13);
    // A checkpoint that does not say what it continues.
    let mut bare = ckpt.clone();
    bare.metadata.remove("seed");
    let job = Job::prepare(base, &data, None).expect("valid job");
    let err = job.check_resume(&bare).expect_err("no seed");
    assert!(
        err.to_string().contains("does not record its seed"),
        "{err}"
    );
}

#[test]
fn cancelling_stops_every_rank() {
    let data = dataset(1000);
    let mut s = spec(3);
    s.global_batch = 9;
    s.epochs = 50;
    let job = Job::prepare(s, &data, None).expect("valid job");
    let cancel = AtomicBool::new(false);
    let seen = Mutex::new(0u64);
    let progress = |p: &Progress| {
        *seen.lock().expect("lock") = p.step;
        if p.step >= 20 {
            cancel.store(true, std::sync::atomic::Ordering::Release);
        }
    };
    let hooks = Hooks {
        progress: &progress,
        cancel: &cancel,
        checkpoint: None,
    };
    let err = job.run(None, &hooks).expect_err("cancelled");
    assert!(matches!(err, Error::Aborted(_)), "{err}");
    assert!(*seen.lock().expect("lock") < job.total_steps());
}

#[test]
fn bad_jobs_are_refused_before_they_start() {
    let data = dataset(100);
    let refuse = |change: &dyn Fn(&mut JobSpec), needle: &str| {
        let mut s = spec(2);
        change(&mut s);
        let err = Job::prepare(s, &data, None).expect_err(needle);
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        assert!(err.to_string().contains(needle), "{err} lacks {needle}");
    };
    refuse(
        &|s| s.features.push("nope".into()),
        "feature column 'nope' is not in the dataset",
    );
    refuse(
        &|s| s.features.push("name".into()),
        "column 'name' has type Utf8",
    );
    refuse(&|s| s.label = "missing".into(), "label column 'missing'");
    refuse(
        &|s| s.task = TaskSpec::Classification(2),
        "outside the 2 classes (0 ≤ label < 2)",
    );
    refuse(
        &|s| s.label = "target".into(),
        "classification needs integer class indices",
    );
    refuse(&|s| s.global_batch = 33, "not divisible by the 2 ranks");
    refuse(
        &|s| s.global_batch = 0,
        "global batch size 0: give the samples",
    );
    refuse(
        &|s| {
            let first = s.features[0].clone();
            s.features.push(first);
        },
        "is named twice (positions 0 and",
    );
    refuse(
        &|s| s.global_batch = 200,
        "larger than the dataset's 100 rows",
    );
    refuse(&|s| s.lr = 0.0, "learning rate");
    refuse(
        &|s| s.task = TaskSpec::Classification(1),
        "at least 2 classes",
    );
    refuse(&|s| s.features = vec![], "no feature columns");
    refuse(&|s| s.devices = Devices::Cpu(0), "no devices");
    // Sizes a client names are bounded before anything of that size exists.
    refuse(
        &|s| s.hidden = vec![100_000, 100_000],
        "parameters; at most",
    );
    refuse(&|s| s.hidden = vec![u32::MAX as usize], "wider than the");
    refuse(&|s| s.hidden = vec![1; 65], "65 hidden layers");
    refuse(
        &|s| s.task = TaskSpec::Classification(u32::MAX),
        "4294967295 classes; at most",
    );
    refuse(
        &|s| {
            s.global_batch = 100;
            s.hidden = vec![1 << 20, 1, 1 << 20, 1, 1 << 20];
        },
        "activations; at most",
    );
    refuse(
        &|s| s.devices = Devices::Gpu(vec![1, 0, 1, 0]),
        "GPU 1 is listed twice (positions 0 and 2)",
    );
    // A regression on the target is fine; GPUs need a driver.
    let mut s = spec(2);
    s.task = TaskSpec::Regression;
    s.label = "target".into();
    let job = Job::prepare(s, &data, None).expect("valid");
    assert_eq!(job.model.dims, vec![3, 8, 1]);
    let mut s = spec(1);
    s.devices = Devices::Gpu(vec![0]);
    let job = Job::prepare(s, &data, None).expect("valid");
    let cancel = AtomicBool::new(false);
    let hooks = quiet_hooks(&cancel);
    if !crate::memory::device::driver_present() {
        let err = job.run(None, &hooks).expect_err("no driver");
        assert!(matches!(err, Error::FailedPrecondition(_)), "{err}");
    }
}

/// A rank that fails (a device error, here injected on the CPU backend)
/// stops every rank at that very step: each returns (no thread is left
/// waiting in a collective), the failed rank with its own error and the
/// others naming it, and the job fails with the failed rank's error.
#[test]
fn one_failing_rank_stops_every_rank_at_that_step() {
    use super::cpu::{Cpu, CpuGroup};
    let data = dataset(1000);
    let mut s = spec(3);
    s.global_batch = 9;
    s.epochs = 5;
    let job = Job::prepare(s, &data, None).expect("valid job");
    let cancel = AtomicBool::new(false);
    let hooks = quiet_hooks(&cancel);
    let group = CpuGroup::new(3);
    let results: Vec<Result<Option<Outcome>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..3u32)
            .map(|rank| {
                let mut cpu = Cpu::new(rank as usize, group.clone());
                if rank == 1 {
                    cpu = cpu.failing_at_batch(5);
                }
                let (job, hooks) = (&job, &hooks);
                scope.spawn(move || job.rank_loop(cpu, rank, 0, None, hooks))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("no rank panics"))
            .collect()
    });
    for (rank, r) in results.iter().enumerate() {
        match (rank, r) {
            (1, Err(Error::Internal(m))) => {
                assert!(m.contains("rank 1 failed at step 4"), "{m}");
                assert!(m.contains("injected failure at batch 5"), "{m}");
            }
            (_, Err(Error::Aborted(m))) if rank != 1 => {
                assert!(
                    m.contains("stopped at step 4: rank 1 failed"),
                    "rank {rank}: {m}"
                );
            }
            other => panic!("rank {rank}: unexpected {other:?}"),
        }
    }
    // Through the job's own runner: the failed rank's error is the job's.
    let err = job
        .run_ranks(3, 0, None, &hooks, &|rank| {
            let cpu = Cpu::new(rank as usize, group.clone());
            Ok(if rank == 2 {
                cpu.failing_at_batch(1)
            } else {
                cpu
            })
        })
        .expect_err("a rank failed");
    assert!(
        matches!(&err, Error::Internal(m) if m.contains("rank 2 failed at step 0")),
        "{err}"
    );
}

/// Gathering one step ahead on another thread trains exactly as gathering
/// in the step does: the same batches in the same order, across an epoch
/// boundary and from a resumed step.
#[test]
fn gathering_ahead_trains_exactly_as_gathering_in_the_step() {
    use super::cpu::{Cpu, CpuGroup};
    let data = dataset(1000);
    let mut s = spec(2);
    s.epochs = 2;
    s.shuffle = Shuffle::Block { block_rows: 64 };
    let job = Job::prepare(s, &data, None).expect("valid job");
    let cancel = AtomicBool::new(false);
    let hooks = quiet_hooks(&cancel);
    let resume = checkpoint_after(&job.spec, &data, 40);
    for (start, resume) in [(0, None), (40, Some(&resume))] {
        let train = |ahead: bool| {
            let group = CpuGroup::new(2);
            job.run_ranks(2, start, resume, &hooks, &|rank| {
                let cpu = Cpu::new(rank as usize, group.clone());
                Ok(if ahead { cpu } else { cpu.gathering_in_step() })
            })
            .expect("job runs")
        };
        let (ahead, in_step) = (train(true), train(false));
        assert_eq!(ahead.params, in_step.params, "from step {start}");
        assert_eq!(ahead.last.loss.to_bits(), in_step.last.loss.to_bits());
    }
}

/// The GPU kernels count with 32 bits: a job past that is refused before it
/// starts rather than copied in part.
#[test]
fn gpu_jobs_past_32_bit_sizes_are_refused() {
    assert!(super::check_gpu_sizes(1_000_000, 64).is_ok());
    assert!(super::check_gpu_sizes(i32::MAX as u64, 1).is_ok());
    for (rows, dim) in [(i32::MAX as u64 + 1, 1), (100_000_000, 64)] {
        let err = super::check_gpu_sizes(rows, dim).expect_err("too large");
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        assert!(err.to_string().contains(&format!("{rows} rows")), "{err}");
    }
}

/// A job with a filter trains on the rows it selects: its steps count
/// them, its batches hold only them, and a filter that selects nothing or
/// names no column is refused.
#[test]
fn a_filter_chooses_the_rows_a_job_trains_on() {
    let data = dataset(1000);
    let mut s = spec(2);
    s.filter = "class = 1 OR name LIKE '%7'".into();
    let job = prepare(s.clone(), &data).expect("valid job");
    let selected: Vec<u64> = {
        let all = Job::prepare(spec(2), &data, None).expect("valid job");
        (0..1000)
            .filter(|&i| all.data.gather_labels(std::iter::once(i))[0] == 1.0 || i % 10 == 7)
            .collect()
    };
    assert!(!selected.is_empty() && selected.len() < 1000);
    assert_eq!(job.data.rows(), selected.len() as u64);
    assert!(!job.data.every_row());
    // Row i of the job is the i-th selected stored row.
    let every = Job::prepare(spec(2), &data, None).expect("valid job");
    let (x, y) = job.data.gather(0..job.data.rows());
    let (want_x, want_y) = every.data.gather(selected.iter().copied());
    assert_eq!((x, y), (want_x, want_y));
    let per_rank = selected.len() as u64 / 2;
    assert_eq!(job.total_steps(), per_rank / 16);
    let outcome = run(&job, None);
    assert_eq!(outcome.steps, job.total_steps());
    assert!(outcome.last.loss.is_finite());

    s.filter = "class > 5".into();
    let err = prepare(s.clone(), &data).expect_err("selects nothing");
    assert!(
        err.to_string()
            .contains("selects none of the dataset's rows"),
        "{err}"
    );
    s.filter = "nope > 1".into();
    let err = prepare(s, &data).expect_err("no such column");
    assert!(err.to_string().contains("nope"), "{err}");
}

/// [`dataset`] with nulls: `s` null in rows `i % 10 == 3`, `class` in rows
/// `i % 10 == 5`, one item of `vec` in rows `i % 10 == 7`.
fn dataset_with_nulls(n: usize) -> SealedData {
    let full = dataset(n);
    let item = Arc::new(Field::new("item", DataType::Float32, true));
    let schema = Arc::new(Schema::new(vec![
        Field::new("vec", DataType::FixedSizeList(item.clone(), 2), false),
        Field::new("s", DataType::Float32, true),
        Field::new("class", DataType::Int32, true),
        Field::new("target", DataType::Float32, false),
        Field::new("name", DataType::Utf8, false),
    ]));
    fn kept<T>(i: usize, k: usize, v: T) -> Option<T> {
        (i % 10 != k).then_some(v)
    }
    let mut start = 0;
    let batches: Vec<RecordBatch> =
        full.batches()
            .iter()
            .map(|b| {
                let rows = start..start + b.num_rows();
                start = rows.end;
                let vec = b.column(0).as_fixed_size_list();
                let items = vec.values().as_primitive::<arrow::datatypes::Float32Type>();
                let items = Float32Array::from_iter(rows.clone().enumerate().flat_map(|(r, i)| {
                    [kept(i, 7, items.value(2 * r)), Some(items.value(2 * r + 1))]
                }));
                let s = b.column(1).as_primitive::<arrow::datatypes::Float32Type>();
                let class = b.column(2).as_primitive::<arrow::datatypes::Int32Type>();
                let columns: Vec<ArrayRef> = vec![
                    Arc::new(FixedSizeListArray::new(
                        item.clone(),
                        2,
                        Arc::new(items),
                        None,
                    )),
                    Arc::new(Float32Array::from_iter(
                        rows.clone()
                            .enumerate()
                            .map(|(r, i)| kept(i, 3, s.value(r))),
                    )),
                    Arc::new(Int32Array::from_iter(
                        rows.clone()
                            .enumerate()
                            .map(|(r, i)| kept(i, 5, class.value(r))),
                    )),
                    b.column(3).clone(),
                    b.column(4).clone(),
                ];
                RecordBatch::try_new(schema.clone(), columns).expect("batch")
            })
            .collect();
    one_partition(schema, batches)
}

/// Nulls in a feature or the label: refused on a job without a filter,
/// pointing at one; a filter that leaves the null rows out trains on the
/// rest; a filter that keeps one is refused naming the column and the row.
#[test]
fn a_filter_can_leave_out_the_rows_with_nulls() {
    let data = dataset_with_nulls(500);
    let err = prepare(spec(2), &data).expect_err("nulls");
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    assert!(
        err.to_string().contains("feature column 'vec' has nulls")
            && err.to_string().contains("IS NOT NULL"),
        "{err}"
    );

    let mut s = spec(2);
    s.filter = r#""s" IS NOT NULL AND "class" IS NOT NULL AND name NOT LIKE '%7'"#.into();
    let job = prepare(s.clone(), &data).expect("the filter leaves the nulls out");
    let kept: Vec<u64> = (0..500u64)
        .filter(|i| ![3, 5, 7].contains(&(i % 10)))
        .collect();
    assert_eq!(job.data.rows(), kept.len() as u64);
    // The rows trained on hold the dataset's values.
    let every = Job::prepare(spec(2), &dataset(500), None).expect("valid job");
    assert_eq!(
        job.data.gather(0..job.data.rows()),
        every.data.gather(kept.iter().copied())
    );
    let outcome = run(&job, None);
    assert_eq!(outcome.steps, job.total_steps());
    assert!(outcome.last.loss.is_finite());

    for (filter, column, row) in [
        (
            r#""class" IS NOT NULL AND name NOT LIKE '%7'"#,
            "feature column 's'",
            3,
        ),
        (
            r#""s" IS NOT NULL AND name NOT LIKE '%7' AND target > -100"#,
            "label column 'class'",
            5,
        ),
        (
            r#""s" IS NOT NULL AND "class" IS NOT NULL AND name LIKE '%17'"#,
            "feature column 'vec'",
            17,
        ),
    ] {
        s.filter = filter.into();
        let err = prepare(s.clone(), &data).expect_err("a selected row has a null");
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        assert!(
            err.to_string().starts_with(&format!(
                "{column} is null at row {row}, a row the job's filter selects"
            )),
            "{filter}: {err}"
        );
    }
}

/// A loss that is no longer a number stops every rank at that step with
/// the advice to lower the learning rate, instead of training on NaN to
/// the end.
#[test]
fn a_loss_that_is_not_finite_stops_the_job_at_its_step() {
    let cancel = AtomicBool::new(false);
    let hooks = quiet_hooks(&cancel);
    let mut s = spec(2);
    s.lr = 1e30;
    s.epochs = 3;
    let job = prepare(s, &dataset(600)).expect("valid job");
    let err = job.run(None, &hooks).expect_err("diverges");
    let Error::FailedPrecondition(m) = &err else {
        panic!("{err:?}");
    };
    assert!(m.contains("the loss of the global batch is"), "{m}");
    assert!(
        m.contains("lower lr (this job's: 1000000000000000000000000000000)"),
        "{m}"
    );
    let step: u64 = m["training stopped at step ".len()..]
        .split(' ')
        .next()
        .and_then(|s| s.parse().ok())
        .expect("a step");
    assert!(step > 0 && step < job.total_steps(), "{m}");
}

/// A NaN or infinite feature value in a row a job trains on is refused
/// before it starts, naming the column and the row (trained on, it would
/// turn the weights it reaches to NaN while the ReLU kept the loss a
/// number); a filter that leaves the row out trains.
#[test]
fn features_that_are_not_numbers_are_refused_naming_the_row() {
    let data = dataset(600);
    let with = |column: &str, row: usize, value: f32| {
        let mut batches = data.batches().to_vec();
        let i = batches[0].schema().index_of(column).expect("column");
        let (b, r) = (row / 97, row % 97);
        let array = batches[b].column(i);
        let mut columns = batches[b].columns().to_vec();
        columns[i] = match array.data_type() {
            DataType::FixedSizeList(field, width) => {
                let list = array.as_fixed_size_list();
                let mut values = list
                    .values()
                    .as_primitive::<Float32Type>()
                    .values()
                    .to_vec();
                values[r * *width as usize + 1] = value;
                Arc::new(FixedSizeListArray::new(
                    field.clone(),
                    *width,
                    Arc::new(Float32Array::from(values)),
                    None,
                )) as ArrayRef
            }
            _ => {
                let mut values = array.as_primitive::<Float32Type>().values().to_vec();
                values[r] = value;
                Arc::new(Float32Array::from(values))
            }
        };
        batches[b] = RecordBatch::try_new(batches[b].schema(), columns).expect("batch");
        SealedData::from_batches(batches[0].schema(), vec![], batches)
    };
    for (column, row, value, shown) in [
        ("s", 102, f32::NAN, "NaN"),
        ("vec", 300, f32::INFINITY, "inf"),
        ("vec", 5, f32::NEG_INFINITY, "-inf"),
    ] {
        let data = with(column, row, value);
        let err = prepare(spec(2), &data).expect_err("not a number");
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        let want = format!("feature column '{column}' holds {shown} at row {row};");
        assert!(err.to_string().contains(&want), "{err}");
        // A filter that keeps the row: refused, naming it as selected.
        let mut s = spec(2);
        s.filter = "class >= 0".into();
        let err = prepare(s, &data).expect_err("selected");
        assert!(
            err.to_string().contains(&format!(
                "holds {shown} at row {row}, a row the job's filter selects"
            )),
            "{err}"
        );
    }
    // Regression labels are checked too.
    let mut s = spec(2);
    s.task = TaskSpec::Regression;
    s.label = "target".into();
    let err = prepare(s.clone(), &with("target", 42, f32::NAN)).expect_err("label");
    assert!(
        err.to_string()
            .contains("label column 'target' holds NaN at row 42;"),
        "{err}"
    );
    // Left out as the message says, the job trains.
    let data = with("s", 102, f32::NAN);
    let mut s = spec(2);
    s.filter = "isnan(s) = false".into();
    let job = prepare(s, &data).expect("the filter leaves the row out");
    assert_eq!(job.data.rows(), 599);
    let outcome = run(&job, None);
    assert!(outcome.last.loss.is_finite());
    assert!(outcome.params.iter().flatten().all(|v| v.is_finite()));
}

/// `data` with its `vec` column as Spark writes `array<float>`: a list
/// column, row `r` of stored batch `b` holding `lengths(b, r)` of its
/// values in turn (2: the row's two values).
fn with_vec_as_list(data: &SealedData, lengths: impl Fn(usize, usize) -> usize) -> SealedData {
    let item = Arc::new(Field::new("item", DataType::Float32, true));
    let mut fields: Vec<Field> = data
        .schema()
        .fields()
        .iter()
        .map(|f| f.as_ref().clone())
        .collect();
    fields[0] = Field::new("vec", DataType::List(item.clone()), false);
    let schema = Arc::new(Schema::new(fields));
    let batches = data
        .batches()
        .iter()
        .enumerate()
        .map(|(b, batch)| {
            let vec = batch.column(0).as_fixed_size_list();
            let values = vec.values().as_primitive::<Float32Type>();
            let mut offsets = vec![0i32];
            let mut kept = Vec::new();
            for r in 0..batch.num_rows() {
                let n = lengths(b, r);
                kept.extend((0..n).map(|i| values.value(r * 2 + i % 2)));
                offsets.push(kept.len() as i32);
            }
            let list = arrow::array::ListArray::new(
                item.clone(),
                arrow::buffer::OffsetBuffer::new(offsets.into()),
                Arc::new(Float32Array::from(kept)),
                None,
            );
            let mut columns = batch.columns().to_vec();
            columns[0] = Arc::new(list);
            RecordBatch::try_new(schema.clone(), columns).expect("batch")
        })
        .collect();
    one_partition(schema, batches)
}

/// A list feature column whose rows all hold the same number of values
/// (Spark's `array<float>`) trains exactly as the `fixed_size_list` it
/// is; lists whose rows differ in length, within a stored batch or from
/// one batch to the next, are refused naming the rows.
#[test]
fn a_list_of_one_length_trains_as_its_fixed_size_list() {
    let fixed = dataset(300);
    let listed = with_vec_as_list(&fixed, |_, _| 2);
    let outcome =
        |data: &SealedData| run(&Job::prepare(spec(2), data, None).expect("valid job"), None);
    assert_eq!(outcome(&fixed).params, outcome(&listed).params);

    let refused = |data: &SealedData| {
        Job::prepare(spec(1), data, None)
            .expect_err("refused")
            .to_string()
    };
    let ragged = with_vec_as_list(&fixed, |b, r| if b == 1 && r == 5 { 3 } else { 2 });
    assert!(
        refused(&ragged).contains(
            "feature column 'vec' is a list whose rows hold different numbers of values (row 97 \
             holds 2, row 102 holds 3)"
        ),
        "{}",
        refused(&ragged)
    );
    let shifting = with_vec_as_list(&fixed, |b, _| if b == 0 { 2 } else { 1 });
    assert!(
        refused(&shifting).contains(
            "feature column 'vec' is a list whose rows hold different numbers of values (rows \
             before row 97 hold 2, row 97 holds 1)"
        ),
        "{}",
        refused(&shifting)
    );
    let empty = with_vec_as_list(&fixed, |_, _| 0);
    assert!(refused(&empty).contains("feature column 'vec' holds empty lists (row 0)"));
}

/// Stored batches that are slices of larger ones (a derived dataset's, say),
/// whose list offsets do not start at 0, train on their own rows' values:
/// as the `fixed_size_list` sliced alike, with a null row or without.
#[test]
fn a_sliced_list_of_one_length_trains_on_its_own_rows() {
    let sliced = |data: &SealedData| {
        let batches = data
            .batches()
            .iter()
            .map(|b| b.slice(b.num_rows() / 4, b.num_rows() / 2))
            .collect();
        one_partition(data.schema().clone(), batches)
    };
    let fixed = dataset(300);
    let outcome = |data: &SealedData| {
        let job = Job::prepare(spec(2), &sliced(data), None).expect("valid job");
        run(&job, None).params
    };
    assert_eq!(
        outcome(&fixed),
        outcome(&with_vec_as_list(&fixed, |_, _| 2))
    );
}
