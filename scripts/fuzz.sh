#!/usr/bin/env bash
# Fuzzes what clients send (fuzz/fuzz_targets): `commands` (descriptors,
# tickets, action bodies, the DoGet edge's framing) and `ingest` (DoPut's
# IPC decode, admission and commit). Needs a nightly toolchain; installs
# cargo-fuzz on first use.
#
#   scripts/fuzz.sh smoke          # each target for 30 s
#   scripts/fuzz.sh run N          # each target for N executions
#
# CI runs the same targets' bodies (fuzz/targets/) on the stable toolchain:
# tests/fuzz_smoke.rs replays each corpus and seeded mutations of it.
#
# New corpus entries go to a temporary folder; crashes to fuzz/artifacts/.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:-smoke}
if ! rustup toolchain list | grep -q '^nightly'; then
    echo "==> fuzz: no nightly toolchain on this machine; fuzzing needs one (rustup toolchain install nightly)"
    exit 0
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    echo "==> installing cargo-fuzz"
    cargo +nightly install cargo-fuzz --locked
fi
echo "==> building the fuzz targets (nightly, address sanitizer)"
cargo +nightly fuzz build -O
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for target in commands ingest; do
    mkdir -p "$work/$target"
    case "$mode" in
        smoke) limit=(-max_total_time=30) ;;
        run) limit=(-runs="${2:?how many executions}") ;;
        *) echo "usage: $0 smoke | run N" >&2; exit 2 ;;
    esac
    echo "==> fuzzing $target"
    status=0
    cargo +nightly fuzz run -O "$target" "$work/$target" "fuzz/corpus/$target" -- \
        "${limit[@]}" -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 \
        >"$work/$target.log" 2>&1 || status=$?
    grep -E '^(stat::number_of_executed_units|stat::peak_rss_mb|SUMMARY|==[0-9]+==ERROR)' "$work/$target.log" || true
    if [ "$status" -ne 0 ]; then
        tail -n 40 "$work/$target.log" >&2
        echo "fuzz target $target failed (exit $status); inputs in fuzz/artifacts/$target" >&2
        exit 1
    fi
done
