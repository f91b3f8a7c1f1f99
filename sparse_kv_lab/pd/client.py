"""OpenAI `/v1/completions` over plain HTTP (stdlib only): token-id prompts in, token ids and timings out.

The servers run with `--skip-tokenizer-init`, so prompts are token ids and `return_token_ids` gives the generated
ids back (streamed too). Greedy decoding with `ignore_eos`: every run of a prompt generates exactly
`max_tokens` ids, and two engines agree iff they computed the same thing."""

from __future__ import annotations

import http.client
import json
import random
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from connector.core.errors import RequestFailed


@dataclass
class Completion:
    token_ids: list[int]
    ttft_s: float
    """Request sent to first generated token received (streamed), or to the whole answer (not streamed)."""
    total_s: float
    finish_reason: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    raw: dict[str, Any] = field(default_factory=dict)


def prompt_ids(length: int, seed: int, vocab: int = 32000) -> list[int]:
    """A reproducible prompt of `length` token ids (3.. avoids the special ids 0-2)."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def completion_body(prompt: list[int], max_tokens: int = 16, *, stream: bool = False, **extra: Any) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, "stream": stream}
    return body | extra


def complete(base_url: str, body: dict[str, Any], *, timeout_s: float = 120.0,
             path: str = "/v1/completions") -> Completion:
    """POST `body`; streamed answers are read as SSE and timed at their first token."""
    parts = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    start = time.monotonic()
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RequestFailed(base_url, resp.status, resp.read().decode(errors="replace"))
        if not body.get("stream"):
            data = json.loads(resp.read())
            end = time.monotonic()
            choice = data["choices"][0]
            return Completion(list(choice.get("token_ids") or []), end - start, end - start,
                              choice.get("finish_reason"), data.get("kv_transfer_params"), data)
        return _read_stream(base_url, resp, start)
    finally:
        conn.close()


def _read_stream(base_url: str, resp: http.client.HTTPResponse, start: float) -> Completion:
    ids: list[int] = []
    first: float | None = None
    finish = None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            break
        event = json.loads(payload)
        if "error" in event:
            raise RequestFailed(base_url, 500, json.dumps(event["error"]))
        for choice in event.get("choices", []):
            new = choice.get("token_ids") or []
            if new and first is None:
                first = time.monotonic()
            ids.extend(new)
            finish = choice.get("finish_reason") or finish
    end = time.monotonic()
    return Completion(ids, (first or end) - start, end - start, finish)
