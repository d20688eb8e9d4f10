#!/usr/bin/env bash
# The device check: the bridge's validation on one CUDA GPU within a budget (default 450 s, under 8 minutes on
# one H200), its results as a few small files in OUT.
#   1. the d = 1001 examples (TinyStories to t = 400, WikiText-2 to t = 1000; the shipped configs), each trained
#      by SGD at three learning rates (0.25, 0.125, 0.0625: the same horizon, steps scaled) beside the exact ODE
#      of its surrogate from the same start (JaxRadau on the GPU, to the example's horizon); the two corpora
#      run side by side (benchmarks/text_validation.py --also-lr 2);
#   2. the GPT-family study (six variants, seed 0, TinyStories) at GPT-2 small's shape (12 layers, width 768,
#      12 heads, bf16 autocast), in whatever the budget leaves.
# The theory's columns are left to the CPU: its rank-r flows are numpy work (`flowsim bridge validate`, RESULTS.md).
# Each part runs under `timeout` so the whole ends within the budget; a part cut short says so in log.txt, and its
# finished runs stay in RUNS (every run is resumable: the same command continues them).
#
# Usage: bash benchmarks/gpu_validation.sh [OUT]        (default runs/gpu-validation)
# Environment: GPU_CHECK_BUDGET (seconds, default 450), GPU_CHECK_DEVICE (default cuda), GPU_CHECK_RUNS (the run
# directories, default OUT-runs), GPU_CHECK_TEXT and GPU_CHECK_GPT (extra `--set` overrides for each part, e.g. a
# small vocabulary and few steps to try the script on a CPU, as tests/test_bridge.py does).
# Output in OUT: summary.md (the tables, with the measured times), tinystories-overlay.png, wikitext2-overlay.png,
# gpt-study.json and log.txt.
set -uo pipefail
OUT=${1:-runs/gpu-validation}
RUNS=${GPU_CHECK_RUNS:-$OUT-runs}
BUDGET=${GPU_CHECK_BUDGET:-450}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
read -r -a TEXT_SET <<< "${GPU_CHECK_TEXT:-}"
read -r -a GPT_SET <<< "${GPU_CHECK_GPT:---set model.n_layer=12 --set model.d_model=768 --set model.n_head=12 --set optim.steps=600}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX and torch processes share the GPU
export PYTHONUNBUFFERED=1
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT" "$RUNS"
LOG="$OUT/log.txt"
: > "$LOG"
start=$SECONDS
left() { echo $(( BUDGET - (SECONDS - start) )); }
say() { echo "[$(( SECONDS - start )) s] $*" | tee -a "$LOG"; }

if [ "$DEVICE" = cuda ]; then
    python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device here'; print('device:', torch.cuda.get_device_name())" \
        2>&1 | tee -a "$LOG" || exit 1
    python -c "import jax; print('jax devices:', jax.devices())" 2>&1 | tee -a "$LOG"
fi

# 1. the d = 1001 validation: both corpora at once, each with its three learning rates and its ODE
text_limit=$(( $(left) * 2 / 3 ))
say "d = 1001 validation, both corpora side by side, at most $text_limit s"
for corpus in tinystories wikitext2; do
    timeout "$text_limit" python "$HERE/text_validation.py" --corpus "$corpus" --out "$RUNS/text" --also-lr 2 \
        --results "$RUNS/text-$corpus.md" --set "data.device='$DEVICE'" "${TEXT_SET[@]}" > "$RUNS/text-$corpus.log" 2>&1 &
done
for job in $(jobs -p); do
    wait "$job" || say "a text validation ended with status $? (124: cut at its $text_limit s)"
done
say "d = 1001 validation done"

# 2. the GPT study in what is left, 20 s kept for the summary
gpt_limit=$(( $(left) - 20 ))
if [ "$gpt_limit" -gt 30 ]; then
    say "GPT study, at most $gpt_limit s"
    timeout "$gpt_limit" python "$HERE/gpt_study.py" --seeds 0 --corpus tinystories --out "$RUNS/gpt" --results "$RUNS/gpt.md" \
        --set "data.device='$DEVICE'" "${GPT_SET[@]}" > "$RUNS/gpt.log" 2>&1 \
        || say "the GPT study ended with status $? (124: cut at its $gpt_limit s)"
else
    say "GPT study skipped: $gpt_limit s left"
fi

# the results: a few small files
{
    echo "# Device check ($(date -u +%Y-%m-%dT%H:%M:%SZ), $(( SECONDS - start )) s of a $BUDGET s budget)"
    for part in text-tinystories text-wikitext2 gpt; do
        echo
        if [ -f "$RUNS/$part.md" ]; then cat "$RUNS/$part.md"; else echo "## $part: no table (cut short or failed; see log.txt)"; fi
    done
} > "$OUT/summary.md"
for corpus in tinystories wikitext2; do
    [ -f "$RUNS/text/$corpus/lr/overlay.png" ] && cp "$RUNS/text/$corpus/lr/overlay.png" "$OUT/$corpus-overlay.png"
done
[ -f "$RUNS/gpt/study.json" ] && cp "$RUNS/gpt/study.json" "$OUT/gpt-study.json"
for part in text-tinystories text-wikitext2 gpt; do
    [ -f "$RUNS/$part.log" ] && { echo "--- $part (last 40 lines)"; tail -n 40 "$RUNS/$part.log"; } >> "$LOG"
done
say "done"
