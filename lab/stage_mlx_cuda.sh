#!/usr/bin/env bash
# Stage MLX's CUDA wheel (and mlx-lm) for the H200 in three parts, .gpu/s1 .gpu/s2 .gpu/s3.
#
# A device call carries the working tree (~30 MB) plus its carried folders within 64 MiB, so the
# ~90 MB wheel goes over in three ~30 MB parts, one call after the other while the machine is warm:
#
#   carry .gpu/s1:  bash .gpu/s1/stash.sh
#   carry .gpu/s2:  bash .gpu/s2/stash.sh
#   carry .gpu/s3:  source .gpu/s3/activate.sh && bash lab/h200_all.sh tests
#
# Run it from the project root, on a machine that reaches PyPI: bash lab/stage_mlx_cuda.sh [MLX_VERSION]
set -euo pipefail
ver="${1:-0.32.4}"
mlx_lm="${MLX_LM_VERSION:-0.32.2}"
root="$(git rev-parse --show-toplevel)"
cd "$root"
grep -qxF '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu/s1 .gpu/s2 .gpu/s3 .gpu/dl && mkdir -p .gpu/s1 .gpu/s2 .gpu/s3 .gpu/dl
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_35_x86_64)
python3 -m pip download -q --no-deps "${plat[@]}" -d .gpu/dl "mlx==$ver" "mlx-cuda-13==$ver"
python3 -m pip download -q --no-deps -d .gpu/s3 "mlx-lm==$mlx_lm"
wheel=$(ls .gpu/dl/mlx_cuda_13-*.whl)
split -b 30m "$wheel" .gpu/dl/part_
[ "$(ls .gpu/dl/part_* | wc -l)" -eq 3 ] || { echo "expected the wheel in 3 parts" >&2; exit 1; }
mv .gpu/dl/part_aa .gpu/s1/ && mv .gpu/dl/part_ab .gpu/s2/ && mv .gpu/dl/part_ac .gpu/s3/
cp .gpu/dl/mlx-"$ver"-cp312-*.whl .gpu/s3/
basename "$wheel" > .gpu/s3/WHEEL_NAME
for part in s1 s2; do
  cat > ".gpu/$part/stash.sh" <<'EOS'
mkdir -p /tmp/mlx-parts && cp "$(dirname "$0")"/part_* /tmp/mlx-parts/ && ls /tmp/mlx-parts
EOS
done
cat > .gpu/s3/activate.sh <<'EOS'
# source me on the H200 machine, after .gpu/s1/stash.sh and .gpu/s2/stash.sh ran there
_s3="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if ! python3 -c 'import sys; sys.path.insert(0, "/tmp/mlx-site"); import mlx.core' 2>/dev/null; then
  [ -e /tmp/mlx-parts/part_aa ] && [ -e /tmp/mlx-parts/part_ab ] \
    || { echo "parts missing: run .gpu/s1/stash.sh and .gpu/s2/stash.sh on this machine first" >&2; return 1; }
  cat /tmp/mlx-parts/part_aa /tmp/mlx-parts/part_ab "$_s3"/part_ac > "/tmp/mlx-parts/$(cat "$_s3/WHEEL_NAME")"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mlx-site \
    "/tmp/mlx-parts/$(cat "$_s3/WHEEL_NAME")" "$_s3"/mlx-*-cp312-*.whl "$_s3"/mlx_lm-*.whl || return 1
fi
export PYTHONPATH="/tmp/mlx-site${PYTHONPATH:+:$PYTHONPATH}"
python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())'
EOS
rm -rf .gpu/dl
du -sh .gpu/s1 .gpu/s2 .gpu/s3
