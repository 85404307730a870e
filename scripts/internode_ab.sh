#!/usr/bin/env bash
# The internode benchmark of this tree against another tree's `src`, in alternating pairs of processes on one machine
# (a machine's host speed varies by 20-50% from process to process, the first after its start the slowest: NOTES rows
# 121-135), after a short warm-up process; then each run's traffic model at EP64 from that run's own host terms.
#
#   AB_BASE=DIR scripts/internode_ab.sh OUT_DIR
#
# DIR holds the other tree's src (`git archive <commit> src | tar -x -C DIR`). Environment: AB_PAIRS (default 2),
# AB_ARGS (default "--iters 4 --rounds 1 --routings uniform"), AB_WORLD (default every GPU), AB_NVLINK (the model's
# intranode GB/s, default 322), AB_WARMUP=0 to skip the warm-up process. The ranks are split into 2 simulated nodes
# (EPCOMM_RANKS_PER_NODE, default half of them) with NCCL's socket transport between them (NCCL_NET=Socket).
# Writes OUT_DIR/internode_ab_{head,base}_N.{csv,md,log} and OUT_DIR/summary.txt (each run's EP64 rows).
set -u
OUT=${1:?usage: AB_BASE=DIR scripts/internode_ab.sh OUT_DIR}
BASE=${AB_BASE:?AB_BASE: a directory holding the src of the other tree}
HERE=$(pwd)
WS=${AB_WORLD:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export EPCOMM_RANKS_PER_NODE=${EPCOMM_RANKS_PER_NODE:-$(( WS / 2 ))} NCCL_NET=${NCCL_NET:-Socket}
ARGS=${AB_ARGS:---iters 4 --rounds 1 --routings uniform}
mkdir -p "$OUT"

bench() {  # SRC NAME [ARGS...]: one benchmark process with SRC first on the path
  local src=$1 name=$2
  shift 2
  PYTHONPATH="$src" python3 -m epcomm bench internode --world-size "$WS" --out "$OUT" --name "$name" "$@" \
    >"$OUT/$name.log" 2>&1
  echo "$name: rc=$?" | tee -a "$OUT/summary.txt"
}

if [ "${AB_WARMUP:-1}" != 0 ]; then  # (compiles the kernels, starts NCCL and the host once: not measured)
  bench "$HERE/src" warmup --tokens 512 --hidden 2048 --iters 1 --rounds 1 --routings uniform
  rm -f "$OUT"/warmup.csv "$OUT"/warmup.md
fi
for i in $(seq 1 "${AB_PAIRS:-2}"); do
  order="head base"
  [ $((i % 2)) = 0 ] && order="base head"
  for tree in $order; do
    src="$HERE/src"
    [ "$tree" = base ] && src="$BASE/src"
    # shellcheck disable=SC2086
    bench "$src" "internode_ab_${tree}_$i" $ARGS
  done
done
for f in "$OUT"/internode_ab_*.csv; do  # each run's model, from its own host terms
  [ -e "$f" ] || continue
  n=$(basename "$f" .csv)
  PYTHONPATH="$HERE/src" python3 -m epcomm bench internode --model-only --costs-from "$f" \
    --nvlink-gbps "${AB_NVLINK:-322}" --out "$OUT/model_$n" --name model >/dev/null 2>&1
  PYTHONPATH="$HERE/src" python3 - "$OUT/model_$n/model.csv" "$f" "$n" <<'PY' | tee -a "$OUT/summary.txt"
import csv
import sys

model, run, name = sys.argv[1:]
rows = [r for r in csv.DictReader(open(model)) if r["EP"] == "64"]
print(f"{name}: EP64, host ahead: " + "; ".join(
    f'{r["routing"]} {r["op"]} {float(r["NIC share (host ahead)"]):.1%} ({r["chunks (host ahead)"]} chunks)'
    for r in rows))
# the host terms the exact rows hang on: the first routing's 'by phase' rows of the BF16 dispatch, us
runs = list(csv.DictReader(open(run)))
terms = {(r["impl"], r["op"]): r["time_us"] for r in runs if r["routing"] == runs[0]["routing"]}
for impl in ("1 chunk", "1 chunk, no head", "4 chunks, no head"):
    got = [f'{what} {float(terms[key]):.0f}' for what, op in (
        ("count exchange (host ahead)", "counts of both legs, host ahead"),
        ("lead", "host from the count read to the first rows"), ("host after the read", "host after the count read"))
        for key in [(f"hierarchical, {impl}, by phase", f"dispatch BF16: {op}")] if terms.get(key)]
    steps = [f'{op[len("dispatch BF16: lead: "):]} {float(us):.0f}' for (mode, op), us in terms.items()
             if mode == f"hierarchical, {impl}, by phase" and op.startswith("dispatch BF16: lead: ") and float(us)]
    if got:
        print(f"    {impl}: " + ", ".join(got) + (f" (lead by step: {'; '.join(steps)})" if steps else ""))
PY
done
