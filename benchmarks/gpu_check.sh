#!/usr/bin/env bash
# The one prepared GPU measurement of TACO-TP: one H100/H200, under 10 minutes from a cold Triton cache.
#
# What it checks and measures (each step runs under `timeout`; a failing step is recorded and the
# next one runs; the summary table comes last, with the Triton compiles each step added):
#   step              GPU budget  what
#   setup                 30 s    versions (python, torch, CUDA, triton, GPU via nvidia-smi and
#                                 torch); installs the repo with `pip install --no-deps
#                                 --no-build-isolation --no-index -e .` if `import taco` fails
#   codec-check           90 s    every codec the later steps time, Triton against the eager reference
#                                 on the GPU (encode, decode, decode-sum-encode; bf16/fp32/fp16; ragged
#                                 tail, NaN and zero groups), one worker process per codec: also the
#                                 compile warm-up, since every later step loads its kernels from the
#                                 Triton cache this step fills (benchmarks/gpu_codec_check.py)
#   kernel-tests          75 s    pytest tests/kernels/test_kernels.py with Triton compiled for the GPU
#   codec-bandwidth       50 s    encode / decode / fused decode-sum-encode (N=8) of 64 MiB, 256 MiB
#                                 and 1 GiB bf16 messages (all larger than the 60 MB L2), every codec
#                                 with a Triton kernel, as time ratios to a D2D copy in the same run
#   host-overhead         25 s    CPU time to issue one codec.encode + codec.decode at 0.25-4 MiB vs
#                                 the GPU time of the kernels (launch/host overhead)
#   allreduce-replay      45 s    one rank of an N=8 two-shot all-reduce of 64 MiB bf16, compute only
#                                 (fused and unfused) against a D2D copy (benchmarks/gpu_replay.py)
#   comm-loopback         45 s    the compressed collectives on CUDA in one process, with loopback
#                                 stand-ins for the NCCL transfers: the real side stream, events,
#                                 record_stream and buffer cache (tests/comm/test_comm_loopback.py)
#   train-data            20 s    offline data: $TACO_GPU_DATA (a prepared data dir with meta.json,
#                                 or a .txt file / directory of .txt) or else a generated 1 MB corpus
#   train                 55 s    `taco train --config configs/demo.toml --train.device=cuda
#                                 --train.steps=30 --parallel.tp=1` (world 1), then checks parameters
#                                 on CUDA (checkpoint), loss falls, prints tok/s
#   recompute             45 s    train.recompute none/full/selective on one GPU (8-layer GPT, hidden
#                                 512, 8 x 512 tokens, bf16): bytes kept for backward and the step's
#                                 torch.cuda.max_memory_allocated against `taco plan`, losses bit for
#                                 bit (benchmarks/gpu_recompute_check.py)
#   peer-step             35 s    the project's uncompressed step against Megatron-Core's TP layers on
#                                 one GPU (configs/cluster.toml's model, tp=1, bf16 with fp32 masters,
#                                 4 alternating rounds of 30 steps; benchmarks/gpu_peer_check.py);
#                                 skipped, with a line, where megatron-core is not importable
#   train-tp2             50 s    the same at --parallel.tp=2 over NCCL with the taco codec, when the
#                                 machine has 2 GPUs (skipped, with a line, otherwise)
#   train-overlap         55 s    the trainer with and without parallel.tp_overlap = "batch-split"
#                                 (int6-hadamard TP codec, 20 steps each), tokens/s of both and their
#                                 ratio: TP=2 over NCCL with 2 GPUs; with one GPU (NCCL takes one GPU per
#                                 rank) TP=1, which times the pieces' worker threads on CUDA, no overlap;
#                                 the dry run: TP=2 over gloo on the CPU
#   total                620 s    at most (+ 5 s of kill grace per step); a warm run is far shorter
# Compiles: TRITON_CACHE_DIR is a fresh folder of the run (a cold cache), and each step's count of
# new compiled kernels (.cubin files) is in the summary; the whole script's is the last line. Sizes
# and dtypes are runtime arguments of the kernels, so a codec compiles three kernels: 33 in all,
# counted without a GPU by `python benchmarks/gpu_check_compiles.py` (every step's launches filed
# under their GPU cache keys).
# Timings (benchmarks/gpu_check.py): CUDA events around back-to-back calls queued behind a sleep
# kernel (GPU time without launch gaps), median of repeats after a warm-up.
#
# Usage:
#   bash benchmarks/gpu_check.sh [--out DIR]   # on a CUDA machine; DIR default: $OUT, else runs/gpu_check
#   bash benchmarks/gpu_check.sh --dry-run     # anywhere: CPU, tiny sizes, TRITON_INTERPRET=1 (~1 min
#                                              # on 2 cores; tests/bench/test_gpu_check.py runs it)
#   TACO_GPU_DATA=/path/to/data bash benchmarks/gpu_check.sh   # train on your own offline data
# Writes DIR/gpu_check.log (everything printed), DIR/summary.json (one record per step),
# DIR/steps/<step>.log and DIR/train/ (metrics.jsonl, summary.json, config.toml of the smoke run).
# Exit status: 0 when no step failed, 1 otherwise. Needs bash, coreutils `timeout` and python.
set -uo pipefail # no -e: every step runs, whatever the previous ones did

cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
DRY=0
OUT_DIR=${OUT:-}
while [[ $# -gt 0 ]]; do
  case $1 in
    --dry-run) DRY=1 ;;
    --out) OUT_DIR=${2:?--out needs a directory}; shift ;;
    --out=*) OUT_DIR=${1#--out=} ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
OUT_DIR=${OUT_DIR:-$ROOT/runs/gpu_check}
mkdir -p "$OUT_DIR/steps" || exit 2
OUT_DIR=$(cd "$OUT_DIR" && pwd)
LOG=$OUT_DIR/gpu_check.log
: >"$LOG"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/taco-gpu-check.XXXXXX") || exit 2
trap 'rm -rf "$WORK"' EXIT

export ROOT DRY WORK OUT_DIR
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if [[ $DRY == 1 ]]; then
  export TRITON_INTERPRET=1 DEV=cpu FLAG=--dry-run
  export TRAIN_STEPS=30 CORPUS_MB=0.3 VOCAB=512
  T_SETUP=60 T_CHECK=150 T_TESTS=150 T_BW=120 T_HOST=120 T_REPLAY=150 T_LOOP=150 T_DATA=60 T_TRAIN=150
  # GPU_CHECK_SLACK=k multiplies the dry run's budgets: it checks the script's wiring, not this CPU's speed
  # (the test suite sets it, so a loaded machine does not fail it)
  T_RECOMP=240 T_PEER=150
  k=${GPU_CHECK_SLACK:-1}
  for v in T_SETUP T_CHECK T_TESTS T_BW T_HOST T_REPLAY T_LOOP T_DATA T_TRAIN T_RECOMP T_PEER; do printf -v "$v" %d $((${!v} * k)); done
else
  export TRITON_INTERPRET=0 DEV=cuda FLAG= # tests/conftest.py would otherwise turn the interpreter on
  export TRAIN_STEPS=30 CORPUS_MB=1 VOCAB=2048
  T_SETUP=30 T_CHECK=90 T_TESTS=75 T_BW=50 T_HOST=25 T_REPLAY=45 T_LOOP=45 T_DATA=20 T_TRAIN=55
  T_RECOMP=45 T_PEER=35
fi
# a cold Triton cache of this run's own: the compiles each step needs are counted in it
export TRITON_CACHE_DIR=$WORK/triton-cache
mkdir -p "$TRITON_CACHE_DIR"
compiled() { find "$TRITON_CACHE_DIR" -name '*.cubin' 2>/dev/null | wc -l; }

# -- the steps (each runs as `bash -c step_x` under timeout) ---------------------------------------
step_setup() {
  echo "mode: $([[ $DRY == 1 ]] && echo "dry run (CPU, Triton interpreter)" || echo GPU)"
  echo "repo: $ROOT ($(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo "no git"))"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  else
    echo "nvidia-smi: not found"
  fi
  if (cd / && env -u PYTHONPATH python -c "import taco" 2>/dev/null); then
    echo "taco: importable without PYTHONPATH (installed)"
  elif [[ $DRY == 1 ]]; then
    echo "taco: not installed; the dry run installs nothing (PYTHONPATH=$ROOT)"
  else
    echo "taco: not installed: pip install --no-deps --no-build-isolation --no-index -e ."
    if timeout 30 python -m pip install -q --no-deps --no-build-isolation --no-index -e "$ROOT"; then
      echo "taco: installed"
    else
      echo "taco: install failed; using PYTHONPATH=$ROOT"
    fi
  fi
  python benchmarks/gpu_check.py versions
}

step_kernel_tests() {
  if ! python -c "import pytest" 2>/dev/null; then
    echo "KEY pytest is not installed"
    exit 77
  fi
  local sel=() out=$WORK/pytest.out
  [[ $DRY == 1 ]] && sel=(-k "triton or decode_sum_encode") # the interpreted Triton tests only
  python -m pytest -q -p no:cacheprovider -rs tests/kernels/test_kernels.py "${sel[@]}" 2>&1 | tee "$out"
  local rc=${PIPESTATUS[0]}
  if [[ $DRY == 0 ]] && grep -q "needs CUDA" "$out"; then
    echo "KEY the CUDA tests were skipped: torch sees no GPU"
    exit 1
  fi
  exit "$rc"
}

step_data() {
  local spec=${TACO_GPU_DATA:-}
  if [[ -n $spec && -f $spec/meta.json ]]; then
    python -c "import sys; from taco.train.data import load_meta; m = load_meta(sys.argv[1]); \
print(f\"KEY TACO_GPU_DATA tokens: train {m['train_tokens']:,}, vocab {m['vocab_size']}\")" "$spec" || exit 1
    echo "--data.dataset=tokens --data.path=$spec" >"$WORK/data_args"
    return 0
  fi
  local text=$WORK/corpus
  if [[ -n $spec ]]; then
    [[ -e $spec ]] || { echo "KEY TACO_GPU_DATA=$spec does not exist"; exit 1; }
    text=$spec
    echo "text corpus from TACO_GPU_DATA: $text"
  else
    python benchmarks/gpu_check.py corpus "$text" --mb "$CORPUS_MB" || exit 1
  fi
  python -m taco.cli data prepare --text "$text" --cache-dir "$WORK/data-cache" --vocab-size "$VOCAB" \
    2>&1 | tee "$WORK/prepare.out"
  [[ ${PIPESTATUS[0]} == 0 ]] || exit 1
  echo "--data.dataset=text --data.path=$text --data.vocab_size=$VOCAB --data.cache_dir=$WORK/data-cache" \
    >"$WORK/data_args"
  local what="generated ${CORPUS_MB} MB corpus"
  [[ -n $spec ]] && what="TACO_GPU_DATA text"
  echo "KEY $what:$(grep -o 'train.bin [0-9,]* tokens' "$WORK/prepare.out" | sed 's/train.bin//'), vocab $VOCAB"
}

step_train() {
  if [[ ! -f $WORK/data_args ]]; then
    echo "KEY no data set: the train-data step failed"
    exit 77
  fi
  local run=$WORK/run
  rm -rf "$run"
  # shellcheck disable=SC2046 # data_args is a list of --key=value words without spaces
  python -m taco.cli train --config configs/demo.toml --train.device="$DEV" --train.steps="$TRAIN_STEPS" \
    --parallel.tp=1 $(cat "$WORK/data_args") --train.out_dir="$run" --train.eval_interval="$TRAIN_STEPS" \
    --train.eval_steps=2 --train.log_interval=10 --train.checkpoint_interval="$TRAIN_STEPS" \
    --train.resume=false
  local rc=$?
  mkdir -p "$OUT_DIR/train"
  for f in metrics.jsonl summary.json config.toml comm_stats.txt; do
    [[ -f $run/$f ]] && cp "$run/$f" "$OUT_DIR/train/"
  done
  [[ $rc == 0 ]] || exit "$rc"
  python benchmarks/gpu_check.py train-check "$run" --device "$DEV"
}

step_recompute() {
  [[ -f $WORK/data_args ]] || { echo "KEY no data set: the train-data step failed"; exit 77; }
  # shellcheck disable=SC2046 # data_args is a list of --key=value words without spaces
  python benchmarks/gpu_recompute_check.py --device "$DEV" $FLAG $(sed 's/^/--data-arg=/; s/ / --data-arg=/g' \
    "$WORK/data_args")
}

step_peer() {
  [[ -f $WORK/data_args ]] || { echo "KEY no data set: the train-data step failed"; exit 77; }
  # exits 77 (skipped, with a KEY line) where megatron-core is not importable
  # shellcheck disable=SC2046 # data_args is a list of --key=value words without spaces
  python benchmarks/gpu_peer_check.py --device "$DEV" $FLAG $(sed 's/^/--data-arg=/; s/ / --data-arg=/g' \
    "$WORK/data_args")
}

step_loopback() {
  python -c "import pytest" 2>/dev/null || { echo "KEY pytest is not installed"; exit 77; }
  local out=$WORK/loopback.out
  python -m pytest -q -p no:cacheprovider tests/comm/test_comm_loopback.py 2>&1 | tee "$out"
  local rc=${PIPESTATUS[0]}
  if [[ $DRY == 0 ]] && ! grep -q "passed" "$out"; then
    exit 1
  fi
  exit "$rc"
}

step_train_tp2() {
  local gpus
  gpus=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  if [[ $DRY == 1 || $gpus -lt 2 ]]; then
    echo "KEY $gpus GPU(s): the TP=2 trainer step needs two"
    exit 77
  fi
  [[ -f $WORK/data_args ]] || { echo "KEY no data set: the train-data step failed"; exit 77; }
  local run=$WORK/run-tp2
  rm -rf "$run"
  # shellcheck disable=SC2046 # data_args is a list of --key=value words without spaces
  python -m taco.cli train --config configs/demo.toml --train.device=cuda --train.steps="$TRAIN_STEPS" \
    --parallel.tp=2 --compression.tp_codec=taco $(cat "$WORK/data_args") --train.out_dir="$run" \
    --train.eval_interval="$TRAIN_STEPS" --train.eval_steps=2 --train.log_interval=10 \
    --train.checkpoint_interval="$TRAIN_STEPS" --train.resume=false || exit 1
  python benchmarks/gpu_check.py train-check "$run" --device cuda
}
step_train_overlap() {
  [[ -f $WORK/data_args ]] || { echo "KEY no data set: the train-data step failed"; exit 77; }
  local gpus tp=1 steps=20 mode
  gpus=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  [[ $DRY == 1 || $gpus -ge 2 ]] && tp=2
  [[ $DRY == 1 ]] && steps=6
  for mode in none batch-split; do
    rm -rf "$WORK/run-overlap-$mode"
    # shellcheck disable=SC2046 # data_args is a list of --key=value words without spaces
    python -m taco.cli train --config configs/demo.toml --train.device="$DEV" --train.steps="$steps" \
      --parallel.tp="$tp" --compression.tp_codec=int6-hadamard --compression.tp_codec_options={} \
      --parallel.tp_overlap="$mode" \
      $(cat "$WORK/data_args") --train.out_dir="$WORK/run-overlap-$mode" --train.eval_interval="$steps" \
      --train.eval_steps=2 --train.log_interval=10 --train.checkpoint_interval=0 --train.resume=false || exit 1
  done
  python - "$WORK/run-overlap-none" "$WORK/run-overlap-batch-split" "$tp" <<'PY'
import json, sys
a, b = (json.load(open(d + "/summary.json"))["tokens_per_s"] for d in sys.argv[1:3])
print(f"KEY TP={sys.argv[3]} int6-hadamard: {a:,.0f} tok/s, batch-split {b:,.0f} tok/s ({b / a:.2f}x)")
PY
}
export -f step_setup step_kernel_tests step_data step_train step_recompute step_peer step_loopback step_train_tp2
export -f step_train_overlap

# -- the runner ------------------------------------------------------------------------------------
NAMES=() STATUS=() SECS=() TMOS=() RCS=() KEYS=() COMPILES=()

run_step() { # name timeout_s command...
  local name=$1 tmo=$2
  shift 2
  local slog=$OUT_DIR/steps/$name.log
  : >"$slog"
  printf '\n=== [%s] timeout %ss: %s\n' "$name" "$tmo" "$*" | tee -a "$LOG"
  local t0 t1 rc status keys c0
  c0=$(compiled)
  t0=$(date +%s.%N)
  timeout -k 5 "$tmo" "$@" </dev/null 2>&1 | tee -a "$LOG" "$slog"
  rc=${PIPESTATUS[0]}
  t1=$(date +%s.%N)
  keys=$(sed -n 's/^KEY //p' "$slog" | paste -sd '|' - | sed 's/|/ | /g')
  case $rc in
    0) status=ok ;;
    77) status="skipped: ${keys:-see log}" keys= ;;
    124 | 137) status="FAILED rc=$rc (timeout ${tmo}s)" ;;
    *) status="FAILED rc=$rc" ;;
  esac
  if [[ -z $keys && $rc != 77 ]]; then # e.g. pytest's last line, or the error of a failed step
    keys=$(grep -v '^\s*$' "$slog" | tail -n 1 | cut -c1-160)
  fi
  NAMES+=("$name") STATUS+=("$status") RCS+=("$rc") TMOS+=("$tmo") KEYS+=("$keys")
  COMPILES+=("$(($(compiled) - c0))")
  SECS+=("$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')")
}

