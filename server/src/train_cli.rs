//! `flightdeck train`: submits a training job to a running server and shows
//! its progress (a bar on a terminal, a line per report otherwise; with
//! `--json`, each report as a line of JSON on stdout).

use std::io::{IsTerminal, Write};

use flightdeck_client::{OptimizerKind, Shuffle, Task, TrainJob, TrainProgress};
use futures::StreamExt;

use crate::admin_cli::{ServerArg, to_json};

/// Flags of `flightdeck train`.
#[derive(Debug, clap::Args)]
pub struct TrainArgs {
    #[command(flatten)]
    server: ServerArg,
    /// Sealed dataset.
    #[arg(long)]
    dataset: String,
    /// Feature columns, comma-separated: numeric, fixed_size_list of numbers,
    /// or a list of numbers whose rows all hold one number of values (Spark's
    /// `array<float>`).
    #[arg(long, value_delimiter = ',', required = true)]
    features: Vec<String>,
    /// Label column.
    #[arg(long)]
    label: String,
    /// Classes of a classification task (integer labels 0 ≤ label <
    /// classes). One of --classes and --regression is required.
    #[arg(
        long,
        conflicts_with = "regression",
        required_unless_present = "regression"
    )]
    classes: Option<u32>,
    /// Regression (squared error on a numeric label) instead of
    /// classification. One of --classes and --regression is required.
    #[arg(long)]
    regression: bool,
    /// Hidden layer sizes of an MLP, comma-separated; none = linear.
    #[arg(long, value_delimiter = ',')]
    hidden: Vec<u32>,
    /// adamw or sgd.
    #[arg(long, default_value = "adamw")]
    optimizer: String,
    /// Learning rate.
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    momentum: f64,
    /// Decoupled weight decay.
    #[arg(long, default_value_t = 0.0)]
    weight_decay: f64,
    /// Samples per step over all ranks.
    #[arg(long, default_value_t = 256)]
    batch_size: u32,
    /// Epochs.
    #[arg(long, default_value_t = 1)]
    epochs: u32,
    /// Seed of the weights and the sample order.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// none, global or block.
    #[arg(long, default_value = "global")]
    shuffle: String,
    /// `cpu`, `cpu:N` (N rank threads) or GPUs like `0,1,2,3` (or `cuda:0,cuda:1`).
    #[arg(long, default_value = "cpu")]
    devices: String,
    /// Folder for checkpoints: a path relative to the server's
    /// --checkpoint-root, or a URL under it or under an allowed prefix.
    #[arg(long)]
    checkpoint_url: Option<String>,
    /// Checkpoint every N steps (0 = only at the end).
    #[arg(long, default_value_t = 0)]
    checkpoint_every: u64,
    /// Checkpoints kept (older ones are deleted as newer ones are written);
    /// 0 = the server's default, 3.
    #[arg(long, default_value_t = 0)]
    keep_checkpoints: u32,
    /// Checkpoint file to continue from (as a job's progress names it).
    #[arg(long)]
    resume_from: Option<String>,
    /// Stop after this many steps in total (0: run every epoch).
    #[arg(long, default_value_t = 0)]
    max_steps: u64,
    /// Train on the rows this SQL condition selects (as a read plan's
    /// filter: `--filter "hash_bucket(id, 10) < 8"`, or `--filter
    /// '"label" IS NOT NULL'` for the labelled rows); default every row.
    #[arg(long, default_value = "")]
    filter: String,
    /// Print each progress report as a line of JSON on stdout (fields named
    /// as `TrainProgress` in flightdeck.proto; the last has `done` true)
    /// instead of the bar and the summary.
    #[arg(long)]
    json: bool,
}

