#!/usr/bin/env bash
# Every H200 measurement issue 10 asks for, in one device call (about 9-10 minutes), each step
# with its own time limit so one slow step can't eat the others. Results go to ${OUT:-.}/:
#   gpu-tests.log      GPU tests of the kernels added or changed last (mat-vec routes, GDN chains)
#   decode.log/.json   kapitsa vs mlx-lm decode + prefill at 512 tokens, four shapes, two rounds,
#                      and the T-token verify cost on the two largest Qwen shapes
#   prefill8k.log      prefill at 8192 tokens (4B; mlx-lm needs minutes for the 27B at 8k)
#   spec.log           speculative decoding on the trained demo's edit workload
# Run after .gpu/ is staged (docs in ../shared/gpu/README.md): source .gpu/b/activate.sh first.
set -u
out=${OUT:-.}
py=python3
timeout 90 $py -m pytest -p no:cacheprovider -o addopts="" -m gpu -q -x \
  tests/kernels/test_qmv_direct.py tests/kernels/test_qmv_tc.py tests/engine/test_qlinear.py \
  > "$out/gpu-tests.log" 2>&1
tail -1 "$out/gpu-tests.log"
timeout 360 $py bench/decode_vs_mlxlm.py --shapes 27b 35b-a3b 4b nemotron-30b-a3b --tokens 64 \
  --prompts 512 --rounds 2 --verify-shapes 27b 35b-a3b --verify-sizes 1 2 4 8 \
  --json "$out/decode.json" > "$out/decode.log" 2>&1
grep -E '"summary"|verify_ms' "$out/decode.log"
timeout 60 $py bench/speculative_bench.py --model kapitsa/demo --tokens 128 --json "$out/spec.json" \
  > "$out/spec.log" 2>&1
tail -3 "$out/spec.log"
timeout 75 $py bench/decode_vs_mlxlm.py --shapes 4b --tokens 8 --prompts 8192 --rounds 1 \
  > "$out/prefill8k.log" 2>&1
grep -E '"summary"' "$out/prefill8k.log"
