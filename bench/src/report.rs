//! Figures of a run: per-phase timings, throughput and latency percentiles,
//! printed as a table and written as JSON.

use std::time::Duration;

use serde_json::{Value, json};

/// One measured run of one phase against one target; the default is an
/// empty one (no time, no latencies), the start of a phase timed in parts.
#[derive(Debug, Clone, Default)]
pub struct Sample {
    /// Wall time of the phase.
    pub elapsed: Duration,
    /// Per-batch (get) or per-partition (put) latencies.
    pub latencies: Vec<Duration>,
}

impl Sample {
    /// This run followed by `next`: the two wall times added and the
    /// latencies of both, for a phase timed in parts run one after another.
    pub fn then(mut self, next: Sample) -> Sample {
        self.elapsed += next.elapsed;
        self.latencies.extend(next.latencies);
        self
    }
}

/// All repetitions of one phase against one target.
#[derive(Debug, Clone)]
pub struct Measured {
    /// Phase name, e.g. `get/global`.
    pub phase: String,
    /// `flightdeck`, `pyarrow`, `parquet` or `limit`.
    pub target: String,
    /// Rows moved per repetition.
    pub rows: u64,
    /// Payload bytes moved per repetition.
    pub bytes: u64,
    /// The repetitions.
    pub samples: Vec<Sample>,
}

/// The `q`-quantile (0..=1) of `values`, by nearest rank.
pub fn quantile(values: &[Duration], q: f64) -> Duration {
    if values.is_empty() {
        return Duration::ZERO;
    }
    let mut v = values.to_vec();
    v.sort_unstable();
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

impl Measured {
    /// Median wall time over the repetitions.
    pub fn median(&self) -> Duration {
        let times: Vec<Duration> = self.samples.iter().map(|s| s.elapsed).collect();
        quantile(&times, 0.5)
    }

    /// Payload GB/s at the median time.
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / self.median().as_secs_f64().max(1e-9) / 1e9
    }

    /// Rows/s at the median time.
    pub fn rows_per_s(&self) -> f64 {
        self.rows as f64 / self.median().as_secs_f64().max(1e-9)
    }

    fn all_latencies(&self) -> Vec<Duration> {
        self.samples
            .iter()
            .flat_map(|s| s.latencies.iter().copied())
            .collect()
    }

    /// JSON form.
    pub fn to_json(&self) -> Value {
        let lat = self.all_latencies();
        json!({
            "phase": self.phase,
            "target": self.target,
            "rows": self.rows,
            "payload_bytes": self.bytes,
            "median_s": self.median().as_secs_f64(),
            "runs_s": self.samples.iter().map(|s| s.elapsed.as_secs_f64()).collect::<Vec<_>>(),
            "rows_per_s": self.rows_per_s(),
            "payload_gb_per_s": self.gbps(),
            "latency_p50_ms": quantile(&lat, 0.5).as_secs_f64() * 1e3,
            "latency_p99_ms": quantile(&lat, 0.99).as_secs_f64() * 1e3,
        })
    }
}

/// The human table.
pub fn table(results: &[Measured]) -> String {
    let mut out = format!(
        "{:<14} {:<11} {:>9} {:>12} {:>9} {:>9} {:>9}\n",
        "phase", "target", "median s", "rows/s", "GB/s", "p50 ms", "p99 ms"
    );
    for m in results {
        let lat = m.all_latencies();
        let (p50, p99) = if lat.is_empty() {
            ("-".to_string(), "-".to_string())
        } else {
            (
                format!("{:.2}", quantile(&lat, 0.5).as_secs_f64() * 1e3),
                format!("{:.2}", quantile(&lat, 0.99).as_secs_f64() * 1e3),
            )
        };
        out += &format!(
            "{:<14} {:<11} {:>9.3} {:>12.0} {:>9.3} {:>9} {:>9}\n",
            m.phase,
            m.target,
            m.median().as_secs_f64(),
            m.rows_per_s(),
            m.gbps(),
            p50,
            p99
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_by_nearest_rank() {
        let v: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(quantile(&v, 0.5), Duration::from_millis(50));
        assert_eq!(quantile(&v, 0.99), Duration::from_millis(99));
        assert_eq!(quantile(&[], 0.5), Duration::ZERO);
    }

    #[test]
    fn a_phase_timed_in_parts_is_one_sample_of_all_its_rows_over_the_summed_time() {
        let ms = Duration::from_millis;
        let part = |t, l: &[u64]| Sample {
            elapsed: ms(t),
            latencies: l.iter().map(|&x| ms(x)).collect(),
        };
        // Three nodes of 750, 625 and 625 rows: one sample of 2000 rows.
        let round = part(300, &[1, 2])
            .then(part(200, &[3]))
            .then(part(500, &[]));
        assert_eq!(round.elapsed, ms(1000));
        assert_eq!(round.latencies, vec![ms(1), ms(2), ms(3)]);
        let m = Measured {
            phase: "cluster/node".into(),
            target: "flightdeck".into(),
            rows: 2000,
            bytes: 2_000_000_000,
            samples: vec![round],
        };
        assert!((m.gbps() - 2.0).abs() < 1e-9);
    }
}
