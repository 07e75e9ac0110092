//! Checks, without a GPU, that the server opens the CUDA libraries a GPU
//! job calls the way a job does — NVRTC, cuBLAS and NCCL, each by the names
//! its packages install (`libnvrtc.so.13`, `libcublas.so.13`,
//! `libnccl.so.2`, …) with every entry point a job calls — and prints
//! which file each was opened as and its version; NCCL also makes a
//! communicator id (the one NCCL call a job makes before any GPU is
//! touched), and cuBLAS is asked for a handle (refused, in cuBLAS's own
//! words, where there is no GPU).
//!
//! ```sh
//! LD_LIBRARY_PATH=…/nvidia/cu13/lib:…/nvidia/nccl/lib \
//!     cargo run -p flightdeck-server --example cuda_libs_check [-- nvrtc cublas nccl]
//! ```
//!
//! With names, only those libraries are checked. `scripts/gpu-check.sh
//! libs` runs it against the CUDA libraries of the test environment's
//! PyTorch (folders holding versioned names alone), then proves each
//! refused where there is none.

use std::process::ExitCode;

use flightdeck_server::train::cudalib::{cublas::Cublas, nccl::Nccl, nvrtc::Nvrtc};

fn main() -> ExitCode {
    let mut asked: Vec<String> = std::env::args().skip(1).collect();
    if asked.is_empty() {
        asked = ["nvrtc", "cublas", "nccl"].map(String::from).to_vec();
    }
    let mut failed = false;
    for name in &asked {
        match check(name) {
            Ok(said) => println!("{said}"),
            Err(e) => {
                eprintln!("cuda_libs_check: {e}");
                failed = true;
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn check(name: &str) -> Result<String, String> {
    match name {
        "nvrtc" => {
            let nvrtc = Nvrtc::get()?;
            let (major, minor) = nvrtc.version()?;
            Ok(format!("NVRTC {major}.{minor} opened as {}", nvrtc.name()))
        }
        "cublas" => {
            let cublas = Cublas::get()?;
            let (major, minor, patch) = cublas.version()?;
            let handle = match cublas.try_handle() {
                Ok(_) => "a handle made".to_string(),
                Err(e) => format!("a handle refused without a GPU ({e})"),
            };
            Ok(format!(
                "cuBLAS {major}.{minor}.{patch} opened as {}; {handle}",
                cublas.name()
            ))
        }
        "nccl" => {
            let nccl = Nccl::get().map_err(|e| e.to_string())?;
            let version = nccl.version().map_err(|e| e.to_string())?;
            nccl.unique_id().map_err(|e| e.to_string())?;
            Ok(format!(
                "NCCL {}.{}.{} opened as {}; a communicator id made",
                version / 10000,
                version / 100 % 100,
                version % 100,
                nccl.name()
            ))
        }
        other => Err(format!(
            "unknown library {other}: name nvrtc, cublas or nccl"
        )),
    }
}
