//! The CPU backend: the same operations over plain vectors, and an
//! in-process all-reduce between the rank threads of one job. A real,
//! deterministic implementation: matrix products in `f32` through
//! matrixmultiply's GEMM, other sums in `f64`, and every rank reduces the
//! ranks' buffers in rank order, so all ranks hold identical parameters
//! after every step.

use std::sync::{Arc, Barrier, Mutex};

use super::backend::Backend;
use super::data::TrainData;

/// The collective of a job's CPU ranks.
#[derive(Debug)]
pub struct CpuGroup {
    world: usize,
    slots: Mutex<Vec<Vec<f64>>>,
    barrier: Barrier,
}

impl CpuGroup {
    /// A group of `world` ranks.
    pub fn new(world: usize) -> Arc<Self> {
        Arc::new(Self {
            world,
            slots: Mutex::new(vec![Vec::new(); world]),
            barrier: Barrier::new(world),
        })
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, Vec<Vec<f64>>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sums `values` over ranks, in rank order.
    fn all_reduce_sum(&self, rank: usize, values: &mut [f64]) {
        if self.world == 1 {
            return;
        }
        self.slots()[rank] = values.to_vec();
        self.barrier.wait();
        {
            let slots = self.slots();
            for (i, v) in values.iter_mut().enumerate() {
                *v = slots.iter().map(|s| s[i]).sum();
            }
        }
        // Nobody overwrites a slot before everyone has read them all.
        self.barrier.wait();
    }
}

/// One CPU rank.
#[derive(Debug)]
pub struct Cpu {
    rank: usize,
    group: Arc<CpuGroup>,
    /// Batches gathered so far, and the one at which to fail (tests).
    batches: u64,
    fail_at_batch: Option<u64>,
    failure: Option<String>,
    gather_ahead: bool,
}

impl Cpu {
    /// Rank `rank` of `group`.
    pub fn new(rank: usize, group: Arc<CpuGroup>) -> Self {
        Self {
            rank,
            group,
            batches: 0,
            fail_at_batch: None,
            failure: None,
            gather_ahead: true,
        }
    }

    /// Makes this rank gather each batch in its step instead of one step
    /// ahead on another thread (the way a device backend does): to test
    /// that both give the same training.
    pub fn gathering_in_step(mut self) -> Self {
        self.gather_ahead = false;
        self
    }

    /// Makes this rank record a failure when it gathers its `k`-th batch
    /// (from 1), the way a device error is recorded: to test what every
    /// rank does when one fails.
    pub fn failing_at_batch(mut self, k: u64) -> Self {
        self.fail_at_batch = Some(k);
        self
    }
}

impl Backend for Cpu {
    type Buf = Vec<f32>;

    fn batch(&mut self, data: &TrainData, rows: &[u64]) -> (Vec<f32>, Vec<f32>) {
        let (x, y) = data.gather(rows.iter().copied());
        self.host_batch(x, y)
    }

    fn gathers_on_host(&self) -> bool {
        self.gather_ahead
    }

    fn host_batch(&mut self, x: Vec<f32>, y: Vec<f32>) -> (Vec<f32>, Vec<f32>) {
        self.batches += 1;
        if self.fail_at_batch == Some(self.batches) && self.failure.is_none() {
            self.failure = Some(format!("injected failure at batch {}", self.batches));
        }
        (x, y)
    }

    fn upload(&mut self, data: &[f32]) -> Vec<f32> {
        data.to_vec()
    }

    fn download(&mut self, buf: &Vec<f32>) -> Vec<f32> {
        buf.clone()
    }

    fn zeros(&mut self, len: usize) -> Vec<f32> {
        vec![0.0; len]
    }

    fn matmul_nt(&mut self, a: &Vec<f32>, b: &Vec<f32>, m: usize, n: usize, k: usize) -> Vec<f32> {
        // B is n × k: its transpose is read with swapped strides.
        gemm(m, n, k, a, (k, 1), b, (1, k))
    }

    fn matmul_tn(&mut self, a: &Vec<f32>, b: &Vec<f32>, m: usize, n: usize, k: usize) -> Vec<f32> {
        // A is k × m: its transpose is read with swapped strides.
        gemm(m, n, k, a, (1, m), b, (n, 1))
    }