START=$(date +%s)
run_step setup "$T_SETUP" bash -c step_setup
run_step codec-check "$T_CHECK" python benchmarks/gpu_check.py codec-check $FLAG
run_step kernel-tests "$T_TESTS" bash -c step_kernel_tests
run_step codec-bandwidth "$T_BW" python benchmarks/gpu_check.py bandwidth $FLAG
run_step host-overhead "$T_HOST" python benchmarks/gpu_check.py host $FLAG
run_step allreduce-replay "$T_REPLAY" python benchmarks/gpu_check.py replay $FLAG
run_step comm-loopback "$T_LOOP" bash -c step_loopback
run_step train-data "$T_DATA" bash -c step_data
run_step train "$T_TRAIN" bash -c step_train
run_step recompute "$T_RECOMP" bash -c step_recompute
run_step peer-step "$T_PEER" bash -c step_peer
run_step train-tp2 "$T_TRAIN" bash -c step_train_tp2
run_step train-overlap "$T_TRAIN" bash -c step_train_overlap
TOTAL=$(($(date +%s) - START))

# -- summary: a table on stdout (and in the log), JSON in OUT_DIR ----------------------------------
FAILED=0
for st in "${STATUS[@]}"; do [[ $st == FAILED* ]] && FAILED=$((FAILED + 1)); done
{
  printf '\n=== summary (%s, %ss in all; log %s)\n' "$([[ $DRY == 1 ]] && echo dry-run || echo gpu)" "$TOTAL" "$LOG"
  printf '%-17s %-34s %7s %8s  %s\n' step status seconds compiles "key figures"
  for i in "${!NAMES[@]}"; do
    printf '%-17s %-34s %7s %8s  %s\n' "${NAMES[$i]}" "${STATUS[$i]}" "${SECS[$i]}" "${COMPILES[$i]}" \
      "${KEYS[$i]}"
  done
  printf 'Triton compiles in all: %s (cache %s)\n' "$(compiled)" "$TRITON_CACHE_DIR"
} | tee -a "$LOG"

for i in "${!NAMES[@]}"; do
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "${NAMES[$i]}" "${STATUS[$i]}" "${RCS[$i]}" "${SECS[$i]}" \
    "${TMOS[$i]}" "${COMPILES[$i]}" "${KEYS[$i]}"
done | python -c '
import json, sys
steps = []
for line in sys.stdin:
    name, status, rc, secs, tmo, comp, keys = line.rstrip("\n").split("\t")
    steps.append({"name": name, "status": status, "rc": int(rc), "seconds": float(secs),
                  "timeout_s": int(tmo), "compiles": int(comp), "key": keys})
mode, total, log, out, comp = sys.argv[1:6]
json.dump({"mode": mode, "total_s": int(total), "compiles": int(comp), "log": log, "steps": steps},
          open(out, "w"), indent=2)
' "$([[ $DRY == 1 ]] && echo dry-run || echo gpu)" "$TOTAL" "$LOG" "$OUT_DIR/summary.json" "$(compiled)" ||
  echo "could not write $OUT_DIR/summary.json" | tee -a "$LOG"
echo "summary: $OUT_DIR/summary.json" | tee -a "$LOG"
[[ $FAILED == 0 ]]
