"""examples/proxy.py's prefill instances and their data-parallel ranks, which rank a request goes to, what prefill's
answer must confirm, and the start-up checks that catch a misconfigured router before any request.

A prefill started with `--data-parallel-size N` (vLLM's own load balancer behind one API server) is N engines, each
with its own side channel: DP rank r's rank (pp0, tp0) listens on side_channel_port + r * tp * pp
(connector.protocol.addressing.engine_base_port). The concurrent flow must tell decode the side channel before
prefill runs, so the router picks the rank itself and pins the prefill leg to it with vLLM's `X-data-parallel-rank`
header (honoured by vLLM's OpenAI server, completions and chat, 0.32 and 0.33). Needs aiohttp only; the side-channel
probe borrows the connector's frame encoding (no vLLM import)."""

from __future__ import annotations

import asyncio
import json
import secrets
import struct
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

DP_HEADER = "X-data-parallel-rank"
"""vLLM's header naming the data-parallel rank a request must run on (an out-of-range rank: HTTP 400)."""
MAX_ANSWER_BYTES = 4 << 20
"""The most of a prefill leg's answer the router reads (a 1-token completion is a few kB)."""


async def read_capped(content: aiohttp.StreamReader, limit: int) -> bytes:
    """The body up to `limit` bytes (a peer's answer: what is beyond is not read)."""
    chunks, size = [], 0
    while size < limit and (chunk := await content.read(limit - size)):
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def check_url(url: str) -> str:
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"not an http(s) URL: {url!r}")
    return url.strip().rstrip("/")


@dataclass(frozen=True)
class Prefill:
    url: str
    """Base URL of the prefill instance's OpenAI server, e.g. http://10.0.0.1:8100."""
    side_channel_addr: str
    """HOST:PORT of DP rank 0's side channel (`side_channel_host`/`side_channel_port`)."""
    dp: int = 1
    """Data-parallel ranks behind this URL (prefill's --data-parallel-size)."""
    ranks_per_dp: int = 1
    """Side-channel ports each DP rank takes: its tensor x pipeline parallel size."""
    spec: str = field(default="", compare=False)
    """The --prefill value as given (error messages quote it)."""

    @property
    def side_host(self) -> str:
        return self.side_channel_addr.rpartition(":")[0]

    def side_port(self, dp_rank: int) -> int:
        return int(self.side_channel_addr.rpartition(":")[2]) + dp_rank * self.ranks_per_dp

    def side_channel(self, dp_rank: int) -> str:
        """HOST:PORT of DP rank `dp_rank`'s side channel: what decode is told for a request pinned to that rank."""
        return f"{self.side_host}:{self.side_port(dp_rank)}"

    def name(self, dp_rank: int) -> str:
        return f"{self.url} DP rank {dp_rank}" if self.dp > 1 else self.url


def parse_prefill(spec: str) -> Prefill:
    """`http://HOST:8100,HOST:5600[,dp=2][,tp=1][,pp=1]` -> Prefill. The side channel is not derivable from the URL
    (own port); dp/tp/pp are prefill's --data-parallel-size, --tensor-parallel-size, --pipeline-parallel-size."""
    url, sep, rest = spec.partition(",")
    side, *options = [p.strip() for p in rest.split(",")]
    host, _, port = side.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--prefill wants URL,SIDE_HOST:SIDE_PORT[,dp=N][,tp=N][,pp=N], got {spec!r}")
    sizes = {"dp": 1, "tp": 1, "pp": 1}
    for option in options:
        key, eq, value = option.partition("=")
        if key not in sizes or not eq or not value.isdigit() or not 0 < int(value) <= 1024:
            raise ValueError(f"--prefill {spec!r}: {option!r} is not dp=N, tp=N or pp=N (N from 1 to 1024)")
        sizes[key] = int(value)
    ranks = sizes["tp"] * sizes["pp"]
    if int(port) + sizes["dp"] * ranks - 1 > 65535:
        raise ValueError(f"--prefill {spec!r}: {sizes['dp']} DP rank(s) of {ranks} side-channel port(s) each do not "
                         f"fit above port {port}")
    return Prefill(check_url(url), side, sizes["dp"], ranks, spec)


class RankPicker:
    """Which (prefill, DP rank) a request goes to: the one with the fewest requests in flight through this router,
    ties taken round-robin (so one request at a time visits every rank in turn)."""

    def __init__(self, prefills: list[Prefill]) -> None:
        self.slots = [(p, r) for p in prefills for r in range(p.dp)]
        self.in_flight = [0] * len(self.slots)
        self._next = 0

    def take(self) -> int:
        n = len(self.slots)
        order = [(self._next + i) % n for i in range(n)]
        slot = min(order, key=lambda i: self.in_flight[i])
        self.in_flight[slot] += 1
        self._next = (slot + 1) % n
        return slot

    def give_back(self, slot: int) -> None:
        self.in_flight[slot] -= 1


