"""The ``deep_ep`` drop-in (``epcomm.deep_ep``) on CPU processes (gloo, the portable transport).

* Signatures: every public function has DeepEP's parameter names, order, defaults and static-ness, as
  recorded below from DeepEP's source (V1: ``deep_ep/buffer.py`` and ``deep_ep/utils.py`` of its last V1
  release, commit 567632d; ``Config`` from its pybind11 binding; V2: ``deep_ep/buffers/elastic.py``).
* ``Config``: DeepEP's checks and size hints; the default configs; ``set_num_sms``.
* ``install()``: registers ``deep_ep`` only when no DeepEP is importable (or when forced), never shadowing one
  by surprise; ``python -m epcomm deep-ep`` runs a program with it.
* Replays (``epcomm.testing.deep_ep``) of how vLLM, SGLang, Megatron-Core, xorl, DeepEP's README and tests, and
  V2 integrations call ``deep_ep``, at 2 and 4 ranks (uneven, with an empty rank), bit for bit against
  ``epcomm.reference``; epcomm's Buffer-level ``cumulative_local_expert_recv_stats``; every NotImplementedError
  and bad-input error.
"""

import inspect
import subprocess
import sys
import warnings

import pytest
import torch

import epcomm.deep_ep as drop_in
from epcomm.deep_ep import _install
from epcomm.testing import spawn

R = inspect.Parameter.empty  # a required parameter

V1_BUFFER = {
    "__init__": ["self", "group", ("num_nvl_bytes", 0), ("num_rdma_bytes", 0), ("low_latency_mode", False),
                 ("num_qps_per_rank", 24), ("allow_nvlink_for_low_latency_mode", True), ("allow_mnnvl", False),
                 ("use_fabric", False), ("explicitly_destroy", False), ("enable_shrink", False), ("comm", None)],
    "destroy": ["self"],
    "is_sm90_compiled": [],
    "set_num_sms": ["new_num_sms"],
    "capture": [],
    "get_low_latency_rdma_size_hint": ["num_max_dispatch_tokens_per_rank", "hidden", "num_ranks", "num_experts"],
    "get_comm_stream": ["self"],
    "get_local_buffer_tensor": ["self", "dtype", ("size", None), ("offset", 0), ("use_rdma_buffer", False)],
    "get_dispatch_config": ["num_ranks"],
    "get_combine_config": ["num_ranks"],
    "get_dispatch_layout": ["self", "topk_idx", "num_experts", ("previous_event", None), ("async_finish", False),
                            ("allocate_on_comm_stream", False)],
    "dispatch": ["self", "x", ("handle", None), ("num_tokens_per_rank", None), ("num_tokens_per_rdma_rank", None),
                 ("is_token_in_rank", None), ("num_tokens_per_expert", None), ("topk_idx", None),
                 ("topk_weights", None), ("expert_alignment", 1), ("num_worst_tokens", 0), ("config", None),
                 ("previous_event", None), ("async_finish", False), ("allocate_on_comm_stream", False)],
    "combine": ["self", "x", "handle", ("topk_weights", None), ("bias", None), ("config", None),
                ("previous_event", None), ("async_finish", False), ("allocate_on_comm_stream", False)],
    "clean_low_latency_buffer": ["self", "num_max_dispatch_tokens_per_rank", "hidden", "num_experts"],
    "low_latency_dispatch": ["self", "x", "topk_idx", "num_max_dispatch_tokens_per_rank", "num_experts",
                             ("cumulative_local_expert_recv_stats", None), ("dispatch_wait_recv_cost_stats", None),
                             ("use_fp8", True), ("round_scale", False), ("use_ue8m0", False), ("async_finish", False),
                             ("return_recv_hook", False)],
    "low_latency_combine": ["self", "x", "topk_idx", "topk_weights", "handle", ("use_logfmt", False),
                            ("zero_copy", False), ("async_finish", False), ("return_recv_hook", False), ("out", None),
                            ("combine_wait_recv_cost_stats", None)],
    "low_latency_update_mask_buffer": ["self", "rank_to_mask", ("mask", False)],
    "low_latency_query_mask_buffer": ["self", "mask_status"],
    "low_latency_clean_mask_buffer": ["self"],
    "get_next_low_latency_combine_buffer": ["self", "handle"],
}
V1_BUFFER["internode_dispatch"] = V1_BUFFER["dispatch"]
V1_BUFFER["internode_combine"] = V1_BUFFER["combine"]
V1_STATIC = {"is_sm90_compiled", "set_num_sms", "capture", "get_low_latency_rdma_size_hint", "get_dispatch_config",
             "get_combine_config"}
