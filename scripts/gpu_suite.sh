#!/usr/bin/env bash
# Runs every GPU test and benchmark in one call and writes logs and results under $OUT (default ./gpu-out).
#
#   scripts/gpu_suite.sh [stage ...]      (no stage: all of them)
#
# Stages: info, tests, bench-dispatch, bench-low-latency, bench-p2p, bench-allgather, bench-internode, demo,
# and (not run by default) bench-layer (the MoE layer on every GPU), layer-1gpu (the MoE layer on one GPU:
# one rank, then EPCOMM_RANKS_PER_GPU ranks sharing it; LAYER_ARGS adds arguments to both) and bench-internode-ab
# (scripts/internode_ab.sh: bench-internode of this tree against AB_BASE, a directory holding another tree's src, in
# alternating pairs of processes after a warm-up one, with each run's EP64 model rows in results/ab/summary.txt)
# Environment: TESTS (paths), TEST_FILTER (a pytest -k expression), PYTEST_ARGS, TEST_TIMEOUT (per test, s),
# STAGE_TIMEOUT (per stage, s), DISPATCH_ARGS / LL_ARGS / INTERNODE_ARGS (extra benchmark arguments; INTERNODE_ARGS
# defaults to --rounds 3: the socket link between simulated nodes drifts).
# bench-internode splits the ranks into 2 simulated nodes (EPCOMM_RANKS_PER_NODE, default half the ranks), each
# with its own NCCL_HOSTID and NCCL_NET=Socket, so that NCCL moves the bytes between them through its network path.
# EPCOMM_RANKS_PER_GPU=N (N > 1; default 4 on a machine with one GPU): up to N ranks share each GPU (tests of
# 2-8 ranks on fewer GPUs); an MPS server runs for the whole call so that the ranks' kernels run at the same
# time. Their CUDA collectives are gloo's; with EPCOMM_RANKS_PER_NODE and EPCOMM_RAIL_NCCL=1 the groups between the
# simulated nodes are NCCL's all the same (each node its own NCCL_HOSTID: NCCL's network path between them; the
# test suites' sizes only: DeepSeek-sized calls stalled so). The benchmark stages then skip (their timings would not
# be NVLink's) unless BENCH_SHARED=1 (smoke runs, world size GPUs x N); the demo runs with GPUs x N ranks.
# Results land in $OUT/results/ (CSV, Markdown, PNG) and are also packed into $OUT/results.tar.gz;
# each stage's log is $OUT/logs/<stage>.log; $OUT/summary.txt says which stages passed.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$(pwd)/src${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$(pwd)/gpu-out}"
mkdir -p "$OUT/logs" "$OUT/results"
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "$NGPU" -eq 1 ] && [ -z "${EPCOMM_RANKS_PER_GPU:-}" ]; then
  export EPCOMM_RANKS_PER_GPU=4 && echo "one GPU: up to 4 ranks share it (EPCOMM_RANKS_PER_GPU=4)"
fi
SHARE=${EPCOMM_RANKS_PER_GPU:-1}
WS=$(( NGPU * SHARE ))
if [ "$SHARE" -gt 1 ]; then
  MPS=$(command -v nvidia-cuda-mps-control || ls /usr/local/nvidia/bin/nvidia-cuda-mps-control 2>/dev/null)
  if [ -n "$MPS" ]; then
    export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
    "$MPS" -d && trap 'echo quit | "$MPS"' EXIT && echo "MPS server started for $SHARE ranks per GPU"
  else
    echo "no MPS server: the ranks sharing a GPU are time-sliced (slow synchronisation)"
  fi
fi
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(info tests bench-dispatch bench-low-latency bench-p2p bench-allgather bench-internode demo)
RES="$OUT/results"

run_stage() {
  local name=$1; shift
  local t0=$(date +%s)
  echo "=== $name: $*" | tee -a "$OUT/summary.txt"
  if timeout "${STAGE_TIMEOUT:-900}" "$@" >"$OUT/logs/$name.log" 2>&1; then
    echo "    PASS ($(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
  else
    echo "    FAIL rc=$? ($(( $(date +%s) - t0 )) s); last lines:" | tee -a "$OUT/summary.txt"
    tail -n 25 "$OUT/logs/$name.log" | sed 's/^/      /' | tee -a "$OUT/summary.txt"
  fi
}

for stage in "${STAGES[@]}"; do
  if [ "$SHARE" -gt 1 ] && [ "${BENCH_SHARED:-0}" != 1 ] && [[ "$stage" == bench-* ]]; then
    echo "=== $stage: skipped, $SHARE ranks share each GPU (no NVLink timings; BENCH_SHARED=1 runs it anyway)" \
      | tee -a "$OUT/summary.txt"
    continue
  fi
  case "$stage" in
    info) run_stage info bash -c "nvidia-smi; nvidia-smi topo -m; python3 -c 'import torch,triton;print(torch.__version__,triton.__version__,torch.cuda.nccl.version())'; if [ $SHARE -gt 1 ]; then CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / SHARE)) python3 -c 'import torch; print(\"SMs seen by a rank sharing its GPU:\", torch.cuda.get_device_properties(0).multi_processor_count)'; fi; true" ;;
    tests) KARGS=(); [ -n "${TEST_FILTER:-}" ] && KARGS=(-k "$TEST_FILTER")
           run_stage tests python3 -m pytest ${TESTS:-tests} -m gpu -v -p no:cacheprovider --timeout=${TEST_TIMEOUT:-300} -rfEs --instafail "${KARGS[@]}" ${PYTEST_ARGS:-} ;;
    bench-dispatch) run_stage bench-dispatch python3 -m epcomm bench dispatch --world-size "$WS" --out "$RES" ${DISPATCH_ARGS:-} ;;
    bench-low-latency) run_stage bench-low-latency python3 -m epcomm bench low-latency --world-size "$WS" --out "$RES" ${LL_ARGS:-} ;;
    bench-p2p) run_stage bench-p2p python3 -m epcomm bench p2p --world-size "$WS" --out "$RES" ;;
    bench-allgather) run_stage bench-allgather python3 -m epcomm bench allgather --world-size "$WS" --out "$RES" ;;
    bench-internode) run_stage bench-internode env EPCOMM_RANKS_PER_NODE="${EPCOMM_RANKS_PER_NODE:-$(( WS / 2 ))}" \
                       NCCL_NET="${NCCL_NET:-Socket}" python3 -m epcomm bench internode --world-size "$WS" \
                       --out "$RES" ${INTERNODE_ARGS:---rounds 3} ;;
    bench-internode-ab) run_stage bench-internode-ab bash scripts/internode_ab.sh "$RES/ab" ;;
    bench-layer) run_stage bench-layer python3 examples/train_moe.py --bench --world-size "$WS" --out "$RES" ${LAYER_ARGS:-} ;;
    layer-1gpu) run_stage layer-1gpu bash -c "python3 examples/train_moe.py --bench --single-gpu --world-size 1 --out '$RES' ${LAYER_ARGS:-} && if [ $SHARE -gt 1 ]; then python3 examples/train_moe.py --bench --single-gpu --world-size $SHARE --out '$RES' ${LAYER_ARGS:-}; fi" ;;
    demo) run_stage demo python3 -m epcomm demo --world-size "$WS" ;;
    *) echo "unknown stage $stage" | tee -a "$OUT/summary.txt" ;;
  esac
done
tar -czf "$OUT/results.tar.gz" -C "$OUT" results logs 2>/dev/null
cat "$OUT/summary.txt"
