"""Per-layer signals for the layers vLLM 0.33 never hooks (connector.vllm.layer_signals), against vLLM's own code:
the installer on the real MiniMaxM3SparseAttention and DeepseekV32Attention classes (made on CPU without their CUDA
init, tests/vllm_layers.py), replay through vLLM's BreakableCUDAGraphCapture and eager_break_during_capture with only
the graph segments stubbed, the per-step bookkeeping, and the CUDA-graph mode each role asks vLLM's VllmConfig for.
The transfer itself (signals -> NIXL WRITEs while prefill computes, byte-exact) is in test_vllm_e2e.py."""

from __future__ import annotations

from unittest import mock

import pytest

vllm = pytest.importorskip("vllm", reason="needs vllm==0.33.0")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from vllm.compilation import breakable_cudagraph as bcg  # noqa: E402
from vllm.config import CUDAGraphMode  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402

from connector.vllm import SparseKVConnector  # noqa: E402
from connector.vllm import layer_signals as S  # noqa: E402
from connector.vllm.connector import kv_role_holding  # noqa: E402
from connector.vllm.regions import classify_layers  # noqa: E402
from tests import vllm_harness as H  # noqa: E402
from tests import vllm_layers as L  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def m3_cfg(tmp_path_factory):
    return H.make_vllm_config(H.write_m3_config(tmp_path_factory.mktemp("m3"), num_layers=8, dense_layers=2),
                              kv_role="kv_producer")


@pytest.fixture(scope="module")
def dsv_cfg(tmp_path_factory):
    return H.make_vllm_config(H.write_dsv32_config(tmp_path_factory.mktemp("dsv32")), kv_role="kv_producer")


def model(cfg):
    """(modules by layer name, the caches the connector sends: name -> global layer) of a whole model; the modules
    are registered in the config's static_forward_context, as building the model does."""
    kvc = H.make_kv_cache_config(cfg, num_blocks=4)
    modules = L.layer_modules(cfg, H.allocate_kv_caches(kvc, cfg))
    cfg.compilation_config.static_forward_context.update(modules)
    return modules, {name: info.layer for name, info in classify_layers(kvc).items()}


def install(modules, layer_of, signals, **kw):
    return S.install(modules, layer_of, signals.append, compile_mode=kw.pop("compile_mode", 0), **kw)


# ---- the installer on vLLM's real classes ---------------------------------------------------------------------

@pytest.mark.parametrize("which", ["m3", "dsv32"])
def test_installs_on_the_real_classes_and_runs_their_real_bodies(which, m3_cfg, dsv_cfg):
    cfg = m3_cfg if which == "m3" else dsv_cfg
    modules, layer_of = model(cfg)
    signals: list[int] = []
    result = install(modules, layer_of, signals)
    if which == "m3":
        cls, method, sparse = "MiniMaxM3SparseAttention", "_run_attention", list(range(2, 8))
    else:
        cls, method, sparse = "DeepseekV32Attention", "_sparse_indexer_and_attn", list(range(6))
    assert [i.global_layer for i in result.installed] == sparse and not result.skipped and not result.unavailable
    assert {i.method for i in result.installed} == {f"{cls}.{method}"}
    assert result.log_lines() == [f"per-layer KV signal after {cls}.{method} on {len(sparse)} layer(s) "
                                  f"{sparse[0]}-{sparse[-1]} (their index caches included)"]
    for item in result.installed:
        layer = item.module
        index = layer.indexer.index_cache if which == "m3" else layer.indexer.k_cache
        # the signal covers the layer's own cache and its index cache (M3: indexer.index_cache, DSv3.2: k_cache)
        assert item.cache_names == (item.layer_name, index.prefix) and layer_of[index.prefix] == item.global_layer
        bound = layer.__dict__[method]
        assert bound.__self__ is layer and getattr(bound.__func__, S.INSTALLED_MARK)
        assert bound.__func__.__code__ is bcg.eager_break_during_capture(lambda: None).__code__  # an eager break
        assert "forward" not in layer.__dict__  # only the one method, on this instance
    # vLLM's generic Attention (M3 dense 0-1) keeps save_kv_layer; index caches get nothing of their own
    untouched = [m for n, m in modules.items() if layer_of[n] not in sparse or n.endswith(("index_cache", "k_cache"))]
    assert all(not any(getattr(v, S.INSTALLED_MARK, False) for v in vars(m).values()) for m in untouched)
    # calling it runs the class's real body (its CUDA kernels stood in for), then signals once, after it returned
    with set_forward_context(None, cfg):
        for item in result.installed:
            calls_before = item.module.impl.calls
            assert L.attend(item.module)
            assert item.module.impl.calls == calls_before + 1 and signals[-1] == item.global_layer
        assert signals == sparse
        if which == "m3":
            assert all(i.module.indexer.impl.calls == 1 for i in result.installed)
        # another instance of the class is not affected: the class's own method is unchanged
        other = (L.m3_sparse_layer if which == "m3" else L.dsv32_layer)("model.layers.99.self_attn.attn")[0]
        cfg.compilation_config.static_forward_context[other.layer_name] = other
        try:
            assert L.attend(other) and signals == sparse
        finally:
            del cfg.compilation_config.static_forward_context[other.layer_name]
        S.uninstall(result)
        assert not result.installed and all(method not in m.__dict__ for m in modules.values())
        L.attend(modules[next(n for n, layer in layer_of.items() if layer == sparse[0])])
    assert signals == sparse  # uninstalled: no more signals


