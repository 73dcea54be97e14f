#!/usr/bin/env bash
# Speculation measurements on the H200 in one device call (about 7 minutes): the compiled
# decode/verify tests on the GPU, then the 27B's decode, verify/rollback cost per T and n-gram
# speculation on the edit workload (spec_shapes.py), against mlx-lm. Results in ${OUT:-.}/.
# Run after .gpu/ is staged (lab/stage_mlx_cuda.sh): source .gpu/mlx/activate.sh first.
set -u
out=${OUT:-.}
py=python3
timeout 100 $py -m pytest -p no:cacheprovider -o addopts="" -v -x --tb=short \
  tests/models/test_compiled_decode.py > "$out/gpu-tests.log" 2>&1
grep -E "FAILED|Error|passed|failed" "$out/gpu-tests.log" | head -8
timeout 420 $py lab/decode_vs_mlxlm.py --shapes 27b --tokens 32 --prompts 512 --rounds 1 \
  --verify-shapes 27b --verify-sizes 1 2 4 6 9 --spec-shapes 27b --spec-tokens 256 \
  > "$out/spec.log" 2>&1
grep -E 'verify_ms|summary|kapitsa-spec' "$out/spec.log"
