#!/usr/bin/env bash
# Per-channel keys (key_format="channel") on the GPU, in one device call: their tests, the gate of every other GPU test
# (the page kernels they share changed), then decode attention and store timings of both key formats (d = 128, pages
# of 32 for per-channel keys, 16 per token) against the fastest BF16 SDPA backend of the same run; per-channel keys
# also in other blocks (`block_n`: 32 is one page a block).
#   OUT=... bash benchmarks/gpu_channel_keys.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/oscar-gpu}
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o "H[0-9]00" | tr H h)  # result names
mkdir -p "$OUT"
( timeout "${GATE_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_key_channel.py \
    tests/test_key_channel.py -k "gpu or small or cuda or choice or debias or graph" > "$OUT/channel_tests.log" 2>&1 ) &
GATE_TIMEOUT=${GATE_TIMEOUT:-420} bash "$(dirname "$0")/gpu_gate.sh" > "$OUT/gate.log" 2>&1
wait
echo "== per-channel key tests"; grep -E "passed|failed|Error|FAILED" "$OUT/channel_tests.log" | tail -12
echo "== gate"; tail -n 30 "$OUT/gate.log"
# per-channel keys in blocks of one page (32), two pages and eight, beside the default (CHANNEL_BLOCK_N: four)
python3 benchmarks/bench_decode.py --key-formats token,channel --name decode_attention_${CARD:-gpu}_key_formats --out "$OUT" \
  --configs '[{"block_n": 32}, {"block_n": 64}, {"block_n": 256}]' \
  2>&1 | grep -v "^  warn" | tee "$OUT/bench.log" | cut -c1-400
python3 benchmarks/bench_decode.py --key-formats token,channel --as-model --no-store \
  --name decode_attention_${CARD:-gpu}_key_formats_as_model --out "$OUT" 2>&1 | tee "$OUT/bench_as_model.log" | cut -c1-400
[ -n "$DEBIAS" ] && python3 benchmarks/bench_decode.py --key-formats token,channel --debias 1 --no-store \
  --name decode_attention_${CARD:-gpu}_key_formats_debias --out "$OUT" 2>&1 | tee "$OUT/bench_debias.log" | cut -c1-400
