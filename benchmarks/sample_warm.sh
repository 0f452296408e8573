#!/usr/bin/env bash
# Where a warm process's start goes: one cold worker fills fresh cache directories, then each warm
# worker runs under sample_start.py (its compile call and its first outputs, sampled).
#
#     bash benchmarks/sample_warm.sh MODEL MODE BACKEND OUTDIR [WARM_RUNS]
#
# Writes OUTDIR/sample-MODEL-MODE-I-BACKEND.txt for each warm run; the workers' own output is
# appended to OUTDIR/sample-log.txt.
set -eu
cd "$(dirname "$0")"
model=$1 mode=$2 backend=$3 out=$4 runs=${5:-2}
dirs=$(mktemp -d)
export CGTREES_CACHE_DIR=$dirs/cgtrees TORCHINDUCTOR_CACHE_DIR=$dirs/inductor TRITON_CACHE_DIR=$dirs/triton
if [ "$backend" = cgtrees-pc ]; then export CGTREES_PRECOMPILE_CACHE=1; fi  # worker.py does inductor-pc's
args=(--workload "$model" --backend "$backend" --mode "$mode")
echo "== $model $mode $backend cold" >>"$out/sample-log.txt"
python3 worker.py "${args[@]}" --phase cold >>"$out/sample-log.txt" 2>&1
for i in $(seq "$runs"); do
  echo "== $model $mode $backend warm $i" >>"$out/sample-log.txt"
  python3 sample_start.py --out "$out/sample-$model-$mode-$i-$backend.txt" -- "${args[@]}" --phase warm \
    >>"$out/sample-log.txt" 2>&1
done
rm -rf "$dirs"
