//! Fuzz target `ingest`: see `fuzz/targets/ingest.rs`.
#![no_main]

#[path = "../targets/ingest.rs"]
mod target;

libfuzzer_sys::fuzz_target!(init: {
    // Panics the server catches (inside arrow's IPC reader) must reach its
    // handler, not libfuzzer's aborting hook; a panic that escapes the
    // server still fails the run (libfuzzer-sys aborts on it).
    std::panic::set_hook(Box::new(|_| {}));
    target::init();
}, |data: &[u8]| {
    target::run(data);
});
