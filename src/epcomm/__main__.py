"""Command line: ``python -m epcomm <command> [options]`` (also installed as ``epcomm``).

Commands:
  demo                 dispatch/combine (normal and low-latency) checked against the reference, with timings
  bench dispatch       normal-mode benchmark: epcomm transports, NCCL and the copy-engine ceiling
  bench low-latency    low-latency benchmark
  bench p2p            one-sided put/get vs NCCL send/recv and the copy engine
  bench allgather      one-sided all-gather vs NCCL
  bench internode      the hierarchical path across (simulated) nodes vs a flat all_to_all, the raw link, a model
  doctor               which transport works on this machine, and why
  deep-ep SCRIPT ...   run a program with `import deep_ep` resolving to epcomm's drop-in (--status: which is active)

Each command's own ``--help`` lists its options. Commands that need several processes spawn them (CPU
processes over gloo without GPUs) or join a torchrun job."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "demo": "epcomm.bench.demo",
    "doctor": "epcomm.topology.doctor",
    "deep-ep": "epcomm.deep_ep._install",
}
BENCHMARKS = {
    "dispatch": "epcomm.bench.dispatch",
    "low-latency": "epcomm.bench.low_latency",
    "p2p": "epcomm.bench.p2p",
    "allgather": "epcomm.bench.allgather",
    "internode": "epcomm.bench.internode",
}


def _usage() -> str:
    return __doc__ or ""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command == "bench":
        if not rest or rest[0] in ("-h", "--help"):
            print("usage: python -m epcomm bench {" + ",".join(BENCHMARKS) + "} [options]")
            return 0
        target, rest = BENCHMARKS.get(rest[0]), rest[1:]
        if target is None:
            print(f"epcomm bench: unknown benchmark {argv[1]!r}; choose one of {', '.join(BENCHMARKS)}",
                  file=sys.stderr)
            return 2
    else:
        target = COMMANDS.get(command)
        if target is None:
            print(f"epcomm: unknown command {command!r}; choose one of {', '.join([*COMMANDS, 'bench'])}",
                  file=sys.stderr)
            return 2
    module = importlib.import_module(target)
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
