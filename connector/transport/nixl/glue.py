"""Thin, synchronous glue over the NIXL 1.5.1 Python API: agent creation with a sane progress-thread delay,
descriptor arrays, and memory-region extraction from tensors. No asyncio here; `agent.py` builds on it.

`nixl` is imported lazily (first agent creation), so importing `connector.transport.nixl` stays cheap.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np

from connector.core.untrusted import is_id

_UINT64 = np.uint64
_agent_ctor_lock = threading.RLock()  # re-entered when clamp_every_agent wraps make_agent's own call


def nixl_api():
    """The `nixl._api` module (nixl_cu13._api or nixl_cu12._api, whichever the meta package picked)."""
    import nixl._api as api  # noqa: PLC0415 - lazy on purpose (imports the bindings, ~0.2 s)

    return api


def nixl_errors() -> tuple[type[BaseException], ...]:
    """Every exception class the NIXL bindings raise (nixlNotFoundError, nixlRemoteDisconnectError, ...)."""
    b = nixl_api().nixlBind
    return tuple(getattr(b, n) for n in dir(b) if n.startswith("nixl") and n.endswith("Error"))


class _BindingsProxy:
    """Stands in for `nixl._api.nixlBind` while `nixl_agent.__init__` runs, handing it a config class whose
    `pthrDelay` cannot be set below our delay. Everything else is forwarded to the real bindings module."""

    def __init__(self, real: Any, config_cls: type) -> None:
        self._real = real
        self.nixlAgentConfig = config_cls

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _clamped_config_class(base: type, progress_delay_us: int) -> type:
    """A subclass of the bindings' `nixlAgentConfig` whose `pthrDelay` cannot be set below `progress_delay_us`."""
    prop = base.__dict__["pthrDelay"]
    delay = int(progress_delay_us)

    def _set(self: Any, value: int) -> None:
        prop.fset(self, max(int(value), delay))

    return type("_DelayedAgentConfig", (base,), {"pthrDelay": property(prop.fget, _set)})


def clamp_every_agent(progress_delay_us: int) -> None:
    """Make every `nixl_agent` created in this process from now on poll with at least `progress_delay_us`, also
    agents other code creates (vLLM's NixlConnector). For benchmarks that run NixlConnector with its progress
    thread clamped (`bench-pd`, via a sitecustomize): nixl 1.5.1 hard-codes a delay of 0, a spinning core per
    agent. Idempotent."""
    if progress_delay_us <= 0:
        raise ValueError("progress_delay_us must be > 0")
    api = nixl_api()
    init = api.nixl_agent.__init__
    if getattr(init, "_sparse_kv_clamped", False):
        return

    def clamped_init(self: Any, *args: Any, **kwargs: Any) -> None:
        real = api.nixlBind
        with _agent_ctor_lock:
            api.nixlBind = _BindingsProxy(real, _clamped_config_class(real.nixlAgentConfig, progress_delay_us))
            try:
                init(self, *args, **kwargs)
            finally:
                api.nixlBind = real

    clamped_init._sparse_kv_clamped = True  # type: ignore[attr-defined]
    api.nixl_agent.__init__ = clamped_init


def make_agent(name: str, *, progress_delay_us: int, ucx_error_handling_mode: str = "peer",
               ucx_config: dict[str, str] | None = None, nixl_threads: int = 0):
    """Create a `nixl_agent` with no backends, a progress thread that sleeps `progress_delay_us` between polls,
    thread-sync mode RW, then the UCX backend.

    Why the patch: `nixl_agent.__init__` (1.5.1) hard-codes `agent_config.pthrDelay = 0`, so its progress thread
    polls with a zero timeout and burns a whole core. We briefly swap `nixl._api.nixlBind` for a proxy whose
    `nixlAgentConfig` is a subclass clamping `pthrDelay` to at least our delay (global lock held; restored at once).

    Why RW sync: the agent is shared by the post worker threads (createXferReq/postXferReq, which on DRAM runs
    the CMA copy inside the call), the event-loop thread (getXferStatus, getNotifs, releaseXferReq) and control
    calls (loadRemoteMD, registerMem). RW makes NIXL take its agent lock shared on the data path and exclusive
    on metadata/registration calls, so posts run in parallel and never race a peer load. STRICT would
    serialise every post (and stall notification polling behind a copy); NONE leaves the agent's maps unguarded.
    The UCX worker itself is multi-threaded because the progress thread is on. Each xfer handle is only ever
    touched by one thread at a time (worker thread until posted, then the loop thread).

    `ucx_config`: UCX settings for this agent's UCX context only (names without the `UCX_` prefix, e.g.
    `TCP_USER_TIMEOUT`), passed as the UCX backend's `engine_config`. A `UCX_*` environment variable of the same
    name takes precedence (NIXL applies these as defaults).
    """
    if progress_delay_us <= 0:
        raise ValueError("progress_delay_us must be > 0: 0 makes the NIXL progress thread spin a whole core")
    api = nixl_api()
    real = api.nixlBind
    cfg_cls = _clamped_config_class(real.nixlAgentConfig, progress_delay_us)
    conf = api.nixl_agent_config(
        enable_prog_thread=True,
        enable_listen_thread=False,  # never NIXL's unauthenticated 0.0.0.0 listener: metadata goes over our channel
        backends=[],
        sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
    )
    with _agent_ctor_lock:
        api.nixlBind = _BindingsProxy(real, cfg_cls)
        try:
            agent = api.nixl_agent(name, conf)
        finally:
            api.nixlBind = real
    params = dict(agent.get_plugin_params("UCX"))
    params["ucx_error_handling_mode"] = ucx_error_handling_mode
    if nixl_threads:
        params["num_threads"] = str(nixl_threads)
    if ucx_config:
        params["engine_config"] = ",".join(f"{key}={value}" for key, value in ucx_config.items())
    agent.create_backend("UCX", params)
    return agent


