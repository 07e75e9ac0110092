#!/usr/bin/env bash
# Runs every test of the project: Rust (unit, property, end-to-end over
# loopback) and Python (a plain pyarrow.flight client against the server
# binary). Sets up .venv with the Python test dependencies on first use.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "==> building the server binary"
cargo build --workspace --bins

echo "==> Rust tests"
cargo test --workspace

echo "==> Python test environment (.venv)"
scripts/python-env.sh

echo "==> Python tests"
FLIGHTDECK_BIN="$PWD/target/debug/flightdeck" .venv/bin/python -m pytest tests/python -q --timeout 600 -rs
