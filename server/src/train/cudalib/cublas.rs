//! cuBLAS, the GEMMs of a GPU job's steps, opened as `libcublas.so.12`,
//! `libcublas.so.13` (CUDA 13's wheels and toolkits ship no other name),
//! then `libcublas.so`: a handle on a stream, and single-precision GEMM.

use std::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;

use super::{open_first, symbol, words};

/// The names tried, in order.
pub const NAMES: [&str; 3] = ["libcublas.so.12", "libcublas.so.13", "libcublas.so"];

/// `CUBLAS_STATUS_SUCCESS`.
const SUCCESS: c_int = 0;
/// `CUBLAS_OP_N` and `CUBLAS_OP_T` (`cublasOperation_t`).
const OP_N: c_int = 0;
const OP_T: c_int = 1;
/// `MAJOR_VERSION`, `MINOR_VERSION` and `PATCH_LEVEL` (`libraryPropertyType`).
const PROPERTIES: [c_int; 3] = [0, 1, 2];

type Create = unsafe extern "C" fn(*mut *mut c_void) -> c_int;
type Destroy = unsafe extern "C" fn(*mut c_void) -> c_int;
type SetStream = unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int;
type GetProperty = unsafe extern "C" fn(c_int, *mut c_int) -> c_int;
type Sgemm = unsafe extern "C" fn(
    *mut c_void,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    *const f32,
    *const f32,
    c_int,
    *const f32,
    c_int,
    *const f32,
    *mut f32,
    c_int,
) -> c_int;
type GetStatusString = unsafe extern "C" fn(c_int) -> *const c_char;

/// An opened cuBLAS and the entry points a job calls.
pub struct Cublas {
    /// Kept open for the life of the entry points below.
    _library: libloading::Library,
    name: &'static str,
    create: Create,
    destroy: Destroy,
    set_stream: SetStream,
    get_property: GetProperty,
    sgemm: Sgemm,
    get_status_string: GetStatusString,
}

impl std::fmt::Debug for Cublas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cublas").field("name", &self.name).finish()
    }
}

impl Cublas {
    /// The process's cuBLAS, opened at the first call (by [`NAMES`]); else
    /// what each name gave and what to install, every time it is asked.
    pub fn get() -> Result<&'static Cublas, String> {
        static CUBLAS: OnceLock<Result<Cublas, String>> = OnceLock::new();
        CUBLAS
            .get_or_init(|| Cublas::open(&NAMES))
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Opens the first of `names` the dynamic linker finds that has every
    /// entry point.
    pub fn open(names: &[&'static str]) -> Result<Cublas, String> {
        open_first(names, |library, name| {
            // SAFETY: each typed as cuBLAS declares it; the library is kept
            // with them.
            unsafe {
                Ok(Cublas {
                    create: symbol(&library, name, "cublasCreate_v2")?,
                    destroy: symbol(&library, name, "cublasDestroy_v2")?,
                    set_stream: symbol(&library, name, "cublasSetStream_v2")?,
                    get_property: symbol(&library, name, "cublasGetProperty")?,
                    sgemm: symbol(&library, name, "cublasSgemm_v2")?,
                    get_status_string: symbol(&library, name, "cublasGetStatusString")?,
                    _library: library,
                    name,
                })
            }
        })
        .map_err(|tried| {
            format!(
                "cuBLAS cannot be loaded ({}): install the CUDA toolkit's cuBLAS, or the \
                 nvidia-cublas-cu12 (CUDA 12) or nvidia-cublas (CUDA 13) Python package, \
                 and put the folder holding libcublas.so.12 or libcublas.so.13 on \
                 LD_LIBRARY_PATH",
                tried.join("; ")
            )
        })
    }

    /// The name the library was opened by.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// cuBLAS's version, `(major, minor, patch)` (no GPU needed).
    pub fn version(&self) -> Result<(i32, i32, i32), String> {
        let mut parts = [0; 3];
        for (property, part) in PROPERTIES.iter().zip(parts.iter_mut()) {
            // SAFETY: writes one int.
            self.check("cublasGetProperty", unsafe {
                (self.get_property)(*property, part)
            })?;
        }
        Ok((parts[0], parts[1], parts[2]))
    }

    /// A handle whose work goes to `stream`, on the device current on this
    /// thread.
    ///
    /// # Safety
    ///
    /// `stream` must be a live stream of the current device that outlives
    /// the handle.
    pub unsafe fn handle(&'static self, stream: *mut c_void) -> Result<Handle, String> {
        let mut handle: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes one handle.
        self.check("cublasCreate_v2", unsafe { (self.create)(&mut handle) })?;
        let handle = Handle {
            cublas: self,
            handle,
        };
        // SAFETY: the caller's promise above.
        self.check("cublasSetStream_v2", unsafe {
            (self.set_stream)(handle.handle, stream)
        })?;
        Ok(handle)
    }

    /// Makes a handle on the current device's default stream and drops it:
    /// whether cuBLAS can start here (without a GPU it cannot, and says so).
    pub fn try_handle(&'static self) -> Result<(), String> {
        // SAFETY: the null stream is the default stream, which outlives the
        // handle, dropped at once.
        unsafe { self.handle(std::ptr::null_mut()) }.map(drop)
    }

    /// `Ok` for success, else an error naming the call and cuBLAS's words.
    fn check(&self, call: &str, code: c_int) -> Result<(), String> {
        if code == SUCCESS {
            return Ok(());
        }
        // SAFETY: cuBLAS answers any status with a static string.
        let words = unsafe { words((self.get_status_string)(code)) };
        Err(format!("cuBLAS: {call} failed with status {code}: {words}"))
    }
}

/// A single-precision GEMM's shape, in cuBLAS's column-major terms:
/// `C (m × n) = op(A) (m × k) · op(B) (k × n)`, β = 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gemm {
    /// Whether A is transposed.
    pub ta: bool,
    /// Whether B is transposed.
    pub tb: bool,
    /// Rows of C.
    pub m: usize,
    /// Columns of C.
    pub n: usize,
    /// The inner dimension.
    pub k: usize,
    /// Leading dimensions of A, B and C.
    pub lda: usize,
    /// See `lda`.
    pub ldb: usize,
    /// See `lda`.
    pub ldc: usize,
}

