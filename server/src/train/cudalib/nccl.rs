//! NCCL, opened as `libnccl.so.2` (the name its runtime package and its
//! `nvidia-nccl-cu12` / `-cu13` wheels install), then `libnccl.so`: a
//! communicator id, a rank joining a communicator, an in-place all-reduce.

use std::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;

use super::{open_first, symbol, words};
use crate::error::{Error, Result};

/// The names tried, in order: the runtime's, then the development link.
pub const NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

/// `ncclFloat32` and `ncclFloat64` (`ncclDataType_t`, stable since NCCL 2.0).
const FLOAT32: c_int = 7;
const FLOAT64: c_int = 8;
/// `ncclSum` and `ncclAvg` (`ncclRedOp_t`; `ncclAvg` since NCCL 2.10).
const SUM: c_int = 0;
const AVG: c_int = 4;
/// `ncclSuccess` and `ncclInProgress` (a non-blocking communicator's
/// pending call; ours block, but it is not an error).
const SUCCESS: c_int = 0;
const IN_PROGRESS: c_int = 7;

/// NCCL's `ncclUniqueId`: what every rank of one communicator shares.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Id {
    internal: [c_char; 128],
}

impl std::fmt::Debug for Id {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("nccl::Id")
    }
}

type GetVersion = unsafe extern "C" fn(*mut c_int) -> c_int;
type GetUniqueId = unsafe extern "C" fn(*mut Id) -> c_int;
type CommInitRank = unsafe extern "C" fn(*mut *mut c_void, c_int, Id, c_int) -> c_int;
type AllReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    *mut c_void,
    *mut c_void,
) -> c_int;
type CommAbort = unsafe extern "C" fn(*mut c_void) -> c_int;
type GetErrorString = unsafe extern "C" fn(c_int) -> *const c_char;

/// An opened NCCL and the entry points a job calls.
pub struct Nccl {
    /// Kept open for the life of the entry points below.
    _library: libloading::Library,
    name: &'static str,
    get_version: GetVersion,
    get_unique_id: GetUniqueId,
    comm_init_rank: CommInitRank,
    all_reduce: AllReduce,
    comm_abort: CommAbort,
    get_error_string: GetErrorString,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nccl").field("name", &self.name).finish()
    }
}

impl Nccl {
    /// The process's NCCL, opened at the first call (by [`NAMES`]); a
    /// machine without it gets `FAILED_PRECONDITION` naming what was
    /// tried and why each failed, every time it asks.
    pub fn get() -> Result<&'static Nccl> {
        static NCCL: OnceLock<std::result::Result<Nccl, String>> = OnceLock::new();
        NCCL.get_or_init(|| Nccl::open(&NAMES))
            .as_ref()
            .map_err(|why| Error::FailedPrecondition(why.clone()))
    }

    /// Opens the first of `names` the dynamic linker finds that has every
    /// entry point; else says what each name gave and what to do.
    pub fn open(names: &[&'static str]) -> std::result::Result<Nccl, String> {
        open_first(names, |library, name| {
            // SAFETY: each typed as NCCL 2 declares it; the library is kept
            // with them.
            unsafe {
                Ok(Nccl {
                    get_version: symbol(&library, name, "ncclGetVersion")?,
                    get_unique_id: symbol(&library, name, "ncclGetUniqueId")?,
                    comm_init_rank: symbol(&library, name, "ncclCommInitRank")?,
                    all_reduce: symbol(&library, name, "ncclAllReduce")?,
                    comm_abort: symbol(&library, name, "ncclCommAbort")?,
                    get_error_string: symbol(&library, name, "ncclGetErrorString")?,
                    _library: library,
                    name,
                })
            }
        })
        .map_err(|tried| {
            format!(
                "this server cannot load NCCL, which training on several GPUs needs ({}). \
                 Install NCCL (its runtime package, or the nvidia-nccl-cu12 / -cu13 Python \
                 package PyTorch installs) and put the folder holding libnccl.so.2 on \
                 LD_LIBRARY_PATH, or train on one GPU",
                tried.join("; ")
            )
        })
    }

    /// The name the library was opened by.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// NCCL's version as it reports it (`major·10000 + minor·100 + patch`
    /// since 2.9), e.g. 23007 for 2.30.7.
    pub fn version(&self) -> Result<i32> {
        let mut version: c_int = 0;
        // SAFETY: writes one int.
        self.check("ncclGetVersion", unsafe {
            (self.get_version)(&mut version)
        })?;
        Ok(version)
    }

    /// A new communicator id, made by the process that starts the job
    /// (no GPU needed).
    pub fn unique_id(&self) -> Result<Id> {
        let mut id = Id { internal: [0; 128] };
        // SAFETY: writes one ncclUniqueId.
        self.check("ncclGetUniqueId", unsafe { (self.get_unique_id)(&mut id) })?;
        Ok(id)
    }

    /// Rank `rank` of `world` joins the communicator `id`, on the device
    /// current on this thread; returns when every rank has joined.
    pub fn join(&'static self, id: Id, rank: usize, world: usize) -> Result<Comm> {
        let count = |n: usize, what: &str| {
            c_int::try_from(n)
                .map_err(|_| Error::InvalidArgument(format!("{what} {n} is too large")))
        };
        let (rank, world) = (count(rank, "rank")?, count(world, "world size")?);
        let mut comm: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes one communicator handle; `id` is passed by value.
        self.check("ncclCommInitRank", unsafe {
            (self.comm_init_rank)(&mut comm, world, id, rank)
        })?;
        Ok(Comm { nccl: self, comm })
    }

    /// `Ok` for success, else an error naming the call and NCCL's words.
    fn check(&self, call: &str, code: c_int) -> Result<()> {
        if code == SUCCESS || code == IN_PROGRESS {
            return Ok(());
        }
        // SAFETY: NCCL answers any code with a static string.
        let words = unsafe { words((self.get_error_string)(code)) };
        Err(Error::Internal(format!(
            "NCCL: {call} failed with code {code}: {words}"
        )))
    }
}