    fn matmul_nn(&mut self, a: &Vec<f32>, b: &Vec<f32>, m: usize, n: usize, k: usize) -> Vec<f32> {
        gemm(m, n, k, a, (k, 1), b, (n, 1))
    }

    fn add_row_bias(&mut self, z: &mut Vec<f32>, bias: &Vec<f32>, rows: usize, cols: usize) {
        for r in 0..rows {
            for (v, b) in z[r * cols..(r + 1) * cols].iter_mut().zip(bias) {
                *v += b;
            }
        }
    }

    fn add_row_bias_relu(&mut self, z: &mut Vec<f32>, bias: &Vec<f32>, rows: usize, cols: usize) {
        for r in 0..rows {
            for (v, b) in z[r * cols..(r + 1) * cols].iter_mut().zip(bias) {
                *v = (*v + b).max(0.0);
            }
        }
    }

    fn col_sums(&mut self, d: &Vec<f32>, rows: usize, cols: usize) -> Vec<f32> {
        let mut acc = vec![0.0f64; cols];
        for r in 0..rows {
            for (s, &v) in acc.iter_mut().zip(&d[r * cols..(r + 1) * cols]) {
                *s += f64::from(v);
            }
        }
        acc.into_iter().map(|v| v as f32).collect()
    }

    fn relu(&mut self, z: &mut Vec<f32>) {
        for v in z.iter_mut() {
            *v = v.max(0.0);
        }
    }

    fn relu_backward(&mut self, d: &mut Vec<f32>, a: &Vec<f32>) {
        for (g, &x) in d.iter_mut().zip(a) {
            if x <= 0.0 {
                *g = 0.0;
            }
        }
    }

    fn softmax_xent(
        &mut self,
        logits: &Vec<f32>,
        labels: &Vec<f32>,
        rows: usize,
        classes: usize,
    ) -> (Vec<f32>, f64, u64) {
        let mut grad = vec![0.0; rows * classes];
        let mut loss = 0.0f64;
        let mut correct = 0u64;
        let scale = 1.0 / rows.max(1) as f64;
        // One buffer for every row's exponentials, and the maximum and its
        // class found in one pass.
        let mut exps = vec![0.0f64; classes];
        for r in 0..rows {
            let z = &logits[r * classes..(r + 1) * classes];
            let label = labels[r] as usize;
            let (argmax, max) =
                z.iter()
                    .enumerate()
                    .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
                        if v > bv { (i, v) } else { (bi, bv) }
                    });
            for (e, &v) in exps.iter_mut().zip(z) {
                *e = f64::from(v - max).exp();
            }
            let sum: f64 = exps.iter().sum();
            loss += sum.ln() - f64::from(z[label] - max);
            correct += u64::from(argmax == label);
            for (c, g) in grad[r * classes..(r + 1) * classes].iter_mut().enumerate() {
                let p = exps[c] / sum;
                *g = ((p - f64::from(u8::from(c == label))) * scale) as f32;
            }
        }
        (grad, loss, correct)
    }

    fn mse(
        &mut self,
        pred: &Vec<f32>,
        target: &Vec<f32>,
        rows: usize,
        outs: usize,
    ) -> (Vec<f32>, f64) {
        let scale = 1.0 / rows.max(1) as f64;
        let mut loss = 0.0f64;
        let grad = pred
            .iter()
            .zip(target)
            .take(rows * outs)
            .map(|(&p, &t)| {
                let e = f64::from(p) - f64::from(t);
                loss += 0.5 * e * e;
                (e * scale) as f32
            })
            .collect();
        (grad, loss)
    }

    fn all_reduce_sum_host(&mut self, values: &mut [f64]) {
        self.group.all_reduce_sum(self.rank, values);
    }

    fn all_reduce_mean(&mut self, bufs: &mut [Vec<f32>]) {
        let world = self.group.world;
        if world == 1 {
            return;
        }
        let mut flat: Vec<f64> = bufs
            .iter()
            .flat_map(|b| b.iter().map(|&v| f64::from(v)))
            .collect();
        self.group.all_reduce_sum(self.rank, &mut flat);
        let mut it = flat.into_iter();
        for b in bufs.iter_mut() {
            for v in b.iter_mut() {
                *v = (it.next().unwrap_or(0.0) / world as f64) as f32;
            }
        }
    }

    fn failure(&mut self) -> Option<String> {
        self.failure.clone()
    }

    fn sgd_step(
        &mut self,
        p: &mut Vec<f32>,
        g: &Vec<f32>,
        v: &mut Vec<f32>,
        lr: f32,
        momentum: f32,
        wd: f32,
    ) {
        for ((p, &g), v) in p.iter_mut().zip(g).zip(v.iter_mut()) {
            *v = momentum * *v + g;
            *p -= lr * (*v + wd * *p);
        }
    }

    fn adamw_step(
        &mut self,
        p: &mut Vec<f32>,
        g: &Vec<f32>,
        m: &mut Vec<f32>,
        v: &mut Vec<f32>,
        t: u64,
        lr: f32,
        wd: f32,
    ) {
        let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-8f64);
        let t = i32::try_from(t).unwrap_or(i32::MAX);
        let c1 = 1.0 - b1.powi(t);
        let c2 = 1.0 - b2.powi(t);
        for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
            let g = f64::from(g);
            let mm = b1 * f64::from(*m) + (1.0 - b1) * g;
            let vv = b2 * f64::from(*v) + (1.0 - b2) * g * g;
            *m = mm as f32;
            *v = vv as f32;
            let update = (mm / c1) / ((vv / c2).sqrt() + eps) + f64::from(wd) * f64::from(*p);
            *p = (f64::from(*p) - f64::from(lr) * update) as f32;
        }
    }
}

