//! The fuzz targets' smoke run, on the stable toolchain: each target's body
//! (`fuzz/targets/`) runs on every input of its corpus (`fuzz/corpus/`) and
//! on seeded mutations of them (bit flips, interesting bytes, insertions,
//! deletions, truncations, splices), a bounded number within a bounded time.
//! No input may panic past the server's own handling. Coverage-guided
//! fuzzing with sanitizers is `scripts/fuzz.sh` (nightly).

use std::cell::RefCell;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[path = "../fuzz/targets/commands.rs"]
mod commands;
#[path = "../fuzz/targets/ingest.rs"]
mod ingest;

/// Mutants of each corpus input, at most.
const MUTANTS_PER_INPUT: usize = 20_000;
/// Time for one target's whole run, at most.
const BUDGET: Duration = Duration::from_secs(30);

/// A xorshift generator: the same mutants on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// `input` changed in one to four places.
fn mutate(input: &[u8], other: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut out = input.to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(out.len() + 1);
        match rng.below(6) {
            0 if at < out.len() => out[at] ^= 1 << rng.below(8),
            1 if at < out.len() => {
                out[at] = [0x00, 0x01, 0x7f, 0x80, 0xff][rng.below(5)];
            }
            2 => out.insert(at, rng.next() as u8),
            3 if at < out.len() => {
                out.remove(at);
            }
            4 => out.truncate(at),
            _ => {
                // Splice in a piece of another input.
                let from = rng.below(other.len());
                let len = rng.below(other.len() - from.min(other.len()) + 1).min(64);
                let piece = other.get(from..from + len).unwrap_or_default().to_vec();
                out.splice(at.min(out.len())..at.min(out.len()), piece);
            }
        }
    }
    out
}

fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("corpus {}: {e}", dir.display()))
        .map(|e| e.expect("corpus entry").path())
        .collect();
    files.sort();
    let inputs: Vec<Vec<u8>> = files
        .iter()
        .map(|f| std::fs::read(f).expect("corpus input"))
        .collect();
    assert!(!inputs.is_empty(), "no corpus for {target}");
    inputs
}

thread_local! {
    /// The message of the last panic on this thread.
    static LAST_PANIC: RefCell<String> = const { RefCell::new(String::new()) };
}

/// Runs `run` on the corpus of `target` and its mutants; returns how many
/// inputs ran and how many of them `run` accepted. Panics the server
/// catches stay quiet; one that escapes fails the test with the input that
/// caused it.
fn smoke(target: &str, run: &dyn Fn(&[u8]) -> bool) -> (usize, usize) {
    let inputs = corpus(target);
    std::panic::set_hook(Box::new(|info| {
        LAST_PANIC.with(|p| *p.borrow_mut() = info.to_string());
    }));
    let start = Instant::now();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ target.len() as u64);
    let (mut ran, mut accepted) = (0usize, 0usize);
    let mut check = |input: &[u8]| match std::panic::catch_unwind(std::panic::AssertUnwindSafe(
        || run(input),
    )) {
        Ok(ok) => accepted += usize::from(ok),
        Err(_) => {
            let message = LAST_PANIC.with(|p| p.borrow().clone());
            let _ = std::panic::take_hook();
            panic!("{target}: input {input:02x?} panicked: {message}");
        }
    };
    for input in &inputs {
        check(input);
        ran += 1;
    }
    'all: for round in 0..MUTANTS_PER_INPUT {
        for (i, input) in inputs.iter().enumerate() {
            if start.elapsed() > BUDGET {
                break 'all;
            }
            let other = &inputs[(i + round + 1) % inputs.len()];
            check(&mutate(input, other, &mut rng));
            ran += 1;
        }
    }
    let _ = std::panic::take_hook();
    println!(
        "{target}: {ran} inputs ({accepted} accepted) in {:?}",
        start.elapsed()
    );
    (ran, accepted)
}

#[test]
fn fuzz_targets_survive_their_corpus_and_its_mutants() {
    // One test: the panic hook is the process's.
    let (decoded, _) = smoke("commands", &|data| {
        commands::run(data);
        true
    });
    ingest::init();
    let (ingested, committed) = smoke("ingest", &ingest::run);
    // Every input ran, and some mutants were still puts that committed.
    let (commands, attempts) = (corpus("commands").len(), corpus("ingest").len());
    assert!(
        decoded > commands && ingested > attempts,
        "{decoded} {ingested}"
    );
    assert!(committed > attempts, "{committed} of {ingested} committed");
}
