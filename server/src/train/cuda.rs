//! The CUDA backend: one rank per GPU, each on its own thread with its own
//! context and stream; GEMMs through cuBLAS, elementwise, gather and loss
//! kernels compiled at start with NVRTC, gradients averaged with NCCL in
//! one all-reduce over one flat buffer.
//!
//! The job's rows live on every rank's GPU for the job's lifetime: features
//! (`rows × dim`) and labels as dense `f32`, uploaded once in 64K-row chunks;
//! each step uploads only the batch's row ids and gathers on the device.
//!
//! Operations cannot fail one by one (the step is written once over
//! [`Backend`]): the first CUDA error is recorded, later operations become
//! no-ops, and [`Backend::failure`] stops every rank at the next all-reduce.
//!
//! cudarc loads the driver (`libcuda`) at run time, and [`super::cudalib`]
//! cuBLAS, NVRTC and NCCL by the names their packages install, so this
//! builds with no CUDA toolkit; [`Setup::new`] probes for the driver and
//! opens the libraries before any call.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig,
    PushKernelArg,
};

use super::backend::Backend;
use super::cudalib::cublas::{Cublas, Gemm, Handle};
use super::cudalib::nccl::{Comm, Id, Nccl, Reduce};
use super::cudalib::nvrtc::{Nvrtc, Output};
use super::data::TrainData;
use crate::error::{Error, Result};
use crate::memory::device::{DeviceColumn, DevicePlacement, driver_present};

/// Launches kernel `$name` over `$n` elements with the given arguments,
/// unless an error is already recorded.
macro_rules! launch {
    ($self:ident, $name:expr, $n:expr, $($arg:expr),+ $(,)?) => {{
        let n: usize = $n;
        if $self.error.is_none() && n > 0 {
            let f = $self.kernel($name).clone();
            let stream = $self.stream.clone();
            let mut builder = stream.launch_builder(&f);
            $( builder.arg($arg); )+
            let cfg = LaunchConfig::for_num_elems(u32::try_from(n).unwrap_or(u32::MAX));
            // SAFETY: every kernel bounds-checks its index against the sizes
            // it is given, which are the lengths of the buffers passed.
            let r = unsafe { builder.launch(cfg) };
            $self.record(r);
        }
    }};
}

/// The training kernels in CUDA C, compiled once per rank with NVRTC when a
/// GPU job starts (and checked without a GPU by `examples/kernel_check.rs`).
pub const KERNELS: &str = r#"
extern "C" __global__ void add_row_bias(float* z, const float* b, int rows, int cols) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (long)rows * cols) z[i] += b[i % cols];
}
extern "C" __global__ void relu(float* z, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    // !(z > 0) also zeroes NaN, as the CPU backend's max(z, 0) does.
    if (i < n && !(z[i] > 0.0f)) z[i] = 0.0f;
}
extern "C" __global__ void relu_backward(float* d, const float* a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && a[i] <= 0.0f) d[i] = 0.0f;
}
extern "C" __global__ void col_sums(const float* d, float* out, int rows, int cols) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= cols) return;
    double s = 0.0;
    for (int r = 0; r < rows; ++r) s += d[(long)r * cols + j];
    out[j] = (float)s;
}
extern "C" __global__ void softmax_xent(const float* z, const float* labels, float* grad,
                                        float* loss, float* correct, int rows, int classes,
                                        float scale) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* row = z + (long)r * classes;
    int label = (int)labels[r];
    float mx = row[0];
    int arg = 0;
    for (int c = 1; c < classes; ++c) if (row[c] > mx) { mx = row[c]; arg = c; }
    double sum = 0.0;
    for (int c = 0; c < classes; ++c) sum += exp((double)(row[c] - mx));
    loss[r] = (float)(log(sum) - (double)(row[label] - mx));
    correct[r] = arg == label ? 1.0f : 0.0f;
    for (int c = 0; c < classes; ++c) {
        double p = exp((double)(row[c] - mx)) / sum;
        grad[(long)r * classes + c] = (float)((p - (c == label ? 1.0 : 0.0)) * scale);
    }
}
extern "C" __global__ void mse(const float* p, const float* t, float* grad, float* loss, int n,
                               float scale) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    double e = (double)p[i] - (double)t[i];
    loss[i] = (float)(0.5 * e * e);
    grad[i] = (float)(e * scale);
}
extern "C" __global__ void sgd(float* p, const float* g, float* v, int n, float lr, float mom,
                               float wd) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    v[i] = mom * v[i] + g[i];
    p[i] -= lr * (v[i] + wd * p[i]);
}
extern "C" __global__ void adamw(float* p, const float* g, float* m, float* v, int n, float lr,
                                 float wd, double c1, double c2) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    double gi = g[i];
    double mm = 0.9 * (double)m[i] + 0.1 * gi;
    double vv = 0.999 * (double)v[i] + 0.001 * gi * gi;
    m[i] = (float)mm;
    v[i] = (float)vv;
    double update = (mm / c1) / (sqrt(vv / c2) + 1e-8) + (double)wd * (double)p[i];
    p[i] = (float)((double)p[i] - (double)lr * update);
}
extern "C" __global__ void gather(const float* src, const long long* rows, float* dst,
                                  int count, int width) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)count * width) return;
    long r = i / width, c = i % width;
    dst[i] = src[rows[r] * width + c];
}
extern "C" __global__ void copy_columns(const float* src, float* dst, int rows, int width,
                                        int dim, int offset) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)rows * width) return;
    long r = i / width, c = i % width;
    dst[r * dim + offset + c] = src[i];
}
"#;

