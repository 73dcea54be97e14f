#!/usr/bin/env bash
# Stage MLX's CUDA wheel (and mlx-lm) for the H200 in parts: .gpu/part1 ... .gpu/part<K>, .gpu/mlx.
#
# A device call carries the working tree (tracked and untracked-not-ignored files) plus its carried
# folders within 64 MiB, so the ~90 MB wheel goes over in parts sized to what the tree leaves, one
# call after the other while the machine is warm; the last part rides with activate.sh and mlx-lm:
#
#   carry .gpu/part1:  bash .gpu/part1/stash.sh     (likewise each .gpu/part<i>)
#   carry .gpu/mlx:    source .gpu/mlx/activate.sh && bash lab/h200_all.sh tests
#
# Run it from the project root, on a machine that reaches PyPI: bash lab/stage_mlx_cuda.sh [MLX_VERSION]
set -euo pipefail
ver="${1:-0.32.4}"
mlx_lm="${MLX_LM_VERSION:-0.32.2}"
root="$(git rev-parse --show-toplevel)"
cd "$root"
grep -qxF '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu/part[0-9]* .gpu/mlx .gpu/dl && mkdir -p .gpu/dl .gpu/mlx
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_35_x86_64)
python3 -m pip download -q --no-deps "${plat[@]}" -d .gpu/dl "mlx==$ver" "mlx-cuda-13==$ver"
python3 -m pip download -q --no-deps -d .gpu/mlx "mlx-lm==$mlx_lm"
wheel=$(ls .gpu/dl/mlx_cuda_13-*.whl)
# what one call may carry beside the tree: 64 MiB, less the tree and 4 MiB (mlx-lm, MLX's small wheel, spare)
tree_bytes=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s}')
room=$(( 64 * 1048576 - tree_bytes - 4 * 1048576 ))
[ "$room" -gt 8388608 ] || { echo "the tree ($tree_bytes bytes) leaves no room for a wheel part" >&2; exit 1; }
split -b "$room" "$wheel" .gpu/dl/part_
parts=($(ls .gpu/dl/part_*))
last=$((${#parts[@]} - 1))  # the last part rides in .gpu/mlx
for i in $(seq 1 "$last"); do
  mkdir -p ".gpu/part$i" && mv "${parts[$((i - 1))]}" ".gpu/part$i/"
  cat > ".gpu/part$i/stash.sh" <<'EOS'
mkdir -p /tmp/mlx-parts && cp "$(dirname "$0")"/part_* /tmp/mlx-parts/ && ls /tmp/mlx-parts
EOS
done
mv "${parts[$last]}" .gpu/mlx/
cp .gpu/dl/mlx-"$ver"-cp312-*.whl .gpu/mlx/
basename "$wheel" > .gpu/mlx/WHEEL_NAME
echo "$last" > .gpu/mlx/PARTS_BEFORE
cat > .gpu/mlx/activate.sh <<'EOS'
# source me on the H200 machine, after the other parts' stash.sh ran there
_here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if ! python3 -c 'import sys; sys.path.insert(0, "/tmp/mlx-site"); import mlx.core' 2>/dev/null; then
  [ "$(ls /tmp/mlx-parts/part_* 2>/dev/null | wc -l)" -eq "$(cat "$_here/PARTS_BEFORE")" ] \
    || { echo "parts missing: run every .gpu/part*/stash.sh on this machine first" >&2; return 1; }
  cat /tmp/mlx-parts/part_* "$_here"/part_* > "/tmp/mlx-parts/$(cat "$_here/WHEEL_NAME")"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mlx-site \
    "/tmp/mlx-parts/$(cat "$_here/WHEEL_NAME")" "$_here"/mlx-*-cp312-*.whl "$_here"/mlx_lm-*.whl || return 1
fi
export PYTHONPATH="/tmp/mlx-site${PYTHONPATH:+:$PYTHONPATH}"
python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())'
EOS
rm -rf .gpu/dl
du -sh .gpu/part[0-9]* .gpu/mlx
