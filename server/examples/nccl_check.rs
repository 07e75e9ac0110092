//! Checks, without a GPU, that the server opens NCCL the way a GPU job does:
//! by the name NCCL's packages install (`libnccl.so.2`), with every entry
//! point a job calls; prints the name, NCCL's version, and that a
//! communicator id can be made (the one NCCL call a job's first process
//! makes before any GPU is touched).
//!
//! ```sh
//! LD_LIBRARY_PATH=…/nvidia/nccl/lib cargo run -p flightdeck-server --example nccl_check
//! ```
//!
//! `scripts/gpu-check.sh kernels` runs it against the NCCL of the test
//! environment's PyTorch (a folder holding `libnccl.so.2` alone, no
//! `libnccl.so` link), then proves it fails where there is none.

use std::process::ExitCode;

use flightdeck_server::train::nccl::Nccl;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nccl_check: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    let nccl = Nccl::get().map_err(|e| e.to_string())?;
    let version = nccl.version().map_err(|e| e.to_string())?;
    nccl.unique_id().map_err(|e| e.to_string())?;
    println!(
        "NCCL {}.{}.{} opened as {}; a communicator id made",
        version / 10000,
        version / 100 % 100,
        version % 100,
        nccl.name()
    );
    Ok(())
}
