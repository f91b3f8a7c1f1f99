"""`bench-pd`: TTFT of one engine against PD pairs of real vLLM engines on the same model and prompts.

Modes (each on its own servers, one mode at a time, so they do not share the machine):
- `local`: one engine, no KV transfer (the baseline every overhead is measured against);
- `sparse-concurrent`: SparseKVConnector, both legs at once (examples/proxy.py's flow);
- `sparse-sequential`: SparseKVConnector behind a prefill-then-decode router (vLLM's proxy pattern);
- `nixl`: vLLM's NixlConnector as shipped (its only flow is sequential);
- `nixl-clamped`: the same with its NIXL progress thread clamped to a 1 ms poll delay (nixl 1.5.1 hard-codes 0,
  a spinning core per agent), so the comparison is not only about that.

Requests go one at a time (TTFT without queueing), streamed, greedy; each request has a fresh `cache_salt` so no
prefix cache is reused. With `pin` (the default on a machine with two cores or more) prefill (and the local
engine) run on core 0 and decode on core 1, standing in for separate nodes: a decode engine spins a core while it
waits for KV, which on a shared core would be taken from prefill's compute. Every PD answer is compared token by token with the local engine's answer to the same
prompt. The first `warmup` requests of each mode are not counted."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from connector.pd import flows, timelines
from connector.pd.timelines import percentile
from connector.pd.client import Completion, prompt_ids
from connector.pd.model import bench_model, sparse_plugin_env
from connector.pd.servers import ServerSpec, VllmServer, metric, sparse_kv_config, start_all
from connector.transport.ports import free_ports

MODES = ("local", "sparse-concurrent", "sparse-sequential", "nixl", "nixl-clamped")
CLAMP_DELAY_US = 1000


@dataclass
class ModeResult:
    mode: str
    requests: int
    token_equal: int
    ttft_ms: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    """The prompt length of each `ttft_ms` sample."""
    breakdown: dict[int, dict[str, tuple[float, float, int]]] = field(default_factory=dict)
    """SparseKVConnector modes: prompt tokens -> stage -> (p50 ms, p99 ms, requests), from both engines' timeline
    lines (connector.pd.timelines)."""
    kv_bytes_per_request: float | None = None
    """SparseKVConnector modes: bytes prefill wrote per measured request (its `bytes_sent` counter)."""
    sent_during_compute: float | None = None
    """The share of those bytes whose WRITE was posted while prefill still computed the request."""

    @property
    def p50_ms(self) -> float:
        return percentile(self.ttft_ms, 50)

    @property
    def p99_ms(self) -> float:
        return percentile(self.ttft_ms, 99)

    def p50_by_length(self) -> dict[int, float]:
        """TTFT p50 per prompt length."""
        return {n: percentile([t for t, m in zip(self.ttft_ms, self.prompt_tokens) if m == n], 50)
                for n in sorted(set(self.prompt_tokens))}


@dataclass(frozen=True)
class BenchConfig:
    requests: int = 30
    warmup: int = 3
    prompt_lengths: tuple[int, ...] = (600, 900, 1000)
    max_tokens: int = 16
    modes: tuple[str, ...] = MODES
    engine_python: str = ".venv-cpu/bin/python"
    work_dir: Path | None = None
    pin: bool = True
    model: str = "tiny"
    """A name in connector.pd.model.MODELS."""
    max_model_len: int = 4096


class PdBench:
    def __init__(self, config: BenchConfig, log: Callable[[str], None] = print) -> None:
        self.config, self.log = config, log
        self.root = Path(config.work_dir or tempfile.mkdtemp(prefix="bench-pd-"))
        self.spec = bench_model(config.model, config.max_model_len)
        self.model = self.spec.write(self.root / f"{config.model}-llama")
        self.model_env = sparse_plugin_env(config.model, self.root / "plugins")
        self.clamp_dir = self._write_clamp()
        n = config.warmup + config.requests
        self.prompts = [prompt_ids(config.prompt_lengths[i % len(config.prompt_lengths)], seed=10_000 + i)
                        for i in range(n)]
        self.reference: list[list[int]] = []

    def _write_clamp(self) -> Path:
        """A sitecustomize that clamps every NIXL agent's progress thread in the process (nixl-clamped mode)."""
        folder = self.root / "nixl-clamp"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "sitecustomize.py").write_text(
            "from connector.transport.nixl.glue import clamp_every_agent\n"
            f"clamp_every_agent({CLAMP_DELAY_US})\n")
        return folder

    def _server(self, name: str, kv: dict | None = None, env: dict | None = None) -> VllmServer:
        allowed = sorted(os.sched_getaffinity(0))
        cpus = None
        if self.config.pin and len(allowed) >= 2:
            cpus = (allowed[1],) if name.endswith("decode") else (allowed[0],)
        # room for a few whole prompts at the longest length, and never less than the 256 MiB default
        cache = max(256 << 20, 4 * self.config.max_model_len * self.spec.kv_bytes_per_token)
        env = dict(env or {})
        if self.model_env:  # the sparse test model's plugin, beside whatever the mode puts on PYTHONPATH
            env |= self.model_env | {"PYTHONPATH": ":".join(filter(None, [env.get("PYTHONPATH"),
                                                                            self.model_env["PYTHONPATH"]]))}
        spec = ServerSpec(name, self.model, free_ports(), kv_transfer_config=kv, env=env, cpus=cpus,
                          max_model_len=self.config.max_model_len, kv_cache_bytes=cache)
        return VllmServer(spec, self.config.engine_python, self.root / "logs")

    def _servers(self, mode: str) -> tuple[list[VllmServer], Callable[[list[int]], Completion]]:
        """The mode's servers, and how to ask them (the answer's kv_transfer_params name its transfer id)."""
        if mode == "local":
            local = self._server("local")
            return [local], lambda p: flows.local(local.url, p, self.config.max_tokens, cache_salt=fresh())
        if mode.startswith("sparse"):
            side = free_ports()
            pre = self._server("sparse-prefill", sparse_kv_config("kv_producer", side_channel_port=side,
                                                                  log_timeline=True))
            dec = self._server("sparse-decode", sparse_kv_config("kv_consumer", log_timeline=True))
            if mode == "sparse-concurrent":
                def concurrent(p: list[int]) -> Completion:
                    tid = fresh()
                    out = flows.concurrent(pre.url, f"127.0.0.1:{side}", dec.url, p, self.config.max_tokens,
                                           cache_salt=fresh(), transfer_id=tid)
                    out.kv_transfer_params = {"transfer_id": tid}
                    return out
                return [pre, dec], concurrent
            return [pre, dec], lambda p: flows.sequential(pre.url, dec.url, p, self.config.max_tokens,
                                                          cache_salt=fresh())
        env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
        if mode == "nixl-clamped":
            env["PYTHONPATH"] = str(self.clamp_dir)
        nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
        pre = self._server(f"{mode}-prefill", nixl, env | {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_ports())})
        dec = self._server(f"{mode}-decode", nixl, env | {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_ports())})
        return [pre, dec], lambda p: flows.sequential(pre.url, dec.url, p, self.config.max_tokens,
                                                      cache_salt=fresh())

    def run_mode(self, mode: str) -> ModeResult:
        servers, ask = self._servers(mode)
        self.log(f"{mode}: starting {len(servers)} server(s)")
        start_all(servers)
        try:
            result = ModeResult(mode, 0, 0)
            asked: list[timelines.ClientRequest] = []
            sent = None
            for i, prompt in enumerate(self.prompts):
                if i == self.config.warmup and mode.startswith("sparse"):
                    sent = bytes_sent(servers[0])
                sent_at = time.time()
                out = ask(prompt)
                if mode == "local":
                    self.reference.append(out.token_ids)
                if i < self.config.warmup:
                    continue
                result.requests += 1
                result.token_equal += out.token_ids == self.reference[i]
                result.ttft_ms.append(out.ttft_s * 1e3)
                result.prompt_tokens.append(len(prompt))
                tid = (out.kv_transfer_params or {}).get("transfer_id")
                if tid:
                    asked.append(timelines.ClientRequest(str(tid), len(prompt), sent_at, sent_at + out.ttft_s))
            if sent is not None and result.requests:
                total, during = (b - a for a, b in zip(sent, bytes_sent(servers[0])))
                result.kv_bytes_per_request = total / result.requests
                result.sent_during_compute = during / total if total else None
            self.log(f"{mode}: p50 {result.p50_ms:.1f} ms, p99 {result.p99_ms:.1f} ms, "
                     f"{result.token_equal}/{result.requests} token-equal")
        finally:
            for s in servers:
                s.stop(20)
        if asked:  # the engines' logs are complete once they stopped
            records = timelines.read_logs(s.log_path for s in servers)
            result.breakdown = timelines.summarize([(r.prompt_tokens, timelines.breakdown(r, records.get(
                r.transfer_id, {}))) for r in asked])
        return result

    def run(self) -> list[ModeResult]:
        modes = list(self.config.modes)
        if "local" in modes:
            modes.remove("local")
        return [self.run_mode("local")] + [self.run_mode(m) for m in modes]