const NAMES: [&str; 10] = [
    "add_row_bias",
    "relu",
    "relu_backward",
    "col_sums",
    "softmax_xent",
    "mse",
    "sgd",
    "adamw",
    "gather",
    "copy_columns",
];

/// What the ranks of one GPU job share before they start.
pub struct Setup {
    ordinals: Vec<u32>,
    /// The dataset's device-tier copies, by device.
    placed: Vec<Arc<DevicePlacement>>,
    /// The NCCL communicator's id (two GPUs or more).
    id: Option<Id>,
    ready: Barrier,
    failed: AtomicBool,
}

impl Setup {
    /// A job on GPUs `ordinals`; fails without a driver or with a device
    /// that does not exist.
    pub fn new(ordinals: &[u32], placed: &[Arc<DevicePlacement>]) -> Result<Self> {
        if !driver_present() {
            return Err(Error::FailedPrecondition(
                "no CUDA driver on this server: train on cpu ranks instead".into(),
            ));
        }
        let count = CudaContext::device_count().map_err(cuda)?;
        let count = u32::try_from(count).unwrap_or(0);
        if let Some(bad) = ordinals.iter().find(|&&d| d >= count) {
            return Err(Error::invalid(format!(
                "GPU {bad} does not exist: this server sees {count} CUDA devices"
            )));
        }
        // The libraries a job loads, opened first: a missing one is the
        // caller's to fix, named with what to install.
        for opened in [Cublas::get().map(|_| ()), Nvrtc::get().map(|_| ())] {
            opened.map_err(|why| Error::FailedPrecondition(format!("training on GPUs: {why}")))?;
        }
        // One GPU needs no communicator, and so no NCCL.
        let id = if ordinals.len() > 1 {
            Some(Nccl::get()?.unique_id()?)
        } else {
            None
        };
        Ok(Self {
            ordinals: ordinals.to_vec(),
            placed: placed.to_vec(),
            id,
            ready: Barrier::new(ordinals.len()),
            failed: AtomicBool::new(false),
        })
    }

    /// Rank `rank`'s backend, made on the rank's own thread. Every rank
    /// prepares its device first; only when all succeeded do they join the
    /// NCCL communicator (whose creation waits for every rank).
    pub fn rank(&self, rank: u32) -> Result<Cuda> {
        let ordinal = self.ordinals[rank as usize];
        let placed = self.placed.iter().find(|p| p.device == ordinal).cloned();
        let prepared = Cuda::prepare(ordinal, placed);
        if prepared.is_err() {
            self.failed.store(true, Ordering::Release);
        }
        self.ready.wait();
        let mut cuda = prepared?;
        if self.failed.load(Ordering::Acquire) {
            return Err(Error::Aborted(
                "another rank could not start its GPU".into(),
            ));
        }
        let world = self.ordinals.len();
        if let (true, Some(id)) = (world > 1, self.id) {
            cuda.comm = Some(Nccl::get()?.join(id, rank as usize, world)?);
        }
        Ok(cuda)
    }
}

