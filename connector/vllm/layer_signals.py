"""Per-layer "KV written" signals for the attention layers vLLM never hooks, and their per-step bookkeeping.

The problem. vLLM 0.33 calls `save_kv_layer` from one place, `maybe_transfer_kv_layer`
(model_executor/layers/attention/kv_transfer_utils.py), which wraps only the generic attention ops
(`unified_attention_with_output`, attention.py:770; `unified_mla_attention_with_output`, mla_attention.py:1484).
MiniMax-M3's sparse layers (minimax_m3/nvidia/model.py `MiniMaxM3SparseAttention`: one fused kernel writes main KV
and index key, then `_run_attention`) and DeepSeek-V3.2 (deepseek_v32/attention.py `DeepseekV32Attention.forward`:
`fused_norm_rope` writes the MLA latent and the indexer keys, then `_sparse_indexer_and_attn`) never reach it, and
neither do their index caches. Without this module those layers wait for the `wait_for_save` sweep at the end of the
forward: M3 streams 3 of 60 layers, DeepSeek-V3.2 none.

The way in. Both models default to vLLM's breakable CUDA graphs (config/vllm.py DEFAULT_BREAKABLE_CUDAGRAPH_
ARCHITECTURES; torch.compile off). Under capture, a function decorated with `eager_break_during_capture`
(compilation/breakable_cudagraph.py) ends a graph segment, runs as Python and is recorded as Python that every replay
runs again; module forwards and forward hooks are not (they run at capture only). The two methods above are such
functions, found generically: every decorated function shares the decorator wrapper's code object. `install` puts
`MethodType(eager_break_during_capture(hooked), layer)` on each such layer instance, where `hooked` runs the
original's `__wrapped__` and then signals the layer's global id: on eager forwards, at capture, and once per replay,
right after the graph segment that wrote the layer's KV and index key. The worker installs it in
`register_kv_caches`, which vLLM runs after profiling and before capture (v1/engine/core.py
initialize_from_config, then compile_or_warm_up_model).

When it cannot be done, nothing is installed for the layers concerned and the log says why once: the decorator
returns functions unchanged (vLLM 0.32 unless breakable graphs were on at import), torch.compile traces the forward
(our Python would be traced too), a class has no or several eager-break methods, `__wrapped__` is missing, or the
global layer holds a cache the method's layer does not write. Those layers go in the sweep, as before: correctness
never depends on a signal.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from connector.core.plan import fold_ranges

INDEX_CACHE_ATTRS = (("indexer", "index_cache"), ("indexer", "index_value_cache"), ("indexer", "k_cache"))
"""Where a layer keeps the index caches its insert writes before the eager method: MiniMax-M3
`layer.indexer.index_cache` (minimax_m3/common/indexer.py `MiniMaxM3Indexer.index_cache`) and, on a model whose
sparse layers keep an index value (vLLM 0.33's M3 builds none; the real-engine test model does),
`layer.indexer.index_value_cache` beside it; DeepSeek-V3.2 `layer.indexer.k_cache` (deepseek_v32/attention.py
`DeepseekV32Indexer`). Each is a module whose `.prefix` is its KV-cache layer name."""

INSTALLED_MARK = "_sparse_kv_layer_signal"
"""Attribute set on the functions `install` puts on layers (tests and `uninstall` look for it)."""


@dataclass(frozen=True)
class Installed:
    layer_name: str
    global_layer: int
    method: str
    """`Class.method` that now signals after it returns."""
    cache_names: tuple[str, ...]
    """The KV-cache layers the signal covers: the layer's own cache and its index cache(s)."""
    module: Any = field(compare=False, repr=False)
    bound: Any = field(compare=False, repr=False)


@dataclass
class InstallResult:
    installed: list[Installed] = field(default_factory=list)
    skipped: dict[str, list[int]] = field(default_factory=dict)
    """Reason -> global layers left to the sweep for it."""
    unavailable: str = ""
    """Why nothing could be installed at all ('' when the check ran per layer)."""

    def log_lines(self) -> list[str]:
        """What the worker logs once at startup: what signals where, and why the rest goes in the sweep."""
        lines = []
        by_method: dict[str, list[int]] = {}
        for item in self.installed:
            by_method.setdefault(item.method, []).append(item.global_layer)
        for method, layers in by_method.items():
            lines.append(f"per-layer KV signal after {method} on {len(layers)} layer(s) {fold_ranges(layers)} "
                         f"(their index caches included)")
        for reason, layers in self.skipped.items():
            lines.append(f"no per-layer signal for layer(s) {fold_ranges(layers)}: {reason}; they go in the "
                         f"wait_for_save sweep")
        if self.unavailable:
            lines.append(f"no per-layer signal installed: {self.unavailable}; layers that vLLM's save_kv_layer does "
                         f"not reach go in the wait_for_save sweep{EXPECTED}")
        elif not self.installed and not self.skipped:
            lines.append("no layer with an eager-break method (generic attention only): save_kv_layer streams the "
                         f"layers vLLM hooks, the rest go in the wait_for_save sweep{EXPECTED}")
        return lines


EXPECTED = (" (expected where vLLM's own save_kv_layer hooks every layer, as for generic attention like a Llama's: "
            "signalled_layers_per_step in the metrics says how many stream)")
"""Said after the lines above: they read like a failure where they are not one."""


def wrapper_code(decorator: Callable[[Callable], Callable]) -> types.CodeType | None:
    """The code object every function decorated with `decorator` shares (functools.wraps keeps the wrapper's own
    code), or None when the decorator hands functions back unchanged (vLLM 0.32 without breakable graphs at
    import: `if not is_breakable_cudagraph_enabled(): return fn`)."""
    def probe() -> None:
        return None

    decorated = decorator(probe)
    return None if decorated is probe else getattr(decorated, "__code__", None)


def eager_methods(cls: type, code: types.CodeType) -> dict[str, Callable]:
    """name -> function for each method of `cls` that is an eager break: the definition `cls` resolves to (a
    subclass's override hides its base's, decorated or not)."""
    out: dict[str, Callable] = {}
    seen: set[str] = set()
    for klass in cls.__mro__:
        for name, value in vars(klass).items():
            if name in seen:
                continue
            seen.add(name)
            if getattr(value, "__code__", None) is code:
                out[name] = value
    return out


def index_cache_names(module: Any) -> tuple[str, ...]:
    """KV-cache layer names of the index caches `module` owns (INDEX_CACHE_ATTRS), in that order."""
    names = []
    for path in INDEX_CACHE_ATTRS:
        obj = module
        for attr in path:
            obj = getattr(obj, attr, None)
            if obj is None:
                break
        prefix = getattr(obj, "prefix", None)
        if isinstance(prefix, str):
            names.append(prefix)
    return tuple(names)


def _signalling(original: Callable, global_layer: int, signal: Callable[[int], None]) -> Callable:
    """`original` (the undecorated method), then `signal(global_layer)` once it returned."""
    @functools.wraps(original)
    def hooked(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        signal(global_layer)
        return result
    return hooked


def install(layers: Mapping[str, Any], layer_of: Mapping[str, int], signal: Callable[[int], None], *,
            compile_mode: int | None, decorator: Callable[[Callable], Callable] | None = None) -> InstallResult:
    """Install a signalling copy of the one eager-break method on every layer of `layer_of` whose module has one.

    layers: vLLM's static_forward_context (layer name -> module). layer_of: the KV caches this rank sends, name ->
    global layer. signal: called with the global layer after the method returns (must return in microseconds).
    compile_mode: vLLM's CompilationConfig.mode; only 0 (NONE, what breakable CUDA graphs force) is safe.
    decorator: vLLM's `eager_break_during_capture` (the running vLLM's, so capture behaves as it does for vLLM)."""
    if decorator is None:
        from vllm.compilation.breakable_cudagraph import eager_break_during_capture as decorator
    result = InstallResult()
    code = wrapper_code(decorator)
    if code is None:
        result.unavailable = ("this vLLM's eager_break_during_capture returns functions unchanged (vLLM 0.32 does "
                              "unless VLLM_USE_BREAKABLE_CUDAGRAPH=1 was set before it was imported)")
        return result
    if compile_mode is None or int(compile_mode) != 0:
        result.unavailable = (f"torch.compile is on (compilation mode {compile_mode}): it would trace the signal into "
                              f"the model's graph; breakable CUDA graphs (vLLM's default for MiniMax-M3 and "
                              f"DeepSeek-V3.2) run with it off")
        return result
    names_of: dict[int, set[str]] = {}
    for name, layer in layer_of.items():
        names_of.setdefault(layer, set()).add(name)
    methods_of: dict[type, dict[str, Callable]] = {}
    for name, global_layer in layer_of.items():
        module = layers.get(name)
        if module is None:
            continue
        cls = type(module)
        if cls not in methods_of:
            methods_of[cls] = eager_methods(cls, code)
        methods = methods_of[cls]
        if not methods:
            continue  # generic attention (vLLM's save_kv_layer, where it runs) or an index cache
        reason = _refusal(cls, methods, module, name, global_layer, layer_of, names_of[global_layer])
        if reason:
            result.skipped.setdefault(reason, []).append(global_layer)
            continue
        (method, function), = methods.items()
        hooked = decorator(_signalling(function.__wrapped__, global_layer, signal))
        setattr(hooked, INSTALLED_MARK, True)
        bound = types.MethodType(hooked, module)
        # The instance attribute hides the class's method for this layer only; nn.Module.__setattr__ stores a
        # plain callable in the instance __dict__.
        setattr(module, method, bound)
        result.installed.append(Installed(name, global_layer, f"{cls.__name__}.{method}",
                                          (name, *index_cache_names(module)), module, bound))
    return result


def _refusal(cls: type, methods: dict[str, Callable], module: Any, name: str, global_layer: int,
             layer_of: Mapping[str, int], same_layer: set[str]) -> str:
    """Why `module` (the layer `name`) must not get a signal, or ''."""
    if len(methods) > 1:
        return (f"{cls.__name__} has {len(methods)} eager-break methods ({', '.join(sorted(methods))}), so which one "
                f"follows the KV write is unknown")
    (method, function), = methods.items()
    if not callable(getattr(function, "__wrapped__", None)):
        return f"{cls.__name__}.{method} has no __wrapped__ (a decorator that does not use functools.wraps)"
    covered = {name, *index_cache_names(module)}
    elsewhere = sorted(n for n in covered if n in layer_of and layer_of[n] != global_layer)
    if elsewhere:
        return f"{cls.__name__} owns index caches of another layer ({', '.join(elsewhere)})"
    unwritten = sorted(same_layer - covered)
    if unwritten:
        # The sender marks a whole global layer (every pool) ready: a cache of the layer that this method's
        # layer does not write would go out before it is written. (Named relative to the layer, so that one
        # reason covers every layer it applies to.)
        relative = ", ".join(f"<layer>{n[len(name):]}" if n.startswith(name) else n for n in unwritten)
        return f"the layer also holds {relative}, which {cls.__name__}.{method} does not write"
    return ""


def uninstall(result: InstallResult) -> None:
    """Take the installed methods off their layers again (the class's own method shows through)."""
    for item in result.installed:
        if item.module.__dict__.get(item.method.rsplit(".", 1)[1]) is item.bound:
            delattr(item.module, item.method.rsplit(".", 1)[1])
    result.installed.clear()


class StepSignals:
    """Which layers of this rank got their per-layer signal in the current step (model-runner thread only).

    Idempotent per step: a layer signalled twice in one step (save_kv_layer and an installed method both, say on a
    vLLM that hooks more than 0.33 does) goes out once, and the repeat is counted. The worker is the place for it:
    it sees the step boundaries (bind, wait_for_save) and both signal sources, and dropping the repeat there spares
    the sender's queue and an event wait."""

    def __init__(self, layers: Iterable[int], cuda: bool) -> None:
        self.layers = sorted(set(layers))
        # One CUDA event per layer, created once and re-recorded every step (as Dynamo's connector does): a hook
        # must return in microseconds. A re-record before the engine waited on the previous one only makes that
        # layer wait for a later point of the same stream, never for less; the sweep covers it either way.
        self._events = {layer: torch.cuda.Event() for layer in self.layers} if cuda else {}
        self._cuda = cuda
        self._done: set[int] = set()
        self.repeated = 0

    def begin(self) -> None:
        """A new step: nothing signalled yet (also drops what a step that never reached wait_for_save left)."""
        self._done = set()
        self.repeated = 0

    def first(self, layer: int) -> bool:
        """True the first time `layer` is signalled in this step; False, and counted, after that."""
        if layer in self._done:
            self.repeated += 1
            return False
        self._done.add(layer)
        return True

    def record(self, layer: int) -> torch.cuda.Event | None:
        """`layer`'s event, recorded now on the current stream (None on CPU: the KV is written already)."""
        event = self._events.get(layer)
        if event is not None:
            event.record()
        return event

    def record_sweep(self) -> torch.cuda.Event | None:
        """A fresh event for the sweep (one per step): it must not be re-recorded while the engine waits on it,
        since a request's last chunk becomes final only behind it."""
        if not self._cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def end(self) -> tuple[list[int], list[int], int]:
        """(layers signalled, layers left to the sweep, repeats) of the step that ends, and start afresh."""
        signalled = sorted(self._done)
        swept = [layer for layer in self.layers if layer not in self._done]
        repeated = self.repeated
        self.begin()
        return signalled, swept, repeated
