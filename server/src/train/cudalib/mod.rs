//! The CUDA libraries a GPU job calls besides the driver — NVRTC (the
//! kernel compiler), cuBLAS (the GEMMs) and NCCL (the all-reduce) — opened
//! at run time by the names their packages install.
//!
//! cudarc's loaders look for `libX.so` and CUDA 12's names, so CUDA 13's
//! libraries (`libcublas.so.13`, `libnvrtc.so.13`: what current PyTorch
//! wheels bring) and NCCL's `libnccl.so.2` (its runtime package and its
//! wheels install no other name) were found only through links made by
//! hand. Here each library is opened by the first of its names the dynamic
//! linker finds (`LD_LIBRARY_PATH`, the linker's cache) that has every entry
//! point a job calls: all are resolved at once, so a library that lacks one
//! is refused whole, before any GPU waits on it. The calls take and return
//! plain C integers, not Rust enums, so a status a newer library returns is
//! reported in the library's own words, never undefined behaviour. The
//! driver stays with cudarc, which finds `libcuda.so.1`.
#![allow(unsafe_code)]

pub mod cublas;
pub mod nccl;
pub mod nvrtc;

use std::ffi::{CStr, c_char};

/// Opens the first of `names` that the dynamic linker finds and `resolve`
/// accepts (its entry points); else what each name gave, in order.
fn open_first<T>(
    names: &[&'static str],
    resolve: impl Fn(libloading::Library, &'static str) -> Result<T, String>,
) -> Result<T, Vec<String>> {
    let mut tried = Vec::new();
    for &name in names {
        // SAFETY: opening a library runs its initialisers; the CUDA
        // libraries' only set up their own state.
        match unsafe { libloading::Library::new(name) } {
            Ok(library) => match resolve(library, name) {
                Ok(opened) => return Ok(opened),
                Err(why) => tried.push(why),
            },
            Err(e) => tried.push(said(&e)),
        }
    }
    Err(tried)
}

/// Entry point `name` of `library` (opened as `file`), typed `T`.
///
/// # Safety
///
/// `T` must be the entry point's C signature, and `library` must outlive
/// the value returned.
unsafe fn symbol<T: Copy>(
    library: &libloading::Library,
    file: &str,
    name: &str,
) -> Result<T, String> {
    let symbol = format!("{name}\0");
    // SAFETY: the caller's promise above.
    unsafe { library.get::<T>(symbol.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| format!("{file} has no {name} ({})", said(&e)))
}

/// What the dynamic linker said, which names the file (libloading's error
/// keeps it as its source).
fn said(e: &libloading::Error) -> String {
    use std::error::Error as _;
    e.source().map_or_else(|| e.to_string(), |s| s.to_string())
}

/// A library's static description of a status code, or a stand-in when it
/// gave none.
///
/// # Safety
///
/// `words` must be null or a NUL-terminated string that outlives the call.
unsafe fn words(words: *const c_char) -> String {
    if words.is_null() {
        return "no description".into();
    }
    // SAFETY: the caller's promise above.
    unsafe { CStr::from_ptr(words) }
        .to_string_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_tried_is_reported_in_order_with_what_the_linker_said() {
        let tried = open_first(
            &["libflightdeck-absent-a.so.2", "libflightdeck-absent-b.so"],
            |_, _| Ok(()),
        )
        .expect_err("no such libraries");
        assert_eq!(tried.len(), 2);
        assert!(
            tried[0].starts_with("libflightdeck-absent-a.so.2: cannot open"),
            "{tried:?}"
        );
        assert!(
            tried[1].starts_with("libflightdeck-absent-b.so: cannot open"),
            "{tried:?}"
        );
    }

    #[test]
    fn a_library_without_an_entry_point_is_passed_over_for_the_next_name() {
        // `cos` is in the maths library, not in the C library.
        let cos = |library: libloading::Library, name: &'static str| {
            // SAFETY: typed as C declares `cos`; not called.
            unsafe { symbol::<unsafe extern "C" fn(f64) -> f64>(&library, name, "cos") }
                .map(|_| name)
        };
        assert_eq!(
            open_first(&["libc.so.6", "libm.so.6"], cos),
            Ok("libm.so.6")
        );
        let tried = open_first(&["libc.so.6"], cos).expect_err("no cos");
        assert!(tried[0].starts_with("libc.so.6 has no cos ("), "{tried:?}");
    }
}
