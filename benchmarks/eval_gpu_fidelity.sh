#!/usr/bin/env bash
# Issue 18's fidelity table on one H200: three packaged models side by side (one process each; a model's own runs
# one after another), many sequences per context so the paired intervals are narrow.
#   bash benchmarks/eval_gpu_fidelity.sh probe|short|long|full OUT
# probe: Gemma 3 alone at 2K, 64 sequences x 64 tokens (a few minutes): run it first, as the three-model call lost the
# machine once.
# Before it: the pieces of every model's GGUF, texts.tgz, tokenizers.tgz and artifacts*.tgz (calibrated on the CPU,
# rows at 0 and rows spread) staged with `eval_gpu.sh stage` (see that script). Logs and reports land in OUT.
OUT=$2
E="bash benchmarks/eval_gpu.sh run"
G=gemma-3-270m-q4_k_m.gguf S=SmolLM2-135M-Instruct.Q4_1.gguf Q=qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
for g in $G $S $Q; do bash benchmarks/eval_gpu.sh py $g -c pass || exit 1; done  # reassemble and unpack once
# The first attempt (2026-12-04) lost the machine six minutes in, cause unknown: host and GPU memory are logged every
# 15 s, and each process takes 5 of the 16 cores (three at once)
export OMP_NUM_THREADS=5
( while sleep 15; do echo "$(date +%T) $(free -g | awk '/Mem/ {print "host used " $3 " GiB of " $2}') gpu" \
    "$(nvidia-smi --query-gpu=memory.used --format=csv,noheader)"; done ) > "$OUT/memory.log" 2>&1 &
watcher=$!

ALL=bf16,kivi,identity,hadamard,default
short() {  # 2K: 256 sequences x 64 scored tokens (16,384 a method); then the same tokens with calibration rows at 0
  $E "$1" --model "$2" --ppl-contexts 2048 --ppl-sequences 256 --ppl-decode 64 --methods $ALL \
     --retrieval-lengths 2048 --retrieval-samples 2 --out "$OUT" --name "eval_$2_h200_2k_256seq" > "$OUT/$2_2k.log" 2>&1
  $E "$1" --model "$2" --ppl-contexts 2048 --ppl-sequences 256 --ppl-decode 64 --methods bf16,default \
     --calib-positions 0 --retrieval-lengths "" --out "$OUT" --name "eval_$2_h200_2k_256seq_p0" > "$OUT/$2_2k_p0.log" 2>&1
}
long() {  # $3: context, $4: sequences
  $E "$1" --model "$2" --ppl-contexts "$3" --ppl-sequences "$4" --ppl-decode 64 --methods bf16,kivi,default \
     --retrieval-lengths "$3" --retrieval-samples 2 --out "$OUT" --name "eval_$2_h200_$(($3 / 1024))k_${4}seq" \
     > "$OUT/$2_$3.log" 2>&1
}
case $1 in
  probe) $E $G --model gemma3-270m --ppl-contexts 2048 --ppl-sequences 64 --ppl-decode 64 --methods bf16,default \
         --retrieval-lengths "" --out "$OUT" --name eval_gemma3-270m_h200_2k_64seq > "$OUT/probe.log" 2>&1 & ;;
  short) short $G gemma3-270m & short $S smollm2-135m & short $Q qwen2.5-coder-0.5b & ;;
  long) long $G gemma3-270m 8192 64 & long $S smollm2-135m 8192 64 &
        { long $Q qwen2.5-coder-0.5b 8192 64; long $Q qwen2.5-coder-0.5b 32768 16; } & ;;
  full) long $G gemma3-270m 32768 20 & ;;
esac
wait $(jobs -p | grep -v "^$watcher$")
kill $watcher
tail -n 25 "$OUT"/*.log