class TwoBreaks(nn.Module):
    @bcg.eager_break_during_capture
    def first(self) -> None: ...

    @bcg.eager_break_during_capture
    def second(self) -> None: ...


class NoWrapped(nn.Module):
    @bcg.eager_break_during_capture
    def attend(self) -> None: ...


del NoWrapped.attend.__wrapped__


def test_refuses_what_it_cannot_vouch_for(tmp_path):
    names = {"model.layers.0.self_attn.attn": 0, "model.layers.1.self_attn.attn": 1}
    modules = {"model.layers.0.self_attn.attn": TwoBreaks(), "model.layers.1.self_attn.attn": NoWrapped()}
    result = install(modules, names, [])
    assert not result.installed
    assert result.skipped == {
        "TwoBreaks has 2 eager-break methods (first, second), so which one follows the KV write is unknown": [0],
        "NoWrapped.attend has no __wrapped__ (a decorator that does not use functools.wraps)": [1]}
    assert result.log_lines()[0] == ("no per-layer signal for layer(s) 0: TwoBreaks has 2 eager-break methods (first, "
                                     "second), so which one follows the KV write is unknown; they go in the "
                                     "wait_for_save sweep")

    # A subclass overriding the method without the decorator hides its base's eager break: nothing to install.
    from vllm.models.minimax_m3.nvidia.model import MiniMaxM3SparseAttention

    class Plain(MiniMaxM3SparseAttention):
        def _run_attention(self, *args):
            return None

    assert S.eager_methods(Plain, bcg.eager_break_during_capture(lambda: None).__code__) == {}

    # The index-V variant: layers 3 and 6 also hold `...index_value_cache`, which the M3 method does not write
    # (vLLM 0.33 builds no such cache); a layer-wide signal would send it before it is written.
    cfg = H.make_vllm_config(H.write_m3_config(tmp_path / "m3v", index_value_layers=(3, 6)), kv_role="kv_producer")
    modules, layer_of = model(cfg)
    result = install(modules, layer_of, [])
    assert [i.global_layer for i in result.installed] == [2, 4, 5, 7]
    (reason, layers), = result.skipped.items()
    assert layers == [3, 6]
    assert reason == ("the layer also holds <layer>.index_value_cache, which MiniMaxM3SparseAttention._run_attention "
                      "does not write")
    # A model whose indexer owns its index-value cache (`indexer.index_value_cache`, as tests/sparse_model's does):
    # the method's layer writes it, so those layers get their signal too, the value cache included.
    S.uninstall(result)
    for layer in (3, 6):
        name = f"{H.layer_prefix(cfg)}.layers.{layer}.self_attn.attn"
        modules[name].indexer.index_value_cache = modules[f"{name}.index_value_cache"]
    result = install(modules, layer_of, [])
    assert [i.global_layer for i in result.installed] == [2, 3, 4, 5, 6, 7] and not result.skipped
    assert [i.cache_names for i in result.installed if i.global_layer == 3] == [
        tuple(f"{H.layer_prefix(cfg)}.layers.3.self_attn.attn{suffix}" for suffix in ("", ".index_cache",
                                                                                    ".index_value_cache"))]


