//! Checks the server's CUDA kernels without a GPU: compiles them with NVRTC
//! and the server's own options to PTX and to a cubin for each architecture
//! (what a GPU job loads), fails on any NVRTC warning, then assembles the
//! PTX with `ptxas` for each architecture, with warnings as errors.
//!
//! ```sh
//! LD_LIBRARY_PATH=…/nvidia/cuda_nvrtc/lib cargo run -p flightdeck-server --example kernel_check -- \
//!     [--ptxas …/nvidia/cuda_nvcc/bin/ptxas] --arch sm_80,sm_90 [--source broken.cu]
//! ```
//!
//! Without `--ptxas` the PTX is not assembled (an NVRTC newer than the
//! ptxas at hand writes PTX that ptxas does not know); NVRTC's cubins for
//! each architecture, what a job loads, are still made and checked.
//!
//! `scripts/gpu-check.sh kernels` installs NVRTC and ptxas from their
//! Python wheels and runs this, then proves it fails on a broken kernel.

use std::process::{Command, ExitCode};

use flightdeck_server::train::cuda::{KERNELS, compile_kernels};
use flightdeck_server::train::cudalib::nvrtc::Nvrtc;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kernel_check: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    let mut ptxas = None;
    let mut archs = vec!["sm_80".to_string(), "sm_90".to_string()];
    let mut source = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--ptxas" => ptxas = Some(value()?),
            "--arch" => archs = value()?.split(',').map(str::to_string).collect(),
            "--source" => source = Some(value()?),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    let (what, src) = match &source {
        Some(path) => (
            path.clone(),
            std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?,
        ),
        None => ("the server's kernels".to_string(), KERNELS.to_string()),
    };
    let compiled = compile_kernels(&src, None).map_err(|e| format!("{what}: NVRTC failed: {e}"))?;
    if !compiled.log.is_empty() {
        return Err(format!("{what}: NVRTC warned:\n{}", compiled.log));
    }
    let ptx = String::from_utf8_lossy(&compiled.image).into_owned();
    let entries = ptx.matches(".entry").count();
    let dir = std::env::temp_dir().join(format!("flightdeck-kernels-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let file = dir.join("kernels.ptx");
    std::fs::write(&file, &ptx).map_err(|e| e.to_string())?;
    let version = ptx
        .lines()
        .find(|l| l.starts_with(".version"))
        .unwrap_or(".version ?")
        .to_string();
    let nvrtc = Nvrtc::get()?;
    let (major, minor) = nvrtc.version()?;
    println!(
        "{what}: NVRTC {major}.{minor} ({}) compiled {entries} kernels, {} bytes of PTX ({version})",
        nvrtc.name(),
        ptx.len()
    );
    let mut failed = Vec::new();
    // What a GPU job loads: NVRTC's own cubin for the device's architecture.
    for arch in &archs {
        match compile_kernels(&src, Some(arch)) {
            Ok(c) if c.log.is_empty() && c.image.starts_with(b"\x7fELF") => {
                println!("{what}: NVRTC cubin {arch}: {} bytes", c.image.len());
            }
            Ok(c) if !c.log.is_empty() => failed.push(format!("NVRTC {arch} warned: {}", c.log)),
            Ok(_) => failed.push(format!("NVRTC {arch}: not an ELF cubin")),
            Err(e) => failed.push(format!("NVRTC {arch}: {e}")),
        }
    }
    // Without --ptxas (an NVRTC newer than any ptxas at hand), NVRTC's own
    // cubins above are the check.
    if let Some(ptxas) = &ptxas {
        for arch in &archs {
            let out = Command::new(ptxas)
                .arg(format!("-arch={arch}"))
                .args(["--warning-as-error", "-o"])
                .arg(dir.join(format!("kernels.{arch}.cubin")))
                .arg(&file)
                .output()
                .map_err(|e| format!("cannot run {ptxas}: {e}"))?;
            let said = String::from_utf8_lossy(&out.stderr).trim().to_string();
            if out.status.success() && said.is_empty() {
                println!("{what}: ptxas {arch}: ok");
            } else {
                failed.push(format!("ptxas {arch}: {said}"));
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!("{what}:\n{}", failed.join("\n")))
    }
}
