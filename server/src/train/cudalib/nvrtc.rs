//! NVRTC, the CUDA C compiler a GPU job builds its kernels with, opened as
//! `libnvrtc.so.12`, `libnvrtc.so.13` (CUDA 13's wheels and toolkits ship
//! no other name), then `libnvrtc.so`.

use std::ffi::{CString, c_char, c_int, c_void};
use std::sync::OnceLock;

use super::{open_first, symbol, words};

/// The names tried, in order.
pub const NAMES: [&str; 3] = ["libnvrtc.so.12", "libnvrtc.so.13", "libnvrtc.so"];

/// `NVRTC_SUCCESS`.
const SUCCESS: c_int = 0;

type Program = *mut c_void;
type Version = unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int;
type CreateProgram = unsafe extern "C" fn(
    *mut Program,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> c_int;
type CompileProgram = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> c_int;
type Size = unsafe extern "C" fn(Program, *mut usize) -> c_int;
type CopyOut = unsafe extern "C" fn(Program, *mut c_char) -> c_int;
type DestroyProgram = unsafe extern "C" fn(*mut Program) -> c_int;
type GetErrorString = unsafe extern "C" fn(c_int) -> *const c_char;

/// An opened NVRTC and the entry points a compile calls.
pub struct Nvrtc {
    /// Kept open for the life of the entry points below.
    _library: libloading::Library,
    name: &'static str,
    version: Version,
    create_program: CreateProgram,
    compile_program: CompileProgram,
    log_size: Size,
    log: CopyOut,
    ptx_size: Size,
    ptx: CopyOut,
    cubin_size: Size,
    cubin: CopyOut,
    destroy_program: DestroyProgram,
    get_error_string: GetErrorString,
}

impl std::fmt::Debug for Nvrtc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nvrtc").field("name", &self.name).finish()
    }
}

/// What a compile makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// PTX text, for the driver to compile.
    Ptx,
    /// Machine code for the architecture the options name.
    Cubin,
}