/// `A · B` (`m × k` by `k × n`, row-major `m × n` out) in `f32` with
/// matrixmultiply's packed, vectorised kernel; `A` and `B` are read through
/// their (row, column) strides, so a transposed operand is no copy.
fn gemm(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    (rsa, csa): (usize, usize),
    b: &[f32],
    (rsb, csb): (usize, usize),
) -> Vec<f32> {
    let mut c = vec![0.0f32; m * n];
    if m == 0 || n == 0 {
        return c;
    }
    let last = |rows: usize, cols: usize, rs: usize, cs: usize| {
        (rows.max(1) - 1) * rs + (cols.max(1) - 1) * cs
    };
    assert!(
        k == 0 || (last(m, k, rsa, csa) < a.len() && last(k, n, rsb, csb) < b.len()),
        "gemm operands smaller than {m}x{k} by {k}x{n}"
    );
    let stride = |s: usize| isize::try_from(s).expect("stride fits isize");
    // SAFETY: the assertion above keeps every element matrixmultiply reads
    // (row r, column c at r·rs + c·cs) inside `a` and `b`; `c` is a fresh,
    // unaliased m × n row-major buffer.
    #[allow(unsafe_code)]
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            stride(rsa),
            stride(csa),
            b.as_ptr(),
            stride(rsb),
            stride(csb),
            0.0,
            c.as_mut_ptr(),
            stride(n),
            1,
        );
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// `A · B` in `f64`, element by element through the same strides.
    fn reference(
        (m, n, k): (usize, usize, usize),
        a: &[f32],
        (rsa, csa): (usize, usize),
        b: &[f32],
        (rsb, csb): (usize, usize),
    ) -> Vec<f64> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k)
                    .map(|p| f64::from(a[i * rsa + p * csa]) * f64::from(b[p * rsb + j * csb]))
                    .sum();
            }
        }
        c
    }

    proptest! {
        /// The three layouts the backend uses agree with an f64 product to
        /// f32 rounding, whatever the sizes (empty ones included).
        #[test]
        fn gemm_matches_the_f64_product(
            m in 0usize..9, n in 0usize..9, k in 0usize..40,
            seed in any::<u64>(),
        ) {
            let mut x = seed | 1;
            let mut next = || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 2001) as f32 / 1000.0 - 1.0
            };
            let a: Vec<f32> = (0..m * k).map(|_| next()).collect();
            let b: Vec<f32> = (0..k * n).map(|_| next()).collect();
            for (sa, sb) in [
                ((k, 1), (n, 1)), // A · B
                ((k, 1), (1, k)), // A · Bᵀ, B stored n × k
                ((1, m), (n, 1)), // Aᵀ · B, A stored k × m
            ] {
                let got = gemm(m, n, k, &a, sa, &b, sb);
                let want = reference((m, n, k), &a, sa, &b, sb);
                prop_assert_eq!(got.len(), m * n);
                for (g, w) in got.iter().zip(&want) {
                    prop_assert!((f64::from(*g) - w).abs() <= 1e-5 * (k as f64 + 1.0));
                }
            }
        }
    }
}
