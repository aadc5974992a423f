#!/usr/bin/env bash
# One device call that gates a kernel change: every GPU test (four pytest shards, with those of test_evaluation.py and
# test_key_channel.py: Gemma 3's geometry against eager, CUDA against the CPU for per-channel keys) and the 512-case fuzz
# (16 shards), all at once (~4 minutes on the H200). Logs land in $OUT (or /tmp/oscar-gpu).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/oscar-gpu}
mkdir -p "$OUT"
SHARDS=("test_decode_page_kernels_gpu" "test_full_shapes_gpu or two_warps"
        "4000 or launch_shapes or bool_mask or int32 or non_finite")
REST="not ($(IFS='|'; echo "${SHARDS[*]}" | sed 's/|/ or /g'))"
i=0
for k in "${SHARDS[@]}" "$REST"; do
  timeout ${GATE_TIMEOUT:-540} python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/passes \
    tests/test_evaluation.py tests/test_key_channel.py \
    --ignore=tests/passes/test_explain.py -k "not fuzz and ($k)" > "$OUT/t$i.log" 2>&1 &
  i=$((i + 1))
done
FUZZ_TIMEOUT=${GATE_TIMEOUT:-540} bash "$(dirname "$0")/gpu_session.sh" fuzz 2>&1 | tail -30
wait
for j in $(seq 0 $((i - 1))); do echo "--- tests shard $j"; grep -E "passed|failed|Error|FAILED" "$OUT/t$j.log" | tail -8; done
