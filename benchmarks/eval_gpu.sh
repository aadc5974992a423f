#!/usr/bin/env bash
# `oscar eval` on the GPU machine, which reaches no package registry: the packaged model's GGUF travels in
# pieces over back-to-back calls (each call's transfer is capped at 64 MiB), then is reassembled here.
#   bash benchmarks/eval_gpu.sh stage DIR            # a call that only carries pieces: copy DIR/* to /tmp/stage
#   bash benchmarks/eval_gpu.sh run GGUF_NAME [oscar eval args...]
#   bash benchmarks/eval_gpu.sh py GGUF_NAME SCRIPT [args...]   # the same staging, then a python script
# "run" concatenates /tmp/stage/GGUF_NAME.part* (or, for a single model, /tmp/stage/part*; or GGUF_NAME.gz.part*, a
# gzip stream split with `gzip -c GGUF | split -b 57M -d - GGUF_NAME.gz.part`), in name order, into
# $OSCAR_CACHE/gguf/GGUF_NAME (the name the package's
# assets expect; its sha256 is checked where the model is defined), installs carried wheels from .whl/ (gguf),
# unpacks carried texts (*.tgz in the stage), tokenizers (tokenizers*.tgz) and calibrated artifacts (artifacts*.tgz: the
# ones calibrated elsewhere, so the GPU evaluates the same rotations as the CPU) into the cache, and runs
# `python -m oscar_compile eval --device cuda`. Run one `run` (or `py NAME -c pass`) per model first, then evals of
# different models may run side by side (the same model's may not: they would convert its GGUF at once).
# `python3 benchmarks/pack_for_gpu.py MODEL...` makes the folders to stage (build/stage/NN) and prints their calls.
# Make the first staging call alone, the rest after it starts: on 2026-12-06 no machine started, and each of the 29
# calls queued behind the first was refused at 15 s of device time (691 s of the session's 1,800 gone, nothing staged).
# On 2026-12-06 (late) no machine started in 2.7 hours: 20 lone calls, each failed start ~90 s, 1,636 s gone. Space
# retries by the wait the refusal names, and keep the first GPU call small (tests, then the longest job).
# On 2026-12-07 (morning) none started in 2 hours: 14 tries spaced by the named waits, ~90-105 s each, 1,516 s gone
# (after an H200 refusal the next plain call gets an H100 try, which failed as well every time).
set -e
export OSCAR_CACHE=${OSCAR_CACHE:-/tmp/oc} PYTHONUNBUFFERED=1
mkdir -p /tmp/stage "$OSCAR_CACHE/gguf" "$OSCAR_CACHE/text"
case $1 in
  stage) cp "$2"/* /tmp/stage/; ls -la /tmp/stage ;;
  run|py) mode=$1 name=$2; shift 2
       if [ ! -f "$OSCAR_CACHE/gguf/$name" ]; then
         if ls /tmp/stage/"$name".gz.part* > /dev/null 2>&1; then  # gzip stream in pieces: 4-bit GGUFs shrink ~6%,
           cat $(ls /tmp/stage/"$name".gz.part* | sort) | gunzip > "$OSCAR_CACHE/gguf/$name.partial"  # a piece fewer
         else
           cat $(ls /tmp/stage/"$name".part* 2>/dev/null || ls /tmp/stage/part* | sort) > "$OSCAR_CACHE/gguf/$name.partial"
         fi
         mv "$OSCAR_CACHE/gguf/$name.partial" "$OSCAR_CACHE/gguf/$name"
       fi
       # texts.tgz holds texts; tokenizers*.tgz, tokenizers saved by a transformers whose GGUF conversion is right
       mkdir -p "$OSCAR_CACHE/tokenizers" "$OSCAR_CACHE/artifacts"
       for t in /tmp/stage/*.tgz; do
         [ -e "$t" ] || continue
         [ "$t.done" -nt "$t" ] && continue  # unpacked once: evals of several models then start side by side
         case $t in
           */tokenizers*.tgz) tar xzf "$t" -C "$OSCAR_CACHE/tokenizers" ;;
           */artifacts*.tgz) tar xzf "$t" -C "$OSCAR_CACHE/artifacts" ;;
           *) tar xzf "$t" -C "$OSCAR_CACHE/text" ;;
         esac
         touch "$t.done"
       done
       if ls .whl/*.whl > /dev/null 2>&1 && [ ! -d /tmp/site/gguf ]; then
         python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
       fi
       export PYTHONPATH=$PWD:/tmp/site
       if [ "$mode" = py ]; then python3 "$@"; else python3 -m oscar_compile eval --device cuda "$@"; fi ;;
esac
