#!/usr/bin/env bash
# Creates .venv and installs the Python test dependencies into it; reinstalls
# only when tests/python/requirements.txt changes.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
req=tests/python/requirements.txt
stamp=.venv/.requirements.sha256
want=$(sha256sum "$req" | cut -d' ' -f1)

if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -r "$req"
  echo "$want" > "$stamp"
fi