V1_OTHERS = {
    drop_in.Config: [("num_sms", 20), ("num_max_nvl_chunked_send_tokens", 6), ("num_max_nvl_chunked_recv_tokens", 256),
                     ("num_max_rdma_chunked_send_tokens", 6), ("num_max_rdma_chunked_recv_tokens", 256)],
    drop_in.Config.get_nvl_buffer_size_hint: ["self", "hidden_bytes", "num_ranks"],
    drop_in.Config.get_rdma_buffer_size_hint: ["self", "hidden_bytes", "num_ranks"],
    drop_in.EventOverlap.__init__: ["self", ("event", None), ("extra_tensors", None)],
    drop_in.EventOverlap.current_stream_wait: ["self"],
    drop_in.EventOverlap.__enter__: ["self"],
    drop_in.EventOverlap.__exit__: ["self", "exc_type", "exc_val", "exc_tb"],
    drop_in.EventHandle: [],
    drop_in.EventHandle.current_stream_wait: ["self"],
}
V2_ELASTIC = {
    "__init__": ["self", "group", ("num_bytes", None), ("num_cpu_bytes", 0), ("num_max_tokens_per_rank", 0),
                 ("hidden", 0), ("num_topk", 0), ("use_fp8_dispatch", False), ("deterministic", False),
                 ("allow_hybrid_mode", True), ("allow_multiple_reduction", True),
                 ("prefer_overlap_with_compute", True), ("sl_idx", 3), ("num_allocated_qps", 0),
                 ("num_cpu_timeout_secs", 300), ("num_gpu_timeout_secs", 100), ("explicitly_destroy", False)],
    "destroy": ["self"],
    "get_buffer_size_hint": ["group", "num_max_tokens_per_rank", "hidden", ("num_topk", 0),
                             ("use_fp8_dispatch", False), ("allow_hybrid_mode", True),
                             ("allow_multiple_reduction", True)],
    "barrier": ["self", ("use_comm_stream", True), ("with_cpu_sync", False), ("sequential", True)],
    "capture": [],
    "get_comm_stream": ["self"],
    "get_physical_domain_size": ["self"],
    "get_logical_domain_size": ["self"],
    "get_theoretical_num_sms": ["self", "num_experts", "num_topk", ("num_scaleout_topk", 0), ("rdma_gbs", 0),
                                ("nvlink_gbs", 0), ("sm_read_gbs", 200), ("sm_write_gbs", 50)],
    "get_theoretical_num_qps": ["self", "num_sms"],
    "dispatch": ["self", "x", ("topk_idx", None), ("topk_weights", None), ("cumulative_local_expert_recv_stats", None),
                 ("num_experts", None), ("num_max_tokens_per_rank", None), ("expert_alignment", None), ("num_sms", 0),
                 ("num_qps", 0), ("previous_event", None), ("previous_event_before_epilogue", None),
                 ("async_with_compute_stream", False), ("allocate_on_comm_stream", False), ("handle", None),
                 ("do_handle_copy", True), ("do_cpu_sync", None), ("do_expand", False), ("do_zero_padding", False),
                 ("use_tma_aligned_col_major_sf", False)],
    "combine": ["self", "x", "handle", ("topk_weights", None), ("bias", None), ("num_sms", 0), ("num_qps", 0),
                ("previous_event", None), ("previous_event_before_epilogue", None),
                ("async_with_compute_stream", False), ("allocate_on_comm_stream", False)],
}
V2_STATIC = {"get_buffer_size_hint", "capture"}


def _params(fn) -> list:
    """``[name | (name, default)]`` of ``fn``'s signature; every parameter positional-or-keyword."""
    out = []
    for p in inspect.signature(fn).parameters.values():
        assert p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, f"{fn}: {p.name} is {p.kind}"
        out.append(p.name if p.default is R else (p.name, p.default))
    return out


@pytest.mark.parametrize("cls, table, static", [(drop_in.Buffer, V1_BUFFER, V1_STATIC),
                                                (drop_in.ElasticBuffer, V2_ELASTIC, V2_STATIC)],
                         ids=["Buffer (V1)", "ElasticBuffer (V2)"])
