#!/usr/bin/env bash
# Speculation measurements on the H200 in one device call (about 7 minutes): GPU tests of the
# kernels and compiled chains, the 27B's verify/rollback cost per T, and spec_shapes.py on the 27B
# and 4B. Results in ${OUT:-.}/. Run after .gpu/ is staged: source .gpu/b/activate.sh first.
set -u
out=${OUT:-.}
py=python3
timeout 150 $py -m pytest -p no:cacheprovider -o addopts="" -q \
  tests/models/test_compiled_decode.py tests/kernels/test_gdn_prefill.py \
  tests/engine/test_qlinear.py tests/kernels/test_qmv_direct.py tests/kernels/test_qmv_tc.py \
  tests/kernels/test_gdn_kernel.py tests/kernels/test_mamba_kernel.py \
  > "$out/gpu-tests.log" 2>&1
tail -3 "$out/gpu-tests.log"
timeout 150 $py bench/decode_vs_mlxlm.py --shapes 27b --tokens 32 --prompts 512 --rounds 1 \
  --verify-shapes 27b --verify-sizes 1 2 3 5 7 9 > "$out/verify.log" 2>&1
grep -E 'verify_ms|summary' "$out/verify.log"
timeout 240 $py bench/spec_shapes.py --shapes 27b 4b --rounds 1 --tokens 256 --json "$out/spec.json" \
  > "$out/spec.log" 2>&1
grep -E 'summary|spec' "$out/spec.log" | tail -6
