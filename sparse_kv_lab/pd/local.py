"""A local PD pair: a prefill engine, a decode engine and a router on this machine, on free ports, with the tiny
seeded model (sparse_kv_lab.pd.model), for `python -m connector serve-local`.

Every process is started in a process group of its own and tied to this one (sparse_kv_lab.pd.servers.die_with_parent:
if the launcher is killed outright, the kernel still tells each server to stop); `stop()` ends every group, router
first. Waits are bounded, and a server that dies or does not come up is named with the last lines of its log. The
auth token between prefill and decode is fresh per run and reaches the engines in a file (`auth_token_file`, mode
0600 in the work folder), so vLLM prints its path, never the token; so is a prefill key (`prefill_key_file`), whose
public half decode trusts alone (`trusted_prefill_keys`): the pair is set up as README, Security advises."""

from __future__ import annotations

import json
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from connector.core.errors import ConfigError
from connector.protocol.auth import engine_public_key, new_engine_key
from sparse_kv_lab.pd import flows
from sparse_kv_lab.pd.client import complete, completion_body, prompt_ids
from sparse_kv_lab.pd.model import TinyLlama
from sparse_kv_lab.pd.servers import ScriptServer, ServerSpec, VllmServer, metric, sparse_kv_config, start_all
from connector.transport.ports import free_ports

ROOT = Path(__file__).resolve().parents[2]
"""The source tree: examples/ holds the routers."""
FLOWS = {"concurrent": "proxy.py", "sequential": "sequential_router.py"}
"""Router script per flow: both legs at once (KV pushed while prefill computes), or vLLM's prefill-then-decode."""
TOKEN_FILE = "auth-token"
KEY_FILE = "prefill.key"
METRIC_WAIT_S = 15.0
"""How long the check waits for decode's /metrics to show the transfer (vLLM publishes it with its step stats)."""


WARM_PROMPT = "warm up the pair " * 20
"""340 tokens of the tiny tokenizer (a byte each): two full blocks, so the warm-up moves KV as a user's request does."""
LOCAL_HANDSHAKE_TIMEOUT_S = 60.0
"""serve-local's side-channel handshake timeout (see where it is set)."""


@dataclass(frozen=True)
class LocalConfig:
    engine_python: str
    """Python of a vLLM environment (tools/cpu-engine-env.sh builds .venv-cpu)."""
    work_dir: Path
    """The model, the request body and the logs go here."""
    flow: str = "concurrent"
    router_port: int | None = None
    """None: a free port (so for the three below)."""
    prefill_port: int | None = None
    """Prefill's HTTP (OpenAI) port."""
    side_channel_port: int | None = None
    """Prefill's side channel (decode's KV handshakes; the concurrent router names it)."""
    decode_port: int | None = None
    timeout_s: float = 600.0
    """Longest wait for the engines to be healthy (both start at once)."""
    prompt_tokens: int = 600
    max_tokens: int = 8


def chosen_ports(config: LocalConfig) -> dict[str, int]:
    """Every port by its flag: the one given (free and distinct from the others, else ConfigError naming the flag),
    or a free one."""
    given = {"--port": config.router_port, "--prefill-port": config.prefill_port,
             "--side-channel-port": config.side_channel_port, "--decode-port": config.decode_port}
    seen: dict[int, str] = {}
    for flag, port in given.items():
        if port is None:
            continue
        if port in seen:
            raise ConfigError(f"{flag} {port} is also {seen[port]}: every server needs a port of its own; give "
                              f"another or leave one out (a free port is chosen)")
        seen[port] = flag
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError as exc:
                raise ConfigError(f"{flag} {port} is not free on 127.0.0.1 ({exc.strerror}): stop what listens there "
                                  f"(`ss -ltnp 'sport = :{port}'`) or give another port") from None
    out = {}
    for flag, port in given.items():
        while port is None or port in seen and seen[port] != flag:
            port = free_ports()
        seen[port] = flag
        out[flag] = port
    return out


@dataclass(frozen=True)
class Check:
    """One request through the router, against decode computing the same prompt alone."""

    pd_tokens: list[int]
    alone_tokens: list[int]
    received_bytes: float
    """Decode's vllm:sparse_kv_bytes_received_total after the PD request."""

    @property
    def token_equal(self) -> bool:
        return self.pd_tokens == self.alone_tokens


