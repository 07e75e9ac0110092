"""The CUDA-vs-CPU training check (`server/tests/gpu.rs`) can pass: a numpy
replay of its job — the same data, model, optimizer and steps — in float32
(as cuBLAS computes) and in float64 (as the CPU backend accumulates) ends
within the test's tolerance of 1e-3 with the test's normalised features
(features in [-1, 1], so that the test measures the backend rather than
float32 rounding of large values)."""

from __future__ import annotations

import numpy as np

ROWS, DIM, CLASSES, HIDDEN = 50_000, 3, 4, (64, 64)
BATCH, STEPS, LR, WD = 512, 100, 1e-3, 0.01


def data() -> tuple[np.ndarray, np.ndarray]:
    """The GPU test's rows: features in [-1, 1], the id's class mod 4."""
    v = np.arange(ROWS * DIM, dtype=np.int64)
    x = (v * 7919 % 2001) / 1000.0 - 1.0
    y = np.arange(ROWS, dtype=np.int64) * 7 % 4
    return x.reshape(ROWS, DIM), y


def train(x: np.ndarray, y: np.ndarray, dtype) -> list[np.ndarray]:
    rng = np.random.default_rng(9)
    dims = (DIM, *HIDDEN, CLASSES)
    params = []
    for i, o in zip(dims, dims[1:]):
        params.append((rng.standard_normal((o, i)) * np.sqrt(2.0 / i)).astype(dtype))
        params.append(np.zeros(o, dtype))
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    order = np.random.default_rng(1).permutation(ROWS)
    x, eye = x.astype(dtype), np.eye(CLASSES, dtype=dtype)
    for t in range(1, STEPS + 1):
        idx = order[(t - 1) * BATCH : t * BATCH]
        acts = [x[idx]]
        for layer in range(len(dims) - 1):
            z = acts[-1] @ params[2 * layer].T + params[2 * layer + 1]
            acts.append(np.maximum(z, 0) if layer < len(dims) - 2 else z)
        logits = acts[-1] - acts[-1].max(1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(1, keepdims=True)
        d = (p - eye[y[idx]]) / BATCH
        grads = [None] * len(params)
        for layer in reversed(range(len(dims) - 1)):
            grads[2 * layer] = d.T @ acts[layer]
            grads[2 * layer + 1] = d.sum(0)
            if layer:
                d = (d @ params[2 * layer]) * (acts[layer] > 0)
        for i, g in enumerate(grads):
            m[i] = 0.9 * m[i] + 0.1 * g
            v[i] = 0.999 * v[i] + 0.001 * g * g
            mh, vh = m[i] / (1 - 0.9**t), v[i] / (1 - 0.999**t)
            params[i] = params[i] - LR * (mh / (np.sqrt(vh) + 1e-8) + WD * params[i])
    return params


def max_relative_difference(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    # The GPU test's measure: |a − b| / max(|a|, |b|, 1e-2).
    return max(
        float((np.abs(x - y) / np.maximum(np.maximum(np.abs(x), np.abs(y)), 1e-2)).max())
        for x, y in zip((p.astype(np.float64) for p in a), b)
    )


def test_the_gpu_parity_tolerance_is_reachable_with_normalised_features():
    x, y = data()
    diff = max_relative_difference(train(x, y, np.float32), train(x, y, np.float64))
    print(f"normalised features: f32 vs f64 after {STEPS} steps differ by {diff:.2e}")
    assert diff <= 1e-3