impl TrainArgs {
    fn job(&self) -> Result<TrainJob, String> {
        let optimizer = match self.optimizer.as_str() {
            "adamw" => OptimizerKind::OptimizerAdamw,
            "sgd" => OptimizerKind::OptimizerSgd,
            other => return Err(format!("unknown optimizer '{other}': use adamw or sgd")),
        };
        let shuffle = match self.shuffle.as_str() {
            "none" => Shuffle::None,
            "global" => Shuffle::Global,
            "block" => Shuffle::Block,
            other => {
                return Err(format!(
                    "unknown shuffle '{other}': use none, global or block"
                ));
            }
        };
        let (cpu_ranks, gpus) = match self.devices.as_str() {
            "cpu" => (1, vec![]),
            d if d.starts_with("cpu:") => match d[4..].parse::<u32>() {
                Ok(0) => {
                    return Err(format!(
                        "--devices {d}: a job needs at least one rank; use cpu (one rank) or \
                         cpu:N with N ≥ 1"
                    ));
                }
                Ok(n) => (n, vec![]),
                Err(_) => return Err(format!("--devices {d}: expected cpu:N")),
            },
            d => (
                0,
                d.split(',')
                    .map(crate::config::parse_gpu)
                    .collect::<Result<_, _>>()
                    .map_err(|e| {
                        format!("--devices {d}: expected cpu, cpu:N or GPUs (0,1 or cuda:0); {e}")
                    })?,
            ),
        };
        let (task, classes) = match (self.regression, self.classes) {
            (true, _) => (Task::Regression, 0),
            (false, Some(c)) => (Task::Classification, c),
            (false, None) => return Err("give --classes N, or --regression".into()),
        };
        Ok(TrainJob {
            dataset: self.dataset.clone(),
            features: self.features.clone(),
            label: self.label.clone(),
            task: task.into(),
            classes,
            hidden: self.hidden.clone(),
            optimizer: optimizer.into(),
            learning_rate: self.lr,
            momentum: self.momentum,
            weight_decay: self.weight_decay,
            batch_size: self.batch_size,
            epochs: self.epochs,
            seed: self.seed,
            shuffle: shuffle.into(),
            block_rows: 0,
            cpu_ranks,
            gpus,
            checkpoint_url: self.checkpoint_url.clone().unwrap_or_default(),
            checkpoint_every: self.checkpoint_every,
            resume_from: self.resume_from.clone().unwrap_or_default(),
            max_steps: self.max_steps,
            keep_checkpoints: self.keep_checkpoints,
            filter: self.filter.clone(),
        })
    }
}

fn line(p: &TrainProgress) -> String {
    let width = 30usize;
    let filled = (p.step * width as u64)
        .checked_div(p.total_steps)
        .unwrap_or(0)
        .min(width as u64) as usize;
    let checkpoint = if p.checkpoint.is_empty() {
        String::new()
    } else {
        format!(" checkpoint {}", p.checkpoint)
    };
    format!(
        "[{}{}] step {}/{} epoch {} loss {:.4} {:.0} samples/s data stall {:.0}%{checkpoint}",
        "#".repeat(filled),
        "-".repeat(width - filled),
        p.step,
        p.total_steps,
        p.epoch,
        p.loss,
        p.samples_per_second,
        p.data_stall_fraction * 100.0
    )
}

/// Runs `flightdeck train`.
pub async fn run(args: TrainArgs) -> Result<(), String> {
    let job = args.job()?;
    let mut client = args.server.connect().await?;
    let mut progress = client.train(job).await.map_err(|e| args.server.said(&e))?;
    let tty = std::io::stderr().is_terminal();
    let mut err = std::io::stderr();
    while let Some(p) = progress.next().await {
        let p = p.map_err(|e| {
            if tty {
                eprintln!();
            }
            args.server.said(&e)
        })?;
        if args.json {
            println!("{}", to_json(&p));
            if p.done {
                return Ok(());
            }
            continue;
        }
        if p.done {
            if tty {
                let _ = writeln!(err, "\r\x1b[2K{}", line(&p));
            }
            let accuracy = p
                .accuracy
                .map(|a| format!(", training accuracy {:.4}", a))
                .unwrap_or_default();
            let checkpoint = if p.checkpoint.is_empty() {
                String::new()
            } else {
                format!(", checkpoint {}", p.checkpoint)
            };
            println!(
                "job {} done: {} steps, loss {:.6}{accuracy}{checkpoint}",
                p.job, p.step, p.loss
            );
            return Ok(());
        }
        if tty {
            let _ = write!(err, "\r\x1b[2K{}", line(&p));
        } else {
            let _ = writeln!(err, "{}", line(&p));
        }
    }
    Err("the server ended the job's stream without a final report".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: TrainArgs,
    }

    fn job(devices: &str) -> Result<TrainJob, String> {
        let argv = [
            "train",
            "--dataset",
            "d",
            "--features",
            "x",
            "--label",
            "y",
            "--classes",
            "2",
            "--devices",
            devices,
        ];
        Cli::try_parse_from(argv).expect("parses").args.job()
    }

    #[test]
    fn devices_name_cpu_ranks_or_gpus() {
        let ranks = |d: &str| job(d).map(|j| (j.cpu_ranks, j.gpus));
        assert_eq!(ranks("cpu"), Ok((1, vec![])));
        assert_eq!(ranks("cpu:3"), Ok((3, vec![])));
        assert_eq!(ranks("0, 2"), Ok((0, vec![0, 2])));
        // Zero ranks would be taken as the default single rank: refused.
        let zero = job("cpu:0").expect_err("no ranks");
        assert!(zero.contains("at least one rank"), "{zero}");
        assert!(job("cpu:x").expect_err("bad").contains("expected cpu:N"));
        let bad = job("gpu0").expect_err("bad");
        assert!(bad.contains("expected cpu, cpu:N or GPUs"), "{bad}");
        assert!(bad.contains("'gpu0' is not a GPU"), "{bad}");
        assert_eq!(ranks("cuda:0,cuda:1"), Ok((0, vec![0, 1])));
    }
}