def test_falls_back_when_this_vllm_cannot_do_it(m3_cfg, monkeypatch):
    modules, layer_of = model(m3_cfg)
    # vLLM 0.32: the decorator hands the function back unless breakable graphs were on at import
    result = install(modules, layer_of, [], decorator=lambda fn: fn)
    assert not result.installed and "returns functions unchanged" in result.unavailable
    assert result.log_lines() == [f"no per-layer signal installed: {result.unavailable}; layers that vLLM's "
                                  f"save_kv_layer does not reach go in the wait_for_save sweep{S.EXPECTED}"]
    # torch.compile on: dynamo would trace the signal
    result = install(modules, layer_of, [], compile_mode=3)
    assert not result.installed and "torch.compile is on (compilation mode 3)" in result.unavailable
    assert not any(m.__dict__.get("_run_attention") for m in modules.values())
    # a dense model: nothing to install, and the log says so once
    result = install({"model.layers.0.self_attn.attn": L.generic_layer("model.layers.0.self_attn.attn")},
                     {"model.layers.0.self_attn.attn": 0}, [])
    assert not result.installed and len(result.log_lines()) == 1
    assert "generic attention only" in result.log_lines()[0]


# ---- replay through vLLM's breakable CUDA graph capture -------------------------------------------------------

class CpuGraph:
    """Stand-in for torch.cuda.CUDAGraph on CPU: kernels launched while a segment captures are recorded, not run
    (as CUDA stream capture does), and the segment's replay runs them."""

    recording: list | None = None

    @staticmethod
    def launch(kernel) -> None:
        if CpuGraph.recording is not None:
            CpuGraph.recording.append(kernel)
        else:
            kernel()

    @staticmethod
    def begin_segment(capture) -> None:  # BreakableCUDAGraphCapture._begin_segment
        assert not capture._capturing
        CpuGraph.recording = []
        capture._capturing = True

    @staticmethod
    def end_segment(capture) -> None:  # BreakableCUDAGraphCapture._end_segment
        if not capture._capturing:
            return
        kernels, CpuGraph.recording = CpuGraph.recording, None
        capture.segments.append(lambda: [k() for k in kernels])
        capture._num_graphs += 1
        capture._capturing = False


class Decoder(nn.Module):
    """A decoder layer shaped like M3's / DSv3.2's: a captured segment that inserts the layer's KV (the fused
    insert kernel), then the attention layer's eager-break method."""

    def __init__(self, attn: nn.Module, layer: int, timeline: list) -> None:
        super().__init__()
        self.attn, self.layer, self.timeline = attn, layer, timeline

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CpuGraph.launch(lambda: self.timeline.append(("insert", self.layer)))
        L.attend(self.attn)
        return x


def wrap_forward(decoder: Decoder, timeline: list) -> None:
    inner = decoder.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        out = inner(x)
        timeline.append(("wrapper", decoder.layer))
        return out

    decoder.forward = forward


