"""Caches that are not one row per token (connector.core.descriptors.group_range, connector.engine.sender_state):
blocks of another size than the rank's unit, per-request states (a ring's one block, a Mamba state's running block
before its speculative scratch blocks) that move whole only with the request's last tokens, and the refusal of a
registration whose state prefill would take too far past where decode resumes. Pure, no I/O."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from connector.core.descriptors import batch_descriptors, batch_pool_bytes, group_range
from connector.core.errors import RegistrationError
from connector.core.layout import Region
from connector.core.plan import Endpoint, Route
from connector.engine.sender_state import SendRequest, check_against_request
from connector.protocol.messages import Register
from tests.test_descriptors import apply, buffer_region


def region(buf, pool, block_size, per_request=False, scratch=0, group=0):
    return msgspec.structs.replace(buffer_region(buf, pool, 0, (0, 1), 1), block_size=block_size, group=group,
                                   per_request=per_request, scratch_blocks=scratch)


def test_blocks_of_another_size_are_counted_in_the_rank_unit():
    buf = np.zeros((1, 8, 1, 16), np.uint8)
    big, same = region(buf, "a", 64), region(buf, "b", 16)
    assert group_range(same, 3, 7, unit=16) == slice(3, 7)
    assert group_range(big, 0, 4, unit=16) == slice(0, 1)  # tokens 0-63: block 0 of 64 tokens, full
    assert group_range(big, 4, 6, unit=16) == slice(1, 2)  # tokens 64-95: block 1, partly filled, sent again later
    assert group_range(big, 5, 9, unit=16) == slice(1, 3)


@pytest.mark.parametrize("scratch, ids, want", [(0, [7], [7]), (0, [0, 0, 5, 9], [9]), (2, [0, 4, 6, 8], [4])])
def test_a_per_request_state_is_its_running_block_and_moves_only_when_final(scratch, ids, want):
    state = region(np.zeros((1, 10, 1, 8), np.uint8), "mixer", 4096, per_request=True, scratch=scratch)
    assert ids[group_range(state, 0, 3, final=False, unit=16)] == []
    assert ids[group_range(state, 0, 3, final=True, unit=16)] == want


def test_a_ring_moves_whole_once_with_the_last_layer_batch_and_paged_blocks_by_their_own_size():
    """One layer with a 64-token paged cache (group 0) and a ring (group 1); the rank's unit is 16 tokens."""
    rng = np.random.default_rng(1)
    src_paged, dst_paged = rng.integers(0, 255, (1, 6, 1, 32), dtype=np.uint8), np.zeros((1, 6, 1, 32), np.uint8)
    src_ring, dst_ring = rng.integers(0, 255, (1, 4, 1, 24), dtype=np.uint8), np.zeros((1, 4, 1, 24), np.uint8)
    src = {("p", 0): region(src_paged, "p", 64), ("r", 0): region(src_ring, "r", 8, per_request=True, group=1)}
    dst = {("p", 0): region(dst_paged, "p", 64), ("r", 0): region(dst_ring, "r", 8, per_request=True, group=1)}
    routes = {0: [Route(pool, 0, Endpoint(0, 0, 0), Endpoint(0, 0, 0), (0, 1), 0) for pool in ("p", "r")]}
    src_ids, dst_ids = [[2, 4], [3]], [[1, 5], [2]]
    # chunk 1: tokens 0-79 computed of 100 decode wants: the 64-token blocks 0 and 1 (1 partly), no ring yet
    first = [(0, 0, 5, False)]
    assert batch_pool_bytes(src, dst, routes, first, dst_ids, unit=16) == {"p": 64, "r": 0}
    # chunk 2, the last: block 1 again (now full) and the ring, whole
    last = [(0, 4, 7, True)]
    assert batch_pool_bytes(src, dst, routes, last, dst_ids, unit=16) == {"p": 32, "r": 24}
    for spans in (first, last):
        for pool, s_buf, d_buf in (("p", src_paged, dst_paged), ("r", src_ring, dst_ring)):
            one = {0: [r for r in routes[0] if r.pool == pool]}
            apply(batch_descriptors(src, dst, one, spans, src_ids, dst_ids, unit=16), s_buf, d_buf)
    assert (dst_paged[0, 1] == src_paged[0, 2]).all() and (dst_paged[0, 5] == src_paged[0, 4]).all()
    assert not dst_paged[0, [0, 2, 3, 4]].any()
    assert (dst_ring[0, 2] == src_ring[0, 3]).all() and not dst_ring[0, [0, 1, 3]].any()


def register(num_tokens: int) -> Register:
    return Register("t", 0, 0, [], 0, num_tokens)


@pytest.mark.parametrize("states, prefill_tokens, ok", [
    (None, 101, True),            # no per-request state: decode recomputes the last token, any count fits
    ((1, "ring"), 101, True),     # a ring taken one token past decode's resume point: decode rewrites that row
    ((1, "ring"), 164, False),    # decode resumed at a block boundary far before: the ring lost rows it needs
    ((0, "mixer"), 100, True),    # a Mamba state: prefill stopped where decode resumes
    ((0, "mixer"), 101, False),   # ... else decode would take that token twice
])
def test_a_state_taken_past_decodes_resume_point_is_refused_by_name(states, prefill_tokens, ok):
    req = SendRequest("t", prefill_tokens, [[1]])
    if ok:
        check_against_request(req, register(100), ("d", 0, 0), (0, 0), states)
        return
    with pytest.raises(RegistrationError, match=rf"decode resumes at token 100 but prefill's {states[1]} will hold "
                                                rf"the state after {prefill_tokens} tokens"):
        check_against_request(req, register(100), ("d", 0, 0), (0, 0), states)
