#!/usr/bin/env bash
# Rebuild the embedded demo model (kapitsa/demo) on a machine with one GPU, torch and transformers:
# the main model and its MTP head are retrained on the committed tokenizer (the draft and Nemotron-H
# fixtures, trained on the same tokenizer, stay as they are and are evaluated beside it).
#   bash tools/rebuild_demo.sh OUT            # then, with kapitsa's environment:
#   .venv/bin/python tools/tinyckpt/package_demo.py OUT/qwen35-demo kapitsa/demo --bits 4
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/checkpoints}
seconds=${DEMO_SECONDS:-170}
python3 tools/train_checkpoints.py prepare --out "$out" --tokenizer kapitsa/demo/tokenizer.json
# Long windows: the demo learns to read an agent's whole opening request and still answer and stop.
python3 tools/train_checkpoints.py train --model main --out "$out" --seq-len 8192 --batch 4 --seconds "$seconds"
python3 tools/train_checkpoints.py mtp --out "$out" --mtp-seconds "${MTP_SECONDS:-50}"
for fixture in qwen35-draft nemotron-h; do
  rm -rf "${out:?}/$fixture" && cp -r "tests/checkpoints/trained/$fixture" "$out/$fixture"
done
python3 tools/train_checkpoints.py evaluate --out "$out"