/// Enqueues an in-place all-reduce of `values` over the job's ranks on
/// `stream`.
fn all_reduce<T: super::cudalib::nccl::Value>(
    comm: &Comm,
    stream: &Arc<CudaStream>,
    values: &mut CudaSlice<T>,
    reduce: Reduce,
) -> std::result::Result<(), Said> {
    let count = values.len();
    let (at, _recorded) = values.device_ptr_mut(stream);
    // SAFETY: `values` holds `count` values on this rank's device and
    // outlives the enqueued work (the rank's stream is synchronised before
    // it reads them back or frees them); the stream is this rank's own.
    unsafe { comm.all_reduce_in_place::<T>(at, count, reduce, stream.cu_stream().cast()) }
        .map_err(|e| Said(e.to_string()))
}

/// A library's error in its own words (`Debug` without quotes, for
/// [`Cuda::record`]).
struct Said(String);

impl std::fmt::Debug for Said {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn cuda(e: impl std::fmt::Debug) -> Error {
    Error::Internal(format!("CUDA: {e:?}"))
}

/// One GPU rank.
pub struct Cuda {
    /// Dropped before the stream it works on.
    blas: Handle,
    stream: Arc<CudaStream>,
    kernels: Vec<CudaFunction>,
    comm: Option<Comm>,
    /// The job's features and labels on this device, uploaded at the first batch.
    resident: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
    /// The dataset's columns in the device tier on this GPU, if placed.
    placed: Option<Arc<DevicePlacement>>,
    /// The flat gradient buffer of the all-reduce, kept between steps.
    flat: Option<CudaSlice<f32>>,
    error: Option<String>,
}

/// NVRTC's options for the kernels (beyond the target architecture).
pub const KERNEL_OPTIONS: &[&str] = &[];

/// What NVRTC made of a CUDA C source.
#[derive(Debug)]
pub struct Compiled {
    /// A cubin for the architecture asked for (`sm_XY`), else PTX text.
    pub image: Vec<u8>,
    /// NVRTC's log: its warnings, empty when it had none.
    pub log: String,
}

/// Compiles CUDA C `src` with NVRTC and [`KERNEL_OPTIONS`], as a GPU job
/// does: for `arch = Some("sm_XY")` a cubin of that architecture's machine
/// code (it loads on any driver of this CUDA major version, whatever PTX
/// version the driver knows), for `None` PTX of NVRTC's own version. An
/// error carries NVRTC's log.
pub fn compile_kernels(src: &str, arch: Option<&str>) -> std::result::Result<Compiled, String> {
    let nvrtc = Nvrtc::get()?;
    let mut options: Vec<String> = KERNEL_OPTIONS.iter().map(|o| o.to_string()).collect();
    options.extend(arch.map(|a| format!("--gpu-architecture={a}")));
    let output = match arch {
        Some(a) if a.starts_with("sm_") => Output::Cubin,
        _ => Output::Ptx,
    };
    let (image, log) = nvrtc.compile(src, &options, output)?;
    Ok(Compiled { image, log })
}

/// NVRTC's and the driver's CUDA versions, as `NVRTC 12.9, driver 12.4`,
/// for errors about loading kernels.
fn cuda_versions() -> String {
    let mut driver = 0;
    // SAFETY: writes one int; the driver was loaded already.
    let drv = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver) }.result();
    let nvrtc = match Nvrtc::get().and_then(|n| n.version().map(|v| (n.name(), v))) {
        Ok((name, (major, minor))) => format!("NVRTC {major}.{minor} ({name})"),
        Err(_) => "NVRTC ?".to_string(),
    };
    match drv {
        Ok(()) => format!("{nvrtc}, driver {}.{}", driver / 1000, driver % 1000 / 10),
        Err(_) => format!("{nvrtc}, driver ?"),
    }
}

