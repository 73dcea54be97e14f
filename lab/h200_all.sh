#!/usr/bin/env bash
# The H200 measurements, in parts that each fit one 10-minute device call:
#   bash lab/h200_all.sh knobs        4B decode (kapitsa default and with fused norms, mlx-lm) under
#                                       MLX's CUDA-graph settings; the fastest kapitsa setting is kept in
#                                       /tmp/kapitsa-knobs.env for the parts after it on this machine
#   bash lab/h200_all.sh prefill      Nemotron's prefill per layer kind ($PREFILL_KINDS, default moe
#                                       attention) at each of $PREFILL_PROMPTS (default 8192) tokens,
#                                       kapitsa beside mlx-lm; kapitsa's MoE layers without the
#                                       dequantized grouped GEMM, its Mamba layers at SSD chunk
#                                       lengths $SSD_CHUNKS
#   bash lab/h200_all.sh moe-cold     whether a MoE prefill pays ~0.25 s when the dequantize route runs after its
#                                       dense expert buffers left MLX's cache ($MOE_COLD_SHAPES, default
#                                       nemotron-30b-a3b 35b-a3b; $MOE_COLD_PROMPT tokens, default 512;
#                                       lab/moe_route_cold.py)
#   bash lab/h200_all.sh timeline     GPU time of kapitsa's decode step by kernel ($TIMELINE_SHAPES,
#                                       default 27b; after a $TIMELINE_PROMPT-token prompt, default
#                                       512) under Nsight Systems (lab/decode_kernels.py)
#   bash lab/h200_all.sh tests        every gpu-marked test, sharded over parallel processes
#                                       (lab/gpu_tests.py; ~6 minutes on a fresh machine)
#   bash lab/h200_all.sh compiled     the compiled decode/verify paths against op by op, sharded
#                                       the same way (~4 minutes fresh; its own call: with
#                                       the GPU set it passes a call's 10 minutes)
#   bash lab/h200_all.sh ptx-save     MLX's JIT cache (/tmp/mlx) as $OUT/ptx.tgz.part-NN, for $PTX_TGZ next time
#   bash lab/h200_all.sh qmv          the one-row mat-vec's launch shapes over the 27B chain
#                                       (persistent grids included); with MATVEC_TESTS=1 their GPU
#                                       tests first
#   bash lab/h200_all.sh batch        aggregate decode at $BATCH_STREAMS streams (default 1,4,8,16),
#                                       kapitsa's engine against mlx-lm's batch_generate, with each
#                                       batch size's first-burst compile cost ($BATCH_SHAPES, default
#                                       all four; lab/batch_sweep.py)
#   bash lab/h200_all.sh prime        MLX's own JIT modules for the table's shapes ($PRIME_SHAPES, default
#                                       all four): short untimed runs side by side, merged into MLX's
#                                       cache, so a fresh machine's timed parts skip those compiles
#   bash lab/h200_all.sh table        #32's table rows, one process per shape ($TABLE_SHAPES, default
#                                       4b; each shape's process under $TABLE_TIMEOUT, default 540;
#                                       $TABLE_ROUNDS interleaved rounds after 512 tokens, default 4:
#                                       a host's batch-1 speed drifts by up to a fifth between two;
#                                       $TABLE_LONG_ROUNDS rounds at 8k, default 1):
#                                       decode and 512/8192-token prefill against mlx-lm, then aggregate
#                                       decode at 1/4/8/16 streams on the same two models, kapitsa's
#                                       engine warming its batch sizes first as serve's does (its
#                                       seconds reported; lab/decode_vs_mlxlm.py --streams; rows:
#                                       lab/results_table.py)
#   bash lab/h200_all.sh moe-pairs    where the MoE expert kernels stop paying: each kernel against
#                                       gather_qmm at 1-8 tokens of random routing on both MoE shapes
#                                       (lab/kernels_moe.py), then aggregate decode at $PAIRS_STREAMS
#                                       (default 4,6,8) streams with KAPITSA_MOE_MAX_PAIRS at
#                                       $PAIRS_LIMITS (default 16 72) on $PAIRS_SHAPES (default
#                                       nemotron-30b-a3b; 35b-a3b is a second call), one process each
#   bash lab/h200_all.sh compile      each decode batch size's first-burst cost and the kernels it
#                                       compiles, over a fresh and then a warm PTX cache
#                                       ($COMPILE_SHAPES, default 4b; lab/batch_compile.py)
#   bash lab/h200_all.sh attn-gap     decode after 512 and 8192 prompt tokens on $ATTN_GAP_SHAPES (default 4b),
#                                       kapitsa with and without its attention kernels ("attn")
#                                       beside mlx-lm (lab/decode_vs_mlxlm.py --kernels-ab): whether
#                                       the 8k loss per attention layer is the kernel path's
#   bash lab/h200_all.sh long-context the attention kernel's and KV tail's GPU tests, then one attention layer's
#                                       decode pieces alone at 512-32k keys (the KV write:
#                                       in place, static, into the tail; the kernel at 16/64/128 splits;
#                                       MLX's attention; lab/kv_step_cost.py), then the 4B's step
#                                       build / encode / wait after 512 and 8192 tokens, attention
#                                       kernels on and off (lab/long_context_step.py)
#   bash lab/h200_all.sh overhead     one stream's decode in process (opened as `kapitsa run` does, and as serve
#                                       does) and through `kapitsa serve`, rounds interleaved, with each
#                                       thread's CPU per token, on $OVERHEAD_SHAPES (default
#                                       nemotron-30b-a3b; lab/server_overhead.py)
#   bash lab/h200_all.sh nvrtc        $NVRTC_COUNT (default 16) distinct GDN kernel sources compiled one after another,
#                                       on 8 threads in-process, and on 8 threads each running a child
#                                       process (what the disk cache does; lab/nvrtc_parallel.py)
#   bash lab/h200_all.sh startup      a process's warm-up and first request on $STARTUP_SHAPES (default 4b
#                                       nemotron-30b-a3b; lab/startup_compile.py): custom kernels
#                                       compiled by MLX in-process, then over one fresh PTX cache
#                                       twice (the disk cache filling it, then reading it)
#   bash lab/h200_all.sh spec         --speculative auto (the default) against plain decoding on
#                                       $SPEC_SHAPES (default all four; lab/spec_default.py): own
#                                       text, a scripted essay, the edit workload (chain and n-gram
#                                       tree) beside mlx-lm; $ROUNDS rounds (default 3)
#   bash lab/h200_all.sh repeat       whether plain greedy decoding repeats itself on $REPEAT_SHAPE (default
#                                       nemotron-30b-a3b): kernel families and compiled steps off in one
#                                       process, then MLX's cuDNN attention off in a second (lab/repeat_decode.py)
#   bash lab/h200_all.sh ragged       aggregate decode at $RAGGED_STREAMS (default 8,16) streams whose prompts
#                                       differ in length ($RAGGED_PROMPT tokens at most, default 2048) on
#                                       $RAGGED_SHAPES (default 4b), with and without the attention kernel
#   bash lab/h200_all.sh gaps         the table's two open gaps on $GAPS_SHAPES (default 4b
#                                       nemotron-30b-a3b; lab/decode_gaps.py): decode after 512 and
#                                       8192 prompt tokens at 64 and 256 tokens, and batch-1 decode
#                                       through engines built as the batch sweep's
#   bash lab/h200_all.sh bf16         tests/engine/test_speculation_bf16.py on the GPU ($BF16_SELECT, default
#                                       its exact_verify variants)
#   bash lab/h200_all.sh verify-diff  the first layer where a verify's rows leave the decode steps' bit
#                                       for bit, per kernel setting (lab/verify_vs_decode.py): the bf16
#                                       test's tiny models, then 4-bit at widths the kernels take
#   bash lab/h200_all.sh flint        lab/small_flint.py: Flint's :small recipe, plain 4-bit and
#                                       mlx-vlm's Flint at the published shape
#   bash lab/h200_all.sh server       kapitsa serve against mlx_lm.server on $SERVER_SHAPES (default
#                                       4b; one bench per shape) as a streaming client sees them, beside the in-process
#                                       engine (lab/server_bench.py; $SERVER_ARGS more of its
#                                       options, e.g. --long-words 1500); the servers' logs (kapitsa's at
#                                       INFO) end in server-<shape>-servers.txt; needs .gpu/serve carried
#                                       (lab/stage_server_wheels.sh)
#   bash lab/h200_all.sh prediction   Predicted Outputs on $PREDICTION_SHAPE (default 4b, a random-weight
#                                       folder from lab/shape_checkpoint.py): the edit request without a
#                                       prediction, with the file and with its own answer as one
#                                       (lab/prediction_bench.py, the engine as serve builds it)
#   bash lab/h200_all.sh cache        the memory estimate against the engine's measured peak on the
#                                       4b and 27b shapes (an 8k prompt in 2048-token chunks, K/V bf16
#                                       and 8-bit; lab/memory_fit.py), then turn N+1's time to first
#                                       token against cold on the 4b, its state in memory and spilled
#                                       to disk with prefetch off and on (lab/prefetch_ttft.py,
#                                       $PREFETCH_REPEATS repeats, default 3); ~9 minutes at most
#   bash lab/h200_all.sh memory       the estimate against the measured peak (lab/memory_fit.py) on the
#                                       4b and 27b shapes with each layer's window placed, layer by
#                                       layer against one graph per chunk, and without the dense
#                                       prefill route; ~8 minutes at most
#   bash lab/h200_all.sh 27b [4b ...] per shape, one process each: decode ($ROUNDS rounds, default 2,
#                                       of $TOKENS tokens, default 64;
#                                       kapitsa at its defaults and with the fused parts $FUSED_AB
#                                       (default residual: the norm prologue off; its edit speculation
#                                       too), mlx-lm, interleaved),
#                                       prefill at 8192 tokens, verify cost per T (27b, nemotron;
#                                       $VERIFY_SIZES, none to skip), edit
#                                       speculation (1 round); also with other kernel families (without the attention kernels
#                                       "attn"; on Nemotron without the fused MoE router "route"), on the MoE
#                                       shapes folded shared experts when FOLD_AB=1
# Getting there: `bash lab/stage_mlx_cuda.sh` stages MLX's CUDA wheel and mlx-lm in parts
# (lab/README.md); the machine stays warm 30 s between calls: have the next command ready.
# Shapes: 27b, 35b-a3b, 4b, nemotron-30b-a3b. Results go to ${OUT:-.}/<part>.log: JSON lines,
# the "summary" lines last. Run after .gpu/ is staged: source .gpu/mlx/activate.sh first. MLX keeps JIT-compiled kernels in /tmp/mlx, so later parts on the
# same machine compile less. KNOB_SETTINGS overrides the settings the knobs part tries; the
# *_TIMEOUT variables the limits (seconds).
set -u
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root" && export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$root"
out=${OUT:-.}
py=${PY:-python3}
part=${1:?which part: knobs, tests, compiled, cache, or shapes (27b 35b-a3b 4b nemotron-30b-a3b)}
knobs_file=/tmp/kapitsa-knobs.env
# MLX keeps its NVRTC output in /tmp/mlx/<version>/ptx; a fresh machine compiles every kernel again
# (kapitsa's ~300 launches a step are a few dozen kernels, each template a compile: minutes
# on a fresh machine, docs/results.md). The ptx-save part returns that cache as $OUT/ptx.tgz.part-NN,
# 15 MiB pieces (a call returns files of at most 16 MiB); kept beside $PTX_TGZ (default
# .gpu-ptx/ptx.tgz, an ignored folder a call carries) they are unpacked here before any part runs
# on a fresh machine (one whole ptx.tgz too).
ptx_tgz=${PTX_TGZ:-$root/.gpu-ptx/ptx.tgz}
if [ ! -d /tmp/mlx ] && compgen -G "$ptx_tgz*" > /dev/null; then
  cat "$ptx_tgz"* | tar xzf - -C /tmp && echo "ptx cache: $(du -sh /tmp/mlx | cut -f1) from $ptx_tgz*"
