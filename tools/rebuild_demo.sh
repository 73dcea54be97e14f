#!/usr/bin/env bash
# Rebuild the embedded demo model (kapitsa/demo) on a machine with one GPU, torch and transformers:
# the main model and its MTP head are retrained on the committed tokenizer (the draft and Nemotron-H
# fixtures, trained on the same tokenizer, stay as they are and are evaluated beside it).
#   bash tools/rebuild_demo.sh OUT            # then, with kapitsa's environment:
#   .venv/bin/python tools/tinyckpt/package_demo.py OUT/qwen35-demo kapitsa/demo --bits 4
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/checkpoints}
python3 tools/train_checkpoints.py prepare --out "$out" --tokenizer kapitsa/demo/tokenizer.json
# Short windows first (many steps: the language), then long ones (reading an agent's long opening
# request and still answering and stopping; a long window's step is several times slower).
python3 tools/train_checkpoints.py train --model main --out "$out" --seq-len 512 --batch 64 --seconds "${SHORT_SECONDS:-150}"
python3 tools/train_checkpoints.py train --model main --out "$out" --resume --lr 6e-4 \
  --seq-len 2048 --batch 16 --seconds "${LONG_SECONDS:-60}"
python3 tools/train_checkpoints.py mtp --out "$out" --mtp-seconds "${MTP_SECONDS:-40}"
for fixture in qwen35-draft nemotron-h; do
  rm -rf "${out:?}/$fixture" && cp -r "tests/checkpoints/trained/$fixture" "$out/$fixture"
done
python3 tools/train_checkpoints.py evaluate --out "$out"
