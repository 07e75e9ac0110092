//! The backend trait: the handful of tensor operations one training step
//! needs, so that the step (`model.rs`) is written once for every device.
//!
//! Matrices are row-major `f32`. A backend owns its buffers (host vectors
//! for the CPU, device memory for CUDA) and its rank's view of the
//! collective (the all-reduce).

use super::data::TrainData;

/// Tensor operations of one rank.
pub trait Backend {
    /// A buffer of `f32` on this backend's device.
    type Buf;

    /// The features (`rows × dim`) and labels of the given global rows of
    /// `data`, in that order, on this backend's device.
    fn batch(&mut self, data: &TrainData, rows: &[u64]) -> (Self::Buf, Self::Buf);

    /// Whether [`Backend::batch`] is a host gather (`TrainData::gather`)
    /// that another thread can run for the next step while this one
    /// computes; its result is handed over with [`Backend::host_batch`].
    /// False where the gather runs on the device (it is queued behind the
    /// step's work there, not on the host's critical path).
    fn gathers_on_host(&self) -> bool {
        false
    }

    /// What [`Backend::batch`] returns, from features and labels gathered
    /// on the host (`TrainData::gather` of the same rows).
    fn host_batch(&mut self, x: Vec<f32>, y: Vec<f32>) -> (Self::Buf, Self::Buf) {
        (self.upload(&x), self.upload(&y))
    }

    /// The first device error since the job started, if any. Operations
    /// cannot fail one by one (the step is written once for every backend);
    /// a backend that hits an error records it here, and the rank stops
    /// every rank at the next all-reduce.
    fn failure(&mut self) -> Option<String> {
        None
    }

    /// Waits until every queued operation has finished (a no-op where
    /// operations run as they are called).
    fn sync(&mut self) {}

    /// A buffer holding `data`.
    fn upload(&mut self, data: &[f32]) -> Self::Buf;
    /// The contents of `buf`.
    fn download(&mut self, buf: &Self::Buf) -> Vec<f32>;
    /// `len` zeros.
    fn zeros(&mut self, len: usize) -> Self::Buf;

    /// `a[m×k] · b[n×k]ᵀ → [m×n]` (a layer's forward: `X · Wᵀ`).
    fn matmul_nt(
        &mut self,
        a: &Self::Buf,
        b: &Self::Buf,
        m: usize,
        n: usize,
        k: usize,
    ) -> Self::Buf;
    /// `a[k×m]ᵀ · b[k×n] → [m×n]` (a weight gradient: `dZᵀ · X`).
    fn matmul_tn(
        &mut self,
        a: &Self::Buf,
        b: &Self::Buf,
        m: usize,
        n: usize,
        k: usize,
    ) -> Self::Buf;
    /// `a[m×k] · b[k×n] → [m×n]` (an input gradient: `dZ · W`).
    fn matmul_nn(
        &mut self,
        a: &Self::Buf,
        b: &Self::Buf,
        m: usize,
        n: usize,
        k: usize,
    ) -> Self::Buf;
    /// Adds `bias[cols]` to every row of `z[rows×cols]`.
    fn add_row_bias(&mut self, z: &mut Self::Buf, bias: &Self::Buf, rows: usize, cols: usize);
    /// `z = max(z + bias, 0)` row by row: [`Backend::add_row_bias`] then
    /// [`Backend::relu`] (a hidden layer's forward), which a backend may do
    /// in one pass over `z`.
    fn add_row_bias_relu(&mut self, z: &mut Self::Buf, bias: &Self::Buf, rows: usize, cols: usize) {
        self.add_row_bias(z, bias, rows, cols);
        self.relu(z);
    }
    /// Column sums of `d[rows×cols]` (a bias gradient).
    fn col_sums(&mut self, d: &Self::Buf, rows: usize, cols: usize) -> Self::Buf;
    /// `z = max(z, 0)` in place.
    fn relu(&mut self, z: &mut Self::Buf);
    /// `d *= (a > 0)` where `a` is the ReLU's output.
    fn relu_backward(&mut self, d: &mut Self::Buf, a: &Self::Buf);

    /// Softmax cross-entropy of `logits[rows×classes]` against class indices
    /// `labels[rows]` (as `f32`): the gradient of the *mean* loss, the loss
    /// summed over rows, and the rows predicted right.
    fn softmax_xent(
        &mut self,
        logits: &Self::Buf,
        labels: &Self::Buf,
        rows: usize,
        classes: usize,
    ) -> (Self::Buf, f64, u64);
    /// Squared error of `pred[rows×outs]` against `target`: the gradient of
    /// the mean loss (`mean over rows of ½·Σ (p − t)²`) and the loss summed
    /// over rows.
    fn mse(
        &mut self,
        pred: &Self::Buf,
        target: &Self::Buf,
        rows: usize,
        outs: usize,
    ) -> (Self::Buf, f64);

    /// Replaces `values` (host numbers: the step's loss and what each rank
    /// says about stopping) with their sum over ranks. Every rank runs it
    /// every step, also after recording a failure, so that every rank
    /// learns of any rank's failure at the step it happens.
    fn all_reduce_sum_host(&mut self, values: &mut [f64]);

    /// Replaces every buffer with the mean of it over all ranks; every rank
    /// ends with identical values. Run only when no rank failed.
    fn all_reduce_mean(&mut self, bufs: &mut [Self::Buf]);

    /// SGD with momentum and decoupled weight decay:
    /// `v = μ·v + g; p -= lr·(v + wd·p)`.
    fn sgd_step(
        &mut self,
        p: &mut Self::Buf,
        g: &Self::Buf,
        v: &mut Self::Buf,
        lr: f32,
        momentum: f32,
        wd: f32,
    );
    /// AdamW (β₁ 0.9, β₂ 0.999, ε 1e-8) at step `t` (from 1).
    #[allow(clippy::too_many_arguments)]
    fn adamw_step(
        &mut self,
        p: &mut Self::Buf,
        g: &Self::Buf,
        m: &mut Self::Buf,
        v: &mut Self::Buf,
        t: u64,
        lr: f32,
        wd: f32,
    );
}