/// The kernels as a module on `ctx`: a cubin for the device's own
/// architecture, so that loading does not depend on the driver knowing
/// NVRTC's PTX version; PTX for the driver to compile where NVRTC does not
/// know the architecture. A failure names both versions.
fn load_kernels(ctx: &Arc<CudaContext>, ordinal: u32) -> Result<Arc<cudarc::driver::CudaModule>> {
    let (major, minor) = ctx.compute_capability().map_err(cuda)?;
    let arch = format!("sm_{major}{minor}");
    let loaded = match compile_kernels(KERNELS, Some(&arch)) {
        Ok(c) => ctx.load_module(cudarc::nvrtc::Ptx::from_binary(c.image)),
        Err(for_arch) => {
            tracing::info!(gpu = ordinal, %arch, error = %for_arch, "no cubin for this GPU; loading PTX");
            let c = compile_kernels(KERNELS, None).map_err(|e| {
                Error::Internal(format!("NVRTC could not compile the kernels: {e}"))
            })?;
            let text = String::from_utf8_lossy(&c.image).into_owned();
            ctx.load_module(cudarc::nvrtc::Ptx::from_src(text))
        }
    };
    loaded.map_err(|e| {
        Error::Internal(format!(
            "GPU {ordinal} ({arch}) could not load the training kernels: {e:?} ({})",
            cuda_versions()
        ))
    })
}

