#!/bin/bash
# `make bench-gpu` on a lent accelerator (the `device` tool), in one command. Two halves:
#
#   here, once per checkout (needs pip and the network):
#       benchmarks/gpu_lease.sh wheels
#     downloads cp312 wheels, at uv.lock's versions, of what the accelerator image lacks (pydantic and
#     its three needs, webdataset and braceexpand, torchao) into .gpu-wheels/ (git-ignored, ~10 MiB).
#   there, as the device tool's command, with carry [".gpu-wheels"] and timeout_s 600:
#       bash benchmarks/gpu_lease.sh run 2>&1 | tee $OUT/log.txt
#     installs them into /tmp/site, runs `python3 -m benchmarks.bench_gpu` on the image's own CUDA torch
#     (8-minute deadline) and leaves gpu.json, gpu.md and gpu-profile.json in $OUT.
#
# Extra arguments after `run` go to bench_gpu (e.g. --rows 1b-eager,1b-compile).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.gpu-wheels
PACKAGES=(pydantic pydantic-core annotated-types typing-inspection typing-extensions webdataset braceexpand torchao)

locked_version() { # the version uv.lock pins for package $1
  awk -v name="$1" '$0 == "name = \"" name "\"" { getline; gsub(/version = |"/, ""); print; exit }' uv.lock
}

case "${1:-}" in
wheels)
  mkdir -p "$WHEELS"
  for package in "${PACKAGES[@]}"; do
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$WHEELS" "$package==$(locked_version "$package")"
  done
  ls -la "$WHEELS"
  ;;
run)
  shift
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  python3 -m benchmarks.bench_gpu --out "${OUT:-benchmarks/results}" --work-dir /tmp/bench-gpu "$@"
  ;;
*)
  echo "usage: $0 wheels | run [bench_gpu arguments]" >&2
  exit 2
  ;;
esac
