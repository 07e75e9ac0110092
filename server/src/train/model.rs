//! The model and its step, written once over [`Backend`]: a linear model or
//! an MLP with ReLU, softmax cross-entropy or squared-error loss, SGD with
//! momentum or AdamW.
//!
//! Parameters are a list of tensors `[W₀, b₀, W₁, b₁, …]` with `Wₗ` of shape
//! `[dₗ₊₁ × dₗ]` (row-major) and `bₗ` of `[dₗ₊₁]`.

use super::backend::Backend;

/// What the model predicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    /// `classes`-way classification, cross-entropy loss.
    Classification {
        /// Number of classes.
        classes: usize,
    },
    /// Regression on `outputs` values, squared-error loss.
    Regression {
        /// Number of target values per row.
        outputs: usize,
    },
}

/// The optimizer and its hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Optimizer {
    /// SGD with momentum.
    Sgd {
        /// Momentum coefficient (0 = plain SGD).
        momentum: f32,
    },
    /// AdamW.
    AdamW,
}

/// Layer sizes and task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Model {
    /// `[inputs, hidden…, outputs]`.
    pub dims: Vec<usize>,
    /// The task.
    pub task: Task,
}

impl Model {
    /// A model from `inputs` through `hidden` layers to the task's outputs.
    pub fn new(inputs: usize, hidden: &[usize], task: Task) -> Self {
        let outputs = match task {
            Task::Classification { classes } => classes,
            Task::Regression { outputs } => outputs,
        };
        let mut dims = vec![inputs];
        dims.extend_from_slice(hidden);
        dims.push(outputs);
        Self { dims, task }
    }

    /// Parameters of all layers (weights and biases); `None` past `u64`.
    pub fn parameter_count(&self) -> Option<u64> {
        self.dims.windows(2).try_fold(0u64, |total, w| {
            let (inputs, outputs) = (w[0] as u64, w[1] as u64);
            total.checked_add(inputs.checked_add(1)?.checked_mul(outputs)?)
        })
    }

    /// Units of all layers, inputs included: the activations of one row.
    pub fn units(&self) -> u64 {
        self.dims
            .iter()
            .fold(0u64, |total, &d| total.saturating_add(d as u64))
    }

    /// Number of layers.
    pub fn layers(&self) -> usize {
        self.dims.len() - 1
    }

    /// Names and shapes of the parameter tensors, in order.
    pub fn tensors(&self) -> Vec<(String, Vec<usize>)> {
        (0..self.layers())
            .flat_map(|l| {
                let (i, o) = (self.dims[l], self.dims[l + 1]);
                [
                    (format!("layers.{l}.weight"), vec![o, i]),
                    (format!("layers.{l}.bias"), vec![o]),
                ]
            })
            .collect()
    }

    /// Initial parameters, a function of `seed` only: weights uniform in
    /// `±1/√fan_in`, biases zero.
    pub fn init(&self, seed: u64) -> Vec<Vec<f32>> {
        let mut rng = SplitMix(seed ^ 0x5eed_f11e_d0c0_ffee);
        self.tensors()
            .into_iter()
            .map(|(name, shape)| {
                let len: usize = shape.iter().product();
                if name.ends_with(".bias") {
                    vec![0.0; len]
                } else {
                    let bound = 1.0 / (shape[1] as f64).sqrt();
                    (0..len)
                        .map(|_| ((rng.unit() * 2.0 - 1.0) * bound) as f32)
                        .collect()
                }
            })
            .collect()
    }

    /// Forward pass of `rows` rows of `x`; returns every layer's output
    /// (after ReLU for hidden layers), the last being the logits.
    pub fn forward<B: Backend>(
        &self,
        b: &mut B,
        params: &[B::Buf],
        x: B::Buf,
        rows: usize,
    ) -> Vec<B::Buf> {
        let mut acts = vec![x];
        for l in 0..self.layers() {
            let (i, o) = (self.dims[l], self.dims[l + 1]);
            let mut z = b.matmul_nt(&acts[l], &params[2 * l], rows, o, i);
            if l + 1 < self.layers() {
                b.add_row_bias_relu(&mut z, &params[2 * l + 1], rows, o);
            } else {
                b.add_row_bias(&mut z, &params[2 * l + 1], rows, o);
            }
            acts.push(z);
        }
        acts
    }