def bytes_sent(prefill: VllmServer) -> tuple[float, float]:
    """Prefill's SparseKVConnector counters: (bytes written, of which posted during compute)."""
    samples = prefill.metrics()
    return (metric(samples, "vllm:sparse_kv_bytes_sent_total"),
            metric(samples, "vllm:sparse_kv_bytes_sent_during_compute_total"))


def fresh() -> str:
    return uuid.uuid4().hex


def table(results: list[ModeResult]) -> str:
    base, base_by = results[0].p50_ms, results[0].p50_by_length()
    lines = ["| mode | requests | token-equal | TTFT p50 ms | TTFT p99 ms | p50 overhead over local | p50 by prompt "
             "length (overhead) | KV per request | posted during compute |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        over = "—" if r.mode == "local" else f"{r.p50_ms - base:+.1f} ms ({100 * (r.p50_ms / base - 1):+.0f}%)"
        by = ", ".join(f"{n}: {ms:.1f}" + ("" if r.mode == "local" or n not in base_by else f" ({ms - base_by[n]:+.1f})")
                       for n, ms in r.p50_by_length().items())
        kv = "—" if r.kv_bytes_per_request is None else f"{r.kv_bytes_per_request / 2**20:.1f} MiB"
        during = "—" if r.sent_during_compute is None else f"{100 * r.sent_during_compute:.0f}%"
        lines.append(f"| {r.mode} | {r.requests} | {r.token_equal}/{r.requests} | {r.p50_ms:.1f} | {r.p99_ms:.1f} "
                     f"| {over} | {by} | {kv} | {during} |")
    return "\n".join(lines)


def to_json(results: list[ModeResult], config: BenchConfig | None = None) -> dict:
    base = results[0].p50_ms
    about = {} if config is None else {"model": config.model, "max_model_len": config.max_model_len,
                                       "load_average": os.getloadavg()}
    return {"date": time.strftime("%Y-%m-%d"), **about, "modes": [
        asdict(r) | {"p50_ms": r.p50_ms, "p99_ms": r.p99_ms, "overhead_p50_ms": r.p50_ms - base,
                     "p50_ms_by_prompt_tokens": r.p50_by_length()} for r in results]}


def from_json(run: dict) -> list[ModeResult]:
    """The results of a saved `bench-pd --json` run (to print its tables again: `bench-pd --report`)."""
    names = {f.name for f in dataclasses.fields(ModeResult)}
    out = []
    for m in run["modes"]:
        r = ModeResult(**{k: v for k, v in m.items() if k in names})
        r.breakdown = {int(n): {stage: tuple(v) for stage, v in stages.items()} for n, stages in r.breakdown.items()}
        out.append(r)
    return out


def dump(results: list[ModeResult], as_json: bool, config: BenchConfig | None = None) -> str:
    if as_json:
        return json.dumps(to_json(results, config))
    parts = [table(results)] + [timelines.table(r.mode, r.breakdown) for r in results if r.breakdown]
    return "\n\n".join(parts)
