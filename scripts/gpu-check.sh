#!/usr/bin/env bash
# GPU checks, in two steps because the GPU machine has no Rust toolchain:
#
#   scripts/gpu-check.sh build   # here: release test and bench binaries, packed into
#                                # target/gpu-check/bins.tar.xz (~40 MB: fits a device carry)
#   scripts/gpu-check.sh run     # on the GPU machine (carry target/gpu-check): the GPU tests
#                                # (pinned arena, place, evict's memory, CUDA training vs CPU),
#                                # the tier tests on pinned memory, the h2d bench, the PyTorch
#                                # tests (pinned hand-over; place, train, evict through the
#                                # server) with its own torch; the CPU read benches on its
#                                # cores (gather split on/off); last the reader bench on the GPU
#   scripts/gpu-check.sh kernels # anywhere, no GPU: NVRTC and ptxas check every kernel
#                                # (run by scripts/test.sh)
#   scripts/gpu-check.sh libs    # anywhere, no GPU: NVRTC, cuBLAS and NCCL opened by the
#                                # names their packages install (run by scripts/test.sh)
#
# `run` sets FLIGHTDECK_GPU_TESTS=1, so a machine without a working driver
# fails the checks instead of passing them vacuously. Output goes to
# target/gpu-check/out and, with $OUT set, to one archive of it there,
# $OUT/gpu-check.tar.gz (packed again after every step).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=target/gpu-check

build() {
    rm -rf "$dir"
    mkdir -p "$dir"
    cargo build --release -p flightdeck-bench -p flightdeck-server --bins
    cp target/release/flightdeck-bench target/release/flightdeck "$dir/"
    # Test executables: the GPU checks of the tiers, and the end-to-end tier tests.
    cargo test --release -p flightdeck-server --test gpu --no-run --message-format=json \
        | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | while read -r exe; do cp "$exe" "$dir/gpu-tests"; done
    cargo test --release -p flightdeck-tests --test e2e_tiers --no-run --message-format=json \
        | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | while read -r exe; do cp "$exe" "$dir/tier-tests"; done
    strip "$dir"/*
    # One xz stream with a dictionary larger than a binary, so the library
    # code the four share is stored once (~40 MB instead of ~75 MB).
    (cd "$dir" && tar -cf - gpu-tests tier-tests flightdeck-bench flightdeck \
        | xz -T1 --lzma2=preset=6,dict=512MiB > bins.tar.xz \
        && rm gpu-tests tier-tests flightdeck-bench flightdeck)
    du -sh "$dir"
}

run() {
    out=$dir/out
    rm -rf "$out"
    mkdir -p "$out"
    # With $OUT set, the outputs also go there as one archive, packed again
    # after every step, so a run cut short leaves what it had.
    pack() { [ -z "${OUT:-}" ] || tar -czf "$OUT/gpu-check.tar.gz" -C "$out" .; }
    bins=$(mktemp -d)
    trap 'rm -rf "$bins"' EXIT
    # Python's tarfile needs no xz binary on the GPU machine.
    python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$dir/bins.tar.xz" "$bins"
    # NCCL, cuBLAS and NVRTC come from the Python env's nvidia-* packages,
    # opened by the versioned names those install (no links: what a user's
    # machine has).
    if nv=$(python3 -c "import nvidia; print(list(nvidia.__path__)[0])" 2>/dev/null); then
        for lib in "$nv"/*/lib; do
            LD_LIBRARY_PATH="$lib:${LD_LIBRARY_PATH:-}"
        done
        export LD_LIBRARY_PATH
    fi
    nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
    export FLIGHTDECK_GPU_TESTS=1
    status=0
    # Each step is bounded, so one that hangs still leaves the others' output.
    step() {
        local name=$1; shift
        timeout 300 "$@" > "$out/$name.txt" 2>&1 || { echo "FAILED: $name" >&2; status=1; }
        pack
    }
    step gpu-tests "$bins/gpu-tests" --include-ignored --test-threads 1 --nocapture
    step tier-tests "$bins/tier-tests" --test-threads 1
    step h2d "$bins/flightdeck-bench" --phases h2d --rows 1000 --baseline "" --reps 5 --in-process \
        --json "$out/h2d.json"
    # PyTorch on the GPU, with the machine's own torch and the server binary
    # built here: pinned batches handed over with non_blocking copies
    # (test_torch.py), and place / train / evict through the server
    # (test_tiers.py).
    if python3 -c "import pyarrow.flight, pytest, torch" 2>/dev/null; then
        export PYTHONPATH="$PWD/client/python:${PYTHONPATH:-}" FLIGHTDECK_BIN="$bins/flightdeck"
        step python-gpu python3 -m pytest -q -p no:cacheprovider tests/python/test_torch.py \
            tests/python/test_tiers.py::test_place_train_and_evict_on_a_gpu
    else
        echo "NOT RUN: this machine's python3 lacks pyarrow, pytest or torch" > "$out/python-gpu.txt"
        status=1
    fi
    # The CPU read targets on this machine's cores (issues 11 and 16): how
    # the scattered gather scales with threads (in-process), and the cluster
    # and get phases with the server's default gather split against one
    # thread a stream (--gather-threads 1).
    step gather "$bins/flightdeck-bench" --phases gather --shuffle none,global --rows 2000000 --ranks 2 --baseline "" \
        --reps 3 --json "$out/gather.json"
    for threads in default 1; do
        split=()
        [ "$threads" = default ] || split=(--server-arg=--gather-threads --server-arg="$threads")
        step "cluster-$threads" "$bins/flightdeck-bench" --phases cluster --rows 2000000 --ranks 6 \
            --members 3 --baseline "" --reps 3 "${split[@]}" --json "$out/cluster-$threads.json"
        step "get-$threads" "$bins/flightdeck-bench" --phases get,limit --shuffle none,global \
            --rows 2000000 --baseline "" --reps 3 "${split[@]}" --json "$out/get-$threads.json"
    done
    # The reader and embedded trainer against PyTorch on an in-memory device
    # tensor: last, as the longest step, so a run cut short still has the rest.
    if [ -n "${FLIGHTDECK_BIN:-}" ]; then
        step reader-gpu python3 bench/reader_throughput.py --device cuda --bin "$bins/flightdeck" \
            --rows 1000000 --dim 32 --reps 5 --threads 4 --json "$out/reader-gpu.json"
    fi
    # The figures: parity, samples/s and gather share, device memory around
    # evictions, H2D bandwidth, the tests' tallies and the reader table.
    grep -h -E "^GPUs|cuMemGetInfo|^test result|passed|failed|error" "$out"/gpu-tests.txt "$out"/tier-tests.txt || true
    grep -v "^$" "$out/h2d.txt" | tail -n 12
    tail -n 3 "$out/python-gpu.txt"
    cat "$out/reader-gpu.txt" 2>/dev/null || true
    for f in gather cluster-default cluster-1 get-default get-1; do
        echo "-- $f"
        grep -E "^(gather|cluster|get)/[a-z0-9/-]+ +flightdeck +[0-9]|x$" "$out/$f.txt" | grep -v /first || true
    done
    exit "$status"
}