def confirm_prefill(prefill: Prefill, dp_rank: int, status: int, raw: bytes) -> str:
    """"" when prefill's 2xx answer confirms it kept the KV for decode on the rank decode was told; else why no rank
    will serve decode's transfer (the router then ends the decode leg instead of leaving it waiting). The answer is
    the peer's: untrusted, parsed defensively."""
    try:
        params = json.loads(raw).get("kv_transfer_params")
    except (ValueError, AttributeError):
        return f"its answer (HTTP {status}) is not a JSON object"
    if not isinstance(params, dict) or not params:
        return ("it answered without kv_transfer_params, so it ran the prompt as a plain request and holds no KV "
                "for decode: is this URL a decode (--prefill and --decode swapped?) or an engine without "
                "SparseKVConnector as kv_producer/kv_both?")
    rank = params.get("prefill_dp_rank")
    if isinstance(rank, int) and rank != dp_rank and prefill.dp == 1:
        return (f"DP rank {rank} served it (vLLM's load balancer chose it), but decode was told DP rank 0's side "
                f"channel: this prefill runs data parallel; give its size, --prefill "
                f"{prefill.url},{prefill.side_channel_addr},dp=N, so the router picks the rank")
    if isinstance(rank, int) and rank != dp_rank:
        return (f"DP rank {rank} served it, but decode was told DP rank {dp_rank}'s side channel: the server ignored "
                f"the {DP_HEADER} header (a vLLM without it, or a load balancer in between that drops it)")
    addr = params.get("prefill_addr")
    if isinstance(addr, str) and addr.rpartition(":")[2] != str(prefill.side_port(dp_rank)):
        return (f"its KV waits at side channel {addr[:200]!r}, but decode was told {prefill.side_channel(dp_rank)}: "
                f"give --prefill the side_channel_port of DP rank 0 and prefill's dp=, tp= and pp= sizes "
                f"(now dp={prefill.dp}, {prefill.ranks_per_dp} port(s) per DP rank)")
    return ""


# ---- start-up checks -------------------------------------------------------------------------------------------

class StartupError(Exception):
    """A router configuration that cannot work: the message names the flag and the fix."""


async def probe_side_channel(host: str, port: int, timeout_s: float) -> str:
    """What listens at host:port: "side channel" (it answered a frame), "http" (an HTTP server), or why neither
    ("unreachable: ...", "closed", "silent"). Sends one connector frame (a Reject, so nothing is registered; prefill
    logs one refused-handshake line) followed by an empty line, which an HTTP server answers with 400."""
    try:
        from connector.protocol.messages import HEADER, Reject, encode_frame
    except ImportError as exc:
        raise StartupError(f"the side-channel check speaks the connector's frames, and this python has no connector "
                           f"package ({exc}): run the proxy with vLLM's python (where SparseKVConnector is installed), "
                           f"pip install sparse-kv-connector here, or pass --no-startup-checks") from None

    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, asyncio.TimeoutError) as exc:
        return f"unreachable: {type(exc).__name__}: {exc}".rstrip(": ")
    try:
        writer.write(encode_frame(Reject("examples/proxy.py start-up check: is this a side channel?")) + b"\r\n\r\n")
        await writer.drain()
        head = await asyncio.wait_for(reader.read(HEADER.size), timeout_s)
        if not head:
            return "closed"
        if head.startswith((b"HTTP", b"<")):  # a status line, or an HTTP/0.9 answer (an HTML error page)
            return "http"
        if len(head) == HEADER.size and HEADER.unpack(head)[0] <= 1 << 20 and HEADER.unpack(head)[1] < 256:
            return "side channel"
        return f"other: it answered {head!r}, which is no frame of a side channel"
    except asyncio.TimeoutError:
        return "silent"
    except OSError as exc:
        return f"closed: {exc}"
    finally:
        writer.close()


async def check_side_channels(prefills: list[Prefill], deadline: float, timeout_s: float = 5.0) -> None:
    """Every DP rank's side channel answers as a side channel; one that is an HTTP port fails at once, one that
    does not answer yet (the engine still starts) is asked again until `deadline` (loop time)."""
    loop = asyncio.get_running_loop()
    for p, rank in ((p, r) for p in prefills for r in range(p.dp)):
        while True:
            got = await probe_side_channel(p.side_host.strip("[]"), p.side_port(rank), timeout_s)
            if got == "side channel":
                break
            if got == "http" or got.startswith("other"):
                raise StartupError(
                    f"--prefill {p.spec or p.url}: {p.side_channel(rank)} (side channel of {p.name(rank)}) answers "
                    f"{'HTTP: it is an HTTP port' if got == 'http' else got}, not prefill's side channel. After the "
                    f"comma give prefill's side_channel_host:side_channel_port (kv_connector_extra_config; default "
                    f"port 5600), not its API port: --prefill {p.url},HOST:SIDE_CHANNEL_PORT")
            if loop.time() >= deadline:
                raise StartupError(
                    f"--prefill {p.spec or p.url}: no side channel at {p.side_channel(rank)} ({p.name(rank)}): "
                    f"{got}. Is prefill up, and is that its side_channel_port (DP rank r listens on side_channel_port "
                    f"+ r * tp * pp: give dp=, tp=, pp=)? --startup-wait sets how long the router waits")
            await asyncio.sleep(1.0)


