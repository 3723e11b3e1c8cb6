#!/usr/bin/env bash
# GPU runs of mla_cupy from a checkout (no install needed): tests, fuzz, sanitizers, benchmarks,
# A/B timings, Nsight Compute, ahead-of-time compilation. Run from anywhere; logs go to --out.
#
#   bash benchmarks/gpu.sh [options] MODE [ARGS...]
#
# Modes:
#   suite [PYTEST ARGS...]   the whole `pytest -m gpu` suite (its fuzz: MLA_FUZZ_EXAMPLES, default 20)
#   fuzz N [--seed S]        N random problems against the float64 reference (benchmarks/fuzz.py:
#                            every variant on every kernel this GPU runs, the backward's four gradients
#                            among them), from where the records in --out of seed S stop; S makes a
#                            run repeatable (default: the records' seed, else a random one, printed)
#   sanitize [TOOL...]       compute-sanitizer (default: memcheck racecheck synccheck initcheck) over a
#                            small-shape subset with every kernel family in it (both 16-bit kernels at
#                            every mask, paged aligned and gathered, epilogue merge, merge_states, NaN
#                            isolation, fp8 per token, fp8 rope plain and paged, the V^T pre-pass, the
#                            quantizers; the backward: both main kernels at every mask, its passes,
#                            float32 out, dlse, deterministic mode); SUBSET='<pytest -k expression>'
#                            replaces the subset
#   bench [ARGS...]          benchmarks/matrix.py: the bench matrix, ours and the peers (JSON and plot
#                            into --out), then the paged-rope and merge timings
#   host [ARGS...]           benchmarks/matrix.py --host: host time per call of every entry point (CuPy
#                            and torch) beside the peers' calls (JSON into --out)
#   train [ARGS...]          benchmarks/train_e2e.py: a DeepSeek-V3-shaped model trained on segments of
#                            repeated random patterns (each next token the one --period back) with
#                            mla_cupy and with sdpa (loss curves, tokens/s, peak memory; JSON and plot
#                            into --out)
#   e2e [ARGS...]            benchmarks/transformers_e2e.py: a DeepSeek-V3-shaped transformers model's
#                            prefill at 1k, 4k and 16k tokens, mla_cupy against sdpa and eager (JSON
#                            into --out)
#   perf [ARGS...]           the README's performance run: benchmarks/ab.py over the README's cases, ours
#                            against FlashAttention-4 and -3, each also with its K build (needs --wheels),
#                            7 rounds, into --out/perf.json;
#                            then, on any machine: python benchmarks/perf_plot.py DIR/perf.json
#   ab [ARGS...]             benchmarks/ab.py ARGS (implementations timed in one process)
#   ncu CASE                 Nsight Compute (--set full, --clock-control none) of one launch: CASE is a
#                            bench case (`mla-cupy bench --list`) or fp8 / e4m3 / bf16 / paged / pagedP (pages of P;
#                            1x8192, H = 128), or FlashAttention-3's kernel on 1x8192: fa3 (bf16, K at 192) / fa3-fp8
#                            (e4m3; needs --wheels); the backward's main kernel on 1x8192: bwd (ours) / fa4-bwd
#                            (FlashAttention-4's, needs --wheels); FlashAttention-4's forward: fa4
#   probe [ARGS...]          benchmarks/pipe_probe.py ARGS: cycles per key tile of the Hopper consumer loop
#                            without its loads, its parts alone and together, and of its loads without
#                            the consumers, from L2 and DRAM (JSON into --out)
#   compile                  `mla-cupy compile`: every kernel family into CuPy's on-disk cache
#   verify STEP [ARGS...]    the reliability evidence, one step per GPU command (each within --timeout),
#                            records in --out, then one summary:
#     verify fuzz [TOTAL] [--seed S] [--start I] [--budget-s B]
#                            problems up to index TOTAL (default 1000) of seed S, from I (default: the
#                            first index the records lack), stopping before B seconds (default
#                            --timeout - 90); prints progress and the command that resumes it
#     verify sanitize [TOOL...]  the sanitize mode above, each tool's errors recorded
#     verify soak [--calls N] [--threads T] [--iters I] [--bwd-runs R]
#                            10,000 mixed calls (plan.run, one-shot, torch op) with memory sampled, then
#                            T = 8 threads with their own streams and plans against the serial results,
#                            then the backward (each kernel) in deterministic mode R = 100 times serially
#                            and R times in each thread, bitwise equal to the first, and its default
#                            mode from the threads within the reference's bound of the serial result
#     verify summary         every record in --out: problems, mismatches, sanitizer errors, soak memory,
#                            concurrency, the backward's repeatability, and the markdown row for
#                            benchmarks/RESULTS.md (no GPU needed)
#     verify                 all of the above in order, the fuzz in budgeted steps up to 1000 (for a
#                            machine without a limit per command)
#
# Options:
#   --out DIR        where logs and results go (default ./gpu-logs)
#   --wheels DIR     install the wheels in DIR (the bench peers: FlashAttention-3's fa3-fwd,
#                    nvidia-cudnn-frontend, FlashAttention-4's flash-attn-4 with nvidia-cutlass-dsl and its
#                    libraries; docs/development.md) into DIR/site without an index, and put it on PYTHONPATH
#   --timeout S      limit of each step in seconds (default 540; each sanitizer tool is one step)
#
# Environment: PYTHON (default python3); NCU and SANITIZER name the tools when they are neither on
# PATH nor in $CUDA_HOME/bin (CUDA_HOME defaults to CUDA_PATH, then /usr/local/cuda); MLA_CUPY_COMMIT
# names the commit of the files (logs and ab.py's JSON) where the checkout's git metadata is not theirs.
set -u -o pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit "${1:-0}"; }