@pytest.mark.parametrize("which", ["m3", "dsv32"])
def test_breakable_graph_replay_signals_each_layer_once_after_its_insert(which, dsv_cfg, monkeypatch):
    monkeypatch.setattr(bcg.BreakableCUDAGraphCapture, "_begin_segment", CpuGraph.begin_segment)
    monkeypatch.setattr(bcg.BreakableCUDAGraphCapture, "_end_segment", CpuGraph.end_segment)
    monkeypatch.setattr(bcg, "_weak_ref_capture_arg", lambda arg: arg)  # the real one is a CUDA-extension op
    timeline: list[tuple[str, int]] = []
    make = L.m3_sparse_layer if which == "m3" else L.dsv32_layer
    names = [f"replay.layers.{i}.self_attn.attn" for i in range(3)]
    attns = {name: make(name)[0] for name in names}
    layers = dsv_cfg.compilation_config.static_forward_context
    layers.update(attns)  # DSv3.2's method looks its layer up in the forward context
    try:
        result = S.install(attns, {n: i for i, n in enumerate(names)}, lambda i: timeline.append(("signal", i)),
                           compile_mode=0)
        assert len(result.installed) == 3
        decoders = [Decoder(attns[n], i, timeline) for i, n in enumerate(names)]
        # Negative controls: a forward hook and a forward wrapper on each decoder layer.
        for d in decoders:
            d.register_forward_hook(lambda mod, args, out: timeline.append(("hook", mod.layer)))
            wrap_forward(d, timeline)

        def forward(mode):
            with set_forward_context(None, dsv_cfg, cudagraph_runtime_mode=mode):
                for d in decoders:
                    d(torch.zeros(4, 8))

        per_layer = [e for i in range(3) for e in (("insert", i), ("signal", i), ("wrapper", i), ("hook", i))]
        forward(CUDAGraphMode.NONE)  # eager: everything runs
        assert timeline == per_layer
        timeline.clear()
        with bcg.BreakableCUDAGraphCapture() as capture:
            forward(CUDAGraphMode.PIECEWISE)
        # capture runs the Python once (inserts are recorded, not run); 3 eager breaks, 4 graph segments
        assert timeline == [e for e in per_layer if e[0] != "insert"]
        assert (capture.num_eager_breaks, capture.num_graphs) == (3, 4)
        for _ in range(3):
            timeline.clear()
            with set_forward_context(None, dsv_cfg, cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE):
                capture.replay()
            # once per layer per replay, right after its insert segment, in layer order; hooks and forward
            # wrappers do not run at all
            assert timeline == [("insert", 0), ("signal", 0), ("insert", 1), ("signal", 1), ("insert", 2),
                                ("signal", 2)]
        # FULL graphs: the eager body is captured inline, so replay runs no Python: no signal (why prefill asks
        # vLLM for PIECEWISE)
        timeline.clear()
        with bcg.BreakableCUDAGraphCapture() as full:
            forward(CUDAGraphMode.FULL)
        timeline.clear()
        full.replay()
        assert timeline == [("insert", 0), ("insert", 1), ("insert", 2)]
    finally:
        for name in names:
            layers.pop(name, None)


# ---- per-step bookkeeping -------------------------------------------------------------------------------------

def test_a_layer_signalled_twice_in_a_step_goes_out_once():
    steps = S.StepSignals([3, 4, 5, 4], cuda=False)
    assert steps.layers == [3, 4, 5]
    steps.begin()
    assert steps.first(4) and steps.first(3)
    assert not steps.first(4) and not steps.first(4)  # save_kv_layer and the installed method both
    assert steps.record(4) is None and steps.record_sweep() is None  # CPU: the KV is written already
    assert steps.end() == ([3, 4], [5], 2)
    assert steps.first(4)  # a new step
    steps.begin()  # a step that never reached wait_for_save leaves nothing behind
    assert steps.end() == ([], [3, 4, 5], 0)


# ---- CUDA graph mode per role ----------------------------------------------------------------------------------

def test_prefill_asks_for_piecewise_and_decode_keeps_full_graphs(tmp_path):
    from vllm.platforms import current_platform

    model_dir = H.write_m3_config(tmp_path / "m3")
    modes = {}
    # The CPU platform captures no graphs; pretend it does so that VllmConfig reaches the connector question
    # (config/vllm.py: cudagraph_mode FULL_AND_PIECEWISE by default, then requires_piecewise_for_cudagraph).
    with mock.patch.object(type(current_platform), "support_static_graph_mode", return_value=True, create=True):
        for role in ("kv_producer", "kv_consumer"):
            cfg = H.make_vllm_config(model_dir, kv_role=role)
            modes[role] = cfg.compilation_config.cudagraph_mode
    assert modes == {"kv_producer": CUDAGraphMode.PIECEWISE, "kv_consumer": CUDAGraphMode.FULL_AND_PIECEWISE}
    # Outside vLLM's call site the role cannot be told: PIECEWISE, right on both sides.
    assert SparseKVConnector.requires_piecewise_for_cudagraph({}) is True

    class Holder:
        def __init__(self, role):
            self.kv_transfer_config = mock.Mock(kv_role=role, kv_connector_extra_config={"k": 1})

        def ask(self, extra):
            return kv_role_holding(extra)

    holder = Holder("kv_consumer")
    assert holder.ask(holder.kv_transfer_config.kv_connector_extra_config) == "kv_consumer"
    assert holder.ask({"k": 1}) is None  # an equal dict is not the config's own: no guess