fi
# shellcheck disable=SC1090
[ -f "$knobs_file" ] && [ "$part" != knobs ] && . "$knobs_file" && echo "settings: $(cat "$knobs_file")"

case "$part" in
  knobs)
    : > "$out/knobs.log"
    # default last: the first process on a cold machine pays MLX's JIT compiles (minutes), and a
    # setting whose run is cut only drops out of the comparison
    for setting in ${KNOB_SETTINGS:-MLX_USE_CUDA_GRAPHS=0 MLX_MAX_OPS_PER_BUFFER=1000 default}; do
      env_args=()
      [ "$setting" != default ] && env_args=("$setting")
      env "${env_args[@]}" timeout "${KNOB_TIMEOUT:-240}" $py lab/decode_vs_mlxlm.py --shapes 4b --tokens 64 --prompts 512 \
        --rounds 2 --fused-ab 2>&1 | sed "s/^{/{\"knob\": \"$setting\", /" >> "$out/knobs.log"
      grep '"summary"' "$out/knobs.log" | tail -1
    done
    $py lab/pick_knobs.py "$out/knobs.log" > "$knobs_file"
    echo "kept: $(cat "$knobs_file")"
    ;;
  ptx-save)
    tar czf - -C /tmp mlx | split -b 15m -d - "$out/ptx.tgz.part-" && ls -l "$out"/ptx.tgz.part-*
    ;;
  qmv)
    : > "$out/qmv.log"
    if [ "${MATVEC_TESTS:-0}" = 1 ]; then
      timeout "${TESTS_TIMEOUT:-200}" $py -m pytest -p no:cacheprovider -o addopts="" -q -rf --tb=line -m gpu \
        tests/kernels/test_matvec_one_row.py tests/kernels/test_matvec_tensor_core.py \
        >> "$out/qmv.log" 2>&1
      tail -3 "$out/qmv.log"
    fi
    # one-row mat-vec launch shapes over the 27B's chain (lab/host_costs.py qmv; ~2 minutes)
    timeout "${QMV_TIMEOUT:-240}" $py lab/host_costs.py --shapes --skip micro >> "$out/qmv.log" 2>&1
    grep '"kind": "qmv"' "$out/qmv.log"
    ;;
  timeline)
    nsys=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
    [ -n "$nsys" ] || { echo "no nsys on this machine"; exit 1; }
    : > "$out/timeline.log"
    for shape in ${TIMELINE_SHAPES:-27b}; do
      timeout "${TIMELINE_TIMEOUT:-240}" "$nsys" profile -t cuda --cuda-graph-trace=node --capture-range=cudaProfilerApi -f true \
        -o "/tmp/steps-$shape" $py lab/decode_kernels.py --shape "$shape" --steps 16 --prompt "${TIMELINE_PROMPT:-512}" >> "$out/timeline.log" 2>&1
      "$nsys" export --type sqlite -f true -o "/tmp/steps-$shape.sqlite" "/tmp/steps-$shape.nsys-rep" >> "$out/timeline.log" 2>&1
      $py lab/decode_kernels.py --summarize "/tmp/steps-$shape.sqlite" --steps 16 | sed "s/^{/{\"shape\": \"$shape\", /" \
        >> "$out/timeline.log"
    done
    grep -E '^\{"shape"' "$out/timeline.log"
    ;;
  prefill)
    # the MoE prefill route against gather_qmm on the GPU first (a minute), then the timings
    # (and the GDN decode variant against the concatenating path)
    timeout 150 $py -m pytest -p no:cacheprovider -o addopts="" -q -rf --tb=line -m gpu tests/ops/test_ops.py \
      tests/kernels/test_gdn_device.py -k "moe_prefill or decode_variant" > "$out/prefill.log" 2>&1
    tail -1 "$out/prefill.log"
    # and the fused MoE router's GPU tests
    timeout 120 $py -m pytest -p no:cacheprovider -o addopts="" -q -rf --tb=line -m gpu \
      tests/kernels/test_router_kernel.py >> "$out/prefill.log" 2>&1
    tail -1 "$out/prefill.log"
    # per prompt length ($PREFILL_PROMPTS): short prompts place the dequantize route's threshold
    # (ops/moe.py), whose cost per chunk does not shrink with the chunk
    for prompt in ${PREFILL_PROMPTS:-8192}; do
      # shellcheck disable=SC2086
      timeout "${PREFILL_TIMEOUT:-300}" $py lab/prefill_parts.py --prompt "$prompt" --kinds ${PREFILL_KINDS:-moe attention} \
        --moe-dequant-ab --ssd-chunks ${SSD_CHUNKS:-} >> "$out/prefill.log" 2>&1
    done
    grep -E 'prefill_part|Error' "$out/prefill.log"
    ;;
  batch)
    timeout "${BATCH_TIMEOUT:-560}" $py lab/batch_sweep.py --shapes "${BATCH_SHAPES:-27b,35b-a3b,4b,nemotron-30b-a3b}" \
      --streams "${BATCH_STREAMS:-1,4,8,16}" --tokens "${TOKENS:-64}" --prompt 512 > "$out/batch.log" 2>&1
    grep -E 'aggregate|Error' "$out/batch.log"
    ;;
  prime)
    # MLX's own JIT modules for the table's shapes, ahead of the timed parts: a short untimed run of
    # every shape, side by side (NVRTC compiles on one host thread per process), each into its own
    # cache folder seeded from MLX's default one, merged back into it at the end (no two processes
    # write one folder). Two at a time where the GPU has under 100 GB (both models of a shape stay loaded).
    cache="/tmp/mlx/$($py -c 'import mlx.core as mx; print(mx.__version__)')/ptx" && mkdir -p "$cache"
    gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
    jobs=${PRIME_JOBS:-$([ "${gpu_mib:-0}" -ge 100000 ] && echo 4 || echo 2)}
    started=$(date +%s) running=0
    for shape in ${PRIME_SHAPES:-4b 27b 35b-a3b nemotron-30b-a3b}; do
      folder="/tmp/kapitsa-prime-$shape" && mkdir -p "$folder" && cp -rn "$cache/." "$folder/"
      (
        MLX_PTX_CACHE_DIR="$folder" timeout "${PRIME_TIMEOUT:-420}" $py lab/decode_vs_mlxlm.py --shapes "$shape" \
          --tokens 4 --prompts 512 8192 --rounds 1 --streams 1,4,8,16 --stream-tokens 4 --stream-warm \
          ${PRIME_ARGS:-} > "$out/prime-$shape.log" 2>&1
        echo "prime $shape: exit $? after $(($(date +%s) - started)) s (124: cut by its timeout)"
      ) &
      running=$((running + 1))
      [ "$running" -ge "$jobs" ] && wait -n && running=$((running - 1))
    done
    wait
    for folder in /tmp/kapitsa-prime-*; do cp -rn "$folder/." "$cache/"; done
    echo "MLX's cache: $(ls "$cache" | wc -l) files in $cache, primed in $(($(date +%s) - started)) s ($jobs at a time)"
    ;;
  moe-cold)
    : > "$out/moe-cold.log"
    # one process per shape (both MoE shapes' weights at once are 36 GB)
    for shape in ${MOE_COLD_SHAPES:-nemotron-30b-a3b 35b-a3b}; do
      timeout "${MOE_COLD_TIMEOUT:-200}" $py lab/moe_route_cold.py --shapes "$shape" \
        --prompt "${MOE_COLD_PROMPT:-512}" --rounds "${ROUNDS:-3}" 2>&1 | tee -a "$out/moe-cold.log" | grep '^{'
    done
    ;;
  table)
    # #32's table rows: one process per shape builds both models once and compiles kapitsa's kernels
    # once for the batch-1 rounds and the stream counts; give lab/results_table.py every table-*.log
    for shape in ${TABLE_SHAPES:-${TABLE_SHAPE:-4b}}; do
      : > "$out/table-$shape.log"
      timeout "${TABLE_TIMEOUT:-540}" $py lab/decode_vs_mlxlm.py --shapes "$shape" --tokens 64 --prompts 512 8192 \
        --rounds "${TABLE_ROUNDS:-4}" --long-rounds "${TABLE_LONG_ROUNDS:-1}" --streams 1,4,8,16 --stream-tokens 48 \
        --stream-warm >> "$out/table-$shape.log" 2>&1 \
        || echo "table $shape: exit $? (124: cut by its timeout)"
      $py lab/results_table.py "$out/table-$shape.log"
    done
    ;;
  overhead)
    [ -f "$root/.gpu/serve/install.sh" ] && bash "$root/.gpu/serve/install.sh"
    # per shape: serve and two engines in this process (without the idle warm-up, and with it as serve does),
    # their rounds interleaved; three copies of the weights on the device at once
    : > "$out/overhead.log"
    for shape in ${OVERHEAD_SHAPES:-nemotron-30b-a3b}; do
      timeout "${OVERHEAD_TIMEOUT:-400}" $py lab/server_overhead.py --shape "$shape" --speculative auto \
        --ignore-eos --tokens "${TOKENS:-128}" --rounds "${ROUNDS:-5}" 2>&1 | sed "s/^{/{\"shape\": \"$shape\", /" \
        | tee -a "$out/overhead.log" | grep '^{'
    done
    ;;
  nvrtc)
    # whether the start's kernel compiles run side by side with MLX's NVRTC on this machine
    $py lab/nvrtc_parallel.py --count "${NVRTC_COUNT:-16}" --workers 8 2>&1 | tee "$out/nvrtc.log" | tail -1
    ;;
  moe-pairs)
    # the kernels against gather_qmm per call (also a T-token verify's MoE cost at batch 1), then
    # whole decode steps under each limit
    : > "$out/moe-pairs.log"
    timeout "${PAIRS_KERNEL_TIMEOUT:-200}" $py lab/kernels_moe.py --tokens 1 2 3 4 5 6 7 8 --iters 100 \
      >> "$out/moe-pairs.log" 2>&1 || echo "kernels_moe.py: exit $?"
    grep -E '"tokens"|Error' "$out/moe-pairs.log" | cut -c1-220
    for shape in ${PAIRS_SHAPES:-nemotron-30b-a3b}; do
      for limit in ${PAIRS_LIMITS:-16 72}; do
        KAPITSA_MOE_MAX_PAIRS=$limit timeout "${PAIRS_BATCH_TIMEOUT:-200}" $py lab/batch_sweep.py --shapes "$shape" \
          --streams "${PAIRS_STREAMS:-4,6,8}" --tokens 48 --prompt 512 --engines kapitsa 2>&1 \
          | sed "s/^{/{\"moe_max_pairs\": $limit, /" >> "$out/moe-pairs.log"
        status=${PIPESTATUS[0]}
        [ "$status" = 0 ] || echo "batch_sweep.py at limit $limit: exit $status (124: cut by its timeout)"
        grep "\"moe_max_pairs\": $limit, .*\"shape\": \"$shape\".*aggregate_tok_s" "$out/moe-pairs.log"
      done
    done
    ;;
  compile)
    # each decode batch size's first-burst cost and the kernels it JIT-compiles ($COMPILE_SHAPES,
    # default 4b; lab/batch_compile.py), twice over one fresh PTX cache: the second process shows
    # what MLX's disk cache leaves of the stall
    export MLX_PTX_CACHE_DIR=/tmp/kapitsa-ptx-compile && rm -rf "$MLX_PTX_CACHE_DIR" && mkdir -p "$MLX_PTX_CACHE_DIR"
    : > "$out/compile.log"
    for pass in cold-cache warm-cache; do
      timeout "${COMPILE_TIMEOUT:-270}" $py lab/batch_compile.py --shapes "${COMPILE_SHAPES:-4b}" \
        --sizes "${COMPILE_SIZES:-1,2,3,4,6,8,16}" 2>&1 | sed "s/^{/{\"pass\": \"$pass\", /" >> "$out/compile.log"
    done
    echo "modules on disk: $(ls "$MLX_PTX_CACHE_DIR" | grep -c '\.ptx$'), of them custom kernels:" \
      "$(ls "$MLX_PTX_CACHE_DIR" | grep '\.ptx$' | grep -c custom_kernel)" | tee -a "$out/compile.log"
    grep -E 'streams|first-request|Error' "$out/compile.log"
    ;;
  long-context)
    # the attention kernel's and the KV tail's GPU tests first (a wrong kernel makes timings moot)
    timeout 120 $py -m pytest -p no:cacheprovider -o addopts="" -q -rf --tb=short -m gpu \
      tests/kernels/test_attention_kernel.py tests/models/test_kv_tail.py > "$out/long-context.log" 2>&1
    tail -1 "$out/long-context.log"
    timeout 90 $py lab/kv_step_cost.py --lengths 512 8192 32768 --steps 32 >> "$out/long-context.log" 2>&1
    timeout "${LONG_CONTEXT_TIMEOUT:-150}" $py lab/long_context_step.py --shape "${LONG_CONTEXT_SHAPE:-4b}" \
      --prompts 512 8192 --steps 32 --rounds 3 >> "$out/long-context.log" 2>&1
    grep -E '^\{' "$out/long-context.log" | cut -c1-260
    ;;
  attn-gap)
    # the table's 8k-decode loss per attention layer (docs/results.md): the same decode with the
    # attention kernels off (MLX's sdpa over the cache instead), interleaved, one process per shape
    : > "$out/attn-gap.log"
    for shape in ${ATTN_GAP_SHAPES:-4b}; do
      timeout "${ATTN_GAP_TIMEOUT:-240}" $py lab/decode_vs_mlxlm.py --shapes "$shape" --prompts 512 8192 \
        --tokens 64 --rounds 2 --kernels-ab gdn,moe,qmv,mamba,route >> "$out/attn-gap.log" 2>&1
    done
    grep -E '"summary"|kapitsa-kernels|Error' "$out/attn-gap.log" | cut -c1-220
    ;;
  startup)
    # three processes per shape, each with MLX's other kernels already on disk (a first pass
    # fills their cache): custom kernels by MLX alone, then written by the disk cache, then read
    : > "$out/startup.log"
    for shape in ${STARTUP_SHAPES:-4b nemotron-30b-a3b}; do
      fresh=/tmp/kapitsa-ptx-startup-$shape && rm -rf "$fresh" "$fresh-off"
      cp -r "/tmp/mlx/$($py -c 'import mlx.core as mx; print(mx.__version__)')/ptx" "$fresh" 2>/dev/null || mkdir -p "$fresh"
      find "$fresh" -name 'custom_kernel_*' -delete && cp -r "$fresh" "$fresh-off"
      for pass in off cold warm; do
        dir=$fresh && flag=() && [ $pass = off ] && dir=$fresh-off && flag=(--no-disk-cache)
        MLX_PTX_CACHE_DIR=$dir timeout "${STARTUP_TIMEOUT:-240}" $py lab/startup_compile.py --shapes "$shape" \
          "${flag[@]}" 2>&1 | sed "s/^{/{\"pass\": \"$pass\", /" | tee -a "$out/startup.log" | grep -E '^\{|Error'
      done
    done
    ;;
  spec)
    # the default speculation against plain decoding per shape ($SPEC_SHAPES, default all four):
    # own output, a scripted essay, the edit workload with the n-gram tree and mlx-lm
    # shellcheck disable=SC2086
    timeout "${SPEC_TIMEOUT:-560}" $py lab/spec_default.py --shapes ${SPEC_SHAPES:-27b 35b-a3b 4b nemotron-30b-a3b} \
      --rounds "${ROUNDS:-3}" --workloads ${SPEC_WORKLOADS:-own essay edit} --edit-rounds "${EDIT_ROUNDS:-${ROUNDS:-3}}" --tokens "${TOKENS:-256}" > "$out/spec.log" 2>&1
    grep -E 'summary|Error' "$out/spec.log"
    ;;
  repeat)
    # plain greedy decoding of one prompt, repeated, under kernel settings that name a suspect
    : > "$out/repeat.log"
    timeout "${REPEAT_TIMEOUT:-270}" $py lab/repeat_decode.py --shape "${REPEAT_SHAPE:-nemotron-30b-a3b}" \
      --variants default KAPITSA_KERNELS=none KAPITSA_COMPILE_DECODE=0 KAPITSA_QLINEAR=stock >> "$out/repeat.log" 2>&1
    # MLX has spelled this variable both ways
    MLX_CUDA_USE_CUDNN_SDPA=0 MLX_CUDA_USE_CUDNN_SPDA=0 timeout "${REPEAT_TIMEOUT:-270}" $py lab/repeat_decode.py \
      --shape "${REPEAT_SHAPE:-nemotron-30b-a3b}" --variants default >> "$out/repeat.log" 2>&1
    grep -E 'variant|summary|Error' "$out/repeat.log"
    ;;
  ragged)
    # batches whose rows sit at different positions (lab/batch_sweep.py --ragged), kapitsa at its
    # defaults and without the attention kernel ("attn"), one process each
    : > "$out/ragged.log"
    for families in default gdn,moe,qmv,mamba,route; do
      setting=() && [ "$families" != default ] && setting=(KAPITSA_KERNELS="$families")
      # shellcheck disable=SC2086
      env "${setting[@]}" timeout "${RAGGED_TIMEOUT:-200}" $py lab/batch_sweep.py --shapes "${RAGGED_SHAPES:-4b}" \
        --streams "${RAGGED_STREAMS:-8,16}" --engines kapitsa --ragged --warm --tokens "${TOKENS:-64}" \
        --prompt "${RAGGED_PROMPT:-2048}" 2>&1 | sed "s/^{/{\"kernels\": \"$families\", /" >> "$out/ragged.log"
    done
    grep -E '"streams"|Error' "$out/ragged.log"
    ;;
  gaps)
    # shellcheck disable=SC2086
    timeout "${GAPS_TIMEOUT:-400}" $py lab/decode_gaps.py --shapes ${GAPS_SHAPES:-4b nemotron-30b-a3b} \
      > "$out/gaps.log" 2>&1
    grep -E 'summary|Error' "$out/gaps.log"
    ;;
  bf16)
    # greedy speculation == plain in bf16 on the GPU's kernels (both families, 256 tokens)
    # $BF16_SELECT: the tests' -k (default: the exact_verify variants; the default kernels' are
    # expected to fail on CUDA, xfail); ~200 s of JIT compiles on a fresh machine
    timeout "${BF16_TIMEOUT:-300}" $py -m pytest -p no:cacheprovider -o addopts="" -q -rf -rx --tb=short \
      -k "${BF16_SELECT:-exact_verify}" tests/engine/test_speculation_bf16.py > "$out/bf16.log" 2>&1
    tail -3 "$out/bf16.log"
    ;;
  verify-diff)
    : > "$out/verify-diff.log"
    timeout "${DIFF_TIMEOUT:-150}" $py lab/verify_vs_decode.py --dtypes bfloat16 \
      --variants default KAPITSA_EXACT_VERIFY=1 KAPITSA_KERNELS=none >> "$out/verify-diff.log" 2>&1
    timeout "${DIFF_TIMEOUT:-150}" $py lab/verify_vs_decode.py --dtypes bfloat16 --small --quantize \
      --variants default KAPITSA_EXACT_VERIFY=1 KAPITSA_QLINEAR=stock >> "$out/verify-diff.log" 2>&1
    grep -oE '"kind[^}]*first_kind": [^,]*|"after_rollback": [^}]*}|Error.*' "$out/verify-diff.log"
    ;;
  flint)
    # Flint at its published shape: :small at a 24 GB and a 16 GB Mac's budgets, plain 4-bit, and
    # mlx-vlm's own Flint at 4 bits (needs .gpu/serve's mlx-vlm wheel installed)
    timeout "${FLINT_TIMEOUT:-400}" $py lab/small_flint.py --tokens "${TOKENS:-128}" --prompt 512 \
      > "$out/flint.log" 2>&1
    grep -E '"shape"|Error|mlx-vlm' "$out/flint.log"
    ;;
  server)
    [ -f "$root/.gpu/serve/install.sh" ] && bash "$root/.gpu/serve/install.sh"
    # shellcheck disable=SC2086
    # one bench per shape; the servers' own logs (kapitsa's at INFO) in $out/server-<shape>-servers.txt
    for shape in ${SERVER_SHAPES:-${SERVER_SHAPE:-4b}}; do
      timeout "${SERVER_TIMEOUT:-560}" $py lab/server_bench.py --shape "$shape" \
        --tokens "${TOKENS:-128}" --streams 8 --work "/tmp/kapitsa-server-bench-$shape" ${SERVER_ARGS:-} \
        > "$out/server-$shape.log" 2>&1 || echo "server $shape: exit $? (124: cut by its timeout)"
      # the servers' own logs in one file (a device call returns at most 8 files)
      tail -n 300 /tmp/kapitsa-server-bench-"$shape"/*.log > "$out/server-$shape-servers.txt" 2>/dev/null
      # the shape's checkpoint (2.5-19 GB) goes: the four together pass the machine's 64 GB disk
      rm -rf /tmp/kapitsa-server-bench-"$shape"
      tail -1 "$out/server-$shape.log"
    done
    ;;
  prediction)
    shape=${PREDICTION_SHAPE:-4b}
    $py lab/shape_checkpoint.py "$shape" "/tmp/kapitsa-shape-$shape" > "$out/prediction.log" 2>&1
    timeout "${PREDICTION_TIMEOUT:-400}" $py lab/prediction_bench.py --model "/tmp/kapitsa-shape-$shape" \
      --tokens "${TOKENS:-256}" --rounds "${ROUNDS:-3}" >> "$out/prediction.log" 2>&1
    grep -E 'summary|Error' "$out/prediction.log"
    ;;
  cache)
    : > "$out/cache.log"
    # one process per shape, so a cut 27B keeps the 4B's rows (and leaves the prefetch its time)
    for shape in 4b 27b; do
      limit=${MEMFIT_TIMEOUT:-$([ "$shape" = 27b ] && echo 160 || echo 140)}
      timeout "$limit" $py lab/memory_fit.py --shapes "$shape" --context 8192 --chunk 2048 --kv-bits none 8 \
        --runs 2 >> "$out/cache.log" 2>&1
    done
    # the 4B's random checkpoint is written to /tmp first (~2.4 GB, half a minute)
    timeout "${PREFETCH_TIMEOUT:-240}" $py lab/prefetch_ttft.py --shape 4b --turns 6 --reply 16 \
      --repeats "${PREFETCH_REPEATS:-3}" --idle-s 2 >> "$out/cache.log" 2>&1
    grep -E '"ratio"|TTFT median|^turns|Error' "$out/cache.log"
    ;;
  memory)
    # the estimate against the measured peak, each layer's window placed (lab/memory_fit.py): 4b and
    # 27b with K/V bf16 and 8-bit, each run as the engine prefills, as one graph per chunk and with
    # attention unblocked (prompt_s: what each costs or gains); then the 4b without the dense
    # prefill route (its copies' share)
    : > "$out/memory.log"
    for shape in 4b 27b; do
      timeout "${MEMFIT_TIMEOUT:-250}" $py lab/memory_fit.py --shapes "$shape" --context 8192 --chunk 2048 \
        --kv-bits none 8 --runs 2 --variants default one-graph no-blocks >> "$out/memory.log" 2>&1
    done
    KAPITSA_QLINEAR=stock timeout 120 $py lab/memory_fit.py --shapes 4b --context 8192 --chunk 2048 \
      --kv-bits none --runs 1 >> "$out/memory.log" 2>&1
    grep -E '"ratio"|Error' "$out/memory.log"
    ;;
  tests)
    # Every gpu-marked test (~540 cases; in one process ~18 minutes on a fresh machine, nearly all
    # NVRTC compiles on one core), sharded over $TEST_SHARDS parallel pytest processes on the one
    # GPU by lab/gpu_tests.py: one JSON line per failure, then the summary (cases not reached by
    # the deadline are counted and named).
    timeout "$(( ${TESTS_TIMEOUT:-360} + 60 ))" $py lab/gpu_tests.py --shards "${TEST_SHARDS:-12}" \
      --budget "${TESTS_TIMEOUT:-360}" --out /tmp/gpu-tests tests > "$out/tests.log" 2>&1
    tail -2 "$out/tests.log"
    cat /tmp/gpu-tests/shard*.log > "$out/tests-shards.log" 2>/dev/null
    ;;
  compiled)
    # the compiled decode/verify paths against the op-by-op ones (tests/models/test_compiled_decode.py)
    # on the GPU: 25 cases, ~4 minutes on a fresh machine (a 120 s limit reaches 16 of them)
    timeout "$(( ${COMPILED_TIMEOUT:-300} + 60 ))" $py lab/gpu_tests.py --shards "${TEST_SHARDS:-12}" \
      --budget "${COMPILED_TIMEOUT:-300}" --marker "not metal and not slow" --out /tmp/gpu-tests-compiled \
      tests/models/test_compiled_decode.py > "$out/compiled.log" 2>&1
    tail -2 "$out/compiled.log"
    cat /tmp/gpu-tests-compiled/shard*.log > "$out/compiled-shards.log" 2>/dev/null
    ;;
  *)
    for shape in "$@"; do
      # the verify cost per T compiles every T's kernels afresh (NVRTC, ~1 s each): on a cold machine
      # it can cut the 27B part before its edit speculation. VERIFY_SIZES=none leaves it out.
      verify=() sizes=${VERIFY_SIZES:-}
      [ -z "$sizes" ] && [ "$shape" = 27b ] && sizes="1 4 8 16"
      [ -z "$sizes" ] && [ "$shape" = nemotron-30b-a3b ] && sizes="1 4 8"
      # shellcheck disable=SC2206
      [ -n "$sizes" ] && [ "$sizes" != none ] && verify=(--verify-shapes "$shape" --verify-sizes $sizes)
      # beside the defaults: on the Qwen shapes the defaults without the attention layer's decode
      # kernels (attn); on Nemotron without the fused MoE router (route).
      # FUSED_AB=none, KERNELS_AB=none leave that variant out (a shorter part).
      if [ "${KERNELS_AB:-}" != none ]; then
        case "$shape" in
          27b | 4b | 35b-a3b) verify+=(--kernels-ab gdn,moe,qmv,mamba,route) ;;
          nemotron-30b-a3b) verify+=(--kernels-ab gdn,moe,qmv,mamba) ;;
        esac
      fi
      case "$shape" in 35b-a3b | nemotron-30b-a3b) [ "${FOLD_AB:-0}" = 1 ] && verify+=(--fold-ab) ;; esac
      [ "${FUSED_AB:-residual}" != none ] && verify+=(--fused-ab "${FUSED_AB:-residual}")
      # the 27B's part is the longest (mlx-lm prefills its 8k prompt twice at ~175 tok/s)
      limit=${SHAPE_TIMEOUT:-$([ "$shape" = 27b ] && echo 360 || echo 290)}
      timeout "$limit" $py lab/decode_vs_mlxlm.py --shapes "$shape" --tokens "${TOKENS:-64}" --prompts 512 \
        --rounds "${ROUNDS:-2}" --prefill-prompts 8192 "${verify[@]}" \
        --spec-shapes "$shape" --spec-rounds 1 \
        --spec-tokens 256 > "$out/$shape.log" 2>&1
      grep -E 'summary|verify_ms|Error' "$out/$shape.log"
    done
    ;;
esac