OUT_DIR=./gpu-logs WHEELS="" STEP_S=540
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT_DIR=$2; shift 2 ;;
    --wheels) WHEELS=$2; shift 2 ;;
    --timeout) STEP_S=$2; shift 2 ;;
    -h|--help) usage 0 ;;
    --*) echo "gpu.sh: unknown option $1" >&2; usage 2 ;;
    *) break ;;
  esac
done
[ $# -ge 1 ] || usage 2
MODE=$1; shift
case "$MODE" in
  suite|fuzz|sanitize|bench|host|e2e|train|perf|ab|ncu|probe|compile|verify) ;;
  *) echo "gpu.sh: unknown mode $MODE" >&2; usage 2 ;;
esac

OUT_DIR=$(mkdir -p "$OUT_DIR" && cd "$OUT_DIR" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT:$ROOT/tests:$ROOT/benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if [ -n "$WHEELS" ]; then
  WHEELS=$(cd "$WHEELS" && pwd)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WHEELS/site" "$WHEELS"/*.whl \
    || { echo "gpu.sh: installing the wheels of $WHEELS failed" >&2; exit 1; }
  export PYTHONPATH="$WHEELS/site:$PYTHONPATH"
  # pip's --target skips the .pth of nvidia-cutlass-dsl (FlashAttention-4's compiler): its packages' folder
  [ -d "$WHEELS/site/nvidia_cutlass_dsl/dsl_packages" ] && export PYTHONPATH="$WHEELS/site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH"
fi

# A CUDA tool by name: $VAR if set, else PATH, else $CUDA_HOME/bin.
find_tool() {
  local name=$1 override=$2 home=${CUDA_HOME:-${CUDA_PATH:-/usr/local/cuda}}
  if [ -n "$override" ]; then echo "$override"; return; fi
  if command -v "$name" >/dev/null 2>&1; then command -v "$name"; return; fi
  if [ -x "$home/bin/$name" ]; then echo "$home/bin/$name"; return; fi
  echo "gpu.sh: $name not found on PATH nor in $home/bin (set ${3} or CUDA_HOME)" >&2
  return 1
}

# step NAME CMD...: run CMD under the step limit, its output into $OUT_DIR/NAME.log.
step() {
  local name=$1; shift
  echo "== $name: $*"
  timeout "$STEP_S" "$@" > "$OUT_DIR/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 124 ] && echo "!! $name: stopped at the ${STEP_S}s limit"
  return $rc
}

# step_shown NAME CMD...: step, with the output also on the terminal as it comes.
step_shown() {
  local name=$1; shift
  echo "== $name: $*"
  timeout "$STEP_S" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 124 ] && echo "!! $name: stopped at the ${STEP_S}s limit"
  return "$rc"
}

# Per-test limit when pytest-timeout is installed (a hung kernel then fails one test, not the run).
PYTEST=("$PY" -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider)
"$PY" -c "import pytest_timeout" 2>/dev/null && PYTEST+=(--timeout="${TEST_TIMEOUT:-300}")

summary() { grep -h -E "$1" "$OUT_DIR/$2.log" | tail -"${3:-20}"; }