/// The values an all-reduce combines.
pub trait Value {
    /// The `ncclDataType_t` of the type.
    const TYPE: c_int;
}

impl Value for f32 {
    const TYPE: c_int = FLOAT32;
}

impl Value for f64 {
    const TYPE: c_int = FLOAT64;
}

/// How an all-reduce combines the ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduce {
    /// The sum over ranks.
    Sum,
    /// The mean over ranks.
    Avg,
}

/// One rank's membership of a communicator; leaving it (drop) aborts it,
/// so a rank that fails does not wait for the others.
pub struct Comm {
    nccl: &'static Nccl,
    comm: *mut c_void,
}

// SAFETY: an NCCL communicator may be used from any one thread at a time;
// `Comm` is moved with its rank, never shared.
unsafe impl Send for Comm {}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("nccl::Comm")
    }
}

impl Comm {
    /// Enqueues an in-place all-reduce of `count` values at device address
    /// `values` on `stream`.
    ///
    /// # Safety
    ///
    /// `values` must be a device allocation of at least `count` values of
    /// `T`, valid until the work enqueued on `stream` has run, and `stream`
    /// a live stream of the device this communicator was joined on.
    pub unsafe fn all_reduce_in_place<T: Value>(
        &self,
        values: u64,
        count: usize,
        reduce: Reduce,
        stream: *mut c_void,
    ) -> Result<()> {
        let op = match reduce {
            Reduce::Sum => SUM,
            Reduce::Avg => AVG,
        };
        let at = values as usize as *mut c_void;
        // SAFETY: the caller's promise above.
        let code = unsafe { (self.nccl.all_reduce)(at, at, count, T::TYPE, op, self.comm, stream) };
        self.nccl.check("ncclAllReduce", code)
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // SAFETY: the handle came from ncclCommInitRank and is dropped once.
        let code = unsafe { (self.nccl.comm_abort)(self.comm) };
        if let Err(e) = self.nccl.check("ncclCommAbort", code) {
            tracing::warn!(error = %e, "leaving an NCCL communicator");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_machine_without_nccl_gets_every_name_tried_and_what_to_do() {
        let err = Nccl::open(&[
            "libflightdeck-absent-nccl.so.2",
            "libflightdeck-absent-nccl.so",
        ])
        .expect_err("no such library");
        assert!(
            err.contains("libflightdeck-absent-nccl.so.2: cannot open"),
            "{err}"
        );
        assert!(
            err.contains("libflightdeck-absent-nccl.so: cannot open"),
            "{err}"
        );
        assert!(
            err.contains("LD_LIBRARY_PATH") && err.contains("train on one GPU"),
            "{err}"
        );
    }

    #[test]
    fn a_library_without_nccl_s_entry_points_is_refused_whole() {
        let err = Nccl::open(&["libc.so.6"]).expect_err("not NCCL");
        assert!(err.contains("libc.so.6 has no ncclGetVersion ("), "{err}");
    }
}