class LocalPair:
    def __init__(self, config: LocalConfig, log: Callable[[str], None] = print) -> None:
        if config.flow not in FLOWS:
            raise ConfigError(f"flow {config.flow!r}: choose one of {sorted(FLOWS)}")
        script = ROOT / "examples" / FLOWS[config.flow]
        if not script.exists():
            raise ConfigError(f"{script} is missing: serve-local runs the routers of the source tree's examples/ "
                              f"(clone the repository and install it with `pip install -e .`)")
        self.config, self.log = config, log
        self.work_dir = Path(config.work_dir).resolve()
        logs = self.work_dir / "logs"
        ports = chosen_ports(config)
        model = TinyLlama().write(self.work_dir / "tiny-llama")
        self.side_port = ports["--side-channel-port"]
        self.token_path = self.work_dir / TOKEN_FILE
        self.token_path.touch(mode=0o600)
        self.token_path.chmod(0o600)
        self.token_path.write_text(secrets.token_hex(32) + "\n")
        prefill_key, self.key_path = new_engine_key(), self.work_dir / KEY_FILE
        self.key_path.touch(mode=0o600)
        self.key_path.chmod(0o600)
        self.key_path.write_text(prefill_key.hex() + "\n")
        # Both engines share a laptop's cores: there the first handshake (UCX starting, NIXL loading the peer) has
        # taken over 10 s, the production default (CI, 2 cores: timed out at 10.0 s, the request answered HTTP 500).
        common = {"auth_token_file": str(self.token_path), "handshake_timeout_s": LOCAL_HANDSHAKE_TIMEOUT_S,
                  "limits": {"handshake_deadline_s": LOCAL_HANDSHAKE_TIMEOUT_S}}
        prefill_kv = sparse_kv_config("kv_producer", side_channel_port=self.side_port,
                                      prefill_key_file=str(self.key_path), **common)
        self.prefill = VllmServer(ServerSpec("prefill", model, ports["--prefill-port"], kv_transfer_config=prefill_kv,
                                             tokenizer=True),
                                  config.engine_python, logs, tie_to_parent=True)
        decode_kv = sparse_kv_config("kv_consumer", trusted_prefill_keys=[engine_public_key(prefill_key).hex()],
                                     **common)
        self.decode = VllmServer(ServerSpec("decode", model, ports["--decode-port"], kv_transfer_config=decode_kv,
                                            tokenizer=True),
                                 config.engine_python, logs, tie_to_parent=True)
        legs = (["--prefill", f"{self.prefill.url},{self.side_channel}"] if config.flow == "concurrent"
                else ["--prefill", self.prefill.url])
        self.router = ScriptServer("router", config.engine_python, script, [*legs, "--decode", self.decode.url],
                                   ports["--port"], logs, tie_to_parent=True)
        self.request_path = self.work_dir / "request.json"

    @property
    def side_channel(self) -> str:
        return f"127.0.0.1:{self.side_port}"

    @property
    def processes(self) -> list:
        return [self.prefill, self.decode, self.router]

    def start(self) -> None:
        """Both engines at once, then the router; raises ServerError naming the one that failed (all stopped)."""
        began = time.monotonic()
        self.log(f"starting prefill and decode (vLLM in {self.config.engine_python}; on a laptop CPU they take 30-120 "
                 f"s; waiting at most {self.config.timeout_s:.0f} s), logs in {self.work_dir / 'logs'}")
        start_all([self.prefill, self.decode], timeout_s=self.config.timeout_s)
        self.log(f"prefill and decode healthy after {time.monotonic() - began:.0f} s")
        try:
            # examples/proxy.py listens once its start-up checks passed (a PD request through each engine):
            # seconds here, more on a machine whose cores the engines share
            self.router.start().wait_listening(timeout_s=max(60.0, self.config.timeout_s / 2))
        except BaseException:
            self.stop()
            raise
        self.request_path.write_text(json.dumps(self.body()) + "\n")

    def body(self, **extra: object) -> dict:
        """The long request (request.json): a seeded prompt of token ids, greedy; what the check compares."""
        return completion_body(prompt_ids(self.config.prompt_tokens, seed=1), self.config.max_tokens, **extra)

    def check(self) -> Check:
        """The request through the router, then the same prompt on decode alone (a fresh cache_salt: it computes
        everything itself); and what decode's /metrics says it received."""
        pd = complete(self.router.url, self.body()).token_ids
        alone = flows.local(self.decode.url, self.body()["prompt"], self.config.max_tokens, stream=False,
                            cache_salt=secrets.token_hex(8)).token_ids
        deadline = time.monotonic() + METRIC_WAIT_S
        received = 0.0
        while time.monotonic() < deadline:
            received = metric(self.decode.metrics(), "vllm:sparse_kv_bytes_received_total")
            if received:
                break
            time.sleep(0.5)
        return Check(pd, alone, received)

    def warm(self) -> float:
        """One streamed text request through the router (the tokenizer, detokenizing, the relay), after the check's
        KV transfer (or as the first one, with --no-check): what a first user request would otherwise pay. Returns
        its time to first token."""
        return complete(self.router.url, {"prompt": WARM_PROMPT, "max_tokens": 4, "stream": True,
                                             "return_token_ids": True}).ttft_s

    def dead(self) -> list[str]:
        """Names of the processes that exited."""
        return [p.name for p in self.processes if p.proc is not None and not p.alive()]

    def stop(self) -> None:
        """End every process group, the router first (idempotent)."""
        for process in (self.router, self.decode, self.prefill):
            process.stop(20)
