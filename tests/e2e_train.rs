//! Training through the Flight API: datasets ingested over `DoPut` and
//! sealed, jobs submitted with action `train` on CPU ranks (classification
//! with AdamW, regression with SGD), progress streamed back, checkpoints
//! written and resumed, bad jobs refused, a job that fails shown `failed`
//! (one whose loss diverges among them), and a job cancelled when its
//! caller hangs up.

use std::sync::Arc;

use arrow::array::{Float32Array, Int64Array, RecordBatch};
use arrow::datatypes::{DataType, Field, Schema};
use flightdeck_client::{
    Client, Code, OptimizerKind, SealDataset, Shuffle, Task, TrainJob, TrainProgress,
};
use flightdeck_server::ServerConfig;
use flightdeck_tests::{TestServer, temp_dir, test_config, timed};
use futures::{StreamExt, TryStreamExt, stream};

/// `n` points in [-1, 1]², labelled by `label`, points for which `keep`
/// fails left out; written as 4 partitions and sealed.
async fn write_points(
    c: &mut Client,
    name: &str,
    n: usize,
    label: impl Fn(f32, f32) -> Option<i64>,
) -> usize {
    let schema = Arc::new(Schema::new(vec![
        Field::new("x", DataType::Float32, false),
        Field::new("y", DataType::Float32, false),
        Field::new("label", DataType::Int64, false),
    ]));
    let (mut xs, mut ys, mut ls) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..n {
        // A low-discrepancy spread over the square.
        let x = ((i as f64 * 0.754_877_666) % 1.0) as f32 * 2.0 - 1.0;
        let y = ((i as f64 * 0.569_840_291) % 1.0) as f32 * 2.0 - 1.0;
        if let Some(l) = label(x, y) {
            xs.push(x);
            ys.push(y);
            ls.push(l);
        }
    }
    let rows = xs.len();
    let quarter = rows.div_ceil(4);
    for p in 0..4 {
        let (a, b) = ((p * quarter).min(rows), ((p + 1) * quarter).min(rows));
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(Float32Array::from(xs[a..b].to_vec())),
                Arc::new(Float32Array::from(ys[a..b].to_vec())),
                Arc::new(Int64Array::from(ls[a..b].to_vec())),
            ],
        )
        .expect("batch");
        timed(
            "put",
            c.put_partition(name, p as u32, 0, schema.clone(), stream::iter([Ok(batch)])),
        )
        .await
        .expect("put");
    }
    timed(
        "seal",
        c.seal(SealDataset {
            dataset: name.into(),
            partitions: 4,
            ..Default::default()
        }),
    )
    .await
    .expect("seal");
    rows
}

/// Three classes cut by lines through the square, with a margin.
fn three_classes(x: f32, y: f32) -> Option<i64> {
    let scores = [x + y, x - y - 0.3, -x + 0.2];
    let mut order: Vec<(usize, f32)> = scores.iter().copied().enumerate().collect();
    order.sort_by(|a, b| b.1.total_cmp(&a.1));
    (order[0].1 - order[1].1 > 0.1).then_some(order[0].0 as i64)
}

/// XOR of the signs, away from the axes.
fn xor(x: f32, y: f32) -> Option<i64> {
    (x.abs() > 0.1 && y.abs() > 0.1).then_some(i64::from((x > 0.0) != (y > 0.0)))
}

fn job(dataset: &str) -> TrainJob {
    TrainJob {
        dataset: dataset.into(),
        features: vec!["x".into(), "y".into()],
        label: "label".into(),
        task: Task::Classification.into(),
        classes: 3,
        optimizer: OptimizerKind::OptimizerAdamw.into(),
        learning_rate: 0.05,
        batch_size: 64,
        epochs: 10,
        seed: 5,
        shuffle: Shuffle::Global.into(),
        cpu_ranks: 2,
        ..Default::default()
    }
}

