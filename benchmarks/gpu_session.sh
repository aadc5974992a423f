#!/usr/bin/env bash
# One device call: GPU tests, then the decode-attention benchmark; results land in $OUT (or /tmp/oscar-gpu).
# Usage: bash benchmarks/gpu_session.sh [gluon|store|tests|fuzz|gate|bench|probe|e2e|tp|ncu|ncusrc|ncug]...   (default: tests bench)
#   gate: gpu_gate.sh (every GPU test in four shards and the fuzz at once; "tests" alone is one slow process)
#   store: Triton store vs reference, per dtype/clip/path; probe: per-kernel profile + PROBE_CONFIGS (JSON list)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/oscar-gpu}
mkdir -p "$OUT"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
DEFAULT_NCU='{};{"ablate": 1};{"ablate": 4}'  # NCU_CONFIGS: kernel options, ';'-separated
DEFAULT_GLUON='[{"warps": 4, "tiles": 1}]'  # GLUON_CONFIGS: JSON list (a '}' inside ${VAR:-...} ends the expansion)
DEFAULT_PROBE='[{"page_warps": 4}, {"page_warps": 2, "splits": 2.0}]'  # the old default; a candidate
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"
for step in "${@:-tests bench}"; do for s in $step; do
  echo "=== $s ($(date +%T))"
  case $s in
    gluon) timeout ${GLUON_TIMEOUT:-150} python3 benchmarks/check_gluon_decode.py --configs "${GLUON_CONFIGS:-$DEFAULT_GLUON}" \
             --out "$OUT/gluon_decode_h200.json" 2>&1 | grep -v "Warn\|warn_once" | grep -v "check case.*ok$" | tee "$OUT/gluon.log" ;;
    testsfuzz|gate) bash "$(dirname "$0")/gpu_gate.sh" ;;  # every GPU test in shards + the fuzz, at once
    store) timeout 90 python3 benchmarks/check_store_gpu.py 2>&1 | tee "$OUT/store.log" ;;
    probe) timeout ${PROBE_TIMEOUT:-150} python3 benchmarks/bench_decode.py --profile --no-store --name decode_probe --out "$OUT" \
             --configs "${PROBE_CONFIGS:-$DEFAULT_PROBE}" ${PROBE_SHAPES:+--shapes $PROBE_SHAPES} 2>&1 | tee "$OUT/probe.log" ;;
    tests) timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/passes --ignore=tests/passes/test_explain.py -k "not fuzz ${TESTS_K:+and $TESTS_K}" 2>&1 | tee "$OUT/tests.log" | tail -25 ;;
    fuzz) for i in $(seq 0 15); do  # one process per shard (FUZZ_SHARDS = 16, FUZZ_CASES = 512 in the test): compiles in parallel
            timeout ${FUZZ_TIMEOUT:-400} python3 -m pytest -q -s -m gpu -p no:cacheprovider \
              "tests/kernels/test_triton_kernels.py::test_fuzz_500_cases_gpu[$i]" > "$OUT/fuzz$i.log" 2>&1 &
          done; wait
          echo "fuzz cases passed: $(cat "$OUT"/fuzz*.log | grep -c "fuzz case ok") of 512; shards passed: $(grep -l " passed" "$OUT"/fuzz*.log | wc -l) of 16"
          grep -h -B2 -A6 "AssertionError: fuzz case\|Error" "$OUT"/fuzz*.log | grep -v DEBUG | head -40 ;;
    ncu) : > "$OUT/ncu.txt"
         # one process per (shape, config): the page region is the 3rd _attn_kernel launch (2 calls x 2 regions)
         for shape in ${NCU_SHAPES:-32x32768 1x131072}; do IFS=';' read -ra cfgs <<< "${NCU_CONFIGS:-$DEFAULT_NCU}"; for cfg in "${cfgs[@]}"; do
           PYTHONPATH=$PWD:$PWD/benchmarks timeout 100 "$NCU" --clock-control none --kernel-name _attn_kernel \
             --launch-skip 2 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
             --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
             --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum" \
             python3 benchmarks/ncu_pages.py --shapes $shape --configs "[$cfg]" >> "$OUT/ncu.txt" 2>&1
         done; done
         grep -E "profiled|==ERROR==|_attn_kernel|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Issued Warp|No Eligible|stalled_(long_scoreboard|short_scoreboard|mio_throttle|barrier|wait|math_pipe_throttle|lg_throttle|not_selected|dispatch_stall|no_instruction)|bank_conflicts" "$OUT/ncu.txt" | head -150 ;;
    ncug) : > "$OUT/ncug.txt"  # the Gluon page kernel: one launch per attention call, the 2nd call's is profiled
         for shape in ${NCU_SHAPES:-32x32768 1x131072}; do  # the kernel as OSCAR_GLUON_CONFIG sets it
           PYTHONPATH=$PWD:$PWD/benchmarks timeout 100 "$NCU" --clock-control none --kernel-name _page_decode_kernel \
             --launch-skip 1 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
             --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
             --section InstructionStats python3 benchmarks/ncu_pages.py --shapes $shape >> "$OUT/ncug.txt" 2>&1
         done
         grep -E "profiled|==ERROR==|_page_decode_kernel|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Achieved Occupancy|Theoretical Occupancy|Registers Per|Warp Cycles Per Issued|Issued Warp|Issue Slots Busy|No Eligible|Executed Ipc" "$OUT/ncug.txt" | head -60
         PYTHONPATH=$PWD:$PWD/benchmarks timeout 150 "$NCU" --clock-control none --kernel-name _page_decode_kernel --launch-skip 1 \
           --launch-count 1 --set full --import-source yes -o "$OUT/gpages" -f python3 benchmarks/ncu_pages.py --shapes 32x32768 > /dev/null 2>&1
         "$NCU" -i "$OUT/gpages.ncu-rep" --page source --print-source sass --csv > "$OUT/gpages_sass.csv" 2>&1
         python3 benchmarks/ncu_summary.py "$OUT/gpages_sass.csv" ;;
    ncusrc)  # per-SASS-instruction counters (shared-memory wavefronts, bank conflicts, stalls) of the page region at 32 x 32K
         PYTHONPATH=$PWD:$PWD/benchmarks timeout 150 "$NCU" --clock-control none --kernel-name _attn_kernel --launch-skip 2 \
           --launch-count 1 --set full --import-source yes -o "$OUT/pages" -f python3 benchmarks/ncu_pages.py --shapes 32x32768 --configs '[{}]'
         "$NCU" -i "$OUT/pages.ncu-rep" --page source --print-source sass --csv > "$OUT/pages_sass.csv" 2>&1
         "$NCU" -i "$OUT/pages.ncu-rep" --page details > "$OUT/pages_details.txt" 2>&1
         python3 benchmarks/ncu_summary.py "$OUT/pages_sass.csv"; grep -i "bank\|excessive" "$OUT/pages_details.txt" | head -20 ;;
    bench) timeout ${BENCH_TIMEOUT:-210} python3 benchmarks/bench_decode.py ${BENCH_ARGS:---profile} --out "$OUT" 2>&1 | tee "$OUT/bench.log" | grep -v "^    " ;;
    tp)  # tp_gpu.py at world size ${TP_WORLD:-1}: oscar and BF16 per shape (TP_SHAPES, BxL), one process each
         for shape in ${TP_SHAPES:-1x131072 32x8192}; do for cfg in ${TP_CONFIGS:-oscar bf16}; do
           timeout ${TP_TIMEOUT:-280} torchrun --nproc-per-node ${TP_WORLD:-1} benchmarks/tp_gpu.py --model llama3-8b \
             --weights /tmp/oscar-tp-llama3-8b --batch ${shape%x*} --prompt ${shape#*x} --config $cfg \
             --out "$OUT/tp_h200.jsonl" > "$OUT/tp_${cfg}_$shape.log" 2>&1
           grep "^{" "$OUT/tp_${cfg}_$shape.log" || grep -v "Warn\|warn" "$OUT/tp_${cfg}_$shape.log" | tail -8
         done; done ;;
    e2e) timeout 400 python3 benchmarks/e2e_gpu.py --models "${E2E_MODELS:-smollm2,llama3-8b:8}" --configs "${E2E_CONFIGS:-int2,eager}" \
           --config-timeout 120 --out "$OUT/e2e_h200.json" 2>&1 | tee "$OUT/e2e.log" | grep "^{" ;;
  esac
done; done
echo "=== done ($(date +%T))"
