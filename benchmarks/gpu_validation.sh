#!/usr/bin/env bash
# The bridge's validation end to end on one CUDA GPU, in about an hour:
#   1. SGD on the default Markov chain (batch 8192) beside the finite-s ODE of the same start;
#   2. the one-layer model on WikiText-2 and TinyStories at lr and lr/2 beside their full-vocabulary
#      bigram surrogates (benchmarks/text_validation.py; the longest part);
#   3. the GPT-family study (mlp / glu x plain / Q/K schedule / smoothing, 3 seeds) at
#      8 layers, width 256, bf16 autocast.
# Needs flowsim installed with the bridge extra and the corpora (data.data_dir or
# $FLOWSIM_DATA_DIR). Usage: bash benchmarks/gpu_validation.sh [OUT]   (default runs/gpu-validation)
set -euo pipefail
OUT=${1:-runs/gpu-validation}
CUDA=(--set data.device=cuda)
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device here'; print('device:', torch.cuda.get_device_name())"
start=$SECONDS

flowsim bridge train configs/bridge/markov-default.toml --out "$OUT/markov" "${CUDA[@]}" --set data.batch_size=8192 --quiet
flowsim bridge compare "$OUT/markov"
# the text validation in the flow regime: lr 20x below the CPU configs' (4e5 and 8e5 steps), large batches
python benchmarks/text_validation.py --out "$OUT/text" "${CUDA[@]}" --set optim.lr=0.0025 --set optim.steps=400000 \
    --set data.batch_size=4096
echo "one-layer validation: $((SECONDS - start)) s"

python benchmarks/gpt_study.py --out "$OUT/gpt" "${CUDA[@]}" --set model.n_layer=8 --set model.d_model=256 \
    --set model.n_head=8 --set data.batch_size=64 --set optim.steps=2000
echo "total: $((SECONDS - start)) s"