async def wait_healthy(session: aiohttp.ClientSession, urls: list[str], deadline: float) -> None:
    loop = asyncio.get_running_loop()
    for url in urls:
        while True:
            try:
                async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 200:
                        break
                    why = f"HTTP {r.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                why = f"{type(exc).__name__}: {exc}".rstrip(": ")
            if loop.time() >= deadline:
                raise StartupError(f"{url}/health does not answer 200 ({why}); --startup-wait sets how long the "
                                   f"router waits for the engines")
            await asyncio.sleep(1.0)


async def served_model(session: aiohttp.ClientSession, url: str, timeout_s: float, headers: dict[str, str]) -> str:
    try:
        async with session.get(url + "/v1/models", headers=headers,
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            data = json.loads(await read_capped(r.content, MAX_ANSWER_BYTES))
        return str(data["data"][0]["id"])
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise StartupError(f"{url}/v1/models names no model ({type(exc).__name__}: {exc}): is it vLLM's OpenAI "
                           f"server?") from None


def warmup_body(model: str) -> dict[str, Any]:
    """A 16-token prompt, one token out, its own prefix-cache salt (it neither hits nor leaves shared blocks)."""
    return {"model": model, "prompt": list(range(3, 19)), "max_tokens": 1, "temperature": 0.0, "ignore_eos": True,
            "cache_salt": secrets.token_hex(16)}


RECVS_OK = "vllm:sparse_kv_recvs_ok_total"
"""The decode counter of requests whose KV arrived (SparseKVConnector's stats, on vLLM's /metrics)."""
SENDS_OK = "vllm:sparse_kv_sends_ok_total"
"""The prefill counter of requests whose KV every rank finished sending."""
KV_ARRIVAL_S = 60.0
"""How long the start-up check waits for the engines' /metrics to count the check request's KV (they lag a step;
more on a machine whose processes stall)."""


async def counter(session: aiohttp.ClientSession, url: str, name: str) -> float | None:
    """Sum of the samples of counter `name` on url's /metrics; None when they do not answer or name none."""
    try:
        async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
            text = (await read_capped(r.content, 16 << 20)).decode(errors="replace") if r.status == 200 else ""
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None
    found = None
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            try:
                found = (found or 0.0) + float(line.rpartition(" ")[2])
            except ValueError:
                continue
    return found


async def counted(session: aiohttp.ClientSession, url: str, name: str, before: float | None) -> str:
    """"" once url's counter `name` is above `before`, within KV_ARRIVAL_S; else what it shows."""
    loop = asyncio.get_running_loop()
    timeout_s = KV_ARRIVAL_S
    deadline = loop.time() + timeout_s
    while True:
        now = await counter(session, url, name)
        if now is not None and now > (before or 0.0):
            return ""
        if loop.time() >= deadline:
            return (f"its /metrics name no {name}" if now is None else
                    f"its {name} stayed at {now:g} for {timeout_s:g} s after the request")
        await asyncio.sleep(0.5)


async def check_kv_moved(session: aiohttp.ClientSession, prefill: Prefill, dp_rank: int, decode: str,
                         before: tuple[float | None, float | None]) -> None:
    """Decode counted the check request's KV received, and prefill counted it sent (their /metrics lag a step).
    A decode that computed the prompt itself (a URL that is really a prefill, an engine without the connector)
    counts nothing."""
    why = await counted(session, decode, RECVS_OK, before[1])
    if why:
        raise StartupError(f"--decode {decode}: a 16-token check request through {prefill.name(dp_rank)} did not "
                           f"load KV: {why}, so it computed the prompt itself. Is this URL a decode with "
                           f"SparseKVConnector as kv_consumer/kv_both (a prefill's URL here, --prefill and --decode "
                           f"swapped?), and is its log free of transfer errors?")
    why = await counted(session, prefill.url, SENDS_OK, before[0])
    if why:
        raise StartupError(f"--prefill {prefill.spec or prefill.url}: decode {decode} loaded the check request's KV "
                           f"but {prefill.name(dp_rank)} did not count it sent: {why}. See prefill's log")