def test_signatures_are_deepeps(cls, table, static):
    for name, want in table.items():
        assert _params(getattr(cls, name)) == want, name
        assert isinstance(inspect.getattr_static(cls, name), staticmethod) == (name in static), name


def test_other_signatures_and_names():
    for fn, want in V1_OTHERS.items():
        assert _params(fn) == want, fn
    assert _params(drop_in.utils.check_nvlink_connections) == ["group"]
    assert drop_in.Buffer.num_sms == 20 and drop_in.topk_idx_t is torch.int64 and drop_in.Buffer.is_sm90_compiled()
    for name in ("Buffer", "Config", "EventOverlap", "topk_idx_t", "ElasticBuffer", "EPHandle", "EventHandle"):
        assert name in drop_in.__all__
    assert {"EventHandle", "EventOverlap", "check_nvlink_connections"} <= set(drop_in.utils.__all__)


# ------------------------------------------------------------------------------------------------- Config
def test_config_checks_and_hints():
    c = drop_in.Config()
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens) == (20, 6, 256)
    assert c.num_max_rdma_chunked_recv_tokens == 258  # DeepEP rounds it up to a multiple of the send size
    for bad, what in (((20, 8, 8), "smaller than"), ((20, 6, 256, 128, 128), "at most half"),
                      ((21,), "even"), ((20, 0), "positive")):
        with pytest.raises(ValueError, match=f"Config: .*{what}"):
            drop_in.Config(*bad)
    with pytest.raises(TypeError):
        drop_in.Config(20, strict_sms=True)  # not a DeepEP argument
    # DeepEP's NVLink hint (csrc/config.hpp): per channel and NVLink peer, the chunk counters and recv-size rows
    # of hidden bytes + an 8-byte source record + 128 int64 top-k ids, 128 float weights and 128 float scales
    for cfg, hidden_bytes, ranks in ((c, 14336, 8), (drop_in.Config(24, 8, 256), 1000, 3), (c, 100, 1)):
        slots = cfg.num_sms // 2 * ranks
        raw = slots * 5 * 4 + slots * cfg.num_max_nvl_chunked_recv_tokens * (hidden_bytes + 8 + 128 * 12 + 128 * 4)
        assert cfg.get_nvl_buffer_size_hint(hidden_bytes, ranks) == -(-raw // 128) * 128
        assert cfg.get_rdma_buffer_size_hint(hidden_bytes, ranks) == 0  # one NVLink domain
    assert c.get_rdma_buffer_size_hint(14336, 16) > c.get_rdma_buffer_size_hint(7168, 16) > 0
    with pytest.raises(ValueError, match="get_nvl_buffer_size_hint: num_ranks=12"):
        c.get_nvl_buffer_size_hint(1024, 12)


def test_default_configs_and_num_sms():
    Buffer = drop_in.Buffer
    try:
        Buffer.set_num_sms(24)
        d2, c8 = Buffer.get_dispatch_config(2), Buffer.get_combine_config(8)
        assert (d2.num_sms, d2.num_max_nvl_chunked_send_tokens, c8.num_max_nvl_chunked_send_tokens) == (24, 24, 4)
        # DeepEP has no entry for 3 or 6 ranks: the next larger size's
        assert Buffer.get_dispatch_config(3) == Buffer.get_dispatch_config(4)
        assert Buffer.get_combine_config(6) == Buffer.get_combine_config(8)
        for bad in (0, 7, "24"):
            with pytest.raises(ValueError, match="Buffer.set_num_sms"):
                Buffer.set_num_sms(bad)
        with pytest.raises(ValueError, match="unsupported number of EP ranks 200"):
            Buffer.get_dispatch_config(200)
    finally:
        Buffer.num_sms = 20


def test_events_and_internode_on_cpu():
    event = drop_in.Buffer.capture()
    assert isinstance(event.event, drop_in.EventHandle)
    event.current_stream_wait()  # a finished event on the CPU
    with event:
        pass
    with pytest.raises(AssertionError, match="EventOverlap.current_stream_wait: this EventOverlap holds no event"):
        drop_in.EventOverlap(None).current_stream_wait()
    with drop_in.EventOverlap(None):  # DeepEP's context manager tolerates an empty event
        pass


# ------------------------------------------------------------------------------------------------- install
@pytest.fixture
def clean_modules(monkeypatch):
    """Leave ``sys.modules`` and ``sys.path`` as they were (no deep_ep unless the test imported one)."""
    saved = {k: v for k, v in sys.modules.items() if k == "deep_ep" or k.startswith("deep_ep.")}
    for k in saved:
        monkeypatch.delitem(sys.modules, k)
    yield monkeypatch
    for k in [k for k in sys.modules if k == "deep_ep" or k.startswith("deep_ep.")]:
        del sys.modules[k]
    sys.modules.update(saved)


def _fake_deepep(tmp_path):
    pkg = tmp_path / "deep_ep"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("REAL = True\n")
    return str(tmp_path)


def test_install_without_deepep(clean_modules):
    assert _install.status()[0] == "none"
    assert drop_in.install()
    import deep_ep
    import deep_ep.utils
    from deep_ep import Buffer, Config, EventOverlap, topk_idx_t  # noqa: F401
    from deep_ep.utils import EventHandle  # noqa: F401

    assert deep_ep is drop_in and deep_ep.utils is drop_in.utils and sys.modules["deep_ep.buffer"] is drop_in.buffer
    assert _install.status()[0] == "epcomm" and drop_in.install()  # idempotent
    drop_in.uninstall()
    assert "deep_ep" not in sys.modules and _install.status()[0] == "none"


def test_install_never_shadows_deepep(clean_modules, tmp_path, capsys):
    clean_modules.syspath_prepend(_fake_deepep(tmp_path))
    kind, detail = _install.status()
    assert kind == "deepep" and str(tmp_path) in detail
    with pytest.warns(RuntimeWarning, match="a DeepEP installation is importable .* install\\(force=True\\)"):
        assert not drop_in.install()
    import deep_ep

    assert deep_ep.REAL  # the real one is kept, even after an attempt to install
    assert _install.main(["/nonexistent.py"]) == 2 and "not shadowing it. Pass --force" in capsys.readouterr().err
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert drop_in.install(force=True)  # forced: replaces the imported DeepEP
    import deep_ep as again

    assert again is drop_in
    drop_in.uninstall()


def test_cli_runs_a_program_with_the_drop_in(clean_modules, tmp_path, capsys):
    script = tmp_path / "prog.py"
    script.write_text("import sys, deep_ep\nprint('ran', deep_ep.__name__, sys.argv[1:])\n")
    assert _install.main(["--status"]) == 0 and "deep_ep: none:" in capsys.readouterr().out
    assert _install.main([str(script), "--flag", "1"]) == 0
    assert "ran epcomm.deep_ep ['--flag', '1']" in capsys.readouterr().out
    drop_in.uninstall()
    assert _install.main([]) == 2 and "give a script or -m MODULE" in capsys.readouterr().err
    # the real entry point, with a DeepEP installed and --force
    env = {**__import__("os").environ, "PYTHONPATH": _fake_deepep(tmp_path) + ":" + __import__("os").environ.get(
        "PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-m", "epcomm", "deep-ep", "--force", str(script), "x"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ran epcomm.deep_ep ['x']" in out.stdout, out.stderr[-2000:]


# ------------------------------------------------------------------------------------------------- replays
def _errors(ctx) -> list:
    """Every feature epcomm lacks raises NotImplementedError naming it; bad input raises with the function name."""
    import deep_ep

    from epcomm.testing.routing import make_inputs

    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(4, 128, ctx.world_size, 4 * ctx.world_size)
    buf = deep_ep.Buffer(ctx.group, num_rdma_bytes=hint, low_latency_mode=True)
    mine = make_inputs(3, ctx.world_size, 4, 128, 4 * ctx.world_size, 2)[ctx.rank]
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(mine.topk_idx, 4 * ctx.world_size)
    _, _, _, _, handle, _ = buf.dispatch(mine.x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                         num_tokens_per_expert=per_expert, topk_idx=mine.topk_idx)
    _, _, ll_handle, _, _ = buf.low_latency_dispatch(mine.x, mine.topk_idx, 4, 4 * ctx.world_size)
    y = torch.zeros(4, 4 * ctx.world_size, 128, dtype=torch.bfloat16)
    eb = deep_ep.ElasticBuffer(ctx.group, num_max_tokens_per_rank=4, hidden=128)
    eb_handle = eb.dispatch(mine.x, mine.topk_idx, num_experts=4 * ctx.world_size,
                            previous_event_before_epilogue=eb.capture())[3]
    cases = {
        "enable_shrink": (lambda: deep_ep.Buffer(ctx.group, enable_shrink=True), NotImplementedError,
                          "Buffer: enable_shrink=True"),
        "use_fabric": (lambda: deep_ep.Buffer(ctx.group, use_fabric=True), NotImplementedError, "use_fabric=True"),
        "comm": (lambda: deep_ep.Buffer(None, comm=object()), NotImplementedError, "mpi4py communicator"),
        "no group": (lambda: deep_ep.Buffer(None), ValueError, "either 'group' or 'comm'"),
        "wait stats": (lambda: buf.low_latency_dispatch(mine.x, mine.topk_idx, 4, 4 * ctx.world_size,
                                                        dispatch_wait_recv_cost_stats=torch.zeros(2, dtype=torch.long)),
                       NotImplementedError, "dispatch_wait_recv_cost_stats"),
        "combine wait stats": (lambda: buf.low_latency_combine(y, mine.topk_idx, mine.topk_weights, ll_handle,
                                                               combine_wait_recv_cost_stats=torch.zeros(2)),
                               NotImplementedError, "combine_wait_recv_cost_stats"),
        "logfmt": (lambda: buf.low_latency_combine(y, mine.topk_idx, mine.topk_weights, ll_handle, use_logfmt=True),
                   NotImplementedError, "use_logfmt=True"),
        "async and hook": (lambda: buf.low_latency_dispatch(mine.x, mine.topk_idx, 4, 4 * ctx.world_size,
                                                            async_finish=True, return_recv_hook=True),
                           ValueError, "async_finish=True and return_recv_hook=True"),
        "raw buffer": (lambda: buf.get_local_buffer_tensor(torch.int8, use_rdma_buffer=True), NotImplementedError,
                       "get_local_buffer_tensor"),
        "masks": (lambda: buf.low_latency_clean_mask_buffer(), NotImplementedError, "masking failed ranks"),
        "handle[5]": (lambda: handle[5], NotImplementedError, r"DispatchHandleTuple\[5\]: DeepEP's send_head"),
        "handle unpacking": (lambda: tuple(handle), NotImplementedError, "channel_prefix_matrix"),
        "wrong handle": (lambda: buf.combine(mine.x, ll_handle), TypeError, "Buffer.combine: handle must be"),
        "wrong config": (lambda: buf.combine(mine.x, handle, config=(20, 6)), TypeError, "deep_ep.Config"),
        "bad stats": (lambda: buf.low_latency_dispatch(mine.x, mine.topk_idx, 4, 4 * ctx.world_size,
                                                       cumulative_local_expert_recv_stats=torch.zeros(4)),
                      ValueError, "low_latency_dispatch: cumulative_local_expert_recv_stats must be a contiguous "
                                  "int32 \\[4\\]"),
        "expand": (lambda: eb.dispatch(mine.x, mine.topk_idx, num_experts=4 * ctx.world_size, do_expand=True),
                   NotImplementedError, "do_expand=True"),
        "engram": (lambda: eb.engram_fetch(mine.topk_idx), NotImplementedError, "Engram"),
        "cached weights": (lambda: eb.dispatch(mine.x, handle=eb_handle, topk_weights=mine.topk_weights),
                           NotImplementedError, "topk_weights in a cached dispatch"),
        "EPHandle field": (lambda: eb_handle.recv_src_metadata, NotImplementedError, "EPHandle.recv_src_metadata"),
        "two previous events": (lambda: eb.dispatch(mine.x, mine.topk_idx, num_experts=4 * ctx.world_size,
                                                    previous_event=eb.capture(),
                                                    previous_event_before_epilogue=eb.capture()),
                                NotImplementedError, "previous_event and previous_event_before_epilogue together"),
        "cpu bytes": (lambda: deep_ep.ElasticBuffer(ctx.group, num_bytes=1 << 21, num_cpu_bytes=1 << 21),
                      NotImplementedError, "num_cpu_bytes"),
        "too many tokens": (lambda: eb.dispatch(torch.zeros(5, 128, dtype=torch.bfloat16),
                                                torch.zeros(5, 2, dtype=torch.int64), num_experts=4 * ctx.world_size,
                                                do_cpu_sync=False),
                            ValueError, "num_max_tokens_per_rank, which must be >= the 5 tokens"),
    }
    import re

    problems = []
    for name, (call, exc, pattern) in cases.items():
        try:
            call()
            problems.append(f"{name}: did not raise")
        except exc as e:
            if not re.search(pattern, str(e)):
                problems.append(f"{name}: {type(e).__name__}: {e}")
    if buf.get_comm_stream() is not None or eb.get_logical_domain_size() != (1, ctx.world_size):
        problems.append("CPU buffer: a comm stream, or wrong domain sizes")
    eb.destroy()
    buf.destroy()
    return [("errors", problems)] if problems else []


def _epcomm_stats(ctx) -> list:
    """epcomm's own Buffer: the cumulative per-expert counters (normal exact, worst-case and cached dispatch;
    low latency with and without a hook) add what the reference says each call received."""
    from epcomm import Buffer, reference
    from epcomm.testing.routing import make_inputs

    e = 4 * ctx.world_size
    inputs = make_inputs(7, ctx.world_size, (6, 0, 11), 128, e, 3, "dropped")
    mine = inputs[ctx.rank]
    ref = reference.dispatch([i.x for i in inputs], [i.topk_idx for i in inputs], e)[ctx.rank]
    per_pair = torch.tensor([int((ref.recv_topk_idx == k).sum()) for k in range(4)], dtype=torch.int32)
    buf = Buffer(ctx.group, transport="alltoall")
    stats = torch.zeros(4, dtype=torch.int32)
    layout = buf.get_dispatch_layout(mine.topk_idx, e)
    kw = dict(num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
              topk_idx=mine.topk_idx, cumulative_local_expert_recv_stats=stats)
    handle = buf.dispatch(mine.x, **kw)[4]
    buf.dispatch(mine.x, **kw, num_worst_tokens=64)
    buf.dispatch(mine.x, handle=handle, cumulative_local_expert_recv_stats=stats)
    problems = [] if torch.equal(stats, 3 * per_pair) else [f"normal: {stats.tolist()} != 3 x {per_pair.tolist()}"]
    ll = reference.low_latency_dispatch([i.x for i in inputs], [i.topk_idx for i in inputs], e)[ctx.rank]
    stats.zero_()
    _, count, _, _, hook = buf.low_latency_dispatch(mine.x, mine.topk_idx, 11, e, return_recv_hook=True,
                                                    cumulative_local_expert_recv_stats=stats)
    before = stats.clone()
    hook()
    hook()  # a hook runs once, however often it is called
    buf.low_latency_dispatch(mine.x, mine.topk_idx, 11, e, cumulative_local_expert_recv_stats=stats)
    want = torch.tensor(ll.count, dtype=torch.int32)
    if before.any() or not torch.equal(stats, 2 * want) or not torch.equal(count, want):
        problems.append(f"low latency: before the hook {before.tolist()}, after {stats.tolist()}, want 2 x "
                        f"{want.tolist()}")
    buf.destroy()
    return [("epcomm Buffer stats", problems)] if problems else []


def _worker(ctx):
    from epcomm.testing.deep_ep import run_replays

    if ctx.world_size == 2:
        return run_replays(ctx) + _errors(ctx) + _epcomm_stats(ctx)
    # at 4 ranks, the replays whose results depend on the rank count (not xorl's or the graph's logic)
    names = ["vllm_ht", "vllm_ll", "sglang", "megatron", "deepep", "elastic"]
    return run_replays(ctx, names=names) + _epcomm_stats(ctx)


@pytest.mark.parametrize("world_size", [2, 4])
def test_framework_replays_match_reference(world_size):
    results = spawn(_worker, world_size, device="cpu")
    problems = [f"rank {r}: {label}: {fails}" for r, res in enumerate(results) for label, fails in res]
    assert not problems, "\n".join(problems)


def _across_nodes(ctx):
    from epcomm.testing.deep_ep import run_replays

    names = ["vllm_ht", "vllm_ll", "sglang", "megatron", "deepep", "elastic"]
    return run_replays(ctx, names=names)


def test_framework_replays_across_simulated_nodes(monkeypatch):
    """The frameworks' call sequences through the drop-in when the group spans 2 nodes of 2 ranks
    (``EPCOMM_RANKS_PER_NODE``): every Buffer takes the hierarchical path, checked against its reference."""
    monkeypatch.setenv("EPCOMM_RANKS_PER_NODE", "2")
    results = spawn(_across_nodes, 4, device="cpu")
    problems = [f"rank {r}: {label}: {fails}" for r, res in enumerate(results) for label, fails in res]
    assert not problems, "\n".join(problems)
