#!/usr/bin/env bash
# Runs every test of the project: Rust (unit, property, end-to-end over
# loopback), the JVM Spark connector's build, and Python (a plain
# pyarrow.flight client, the Python client, PySpark with both Spark
# connectors, a JDBC client of the SQL endpoint, against the server
# binary). Sets up .venv with the Python test dependencies on first use.
set -euo pipefail
cd "$(dirname "$0")/.."

# What the tests need, checked before the long build: each missing piece
# named with what to install.
missing=()
command -v cargo >/dev/null || missing+=("cargo: install Rust with rustup (rust-toolchain.toml pins the version)")
python=${PYTHON:-python3}
if ! command -v "$python" >/dev/null; then
  missing+=("$python: install Python 3.10 or newer")
elif ! "$python" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  missing+=("$python -m venv: install Python 3.10 or newer with venv and ensurepip (Debian: python3-venv)")
fi
if ! command -v java >/dev/null; then
  missing+=("java: install a Java 17 runtime (PySpark's tests run Spark on it)")
elif ! java -version 2>&1 | grep -Eq 'version "(1[7-9]|2[0-9])'; then
  missing+=("java: PySpark needs Java 17 or newer; found $(java -version 2>&1 | head -n1)")
fi
command -v mvn >/dev/null || missing+=("mvn: install Maven 3.8 or newer (it builds the JVM Spark connector, connectors/spark)")
command -v openssl >/dev/null || missing+=("openssl: the TLS tests make their certificates with it")
if [ ${#missing[@]} -gt 0 ]; then
  echo "cannot run the tests; missing:" >&2
  printf '  - %s\n' "${missing[@]}" >&2
  exit 1
fi

echo "==> building the server binary"
cargo build --workspace --bins

echo "==> Rust tests"
cargo test --workspace

echo "==> Python test environment (.venv)"
scripts/python-env.sh

echo "==> JVM Spark connector (connectors/spark)"
mvn -q -B -f connectors/spark/pom.xml package

echo "==> JDBC client of the Flight SQL endpoint (tests/jdbc)"
mvn -q -B -f tests/jdbc/pom.xml package

echo "==> CUDA kernels: NVRTC and ptxas, no GPU needed"
scripts/gpu-check.sh kernels

echo "==> NVRTC, cuBLAS and NCCL by the names their packages install, no GPU needed"
scripts/gpu-check.sh libs

echo "==> Python tests"
FLIGHTDECK_BIN="$PWD/target/debug/flightdeck" .venv/bin/python -m pytest tests/python -q --timeout 600 -rs