async fn run_to_end(c: &mut Client, job: TrainJob) -> Vec<TrainProgress> {
    let stream = timed("train", c.train(job)).await.expect("train starts");
    timed("training", stream.try_collect::<Vec<_>>())
        .await
        .expect("training finishes")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn softmax_regression_separates_three_classes() {
    let server = TestServer::start().await;
    let mut c = server.client().await;
    let rows = write_points(&mut c, "three", 3000, three_classes).await;
    let reports = run_to_end(&mut c, job("three")).await;
    let last = reports.last().expect("a final report");
    assert!(last.done);
    let accuracy = last.accuracy.expect("classification accuracy");
    assert!(accuracy >= 0.95, "accuracy {accuracy} on {rows} rows");
    // Progress went forward, with throughput and stall figures.
    assert!(reports.len() >= 10, "{} reports", reports.len());
    assert!(reports.windows(2).all(|w| w[0].step <= w[1].step));
    assert_eq!(last.total_steps, (rows as u64 / 64) * 10);
    assert!(
        reports[..reports.len() - 1]
            .iter()
            .all(|p| p.samples_per_second > 0.0)
    );
    assert!(
        reports
            .iter()
            .all(|p| (0.0..=1.0).contains(&p.data_stall_fraction))
    );
    let jobs = c.jobs(last.job).await.expect("job status");
    assert_eq!(jobs.jobs[0].state, "finished");
    assert_eq!(jobs.jobs[0].step, last.total_steps);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_loss_is_no_longer_a_number_fails_at_that_step() {
    let server = TestServer::start().await;
    let mut c = server.client().await;
    write_points(&mut c, "wild", 1000, three_classes).await;
    let diverging = TrainJob {
        hidden: vec![8],
        learning_rate: 1e30,
        ..job("wild")
    };
    let stream = timed("train", c.train(diverging))
        .await
        .expect("train starts");
    let err = timed("training", stream.try_collect::<Vec<_>>())
        .await
        .expect_err("the loss diverges");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    assert!(
        err.to_string().contains("training stopped at step"),
        "{err}"
    );
    assert!(
        err.to_string().contains("start again with a lower lr"),
        "{err}"
    );
    let jobs = c.jobs(0).await.expect("jobs").jobs;
    let failed = jobs.iter().max_by_key(|j| j.job).expect("the job");
    assert_eq!(failed.state, "failed", "{failed:?}");
    assert!(failed.step < failed.total_steps, "{failed:?}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mlp_fits_xor() {
    let server = TestServer::start().await;
    let mut c = server.client().await;
    write_points(&mut c, "xor", 2000, xor).await;
    let mut j = job("xor");
    j.classes = 2;
    j.hidden = vec![16, 16];
    j.learning_rate = 0.01;
    j.epochs = 30;
    j.cpu_ranks = 4;
    let reports = run_to_end(&mut c, j.clone()).await;
    let accuracy = reports.last().and_then(|p| p.accuracy).expect("accuracy");
    assert!(accuracy >= 0.95, "MLP accuracy on XOR {accuracy}");
    // A linear model cannot: XOR is the point of the hidden layers.
    j.hidden = vec![];
    let reports = run_to_end(&mut c, j).await;
    let linear = reports.last().and_then(|p| p.accuracy).expect("accuracy");
    assert!(linear < 0.8, "a linear model fits XOR to {linear}?");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regression_with_sgd_fits_a_plane() {
    let server = TestServer::start().await;
    let mut c = server.client().await;
    // label = round(20x − 10y + 3): a plane, and the rounding's noise
    // (mean squared error 1/12) is what is left to fit.
    write_points(&mut c, "plane", 2000, |x, y| {
        Some((20.0 * x - 10.0 * y + 3.0).round() as i64)
    })
    .await;
    let mut j = job("plane");
    j.task = Task::Regression.into();
    j.classes = 0;
    j.optimizer = OptimizerKind::OptimizerSgd.into();
    j.momentum = 0.9;
    j.learning_rate = 0.02;
    j.epochs = 20;
    let reports = run_to_end(&mut c, j.clone()).await;
    let (first, last) = (&reports[0], reports.last().expect("final"));
    assert!(last.done && last.accuracy.is_none(), "{last:?}");
    // From the label's spread (≈ 170) to the rounding noise.
    assert!(first.loss > 10.0, "{first:?}");
    assert!(last.loss < 0.5, "{reports:#?}");

    // SGD is not AdamW under another name: the same job with AdamW and the
    // same rate ends elsewhere.
    let mut adamw = j;
    adamw.optimizer = OptimizerKind::OptimizerAdamw.into();
    let other = run_to_end(&mut c, adamw).await;
    assert_ne!(other.last().expect("final").loss, last.loss);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_resume_over_the_api() {
    let dir = temp_dir("ckpt");
    let server = TestServer::start_with(ServerConfig {
        memory_limit: 1 << 30,
        checkpoint_root: Some(dir.to_path_buf()),
        ..test_config()
    })
    .await;
    let mut c = server.client().await;
    write_points(&mut c, "ck", 1000, three_classes).await;
    // Relative to the server's checkpoint root; answered with the full URL.
    let url = format!("file://{}/run", dir.display());
    let mut whole = job("ck");
    whole.epochs = 3;
    let uninterrupted = run_to_end(&mut c, whole.clone()).await;

    let mut first = whole.clone();
    first.max_steps = 7;
    first.checkpoint_url = "run".into();
    first.checkpoint_every = 5;
    let reports = run_to_end(&mut c, first).await;
    let written: Vec<&str> = reports
        .iter()
        .map(|p| p.checkpoint.as_str())
        .filter(|c| !c.is_empty())
        .collect();
    assert!(
        written.contains(&format!("{url}/step-0000000005.safetensors").as_str()),
        "{written:?}"
    );
    let last = reports.last().expect("final");
    assert_eq!((last.step, last.done), (7, true));
    assert_eq!(
        last.checkpoint,
        format!("{url}/step-0000000007.safetensors")
    );
    assert!(dir.join("run/step-0000000007.safetensors").exists());

    let mut rest = whole;
    rest.resume_from = last.checkpoint.clone();
    let resumed = run_to_end(&mut c, rest).await;
    let (a, b) = (
        uninterrupted.last().expect("final"),
        resumed.last().expect("final"),
    );
    assert_eq!(a.step, b.step);
    assert!(
        (a.loss - b.loss).abs() <= 1e-6 * a.loss.abs().max(1e-3),
        "{} vs {}",
        a.loss,
        b.loss
    );
    assert_eq!(a.accuracy, b.accuracy);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_checkpoints_go_and_memory_ones_count_against_the_budget() {
    let dir = temp_dir("keep");
    let server = TestServer::start_with(ServerConfig {
        memory_limit: 16 << 20,
        checkpoint_root: Some(dir.to_path_buf()),
        checkpoint_prefixes: vec!["memory://".into()],
        ..test_config()
    })
    .await;
    let mut c = server.client().await;
    write_points(&mut c, "k", 1000, three_classes).await;
    let mut every_two = job("k");
    every_two.max_steps = 10;
    every_two.checkpoint_every = 2;
    every_two.keep_checkpoints = 2;

    // On disk: the two newest stay.
    let mut on_disk = every_two.clone();
    on_disk.checkpoint_url = "run".into();
    let reports = run_to_end(&mut c, on_disk).await;
    let written: std::collections::BTreeSet<&str> = reports
        .iter()
        .map(|p| p.checkpoint.as_str())
        .filter(|c| !c.is_empty())
        .collect();
    assert_eq!(written.len(), 5, "{written:?}");
    let mut left: Vec<String> = std::fs::read_dir(dir.join("run"))
        .expect("the checkpoint folder")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(
        left,
        ["step-0000000008.safetensors", "step-0000000010.safetensors"]
    );
    let size = std::fs::metadata(dir.join("run/step-0000000010.safetensors"))
        .expect("a checkpoint")
        .len();

    // In memory: the two newest, in the budget.
    let before = c.stats().await.expect("stats").memory_used;
    let mut in_memory = every_two.clone();
    in_memory.checkpoint_url = "memory://m".into();
    let last = run_to_end(&mut c, in_memory).await;
    let after = c.stats().await.expect("stats").memory_used;
    // (Checkpoints differ by a few bytes of metadata, such as the loss.)
    assert!(
        (after - before).abs_diff(2 * size) <= 2 * 64,
        "{} bytes held for two checkpoints of ~{size}",
        after - before
    );
    // The newest can be resumed from.
    let mut resumed = every_two.clone();
    resumed.max_steps = 12;
    resumed.resume_from = last.last().expect("final").checkpoint.clone();
    assert_eq!(
        run_to_end(&mut c, resumed)
            .await
            .last()
            .expect("final")
            .step,
        12
    );

    // A model whose checkpoints do not fit the budget is stopped, and told why.
    let mut big = every_two;
    big.hidden = vec![1024, 1024];
    big.checkpoint_url = "memory://big".into();
    let stream = c.train(big).await.expect("train starts");
    let err = stream
        .try_collect::<Vec<_>>()
        .await
        .expect_err("the checkpoint does not fit");
    assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
    assert!(err.to_string().contains("--checkpoint-root"), "{err}");
    // Its status says so after the stream has gone: failed, with the reason.
    let jobs = c.jobs(0).await.expect("jobs").jobs;
    let failed = jobs.iter().max_by_key(|j| j.job).expect("the job");
    assert_eq!(failed.state, "failed", "{failed:?}");
    assert!(failed.error.contains("--checkpoint-root"), "{failed:?}");
    assert!(failed.step < failed.total_steps, "{failed:?}");
    // (Its first checkpoint fitted, and stays for a resume.)
    assert!(c.stats().await.expect("stats").memory_used <= 16 << 20);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unwritable_places_fail_before_the_work_not_after() {
    let dir = temp_dir("unwritable");
    // A file where a folder would have to be: nothing can be written under it.
    std::fs::write(dir.join("blocked"), b"a file").expect("write");
    let err = flightdeck_server::state::State::open(
        ServerConfig {
            spill_url: Some(dir.join("blocked/store").display().to_string()),
            ..test_config()
        },
        "grpc://test".into(),
    )
    .await
    .expect_err("the spill store cannot be written");
    assert!(err.to_string().contains("--spill-url"), "{err}");
    assert!(err.to_string().contains("blocked/store"), "{err}");
    // The default store under --data-dir: the flag given is named.
    let err = flightdeck_server::state::State::open(
        ServerConfig {
            data_dir: dir.join("blocked/data"),
            spill_url: None,
            ..test_config()
        },
        "grpc://test".into(),
    )
    .await
    .expect_err("the data folder cannot be written");
    assert!(
        err.to_string().contains(&format!(
            "(the store under --data-dir '{}': give a --data-dir this server may write",
            dir.join("blocked/data").display()
        )),
        "{err}"
    );

    let server = TestServer::start_with(ServerConfig {
        checkpoint_root: Some(dir.to_path_buf()),
        ..test_config()
    })
    .await;
    let mut c = server.client().await;
    write_points(&mut c, "u", 500, three_classes).await;
    let mut j = job("u");
    j.checkpoint_url = "blocked/run".into();
    let refused = match c.train(j).await {
        Err(e) => e,
        Ok(stream) => stream
            .try_collect::<Vec<_>>()
            .await
            .expect_err("refused before it starts"),
    };
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused}");
    assert!(refused.to_string().contains("blocked/run"), "{refused}");
    assert!(
        refused.to_string().contains("cannot be written"),
        "{refused}"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_jobs_get_invalid_argument_and_hanging_up_cancels() {
    let server = TestServer::start().await;
    let mut c = server.client().await;
    write_points(&mut c, "d", 500, three_classes).await;
    let refused = |j: TrainJob| {
        let uri = server.uri();
        async move {
            let mut c = Client::connect(uri).await.expect("connect");
            match c.train(j).await {
                Err(e) => e,
                Ok(s) => s.try_collect::<Vec<_>>().await.expect_err("refused"),
            }
        }
    };
    for (change, code, needle) in [
        (
            Box::new(|j: &mut TrainJob| j.features.push("nope".into()))
                as Box<dyn Fn(&mut TrainJob)>,
            Code::InvalidArgument,
            "feature column 'nope'",
        ),
        (
            Box::new(|j| j.classes = 2),
            Code::InvalidArgument,
            "outside the 2 classes",
        ),
        (
            Box::new(|j| j.cpu_ranks = 3),
            Code::InvalidArgument,
            "not divisible by the 3 ranks",
        ),
        (
            Box::new(|j| j.dataset = "missing".into()),
            Code::NotFound,
            "'missing'",
        ),
        (
            Box::new(|j| j.gpus = vec![0]),
            Code::FailedPrecondition,
            "no CUDA driver",
        ),
        (
            Box::new(|j| j.resume_from = "nothing/here".into()),
            Code::InvalidArgument,
            "cannot read checkpoint",
        ),
        // Checkpoints stay under the server's checkpoint root.
        (
            Box::new(|j| j.resume_from = "memory://nothing/here".into()),
            Code::PermissionDenied,
            "outside this server's checkpoint root",
        ),
        (
            Box::new(|j| j.resume_from = "/etc/hostname".into()),
            Code::PermissionDenied,
            "resume_from '/etc/hostname' is outside",
        ),
        (
            Box::new(|j| j.checkpoint_url = "file:///tmp".into()),
            Code::PermissionDenied,
            "--checkpoint-root",
        ),
        (
            Box::new(|j| j.checkpoint_url = "../../elsewhere".into()),
            Code::PermissionDenied,
            "--checkpoint-root",
        ),
    ] {
        let mut j = job("d");
        change(&mut j);
        let err = refused(j).await;
        assert_eq!(err.code(), code, "{err}");
        assert!(err.message().contains(needle), "{err} lacks {needle}");
    }

    // A long job whose caller hangs up is cancelled.
    let mut long = job("d");
    long.epochs = 100_000;
    long.batch_size = 2;
    let mut stream = c.train(long).await.expect("starts");
    let first = timed("first report", stream.next())
        .await
        .expect("a report")
        .expect("ok");
    drop(stream);
    let state = flightdeck_tests::eventually("the job ending once its caller left", || {
        let mut c = c.clone();
        async move {
            let state = c.jobs(first.job).await.expect("status").jobs[0]
                .state
                .clone();
            if state == "running" {
                Err(state)
            } else {
                Ok(state)
            }
        }
    })
    .await;
    assert_eq!(state, "cancelled");
    let all = c.jobs(0).await.expect("all jobs");
    assert!(all.jobs.iter().any(|j| j.job == first.job));
    assert_eq!(
        c.jobs(9999).await.expect_err("unknown").code(),
        Code::NotFound
    );
    server.stop().await;
}
