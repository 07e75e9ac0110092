//! Records the commit the benchmark is built from (with `+dirty` when the
//! tree had changes), so every JSON it writes names the code it measured.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    let commit = git(&["rev-parse", "HEAD"]).map(|head| {
        let dirty =
            git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
        if dirty { format!("{head}+dirty") } else { head }
    });
    println!(
        "cargo:rustc-env=FLIGHTDECK_BUILD_COMMIT={}",
        commit.unwrap_or_default()
    );
    // Built again when HEAD moves or the index changes (a commit or a
    // checkout), not on every build.
    if let Some(dir) = git(&["rev-parse", "--absolute-git-dir"]) {
        println!("cargo:rerun-if-changed={dir}/HEAD");
        println!("cargo:rerun-if-changed={dir}/index");
        if let Some(head) = git(&["symbolic-ref", "-q", "HEAD"]) {
            println!("cargo:rerun-if-changed={dir}/{head}");
        }
    }
}