[ "$MODE $*" = "verify summary" ] || {
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu \
    --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"
  if [ -n "${MLA_CUPY_COMMIT:-}" ]; then echo "commit $MLA_CUPY_COMMIT (MLA_CUPY_COMMIT)"
  else echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD -- kernels mla_cupy 2>/dev/null || echo ' (kernels/ or mla_cupy/ modified)')"; fi
  "$PY" -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)" 2>&1 | tail -1
} | tee "$OUT_DIR/env.txt"

SANITIZER_SUBSET='(every_mask_dtype_heads and (16-bf16 or 16-fp16-CausalMask)) or (paged_equals_plain and (16- or 64-)) or accumulate_merges or merge_states_exact or nan_in_one or (fp8_every_mask_heads_odd_lengths and 16-) or (e4m3_every_mask_heads_odd_lengths and 16-) or e4m3_rope_alone or (fp8_paged_rope and 64) or (fp8_rope_plain and 16-) or (fp8_rope_paged and 64) or transpose_v_device or (device_quantizers and 16) or (every_mask_and_dtype and (bf16 or fp16-CausalMask)) or deterministic_mode_repeats_bits or float32_out_dlse_deterministic'
SANITIZER_FILES=(tests/test_gpu_prefill.py tests/test_gpu_paged_merge.py tests/test_gpu_fp8.py tests/test_gpu_backward.py)

FUZZ=("$PY" benchmarks/fuzz.py --out "$OUT_DIR")
VERIFY=("$PY" benchmarks/verify.py)
STAMP() { date +%Y%m%d-%H%M%S; }

# sanitize_tools [TOOL...]: the warm-up run, then each tool (default: all four) as one step, and
# each tool's record for the summary.
sanitize_tools() {
  local SAN K t rc
  [ $# -gt 0 ] || set -- memcheck racecheck synccheck initcheck
  SAN=$(find_tool compute-sanitizer "${SANITIZER:-}" SANITIZER) || return 1
  K=${SUBSET:-$SANITIZER_SUBSET}
  # One plain run first: it compiles every kernel of the subset into the on-disk cache, so the
  # sanitized runs (much slower per instruction) spend their time in the kernels, not in NVRTC.
  step sanitize-warmup "${PYTEST[@]}" "${SANITIZER_FILES[@]}" -k "$K"
  summary "passed|failed|skipped" sanitize-warmup 2
  # No -x: one failing test must not hide what the tool reports on the others.
  for t in "$@"; do
    step "sanitize-$t" "$SAN" --tool "$t" --target-processes all --print-limit 20 \
      "${PYTEST[@]}" "${SANITIZER_FILES[@]}" -k "$K"
    rc=$?
    summary "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "sanitize-$t" 4
    "${VERIFY[@]}" record-sanitizer "$t" "$OUT_DIR/sanitize-$t.log" "$rc" "$OUT_DIR"
  done
}

# verify_fuzz [TOTAL] [FUZZ ARGS...]: one budgeted step of problems up to index TOTAL.
verify_fuzz() {
  local total=1000
  case "${1:-}" in [0-9]*) total=$1; shift ;; esac
  step_shown "fuzz-$(STAMP)" "${FUZZ[@]}" --total "$total" --budget-s $((STEP_S - 90)) "$@"
}