impl Cuda {
    fn prepare(ordinal: u32, placed: Option<Arc<DevicePlacement>>) -> Result<Self> {
        let ctx = CudaContext::new(ordinal as usize).map_err(cuda)?;
        // SAFETY: a rank runs all its work on its one stream, so its buffers
        // need no events to order their uses across streams.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(cuda)?;
        ctx.bind_to_thread().map_err(cuda)?;
        let cublas = Cublas::get().map_err(Error::FailedPrecondition)?;
        // SAFETY: the rank's own stream, on the device now current; the
        // handle is dropped before it (field order of `Cuda`).
        let blas = unsafe { cublas.handle(stream.cu_stream().cast()) }.map_err(Error::Internal)?;
        let module = load_kernels(&ctx, ordinal)?;
        let kernels = NAMES
            .iter()
            .map(|n| module.load_function(n).map_err(cuda))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            blas,
            stream,
            kernels,
            comm: None,
            resident: None,
            placed,
            flat: None,
            error: None,
        })
    }

    fn kernel(&self, name: &str) -> &CudaFunction {
        let i = NAMES.iter().position(|n| *n == name).unwrap_or(0);
        &self.kernels[i]
    }

    fn record<T>(&mut self, r: std::result::Result<T, impl std::fmt::Debug>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                if self.error.is_none() {
                    self.error = Some(format!("CUDA: {e:?}"));
                }
                None
            }
        }
    }

    fn empty(&self) -> CudaSlice<f32> {
        // A zero-length allocation cannot fail in practice; if it does the
        // error is already recorded by the caller's operation.
        self.stream.alloc_zeros::<f32>(1).unwrap_or_else(|_| {
            self.stream
                .null::<f32>()
                .unwrap_or_else(|_| unreachable_slice())
        })
    }

    fn zeros_or_empty(&mut self, len: usize) -> CudaSlice<f32> {
        let r = self.stream.alloc_zeros::<f32>(len.max(1));
        self.record(r).unwrap_or_else(|| self.empty())
    }

    /// `len` values left as they are, for outputs that are written whole
    /// before anything reads them (a GEMM with β = 0, a gather): no pass to
    /// zero them first.
    fn uninit_or_empty(&mut self, len: usize) -> CudaSlice<f32> {
        // SAFETY: callers overwrite every value before any is read (or a
        // failure is recorded and the step's results are not used).
        let r = unsafe { self.stream.alloc::<f32>(len.max(1)) };
        self.record(r).unwrap_or_else(|| self.empty())
    }

    /// `c = op(a)·op(b)` in cuBLAS's column-major terms.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &mut self,
        ta: bool,
        tb: bool,
        m: usize,
        n: usize,
        k: usize,
        a: &CudaSlice<f32>,
        lda: usize,
        b: &CudaSlice<f32>,
        ldb: usize,
        ldc: usize,
    ) -> CudaSlice<f32> {
        // β = 0: cuBLAS writes every value of C and reads none.
        let mut c = self.uninit_or_empty(m * n);
        if self.error.is_some() || m == 0 || n == 0 {
            return c;
        }
        let shape = Gemm {
            ta,
            tb,
            m,
            n,
            k,
            lda,
            ldb,
            ldc,
        };
        let (a, a_used) = a.device_ptr(&self.stream);
        let (b, b_used) = b.device_ptr(&self.stream);
        let (c_at, c_used) = c.device_ptr_mut(&self.stream);
        // SAFETY: the shapes and leading dimensions describe buffers of
        // exactly these sizes (checked by the step's construction), all on
        // this rank's device and stream.
        let r = unsafe { self.blas.sgemm(shape, a, b, c_at) };
        drop((a_used, b_used, c_used));
        self.record(r.map_err(Said));
        c
    }

    /// The job's rows on this device. Features come from the device tier
    /// when every feature column is placed on this GPU as `f32` (a copy on
    /// the device, nothing crosses the bus); otherwise they, like the
    /// labels, are copied from host memory in chunks so that no rank holds
    /// a host copy of the whole dataset.
    fn upload_rows(&mut self, data: &TrainData) -> Option<(CudaSlice<f32>, CudaSlice<f32>)> {
        const CHUNK: u64 = 65_536;
        let (n, dim, lw) = (data.rows(), data.dim, data.label_width);
        let mut x = self.zeros_or_empty(n as usize * dim);
        let mut y = self.zeros_or_empty(n as usize * lw);
        let placed = self.placed.clone();
        let columns = placed.as_deref().and_then(|p| placed_features(p, data));
        tracing::info!(
            gpu = self.stream.context().ordinal(),
            features = if columns.is_some() {
                "device tier"
            } else {
                "host memory"
            },
            "GPU rank uploads its rows"
        );
        if let Some(columns) = &columns {
            let (rows, dim_i) = (n as i32, dim as i32);
            let mut offset = 0i32;
            for col in columns {
                let width = col.width as i32;
                launch!(
                    self,
                    "copy_columns",
                    n as usize * col.width,
                    &col.buffer,
                    &mut x,
                    &rows,
                    &width,
                    &dim_i,
                    &offset
                );
                offset += width;
            }
        }
        let mut at = 0u64;
        while at < n && self.error.is_none() {
            let end = (at + CHUNK).min(n);
            let (a, b) = (at as usize, end as usize);
            let hy = if columns.is_some() {
                data.gather_labels(at..end)
            } else {
                let (hx, hy) = data.gather(at..end);
                let r = self
                    .stream
                    .memcpy_htod(&hx, &mut x.slice_mut(a * dim..b * dim));
                self.record(r);
                hy
            };
            let r = self
                .stream
                .memcpy_htod(&hy, &mut y.slice_mut(a * lw..b * lw));
            self.record(r);
            at = end;
        }
        self.error.is_none().then_some((x, y))
    }

    fn host_sum(&mut self, buf: &CudaSlice<f32>) -> f64 {
        let r = self.stream.clone_dtoh(buf);
        self.record(r)
            .map(|v| v.iter().map(|&x| f64::from(x)).sum())
            .unwrap_or(0.0)
    }
}

/// The placed copy of every feature column of `data`, in order, if each is
/// on this device as `f32` with the job's rows and width (a job with a
/// filter that leaves rows out gathers its rows on the host).
fn placed_features<'a>(
    placed: &'a DevicePlacement,
    data: &TrainData,
) -> Option<Vec<&'a DeviceColumn>> {
    if !data.every_row() {
        return None;
    }
    data.columns
        .iter()
        .map(|(name, width)| {
            placed.columns.iter().find(|c| {
                &c.name == name
                    && c.element == arrow::datatypes::DataType::Float32
                    && c.width == *width
                    && c.rows == data.rows()
            })
        })
        .collect()
}

/// Never reached: `null()` and 1-element allocations only fail when the
/// device is gone, and then the operation's own error is what is reported.
fn unreachable_slice() -> CudaSlice<f32> {
    panic!("the CUDA device is gone")
}

impl Backend for Cuda {
    type Buf = CudaSlice<f32>;

