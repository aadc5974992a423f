#!/usr/bin/env bash
# One device call: per-channel decode attention in blocks of 1, 2 and 4 pages with 4 or 8 warps, the scale folded into
# the query or the keys dequantized (d = 128, pages of 32, against the fastest BF16 SDPA of the same run), and the
# per-channel GPU tests (they run the default blocks); with EVAL=1, after the Gemma 3 pieces were staged
# (eval_gpu.sh stage, back-to-back calls), eval_gpu_fidelity.sh keys on Gemma 3 for LIMIT seconds.
#   OUT=... [EVAL=1 LIMIT=420] bash benchmarks/gpu_channel_blocks.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/oscar-gpu}
mkdir -p "$OUT"
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o "H[0-9]00" | tr H h)
timeout 150 python3 benchmarks/bench_decode.py --key-formats channel --no-store --shapes 1x32768,1x131072,32x8192,64x4096 \
  --configs '[{"block_n": 32}, {"block_n": 64, "page_warps": 4}, {"block_n": 128, "page_warps": 4}, {"block_n": 128, "page_warps": 8}, {"block_n": 64, "page_warps": 4, "channel_fold": false}, {"block_n": 128, "page_warps": 8, "channel_fold": false}]' \
  --name "decode_attention_${CARD:-gpu}_channel_blocks" --out "$OUT" 2>&1 | grep "keys:" | cut -c1-300
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_key_channel.py -k gpu 2>&1 | tail -n 3
[ -n "$EVAL" ] && MODELS=gemma3-270m LIMIT=${LIMIT:-420} bash benchmarks/eval_gpu_fidelity.sh keys "$OUT"
