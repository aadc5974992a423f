#!/usr/bin/env bash
# The next GPU call for the FP8 heads' read (README, "FP8 retrieval heads, the storage"): bench_fp8_ring.py on this
# revision (FP8 rows in loops of their own, scales outside the dots) and on 65dba96 (the revision the full-depth
# e2e rows were timed with), same machine; with WITH_F16=1 also the f16-decode variant of the old one. Make and carry
# the old file:
#   git show 65dba96:oscar_compile/kernels/triton_attention.py > build/attention_65dba96.py
#   bash benchmarks/gpu_fp8_read.sh          (carry build/attention_65dba96.py and .whl; at most ~8 minutes, fits one call;
#                                            results under $OUT)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
nvidia-smi --query-gpu=name --format=csv,noheader
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o "H[0-9][0-9]*" | head -1 | tr H h)  # h100 or h200
[ -f build/attention_65dba96.py ] || { echo "build/attention_65dba96.py missing (see the top of this script)"; exit 1; }
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1  # carry .whl too
[ -n "$SKIP_TESTS" ] || { echo "=== FP8 ring tests on the GPU (the new loops and the per-channel flush: checked only in the interpreter)"
PYTHONPATH=$PWD:/tmp/site timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_ring.py \
  tests/passes/test_exact_heads.py -k "fp8 or gather or ring" 2>&1 | tail -6; }  # SKIP_TESTS=1 after gpu_gate.sh, which runs them
echo "=== this revision"
timeout 200 python3 benchmarks/bench_fp8_ring.py --shapes 64x8192,1x131072 --out "$OUT/bench_fp8_ring_${CARD:-gpu}.json" 2>&1 \
  | grep -v Warning
echo "=== 65dba96"
timeout 150 python3 benchmarks/bench_fp8_ring.py --shapes 64x8192,1x131072 --splits 0,16 --warps 0 \
  --attention-from build/attention_65dba96.py --out "$OUT/bench_fp8_ring_65dba96_${CARD:-gpu}.json" 2>&1 | grep -v Warning
[ -n "$WITH_F16" ] || exit 0  # the f16-decode variant of the old read only on request (device time)
echo "=== 65dba96, fp16 decode of the FP8 rows"
timeout 120 python3 benchmarks/bench_fp8_ring.py --shapes 64x8192 --splits 0 --warps 0 --load f16 \
  --attention-from build/attention_65dba96.py 2>&1 | grep -v Warning | grep fp8