    fn batch(&mut self, data: &TrainData, rows: &[u64]) -> (CudaSlice<f32>, CudaSlice<f32>) {
        if self.resident.is_none() && self.error.is_none() {
            self.resident = self.upload_rows(data);
        }
        let ids: Vec<i64> = rows.iter().map(|&r| r as i64).collect();
        let ids = self.stream.clone_htod(&ids);
        let Some(ids) = self.record(ids) else {
            return (self.empty(), self.empty());
        };
        let (dim, lw) = (data.dim, data.label_width);
        // The gather writes every value.
        let mut x = self.uninit_or_empty(rows.len() * dim);
        let mut y = self.uninit_or_empty(rows.len() * lw);
        let Some((fx, fy)) = self.resident.take() else {
            return (x, y);
        };
        let count = rows.len() as i32;
        for (src, dst, width) in [(&fx, &mut x, dim), (&fy, &mut y, lw)] {
            let w = width as i32;
            launch!(
                self,
                "gather",
                rows.len() * width,
                src,
                &ids,
                dst,
                &count,
                &w
            );
        }
        self.resident = Some((fx, fy));
        (x, y)
    }

    fn failure(&mut self) -> Option<String> {
        self.error.clone()
    }

    fn sync(&mut self) {
        let r = self.stream.synchronize();
        self.record(r);
    }

    fn upload(&mut self, data: &[f32]) -> CudaSlice<f32> {
        let r = self.stream.clone_htod(data);
        self.record(r).unwrap_or_else(|| self.empty())
    }

    fn download(&mut self, buf: &CudaSlice<f32>) -> Vec<f32> {
        let r = self.stream.clone_dtoh(buf);
        self.record(r).unwrap_or_default()
    }

    fn zeros(&mut self, len: usize) -> CudaSlice<f32> {
        self.zeros_or_empty(len)
    }

    // Row-major X[r×c] is column-major Xᵀ with leading dimension c; each
    // product below is computed as its transpose.
    fn matmul_nt(
        &mut self,
        a: &Self::Buf,
        b: &Self::Buf,
        m: usize,
        n: usize,
        k: usize,
    ) -> Self::Buf {
        // Cᵀ[n×m] = B[n×k]·Aᵀ: op(B_cm)=T, op(A_cm)=N.
        self.gemm(true, false, n, m, k, b, k, a, k, n)
    }

    fn matmul_tn(
        &mut self,
        a: &Self::Buf,
        b: &Self::Buf,
        m: usize,
        n: usize,
        k: usize,
    ) -> Self::Buf {
        // C = Aᵀ·B with A[k×m], B[k×n]: Cᵀ[n×m] = Bᵀ·A = B_cm·A_cmᵀ.
        self.gemm(false, true, n, m, k, b, n, a, m, n)
    }

    fn matmul_nn(
        &mut self,
        a: &Self::Buf,
        b: &Self::Buf,
        m: usize,
        n: usize,
        k: usize,
    ) -> Self::Buf {
        // Cᵀ[n×m] = Bᵀ·Aᵀ = B_cm·A_cm.
        self.gemm(false, false, n, m, k, b, n, a, k, n)
    }

    fn add_row_bias(&mut self, z: &mut Self::Buf, bias: &Self::Buf, rows: usize, cols: usize) {
        let (r, c) = (rows as i32, cols as i32);
        launch!(self, "add_row_bias", rows * cols, z, bias, &r, &c);
    }

    fn col_sums(&mut self, d: &Self::Buf, rows: usize, cols: usize) -> Self::Buf {
        let mut out = self.zeros_or_empty(cols);
        let (r, c) = (rows as i32, cols as i32);
        launch!(self, "col_sums", cols, d, &mut out, &r, &c);
        out
    }

    fn relu(&mut self, z: &mut Self::Buf) {
        let n = z.len();
        let ni = n as i32;
        launch!(self, "relu", n, z, &ni);
    }

    fn relu_backward(&mut self, d: &mut Self::Buf, a: &Self::Buf) {
        let n = d.len();
        let ni = n as i32;
        launch!(self, "relu_backward", n, d, a, &ni);
    }

