"""Test and benchmark support: the multi-process launcher and routing generators."""

from .launcher import WorkerContext, WorkerError, run, spawn
from .routing import RankInputs, make_inputs, make_topk

__all__ = ["WorkerContext", "WorkerError", "run", "spawn", "RankInputs", "make_inputs", "make_topk"]
