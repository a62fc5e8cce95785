#!/usr/bin/env bash
# Make .venv-gpukit/ (ignored by git, a few MiB) for a lent GPU machine, whose image has
# torch with CUDA (/opt/torch/.venv, Python 3.12) and the system Open MPI but no network:
# the build tools and pytest as wheels, mpi4py for Python 3.12, and the scripts here.
# Then, with the device tool: carry [".venv-gpukit"] and run `bash .venv-gpukit/check.sh`
# (builds fastreduce there in about 20 s, runs tests/mpi/test_gpu.py on 2 and 4 ranks and
# tests/launch/test_gpu_bench.py; logs in $OUT); `bash .venv-gpukit/train.sh` times the
# data-parallel step there; `bash .venv-gpukit/measure.sh [PART ...]` measures and checks
# every collective on CUDA tensors. docs/testing.md, "On a GPU".
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
kit=$root/.venv-gpukit
rm -rf "$kit" && mkdir -p "$kit/wheels"
pip=(python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$kit/wheels")
"${pip[@]}" --python-version 3.12 --platform manylinux2014_x86_64 "mpi4py==4.1.2"
"${pip[@]}" --python-version 3.12 --platform manylinux2014_x86_64 cython ninja
"${pip[@]}" meson packaging pytest pytest-timeout pluggy iniconfig
cp "$root/tools/gpu/build.sh" "$root/tools/gpu/check.sh" "$root/tools/gpu/train.sh" \
   "$root/tools/gpu/measure.sh" "$kit/"
echo "$kit"