    /// Loss gradient at the output, the loss summed over rows, and correct
    /// predictions (classification).
    pub fn loss<B: Backend>(
        &self,
        b: &mut B,
        out: &B::Buf,
        target: &B::Buf,
        rows: usize,
    ) -> (B::Buf, f64, u64) {
        match self.task {
            Task::Classification { classes } => b.softmax_xent(out, target, rows, classes),
            Task::Regression { outputs } => {
                let (g, loss) = b.mse(out, target, rows, outputs);
                (g, loss, 0)
            }
        }
    }

    /// Forward and backward over one batch: the gradients of the batch's
    /// mean loss for every tensor, the summed loss, and correct predictions.
    pub fn gradients<B: Backend>(
        &self,
        b: &mut B,
        params: &[B::Buf],
        x: B::Buf,
        target: &B::Buf,
        rows: usize,
    ) -> (Vec<B::Buf>, f64, u64) {
        let acts = self.forward(b, params, x, rows);
        let (mut dz, loss, correct) = self.loss(b, &acts[self.layers()], target, rows);
        // Layers from the last to the first; every layer gives [dW, db].
        let mut back = Vec::with_capacity(self.layers());
        for l in (0..self.layers()).rev() {
            let (i, o) = (self.dims[l], self.dims[l + 1]);
            back.push([
                b.matmul_tn(&dz, &acts[l], o, i, rows),
                b.col_sums(&dz, rows, o),
            ]);
            if l > 0 {
                let mut da = b.matmul_nn(&dz, &params[2 * l], rows, i, o);
                b.relu_backward(&mut da, &acts[l]);
                dz = da;
            }
        }
        let grads = back.into_iter().rev().flatten().collect();
        (grads, loss, correct)
    }

    fn tensor_len(&self, t: usize) -> usize {
        let l = t / 2;
        if t.is_multiple_of(2) {
            self.dims[l] * self.dims[l + 1]
        } else {
            self.dims[l + 1]
        }
    }

    /// Predictions of `rows` rows for evaluation: (summed loss, correct).
    pub fn evaluate<B: Backend>(
        &self,
        b: &mut B,
        params: &[B::Buf],
        x: B::Buf,
        target: &B::Buf,
        rows: usize,
    ) -> (f64, u64) {
        let acts = self.forward(b, params, x, rows);
        let (_, loss, correct) = self.loss(b, &acts[self.layers()], target, rows);
        (loss, correct)
    }
}

/// Optimizer state: one or two buffers per tensor.
pub struct OptState<B: Backend> {
    /// Momentum (SGD) or first moment (AdamW).
    pub m: Vec<B::Buf>,
    /// Second moment (AdamW only; empty for SGD).
    pub v: Vec<B::Buf>,
    /// Updates applied so far.
    pub t: u64,
}

impl<B: Backend> OptState<B> {
    /// Zero state for `params`.
    pub fn new(b: &mut B, model: &Model, opt: Optimizer) -> Self {
        let lens: Vec<usize> = (0..2 * model.layers())
            .map(|t| model.tensor_len(t))
            .collect();
        let m = lens.iter().map(|&n| b.zeros(n)).collect();
        let v = match opt {
            Optimizer::AdamW => lens.iter().map(|&n| b.zeros(n)).collect(),
            Optimizer::Sgd { .. } => Vec::new(),
        };
        Self { m, v, t: 0 }
    }

    /// Applies one update with `grads` to `params`.
    pub fn update(
        &mut self,
        b: &mut B,
        opt: Optimizer,
        params: &mut [B::Buf],
        grads: &[B::Buf],
        lr: f32,
        wd: f32,
    ) {
        self.t += 1;
        for (i, (p, g)) in params.iter_mut().zip(grads).enumerate() {
            match opt {
                Optimizer::Sgd { momentum } => b.sgd_step(p, g, &mut self.m[i], lr, momentum, wd),
                Optimizer::AdamW => {
                    let (m, v) = (&mut self.m[i], &mut self.v[i]);
                    b.adamw_step(p, g, m, v, self.t, lr, wd);
                }
            }
        }
    }
}

/// A small deterministic generator for initial weights.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}
