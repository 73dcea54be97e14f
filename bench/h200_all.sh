#!/usr/bin/env bash
# Every H200 measurement issue 10 asks for, in parts that each fit one 10-minute device call:
#   bash bench/h200_all.sh tests        GPU tests of the kernels and compiled paths (~5 min)
#   bash bench/h200_all.sh 27b          decode (2 rounds) + verify cost per T + edit speculation
#   bash bench/h200_all.sh 35b-a3b      decode (2 rounds) + edit speculation (1 round)
#   bash bench/h200_all.sh 4b           likewise
#   bash bench/h200_all.sh nemotron-30b-a3b
#   bash bench/h200_all.sh prefill8k    prefill at 8192 tokens, every shape, 1 round
#   bash bench/h200_all.sh fused        decode of 4b, 27b and Nemotron with KAPITSA_FUSED_NORMS=1 (norms,
#                                       MLP activations and residual adds inside the mat-vecs) to
#                                       compare with the shape parts' default runs
# Results go to ${OUT:-.}/<part>.log (+ .json). Run after .gpu/ is staged (docs in
# ../shared/gpu/README.md): source .gpu/b/activate.sh first. Speculation's first run of each
# verify length compiles kernels and traces (a minute or more per shape on a cold machine).
set -u
out=${OUT:-.}
py=python3
part=${1:?which part: tests, 27b, 35b-a3b, 4b, nemotron-30b-a3b, prefill8k, fused}
case "$part" in
  tests)
    for f in tests/engine/test_qlinear.py tests/kernels/test_qmv_tc.py tests/kernels/test_qmv_direct.py \
             tests/models/test_compiled_decode.py tests/kernels/test_gdn_prefill.py \
             tests/kernels/test_mamba_kernel.py; do
      timeout 90 $py -m pytest -p no:cacheprovider -o addopts="" -q -rf "$f" >> "$out/tests.log" 2>&1
      echo "$f: $(tail -1 "$out/tests.log")"
    done
    ;;
  fused)
    KAPITSA_FUSED_NORMS=1 timeout 560 $py bench/decode_vs_mlxlm.py --shapes 4b 27b nemotron-30b-a3b \
      --tokens 64 --prompts 512 --rounds 2 --json "$out/fused.json" > "$out/fused.log" 2>&1
    grep -E '"summary"' "$out/fused.log"
    ;;
  prefill8k)
    timeout 560 $py bench/decode_vs_mlxlm.py --shapes 4b 27b 35b-a3b nemotron-30b-a3b --tokens 8 \
      --prompts 8192 --rounds 1 --json "$out/prefill8k.json" > "$out/prefill8k.log" 2>&1
    grep -E '"summary"' "$out/prefill8k.log"
    ;;
  *)
    verify=()
    [ "$part" = 27b ] && verify=(--verify-shapes 27b --verify-sizes 1 2 4 8 12 16)
    timeout 560 $py bench/decode_vs_mlxlm.py --shapes "$part" --tokens 64 --prompts 512 --rounds 2 \
      "${verify[@]}" --spec-shapes "$part" --spec-rounds 1 --spec-tokens 256 \
      --json "$out/$part.json" > "$out/$part.log" 2>&1
    grep -E 'summary|verify_ms' "$out/$part.log"
    ;;
esac