/// A cuBLAS handle on one stream; destroyed on drop.
pub struct Handle {
    cublas: &'static Cublas,
    handle: *mut c_void,
}

// SAFETY: a cuBLAS handle may be used from any one thread at a time; a
// `Handle` is moved with its rank, never shared.
unsafe impl Send for Handle {}

impl std::fmt::Debug for Handle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("cublas::Handle")
    }
}

impl Handle {
    /// Enqueues `C = op(A)·op(B)` (`shape`) on the handle's stream, with
    /// device addresses `a`, `b` and `c`.
    ///
    /// # Safety
    ///
    /// The addresses must be device allocations of the current device that
    /// hold the matrices `shape` describes and outlive the enqueued work.
    pub unsafe fn sgemm(&self, shape: Gemm, a: u64, b: u64, c: u64) -> Result<(), String> {
        let int = |v: usize, what: &str| {
            c_int::try_from(v)
                .map_err(|_| format!("a GEMM's {what} of {v} is past cuBLAS's 32-bit sizes"))
        };
        let op = |t: bool| if t { OP_T } else { OP_N };
        let (alpha, beta) = (1.0f32, 0.0f32);
        let code = unsafe {
            // SAFETY: the caller's promise above; α and β are host values,
            // cuBLAS's default pointer mode.
            (self.cublas.sgemm)(
                self.handle,
                op(shape.ta),
                op(shape.tb),
                int(shape.m, "m")?,
                int(shape.n, "n")?,
                int(shape.k, "k")?,
                &alpha,
                a as usize as *const f32,
                int(shape.lda, "lda")?,
                b as usize as *const f32,
                int(shape.ldb, "ldb")?,
                &beta,
                c as usize as *mut f32,
                int(shape.ldc, "ldc")?,
            )
        };
        self.cublas.check("cublasSgemm_v2", code)
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: the handle came from cublasCreate_v2 and is dropped once.
        let code = unsafe { (self.cublas.destroy)(self.handle) };
        if let Err(e) = self.cublas.check("cublasDestroy_v2", code) {
            tracing::warn!(error = %e, "destroying a cuBLAS handle");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_machine_without_cublas_gets_every_name_tried_and_what_to_install() {
        let err = Cublas::open(&["libflightdeck-absent-cublas.so.13"]).expect_err("none");
        assert!(
            err.contains("libflightdeck-absent-cublas.so.13: cannot open"),
            "{err}"
        );
        assert!(
            err.contains("nvidia-cublas") && err.contains("LD_LIBRARY_PATH"),
            "{err}"
        );
    }

    #[test]
    fn a_library_without_cublas_s_entry_points_is_refused_whole() {
        let err = Cublas::open(&["libc.so.6"]).expect_err("not cuBLAS");
        assert!(err.contains("libc.so.6 has no cublasCreate_v2 ("), "{err}");
    }
}