def descs_array(pairs: Any, device: int = 0) -> np.ndarray:
    """Descriptor rows as a C-contiguous Nx3 uint64 array `(addr, nbytes, device)`, the fast form NIXL takes.

    `pairs`: an Nx2 / Nx3 array or a sequence of `(addr, nbytes)` / `(addr, nbytes, dev)` tuples. For Nx2 input
    the device column is `device`. Raises ValueError on a bad shape or negative values."""
    if isinstance(pairs, np.ndarray):
        arr = pairs
    else:
        try:
            arr = np.array(pairs, dtype=_UINT64)
        except (OverflowError, TypeError, ValueError) as exc:
            raise ValueError(f"descriptors must be (addr, nbytes) pairs of non-negative ints: {exc}") from None
    if arr.size == 0:
        return np.zeros((0, 3), dtype=_UINT64)
    if arr.ndim != 2 or arr.shape[1] not in (2, 3):
        raise ValueError(f"descriptors must have shape (N, 2) or (N, 3), got {arr.shape}")
    if arr.dtype != _UINT64:
        if arr.dtype.kind not in "iu":
            raise ValueError(f"descriptor arrays must hold integers, got {arr.dtype}")
        if arr.dtype.kind == "i" and (arr < 0).any():
            raise ValueError("descriptor addresses and lengths must be non-negative")
        arr = arr.astype(_UINT64)
    if arr.shape[1] == 3:
        return np.ascontiguousarray(arr)
    out = np.empty((arr.shape[0], 3), dtype=_UINT64)
    out[:, :2] = arr
    out[:, 2] = device
    return out


def memory_region(obj: Any) -> tuple[int, int, str, int]:
    """`(addr, nbytes, mem_type, device)` of a contiguous torch tensor (CPU -> "DRAM", CUDA -> "VRAM" with
    `tensor.device.index`) or numpy array ("DRAM"). Duck-typed so this module never imports torch."""
    if hasattr(obj, "data_ptr") and hasattr(obj, "device"):
        if not obj.is_contiguous():
            raise ValueError("register() needs a contiguous tensor (call .contiguous() or register its base)")
        nbytes = obj.numel() * obj.element_size()
        dev = obj.device
        if dev.type == "cpu":
            return obj.data_ptr(), nbytes, "DRAM", 0
        if dev.type == "cuda":
            index = dev.index
            if index is None:
                import torch  # noqa: PLC0415 - only reached with a CUDA tensor, so torch is loaded already

                index = torch.cuda.current_device()
            return obj.data_ptr(), nbytes, "VRAM", int(index)
        raise ValueError(f"cannot register a tensor on device {dev}; only cpu and cuda are supported")
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError("register() needs a C-contiguous numpy array")
        return obj.ctypes.data, obj.nbytes, "DRAM", 0
    raise TypeError(f"register() takes a torch tensor or numpy array, not {type(obj).__name__}")


def pair_check(local: np.ndarray, remote: np.ndarray) -> int:
    """Validate paired descriptor arrays; returns the total byte count. ValueError on any mismatch."""
    if local.shape[0] != remote.shape[0]:
        raise ValueError(f"local has {local.shape[0]} descriptors but remote has {remote.shape[0]}; they pair 1:1")
    lens = local[:, 1]
    bad = np.nonzero(lens != remote[:, 1])[0]
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"descriptor {i}: local length {int(lens[i])} != remote length {int(remote[i, 1])} "
            f"({bad.size} mismatched pair(s)); each local[i] must have the same nbytes as remote[i]"
        )
    if (lens == 0).any():
        raise ValueError(f"descriptor {int(np.nonzero(lens == 0)[0][0])} has length 0")
    return int(lens.sum(dtype=_UINT64))


def as_descs(pairs: Sequence[tuple[int, int]] | np.ndarray, device: int) -> np.ndarray:
    """`descs_array` with the device column forced to `device` (never mutates the caller's array)."""
    arr = descs_array(pairs, device)
    if arr.shape[0] and not (arr[:, 2] == device).all():
        if arr is pairs or (isinstance(pairs, np.ndarray) and np.shares_memory(arr, pairs)):
            arr = arr.copy()
        arr[:, 2] = device
    return arr


MAX_AGENT_NAME = 256
"""Longest agent name read from metadata: Hello's limit for it (connector.protocol.messages.MAX_ID)."""


def metadata_agent_name(metadata: bytes) -> str | None:
    """The agent name NIXL 1.5 agent metadata starts with (`nixlSerDes|Agent` + u64 little-endian length + name), read
    without loading anything; None if the bytes are not laid out that way, or name no agent a Hello could
    (connector.core.untrusted.ID_PATTERN, at most MAX_AGENT_NAME characters)."""
    head = b"nixlSerDes|Agent"
    if not metadata.startswith(head) or len(metadata) < len(head) + 8:
        return None
    length = int.from_bytes(metadata[len(head):len(head) + 8], "little")
    start = len(head) + 8
    if length > 4096 or len(metadata) < start + length:
        return None
    try:
        name = metadata[start:start + length].decode()
    except UnicodeDecodeError:
        return None
    return name if is_id(name) and len(name) <= MAX_AGENT_NAME else None  # it is logged and put in errors