# No GPU needed: the server's kernels compiled by NVRTC with the server's own
# options and assembled by ptxas for sm_80 and sm_90, warnings as errors; then
# each kernel in scripts/kernel-check/ (one broken, one that warns) must fail.
# NVRTC and ptxas come from their Python wheels (pinned, ~130 MB, pip's cache
# keeps them between runs) installed under target/nvidia-wheels.
kernels() {
    wheels=target/nvidia-wheels
    nv="$wheels/nvidia"
    if [ ! -x "$nv/cuda_nvcc/bin/ptxas" ] || [ ! -e "$nv/cuda_nvrtc/lib/libnvrtc.so.12" ]; then
        py=.venv/bin/python
        [ -x "$py" ] || py=python3
        if ! "$py" -m pip install --quiet --disable-pip-version-check --target "$wheels" \
            nvidia-cuda-nvrtc-cu12==12.9.86 nvidia-cuda-nvcc-cu12==12.9.86; then
            echo "kernel check SKIPPED: the nvidia-cuda-nvrtc-cu12 and nvidia-cuda-nvcc-cu12 wheels could not be installed" >&2
            return 0
        fi
    fi
    cargo build --quiet -p flightdeck-server --example kernel_check
    check() {
        LD_LIBRARY_PATH="$nv/cuda_nvrtc/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
            target/debug/examples/kernel_check --ptxas "$nv/cuda_nvcc/bin/ptxas" --arch sm_80,sm_90 "$@"
    }
    check
    for bad in scripts/kernel-check/*.cu; do
        if check --source "$bad" > /dev/null 2>&1; then
            echo "kernel check passed $bad, which it must refuse" >&2
            exit 1
        fi
        echo "$bad: refused, as it must be"
    done
}

# No GPU needed: the server opens NVRTC, cuBLAS and NCCL by the names their
# packages install (libnvrtc.so.13, libcublas.so.13, libnccl.so.2, ...),
# checked against the CUDA libraries the test environment's PyTorch brought
# (its nvidia-* wheels), from a folder holding their versioned files alone;
# NVRTC then compiles the kernels into cubins for sm_80 and sm_90 (no
# ptxas: it may be older than that NVRTC); and where a machine has none of a
# library, opening it must be refused.
libs() {
    py=.venv/bin/python
    [ -x "$py" ] || py=python3
    nv=$("$py" -c "import nvidia; print(list(nvidia.__path__)[0])" 2>/dev/null || true)
    only=$(mktemp -d)
    for f in "$nv"/*/lib/lib*.so.*; do
        [ -e "$f" ] && ln -sf "$f" "$only/"
    done
    asked=()
    for lib in nvrtc cublas nccl; do
        ls "$only"/lib"$lib".so.* > /dev/null 2>&1 && asked+=("$lib")
    done
    if [ ${#asked[@]} -eq 0 ]; then
        echo "CUDA library check SKIPPED: no NVRTC, cuBLAS or NCCL in the Python environment (PyTorch's nvidia-* wheels)" >&2
        rm -rf "$only"
        return 0
    fi
    cargo build --quiet -p flightdeck-server --example cuda_libs_check --example kernel_check
    status=0
    LD_LIBRARY_PATH="$only" target/debug/examples/cuda_libs_check "${asked[@]}" || status=$?
    if [ "$status" -eq 0 ] && [[ " ${asked[*]} " == *" nvrtc "* ]]; then
        LD_LIBRARY_PATH="$only" target/debug/examples/kernel_check --arch sm_80,sm_90 || status=$?
    fi
    rm -rf "$only"
    [ "$status" -eq 0 ] || exit "$status"
    for lib in "${asked[@]}"; do
        ldconfig -p 2>/dev/null | grep -q "lib$lib\.so" && continue
        if LD_LIBRARY_PATH="" target/debug/examples/cuda_libs_check "$lib" > /dev/null 2>&1; then
            echo "cuda_libs_check opened $lib on a machine that has none" >&2
            exit 1
        fi
        echo "$lib without the library: refused, as it must be"
    done
}

case "${1:-}" in
    build) build ;;
    run) run ;;
    kernels) kernels ;;
    libs) libs ;;
    *) echo "usage: $0 build|run|kernels|libs" >&2; exit 2 ;;
esac
