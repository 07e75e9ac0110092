//! Fuzz target `commands`: see `fuzz/targets/commands.rs`.
#![no_main]

#[path = "../targets/commands.rs"]
mod target;

libfuzzer_sys::fuzz_target!(|data: &[u8]| target::run(data));
