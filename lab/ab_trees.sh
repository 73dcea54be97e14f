#!/usr/bin/env bash
# Decode and prefill speed of two kapitsa checkouts on one machine, interleaved: for each round and
# shape, the old checkout's decode_vs_mlxlm run, then this one's. Each run times kapitsa beside
# mlx-lm in its own process, so mlx-lm's figure in both runs shows how much the machine drifted.
#
#   OLD=/path/to/old/checkout bash lab/ab_trees.sh 27b 35b-a3b
#
# OLD holds `kapitsa/` plus `lab/decode_vs_mlxlm.py` (or, before the lab folder, bench/). ROUNDS
# (default 2) rounds per shape, TOKENS (default 64) decoded tokens per timing, EXTRA more flags
# for both scripts (EXTRA=--tiny: a CPU smoke run). Results: JSON lines
# in ${OUT:-.}/ab-{old,new}-<shape>-<round>.log; a last "ab" line per shape and checkout holds
# the medians of the summaries.
set -u
new="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
old="${OLD:?OLD=path of the checkout to compare against}"
out=${OUT:-.}
rounds=${ROUNDS:-2}
tokens=${TOKENS:-64}
[ $# -gt 0 ] || { echo "usage: OLD=DIR bash lab/ab_trees.sh SHAPE [SHAPE ...]" >&2; exit 2; }

script_of() {  # the checkout's decode_vs_mlxlm.py
  for sub in lab bench; do
    [ -f "$1/$sub/decode_vs_mlxlm.py" ] && { echo "$1/$sub/decode_vs_mlxlm.py"; return; }
  done
  echo "no decode_vs_mlxlm.py under $1/lab or $1/bench" >&2
  exit 2
}

run_one() {  # tree-name tree-dir shape round
  local log="$out/ab-$1-$3-$4.log"
  (cd "$2" && PYTHONPATH="$2${PYTHONPATH:+:$PYTHONPATH}" python3 "$(script_of "$2")" \
    --shapes "$3" --tokens "$tokens" --rounds 1 --prompts 512 ${EXTRA:-} > "$log" 2> "$log.err")
  echo "$1 $3 round $4: $(grep '"summary"' "$log" | head -1)"
}

for shape in "$@"; do
  for r in $(seq 1 "$rounds"); do
    run_one old "$old" "$shape" "$r"
    run_one new "$new" "$shape" "$r"
  done
done

python3 - "$out" "$@" <<'EOF'
import json, pathlib, statistics, sys
out, shapes = pathlib.Path(sys.argv[1]), sys.argv[2:]
for shape in shapes:
    for tree in ("old", "new"):
        rows = []
        for log in sorted(out.glob(f"ab-{tree}-{shape}-*.log")):
            rows += [json.loads(l) for l in log.read_text().splitlines() if l.startswith("{") and '"summary"' in l]
        rows = [r for r in rows if r.get("summary") == shape]
        keys = ("kapitsa_decode", "mlxlm_decode", "kapitsa_prefill", "mlxlm_prefill")
        line = {k: round(statistics.median(r[k] for r in rows), 1) for k in keys if rows}
        print(json.dumps({"ab": tree, "shape": shape, "runs": len(rows), **line}))
EOF
