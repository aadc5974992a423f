#!/usr/bin/env bash
# Issue 18's fidelity table on one H200: packaged models side by side (one process each; a model's own runs one after
# another, or side by side in `all`), many sequences per context so the paired intervals are narrow.
#   MODELS="gemma3-270m smollm2-135m" bash benchmarks/eval_gpu_fidelity.sh probe|short|long|all OUT
# probe: Gemma 3 alone at 2K, 64 sequences x 64 tokens (a few minutes).
# short: 2K, 256 sequences x 64 scored tokens (16,384 a method), every baseline, retrieval at 2K; then the same tokens
#   with the calibration rows all at position 0.
# all: short and long at once (for two models the five processes outgrew the H200's 139 GiB on 2026-12-05 and the
#   long runs died: run short, then long). long: each model's 8K (64 x 128) and, where the model serves it, 32K (20 x 128), with retrieval at that length.
# keys: per-token keys (`default:t`) against per-channel keys over pages of 32 (`default`, since 2026-12-05) and 64
#   tokens (`default:c64`), 2K (256 x 64) and 8K (64 x 128), retrieval at 24 prompts a length.
# ranges: per-channel keys with the check's page range ratios (`default:kr`) against full page ranges (`default`),
#   2K (256 x 64) and 8K (64 x 128), retrieval at 24 prompts a length.
# feedback: the default (keys rounded by error feedback where the artifact has its factors, since 2026-12-06) against
#   plain rounding (`default:nofb`, the backend's key_feedback=False; the 2026-12-06 runs compared `default` before
#   the switch, plain, with `default:fb`), 2K (256 x 64), 8K (64 x 128) and, on Gemma 3, 32K (20 x 128); Qwen2.5-Coder-0.5B at heldout's
#   sizes (128 x 64, 32 x 128, 10 x 128); retrieval at 12 prompts a length
#   (needs artifacts calibrated since 2026-12-06: they carry the feedback factors). CONTEXTS="8192" picks lengths.
# exact: retrieval heads in BF16 (`default:xh`, the backend's exact_heads="auto") against every head INT2
#   (`default:noxh`), retrieval at 36 prompts a length (answer NLL) and perplexity at 8K (32 x 128) and, where the model
#   serves it, 32K (8 x 128; N32 sequences). CONTEXTS picks lengths; 2048: 256 x 64 (Qwen 128 x 64, as feedback).
# heldout: a model none of the method's choices were made on (Qwen2.5-Coder-0.5B): every baseline at 2K (128 x 64),
#   the default and its page range option at 8K (32 x 128), the default at 32K (10 x 128), retrieval at each length.
# fresh: a model measured on the GPU for the first time, as Qwen2.5-Coder-1.5B was on 2026-12-06 (its
#   `eval_*_h100_*k_fresh.json`), one length after another (side by side, three lengths outgrew the H100's 80 GB):
#   2K (64 x 64) with BF16, every head INT2 (`default:noxh`), the default, `oscar`, Hadamard and KIVI-2; 8K (32 x 128)
#   with BF16, KIVI-2, every head INT2 and the default, and retrieval at RSAMPLES x 6 prompts (default 4; ~8 s a
#   prompt a method on the 1.5B, so it needs its own call: that run was stopped in KIVI-2's prompts); 32K (8 x 128)
#   with BF16, every head INT2 and the default. CONTEXTS picks lengths.
# retrieval: retrieval only, BF16, every head INT2 and the default at each of CONTEXTS (default 8192), RSAMPLES x 6
#   prompts (default 2), named *_retrieval<prompts>: Qwen2.5-Coder-1.5B's 8K (RSAMPLES=8) and 32K (2) runs of
#   2026-12-06 (night), side by side (~1.4 s a prompt a method at 8K, ~8 s at 32K). Its 24-prompt 8K file
#   (`*_8k_retrieval.json`) has no BF16: it pairs with the BF16 prompts of its `fresh` 8K run (same seed and draws).
# share: a larger share of retrieval heads in BF16 (`default:xh<SHARE>`, default 1/8) against the default and BF16. Gemma 3:
#   32K (20 x 128, 12 prompts) then 8K (32 x 128, 24 prompts), one after the other (CONTEXTS; 2048: 256 x 64, 48
#   prompts); other models (the 1.5B): retrieval at
#   32K, the share alone on the seed-0 prompts (pairs with its *_32k_retrieval12.json), then BF16, the share and the
#   default on 12 other prompts per seed in RSEEDS (default 1; `--retrieval-seed`); NOSEED0=1 skips the first.
# fp8: the retrieval heads at SHARE in FP8 (`default:xh<SHARE>:x8`, exact_format="fp8") beside BF16 ones, the default
#   and BF16, at CONTEXTS (default 32768: 20 x 128, 12 prompts; 2048: 256 x 64, 48 prompts; others 32 x 128, 24).
# Before it: the pieces of every model's GGUF, texts.tgz, tokenizers*.tgz and artifacts*.tgz (calibrated on the CPU)
# staged with `eval_gpu.sh stage` (see that script). The evals stop LIMIT seconds after the script started (default
# 540, under the call's 600) and what they measured is packed into OUT/results.tgz: a call brings back at most 8 files.
OUT=$2 LIMIT=${LIMIT:-540}
W=$OUT/work
mkdir -p "$W"
MODELS=${MODELS:-"gemma3-270m smollm2-135m qwen2.5-coder-0.5b"}
gguf_of() {
  case $1 in
    gemma3-270m) echo gemma-3-270m-q4_k_m.gguf ;;
    smollm2-135m) echo SmolLM2-135M-Instruct.Q4_1.gguf ;;
    qwen2.5-coder-0.5b) echo qwen2.5-coder-0.5b-instruct-q4_k_m.gguf ;;
    qwen2.5-coder-1.5b) echo qwen2.5-coder-1.5b-instruct-q4_k_m.gguf ;;
  esac
}
E="bash benchmarks/eval_gpu.sh run"
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o "H[0-9]00" | tr H h)
for m in $MODELS; do  # reassemble, unpack and convert once: then a model's runs may start side by side
  bash benchmarks/eval_gpu.sh py "$(gguf_of $m)" -c "from oscar_compile.assets import model_dir; model_dir('$m')" || exit 1