case "$MODE" in
  suite)
    step suite "${PYTEST[@]}" -s tests "$@"
    summary "host overhead|accuracy|passed|failed|skipped|FAILED|ERROR|Error" suite 30 ;;
  fuzz)
    [ $# -ge 1 ] || usage 2
    N=$1; shift
    step_shown "fuzz-$(STAMP)" "${FUZZ[@]}" --count "$N" --budget-s $((STEP_S - 90)) "$@" ;;
  sanitize) sanitize_tools "$@" ;;
  bench)
    step bench "$PY" benchmarks/matrix.py --json "$OUT_DIR/bench.json" --plot "$OUT_DIR/bench.png" --reps 20 \
      --no-progress "$@"
    summary "device|matmul|mla_cupy|fa3|Error" bench 40
    step paged_merge "$PY" benchmarks/paged_merge_bench.py
    cat "$OUT_DIR/paged_merge.log" ;;
  host)
    step_shown host "$PY" benchmarks/matrix.py --host --json "$OUT_DIR/host.json" "$@" ;;
  e2e)
    step_shown e2e "$PY" benchmarks/transformers_e2e.py --json "$OUT_DIR/e2e.json" "$@" ;;
  perf)
    PERF_CASES=1x512,1x1024,1x2048,1x4096,1x8192,1x16384,1x32768,4x2048,16x512,64x128,ragged,ragged-300+5000+77+1500,1024+ctx8192,H16-1x8192,H16-1x16384,noncausal-1x4096
    step_shown perf "$PY" benchmarks/ab.py --impls ours,fa4,fa3,fa4+kbuild,fa3+kbuild --cases "$PERF_CASES" --rounds 7 \
      --out "$OUT_DIR/perf.json" "$@" ;;
  train)
    step_shown train "$PY" benchmarks/train_e2e.py --json "$OUT_DIR/train.json" --plot "$OUT_DIR/train.png" "$@" ;;
  ab)
    step ab "$PY" benchmarks/ab.py "$@"
    cat "$OUT_DIR/ab.log" ;;
  ncu)
    [ $# -ge 1 ] || usage 2
    NCU=$(find_tool ncu "${NCU:-}" NCU) || exit 1
    CASE=$1; name=ncu-${CASE//[^A-Za-z0-9._-]/_}
    KERNEL=(-k regex:mla_prefill)
    case "$CASE" in
      fp8|e4m3|bf16|paged|paged[0-9]*) DRIVER=(benchmarks/ncu_fp8.py "$CASE") ;;
      fa3|fa3-fp8) DRIVER=(benchmarks/ab.py --impls "$CASE" --cases 1x8192 --profile)
                   KERNEL=(--kernel-name-base demangled -k regex:FlashAttnFwd) ;;
      fa4) DRIVER=(benchmarks/ab.py --impls fa4 --cases 1x8192 --profile)
           KERNEL=(--kernel-name-base demangled -k regex:Forward) ;;
      bwd) DRIVER=(benchmarks/ab.py --backward --impls ours --cases 1x8192 --profile)
           KERNEL=(-k regex:mla_backward_kernel) ;;
      fa4-bwd) DRIVER=(benchmarks/ab.py --backward --impls fa4 --cases 1x8192 --profile)
               KERNEL=(--kernel-name-base demangled -k regex:BackwardSm90) ;;  # the main kernel, not its pre- and post-process
      *) DRIVER=(benchmarks/ncu_case.py "$CASE") ;;
    esac
    # The drivers launch the kernel three times; the third launch is profiled.
    step "$name" "$NCU" --clock-control none "${KERNEL[@]}" --launch-skip 2 --launch-count 1 --set full \
      --import-source no -f -o "$OUT_DIR/$name" "$PY" "${DRIVER[@]}"
    "$NCU" --import "$OUT_DIR/$name.ncu-rep" --print-details all > "$OUT_DIR/$name-details.txt" 2>&1
    "$NCU" --import "$OUT_DIR/$name.ncu-rep" --page source --csv --print-source sass > "$OUT_DIR/$name-sass.csv" 2>&1
    grep -E "Duration|SM Frequency|Elapsed Cycles|Tensor|Memory Throughput|DRAM Throughput|L2 Cache Throughput|L2 Hit Rate|Executed Instructions  " \
      "$OUT_DIR/$name-details.txt" | head -16 ;;
  probe)
    step probe "$PY" benchmarks/pipe_probe.py --json "$OUT_DIR/probe.json" "$@"
    cat "$OUT_DIR/probe.log" ;;
  compile)
    step compile "$PY" -m mla_cupy compile
    tail -5 "$OUT_DIR/compile.log" ;;
  verify)
    SUB=${1:-all}; [ $# -gt 0 ] && shift
    case "$SUB" in
      fuzz) verify_fuzz "$@" ;;
      sanitize) sanitize_tools "$@" ;;
      soak) step_shown soak "${VERIFY[@]}" soak --out "$OUT_DIR" "$@" ;;
      summary) "${VERIFY[@]}" summary "$OUT_DIR" | tee "$OUT_DIR/summary.txt" ;;
      all)
        step compile "$PY" -m mla_cupy compile
        tail -2 "$OUT_DIR/compile.log"
        left=$("${FUZZ[@]}" --total 1000 --remaining)
        while [ "$left" -gt 0 ]; do
          verify_fuzz 1000
          [ $? -eq 2 ] && break  # the CUDA context was lost: the summary says where
          now=$("${FUZZ[@]}" --total 1000 --remaining)
          [ "$now" -lt "$left" ] || break  # no progress: do not loop
          left=$now
        done
        sanitize_tools
        step_shown soak "${VERIFY[@]}" soak --out "$OUT_DIR"
        "${VERIFY[@]}" summary "$OUT_DIR" | tee "$OUT_DIR/summary.txt" ;;
      *) echo "gpu.sh: unknown verify step $SUB (fuzz, sanitize, soak, summary)" >&2; usage 2 ;;
    esac ;;
esac
echo "logs: $OUT_DIR"
