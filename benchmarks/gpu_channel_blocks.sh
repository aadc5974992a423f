#!/usr/bin/env bash
# One device call: per-channel decode attention by the Gluon kernel and by the Triton page kernel in blocks of 1, 2 and
# 4 pages (d = 128, pages of 32, against the fastest BF16 SDPA of the same run), and the per-channel GPU tests with
# either kernel (~8 minutes). With EVAL=1 instead, after the Gemma 3 pieces were staged (eval_gpu.sh stage,
# back-to-back calls): eval_gpu_fidelity.sh keys on Gemma 3 for LIMIT seconds (per-token against per-channel keys).
#   OUT=... [EVAL=1 LIMIT=540] bash benchmarks/gpu_channel_blocks.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/oscar-gpu}
mkdir -p "$OUT"
if [ -n "$EVAL" ]; then MODELS=${MODELS:-gemma3-270m} LIMIT=${LIMIT:-540} bash benchmarks/eval_gpu_fidelity.sh keys "$OUT"; exit; fi
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o "H[0-9]00" | tr H h)
echo "== per-channel GPU tests with the Gluon decode kernel (OSCAR_GLUON_KEY_CHANNEL=1)"
OSCAR_GLUON_KEY_CHANNEL=1 timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_key_channel.py \
  -k gpu -x > "$OUT/gluon_tests.log" 2>&1
rc=$?
grep -E "passed|failed|Error|error|assert" "$OUT/gluon_tests.log" | tail -n 12
[ $rc = 0 ] || export OSCAR_GLUON_KEY_CHANNEL=0  # the bench's default kernel for these rows, if it passed
echo "== full shapes with the Triton page kernel"
OSCAR_GLUON_KEY_CHANNEL=0 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_key_channel.py \
  -k full_shapes 2>&1 | tail -n 2
# decode attention: the default kernel (Gluon if its tests passed), the Triton page kernel as configs
timeout 170 python3 benchmarks/bench_decode.py --key-formats channel --no-store \
  --shapes 1x32768,1x131072,32x8192,64x4096,32x32768 \
  --configs '[{"page_kernel": "triton"}, {"page_kernel": "triton", "block_n": 32}, {"page_kernel": "triton", "block_n": 64, "page_warps": 4}, {"page_kernel": "triton", "block_n": 128, "page_warps": 8}, {"page_kernel": "triton", "block_n": 64, "page_warps": 4, "channel_fold": false}]' \
  --name "decode_attention_${CARD:-gpu}_channel_gluon" --out "$OUT" 2>&1 | grep "keys:" | cut -c1-300
