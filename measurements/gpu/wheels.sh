#!/usr/bin/env bash
# Download, here, the wheels the GPU check needs and the GPU machine lacks (it has no package registry and no
# network): pytest and what it needs for the test steps, llguidance and gguf which batchjob imports for
# constrained decoding and GGUF. Into .whl/ at the repository root (ignored by git; ~4 MB): carry that
# folder with the command, and measurements/gpu/check.py unpacks it there onto PYTHONPATH. The versions are
# this environment's own (the ones the tests pass with), for CPython 3.12 on x86-64 Linux (glibc 2.31 or newer
# for llguidance's wheel).
#   bash measurements/gpu/wheels.sh            (env: PYTHON, the interpreter whose versions to pin)
set -euo pipefail
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  echo "usage: bash measurements/gpu/wheels.sh   (writes .whl/ at the repository root; env: PYTHON)"
  exit 0
fi
root=$(cd "$(dirname "$0")/../.." && pwd)
python=${PYTHON:-python}
dest="$root/.whl"
mkdir -p "$dest"
# name==version for each, as installed here; a package not installed here is downloaded at its newest
pins=$("$python" - <<'EOF'
import importlib.metadata as md

for name in ("pytest", "pluggy", "iniconfig", "pygments", "pytest-timeout", "llguidance", "gguf"):
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        print(name)
EOF
)
# shellcheck disable=SC2086  # one argument per pin
"$python" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$dest" $pins
du -sh "$dest"
ls "$dest"