done
# An earlier attempt (2026-12-04) lost the machine six minutes in, cause unknown: host and GPU memory are logged every
# 15 s, and the processes share the 16 cores
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-3}
( while sleep 15; do echo "$(date +%T) $(free -g | awk '/Mem/ {print "host used " $3 " GiB of " $2}') gpu" \
    "$(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader)"; done ) > "$W/memory.log" 2>&1 &
watcher=$!

ALL=bf16,kivi,identity,hadamard,default
short() {  # $1: model
  $E "$(gguf_of $1)" --model "$1" --ppl-contexts 2048 --ppl-sequences 256 --ppl-decode 64 --methods $ALL \
     --retrieval-lengths 2048 --retrieval-samples 2 --out "$W" --name "eval_$1_${CARD}_2k_256seq" > "$W/$1_2k.log" 2>&1
  ls -d "${OSCAR_CACHE:-/tmp/oc}/artifacts/$1-"*"-32768-c"* > /dev/null 2>&1 || return 0  # p0 artifacts not staged
  $E "$(gguf_of $1)" --model "$1" --ppl-contexts 2048 --ppl-sequences 256 --ppl-decode 64 --methods bf16,default \
     --calib-positions 0 --retrieval-lengths "" --out "$W" --name "eval_$1_${CARD}_2k_256seq_p0" > "$W/$1_2k_p0.log" 2>&1
}
long() {  # $1: model, $2: context, $3: sequences, $4: scored tokens each
  $E "$(gguf_of $1)" --model "$1" --ppl-contexts "$2" --ppl-sequences "$3" --ppl-decode "$4" --methods bf16,kivi,default \
     --retrieval-lengths "$2" --retrieval-samples 2 --out "$W" --name "eval_$1_${CARD}_$(($2 / 1024))k_${3}x$4" \
     > "$W/$1_$2.log" 2>&1
}
ranges() {  # $1: model, $2: context, $3: sequences, $4: scored tokens each
  $E "$(gguf_of $1)" --model "$1" --ppl-contexts "$2" --ppl-sequences "$3" --ppl-decode "$4" \
     --methods bf16,default,default:kr --retrieval-lengths "$2" --retrieval-samples 4 --out "$W" \
     --name "eval_$1_${CARD}_$(($2 / 1024))k_ranges" > "$W/$1_$2_ranges.log" 2>&1
}
keys() {  # $1: model, $2: context, $3: sequences, $4: scored tokens each
  $E "$(gguf_of $1)" --model "$1" --ppl-contexts "$2" --ppl-sequences "$3" --ppl-decode "$4" \
     --methods bf16,default:t,default,default:c64 --retrieval-lengths "$2" --retrieval-samples 4 --out "$W" \
     --name "eval_$1_${CARD}_$(($2 / 1024))k_keys" > "$W/$1_$2_keys.log" 2>&1
}
feedback() {  # $1: model, $2: context, $3: sequences, $4: scored tokens each
  $E "$(gguf_of $1)" --model "$1" --ppl-contexts "$2" --ppl-sequences "$3" --ppl-decode "$4" \
     --methods bf16,default:nofb,default --retrieval-lengths "$2" --retrieval-samples 2 --out "$W" \
     --name "eval_$1_${CARD}_$(($2 / 1024))k_feedback" > "$W/$1_$2_feedback.log" 2>&1
}
exact() {  # $1: model, $2: context, $3: sequences, $4: scored tokens each
  $E "$(gguf_of $1)" --model "$1" --ppl-contexts "$2" --ppl-sequences "$3" --ppl-decode "$4" \
     --methods bf16,default:noxh,default:xh --retrieval-lengths "$2" --retrieval-samples ${RSAMPLES:-6} --out "$W" \
     --name "eval_$1_${CARD}_$(($2 / 1024))k_exact" > "$W/$1_$2_exact.log" 2>&1
}
heldout() {  # $1: model, $2: context, $3: sequences, $4: scored tokens each, $5: methods
  $E "$(gguf_of $1)" --model "$1" --ppl-contexts "$2" --ppl-sequences "$3" --ppl-decode "$4" --methods "$5" \
     --retrieval-lengths "$2" --retrieval-samples 2 --out "$W" \
     --name "eval_$1_${CARD}_$(($2 / 1024))k_heldout" > "$W/$1_$2_heldout.log" 2>&1
}
fresh() {  # $1: model, $2: context, $3: sequences, $4: scored tokens each, $5: methods, $6: retrieval lengths
  $E "$(gguf_of $1)" --model "$1" --ppl-contexts "$2" --ppl-sequences "$3" --ppl-decode "$4" --methods "$5" \
     --retrieval-lengths "$6" --retrieval-samples ${RSAMPLES:-4} --out "$W" \
     --name "eval_$1_${CARD}_$(($2 / 1024))k_fresh" > "$W/$1_$2_fresh.log" 2>&1
}
retrieval() {  # $1: model, $2: context, $3: methods (default: BF16, every head INT2, the default), $4: seed (0)
  local seed=${4:-0} tag=${5:-}
  $E "$(gguf_of $1)" --model "$1" --ppl-contexts "" --methods "${3:-bf16,default:noxh,default}" --retrieval-lengths "$2" \
     --retrieval-samples ${RSAMPLES:-2} --retrieval-seed "$seed" --out "$W" \
     --name "eval_$1_${CARD}_$(($2 / 1024))k_retrieval$((${RSAMPLES:-2} * 6))$([ "$seed" = 0 ] || echo "_seed$seed")$tag" \
     > "$W/$1_$2_retrieval_$seed$tag.log" 2>&1
}
share() {  # $1: model, $2: context, $3: sequences, $4: scored tokens each, $5: retrieval samples, $6: more methods,
  # $7: the run's tag (default: share)
  local tag=${7:-share}
  $E "$(gguf_of $1)" --model "$1" --ppl-contexts "$2" --ppl-sequences "$3" --ppl-decode "$4" \
     --methods bf16,default,default:xh${SHARE:-0.125}$6 --retrieval-lengths "$2" --retrieval-samples "$5" --out "$W" \
     --name "eval_$1_${CARD}_$(($2 / 1024))k_$tag" > "$W/$1_$2_$tag.log" 2>&1
}
fp8() {  # the share's methods and its heads in FP8 (:x8); arguments as share's
  share "$1" "$2" "$3" "$4" "$5" ",default:xh${SHARE:-0.125}:x8" fp8heads
}
for m in $MODELS; do
  case $1 in retrieval) for c in ${CONTEXTS:-8192}; do retrieval $m "$c" & done ;; esac
  case $1 in share)
    case $m in
      gemma*) ( for c in ${CONTEXTS:-32768 8192}; do  # one after the other: both side by side outgrow the H100
                  case $c in 32768) share $m 32768 20 128 2 ;; 2048) share $m 2048 256 64 8 ;; *) share $m "$c" 32 128 4 ;; esac
                done ) & ;;
      *) ( [ -z "$NOSEED0" ] && retrieval $m 32768 default:xh${SHARE:-0.125} 0 _share  # pairs with the seed 0 file
           for seed in ${RSEEDS:-1}; do retrieval $m 32768 bf16,default:xh${SHARE:-0.125},default $seed; done ) & ;;
    esac ;;
  esac
  case $1 in fp8)  # the retrieval heads at SHARE in FP8 (:x8) beside BF16 ones, the default and BF16
    ( for c in ${CONTEXTS:-32768}; do
        case $c in 32768) fp8 $m 32768 20 128 2 ;; 2048) fp8 $m 2048 256 64 8 ;; *) fp8 $m "$c" 32 128 4 ;; esac
      done ) & ;;
  esac
  case $1 in heldout)
    heldout $m 2048 128 64 bf16,kivi,identity,hadamard,oscar,default,default:kr &
    heldout $m 8192 32 128 bf16,kivi,default,default:kr & heldout $m 32768 10 128 bf16,default & ;;
  esac
  case $1 in fresh)  # one length after another
    ( for c in ${CONTEXTS:-2048 8192 32768}; do
        case $c in
          2048) fresh $m 2048 64 64 bf16,default:noxh,default,oscar,hadamard,kivi "" ;;
          8192) fresh $m 8192 32 128 bf16,kivi,default:noxh,default 8192 ;;
          *) fresh $m "$c" 8 128 bf16,default:noxh,default "" ;;
        esac
      done ) & ;;
  esac
  case $1 in exact)
    for c in ${CONTEXTS:-8192 32768}; do
      case $m:$c in
        qwen*:2048) exact $m 2048 128 64 & ;;
        *:2048) exact $m 2048 256 64 & ;;
        *:8192) exact $m 8192 32 128 & ;;
        smollm2*:32768) ;;  # not served
        *:32768) exact $m 32768 ${N32:-8} 128 & ;;
      esac
    done ;;
  esac
  case $1 in keys) keys $m 2048 256 64 & keys $m 8192 64 128 & ;; esac
  case $1 in ranges) ranges $m 2048 256 64 & ranges $m 8192 64 128 & ;; esac
  case $1 in feedback)  # the 32K run only where the model serves it (not SmolLM2); Qwen at heldout's sizes (bigger)
    for c in ${CONTEXTS:-2048 8192 32768}; do
      case $m:$c in
        qwen*:2048) feedback $m 2048 128 64 & ;;
        qwen*:8192) feedback $m 8192 32 128 & ;;
        qwen*:32768) feedback $m 32768 10 128 & ;;
        *:2048) feedback $m 2048 256 64 & ;;
        *:8192) feedback $m 8192 64 128 & ;;
        gemma*:32768) feedback $m 32768 20 128 & ;;
      esac
    done ;;
  esac
  case $1 in
    probe) [ $m = gemma3-270m ] && $E "$(gguf_of $m)" --model $m --ppl-contexts 2048 --ppl-sequences 64 --ppl-decode 64 \
             --methods bf16,default --retrieval-lengths "" --out "$W" --name eval_gemma3-270m_h200_2k_64seq \
             > "$W/probe.log" 2>&1 & ;;
  esac
  case $1 in short|all) short $m & ;; esac
  case $1 in long|all)
    case $m in
      smollm2-135m) long $m 8192 64 128 & ;;  # its full context
      *) long $m 8192 64 128 & long $m 32768 20 128 & ;;  # Gemma 3 270M and Qwen2.5-Coder-0.5B serve 32K
    esac ;;
  esac
done
jobs=$(jobs -p | grep -v "^$watcher$")
# LIMIT counts from the script's start: converting two models' GGUFs took ~2 minutes on 2026-12-06, and a limit
# counted after it ran the call past 600 s (the runs' results came back; the packed logs did not)
( sleep $((LIMIT > SECONDS + 30 ? LIMIT - SECONDS : 30)); while true; do pkill -f "oscar_compile eval"; sleep 1; done ) > /dev/null 2>&1 &  # a killed run
# keeps its .partial.json; the loop also stops the runs queued behind it
stopper=$!
wait $jobs
kill $watcher $stopper 2> /dev/null
for f in "$W"/*.log; do echo "== $f"; tr '\r' '\n' < "$f" | grep -E "^ppl  context|^retrieval  |Error|error:" | tail -n 20; done
tail -n 4 "$W/memory.log"
tar czf "$OUT/results-$1.tgz" -C "$W" . && rm -rf "$W"
