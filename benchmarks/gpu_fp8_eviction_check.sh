#!/usr/bin/env bash
# The next GPU call for the FP8 ring's eviction NaN (an H100, 2026-12-07; see probe_fp8_eviction_gpu.py): the probe on
# the code as it is (the store decodes FP8 with Triton's fp8 conversion), then with fp8_integer_decode.patch applied
# (the store and attention decode e4m3 codes by integer arithmetic, exact against torch for all 256 codes in the
# interpreter; the quantize=True refusal lifted and the INT2 cases of test_fp8_ring.py back), the probe again and the
# FP8 tests on it (test_exact_heads' fp8 cases include a compiled model on CUDA). The patch is reverted at the end.
# If the patched probe is clean and the tests pass, apply the patch for good.
#   bash benchmarks/gpu_fp8_eviction_check.sh          (carry .whl; add a build/stage/00 to stage it in the same call)
[ -d build/stage/00 ] && bash benchmarks/eval_gpu.sh stage build/stage/00 > /dev/null && echo "staged 00"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
echo "=== probe, fp8 conversion"; timeout 100 python3 benchmarks/probe_fp8_eviction_gpu.py 2>&1 | tail -30
git apply benchmarks/fp8_integer_decode.patch && echo "=== patched: integer decode"
echo "=== probe, integer decode"; timeout 60 python3 benchmarks/probe_fp8_eviction_gpu.py 2>&1 | tail -30
echo "=== tests, integer decode"; timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_ring.py \
  tests/passes/test_exact_heads.py -k "fp8 or gather" 2>&1 | tail -25
git apply -R benchmarks/fp8_integer_decode.patch