    fn softmax_xent(
        &mut self,
        logits: &Self::Buf,
        labels: &Self::Buf,
        rows: usize,
        classes: usize,
    ) -> (Self::Buf, f64, u64) {
        let mut grad = self.zeros_or_empty(rows * classes);
        let mut loss = self.zeros_or_empty(rows);
        let mut correct = self.zeros_or_empty(rows);
        let (r, c) = (rows as i32, classes as i32);
        let scale = 1.0f32 / rows.max(1) as f32;
        launch!(
            self,
            "softmax_xent",
            rows,
            logits,
            labels,
            &mut grad,
            &mut loss,
            &mut correct,
            &r,
            &c,
            &scale
        );
        let total = self.host_sum(&loss);
        let right = self.host_sum(&correct);
        (grad, total, right as u64)
    }

    fn mse(
        &mut self,
        pred: &Self::Buf,
        target: &Self::Buf,
        rows: usize,
        outs: usize,
    ) -> (Self::Buf, f64) {
        let n = rows * outs;
        let mut grad = self.zeros_or_empty(n);
        let mut loss = self.zeros_or_empty(n);
        let ni = n as i32;
        let scale = 1.0f32 / rows.max(1) as f32;
        launch!(
            self, "mse", n, pred, target, &mut grad, &mut loss, &ni, &scale
        );
        let total = self.host_sum(&loss);
        (grad, total)
    }

    fn all_reduce_sum_host(&mut self, values: &mut [f64]) {
        let Some(comm) = self.comm.take() else {
            return;
        };
        // Runs even after this rank recorded an error: the other ranks are
        // waiting in this collective to learn of it.
        match self.stream.clone_htod(values) {
            Ok(mut sums) => {
                let r = all_reduce(&comm, &self.stream, &mut sums, Reduce::Sum);
                if self.record(r).is_some() {
                    let back = self.stream.clone_dtoh(&sums);
                    if let Some(back) = self.record(back) {
                        values.copy_from_slice(&back);
                    }
                }
            }
            Err(e) => {
                self.record::<()>(Err(e));
            }
        }
        self.comm = Some(comm);
    }

    fn all_reduce_mean(&mut self, bufs: &mut [Self::Buf]) {
        let Some(comm) = self.comm.take() else {
            return;
        };
        // One all-reduce over one flat buffer: the gradients are copied
        // into it back to back (device to device), averaged, copied back.
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let mut flat = match self.flat.take() {
            Some(f) if f.len() == total => f,
            _ => self.zeros_or_empty(total),
        };
        let mut at = 0;
        for b in bufs.iter() {
            let r = self
                .stream
                .memcpy_dtod(b, &mut flat.slice_mut(at..at + b.len()));
            self.record(r);
            at += b.len();
        }
        if self.error.is_none() && total > 0 {
            let r = all_reduce(&comm, &self.stream, &mut flat, Reduce::Avg);
            self.record(r);
        }
        let mut at = 0;
        for b in bufs.iter_mut() {
            let len = b.len();
            let r = self.stream.memcpy_dtod(&flat.slice(at..at + len), b);
            self.record(r);
            at += len;
        }
        self.flat = Some(flat);
        self.comm = Some(comm);
    }

    fn sgd_step(
        &mut self,
        p: &mut Self::Buf,
        g: &Self::Buf,
        v: &mut Self::Buf,
        lr: f32,
        momentum: f32,
        wd: f32,
    ) {
        let n = p.len();
        let ni = n as i32;
        launch!(self, "sgd", n, p, g, v, &ni, &lr, &momentum, &wd);
    }

    fn adamw_step(
        &mut self,
        p: &mut Self::Buf,
        g: &Self::Buf,
        m: &mut Self::Buf,
        v: &mut Self::Buf,
        t: u64,
        lr: f32,
        wd: f32,
    ) {
        let n = p.len();
        let ni = n as i32;
        let t = i32::try_from(t).unwrap_or(i32::MAX);
        let c1 = 1.0 - 0.9f64.powi(t);
        let c2 = 1.0 - 0.999f64.powi(t);
        launch!(self, "adamw", n, p, g, m, v, &ni, &lr, &wd, &c1, &c2);
    }
}