impl Nvrtc {
    /// The process's NVRTC, opened at the first call (by [`NAMES`]); else
    /// what each name gave and what to install, every time it is asked.
    pub fn get() -> Result<&'static Nvrtc, String> {
        static NVRTC: OnceLock<Result<Nvrtc, String>> = OnceLock::new();
        NVRTC
            .get_or_init(|| Nvrtc::open(&NAMES))
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Opens the first of `names` the dynamic linker finds that has every
    /// entry point.
    pub fn open(names: &[&'static str]) -> Result<Nvrtc, String> {
        open_first(names, |library, name| {
            // SAFETY: each typed as NVRTC declares it; the library is kept
            // with them.
            unsafe {
                Ok(Nvrtc {
                    version: symbol(&library, name, "nvrtcVersion")?,
                    create_program: symbol(&library, name, "nvrtcCreateProgram")?,
                    compile_program: symbol(&library, name, "nvrtcCompileProgram")?,
                    log_size: symbol(&library, name, "nvrtcGetProgramLogSize")?,
                    log: symbol(&library, name, "nvrtcGetProgramLog")?,
                    ptx_size: symbol(&library, name, "nvrtcGetPTXSize")?,
                    ptx: symbol(&library, name, "nvrtcGetPTX")?,
                    cubin_size: symbol(&library, name, "nvrtcGetCUBINSize")?,
                    cubin: symbol(&library, name, "nvrtcGetCUBIN")?,
                    destroy_program: symbol(&library, name, "nvrtcDestroyProgram")?,
                    get_error_string: symbol(&library, name, "nvrtcGetErrorString")?,
                    _library: library,
                    name,
                })
            }
        })
        .map_err(|tried| {
            format!(
                "NVRTC cannot be loaded ({}): install the CUDA toolkit's NVRTC, or the \
                 nvidia-cuda-nvrtc-cu12 (CUDA 12) or nvidia-cuda-nvrtc (CUDA 13) Python \
                 package, and put the folder holding libnvrtc.so.12 or libnvrtc.so.13 on \
                 LD_LIBRARY_PATH",
                tried.join("; ")
            )
        })
    }

    /// The name the library was opened by.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// NVRTC's CUDA version, `(major, minor)`.
    pub fn version(&self) -> Result<(i32, i32), String> {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: writes two ints.
        self.check("nvrtcVersion", unsafe {
            (self.version)(&mut major, &mut minor)
        })?;
        Ok((major, minor))
    }

    /// Compiles CUDA C `src` with `options` into `output`; returns it with
    /// NVRTC's log (its warnings; empty when it had none). A failed compile's
    /// error carries the log.
    pub fn compile(
        &self,
        src: &str,
        options: &[String],
        output: Output,
    ) -> Result<(Vec<u8>, String), String> {
        let src = CString::new(src).map_err(|_| "the CUDA source holds a NUL byte".to_string())?;
        let options = options
            .iter()
            .map(|o| CString::new(o.as_str()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| "an NVRTC option holds a NUL byte".to_string())?;
        let pointers: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
        let count = c_int::try_from(pointers.len()).map_err(|_| "too many NVRTC options")?;
        let mut program: Program = std::ptr::null_mut();
        // SAFETY: `src` is NUL-terminated; no name, no headers.
        self.check("nvrtcCreateProgram", unsafe {
            (self.create_program)(
                &mut program,
                src.as_ptr(),
                std::ptr::null(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        })?;
        // SAFETY: `program` is live (destroyed below, once); `pointers`
        // holds `count` NUL-terminated options that outlive the call.
        let compiled = unsafe { (self.compile_program)(program, count, pointers.as_ptr()) };
        let log = self.copy_out(program, self.log_size, self.log, "nvrtcGetProgramLog");
        let log = log.map(|bytes| {
            String::from_utf8_lossy(&bytes)
                .trim_end_matches('\0')
                .trim()
                .to_string()
        });
        let out = match (self.check("nvrtcCompileProgram", compiled), log) {
            (Err(e), log) => Err(format!("{e}: {}", log.unwrap_or_default())),
            (Ok(()), Err(e)) => Err(e),
            (Ok(()), Ok(log)) => match output {
                Output::Cubin => {
                    self.copy_out(program, self.cubin_size, self.cubin, "nvrtcGetCUBIN")
                }
                Output::Ptx => self
                    .copy_out(program, self.ptx_size, self.ptx, "nvrtcGetPTX")
                    .map(|mut text| {
                        while text.last() == Some(&0) {
                            text.pop();
                        }
                        text
                    }),
            }
            .map(|image| (image, log)),
        };
        // SAFETY: `program` is not used after this.
        let _ = unsafe { (self.destroy_program)(&mut program) };
        out
    }

    /// One of a compiled program's outputs, sized by `size` and copied out
    /// by `copy`.
    fn copy_out(
        &self,
        program: Program,
        size: Size,
        copy: CopyOut,
        call: &str,
    ) -> Result<Vec<u8>, String> {
        let mut len = 0usize;
        // SAFETY: `program` is live; writes one size.
        self.check(call, unsafe { size(program, &mut len) })?;
        let mut bytes = vec![0u8; len];
        // SAFETY: NVRTC writes exactly the `len` bytes it reported.
        self.check(call, unsafe { copy(program, bytes.as_mut_ptr().cast()) })?;
        Ok(bytes)
    }

    /// `Ok` for success, else an error naming the call and NVRTC's words.
    fn check(&self, call: &str, code: c_int) -> Result<(), String> {
        if code == SUCCESS {
            return Ok(());
        }
        // SAFETY: NVRTC answers any code with a static string.
        let words = unsafe { words((self.get_error_string)(code)) };
        Err(format!("NVRTC: {call} failed with code {code}: {words}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_machine_without_nvrtc_gets_every_name_tried_and_what_to_install() {
        let err = Nvrtc::open(&["libflightdeck-absent-nvrtc.so.13"]).expect_err("none");
        assert!(
            err.contains("libflightdeck-absent-nvrtc.so.13: cannot open"),
            "{err}"
        );
        assert!(
            err.contains("nvidia-cuda-nvrtc") && err.contains("LD_LIBRARY_PATH"),
            "{err}"
        );
    }

    #[test]
    fn a_library_without_nvrtc_s_entry_points_is_refused_whole() {
        let err = Nvrtc::open(&["libc.so.6"]).expect_err("not NVRTC");
        assert!(err.contains("libc.so.6 has no nvrtcVersion ("), "{err}");
    }
}
