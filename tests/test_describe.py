"""A pair whose caches differ is refused naming what differs (connector.core.describe, Hello's layout): pure."""

from __future__ import annotations

import msgspec
import pytest

from connector.core.describe import describe_model, layout_difference
from connector.core.errors import ControlError
from connector.core.layout import ParallelLayout
from connector.protocol.auth import identity, new_nonce
from connector.protocol.handshake import check_hello, layout_of_hello
from connector.protocol.messages import Hello, decode_frame, encode_frame
from tests.helpers import make_model, rank_hello


def hellos(prefill_kinds: str, decode_kinds: str, **decode_kw) -> tuple[Hello, Hello]:
    p, d = make_model(prefill_kinds), make_model(decode_kinds, **decode_kw)
    # as they go on the wire (identity: no memory), with their nonces
    return tuple(msgspec.structs.replace(identity(rank_hello(m, role, ParallelLayout.build(m.num_layers, 1, 1))),
                                         nonce=new_nonce()) for m, role in ((p, "prefill"), (d, "decode")))


def test_describe_model_names_every_pool_with_its_layers_and_sizes():
    text = describe_model(make_model("ddkkvv"))
    assert text == ("kv on layers 0-5 (4 head(s) x 512 B per token, sharded over TP), index_k on layers 2-5 "
                    "(1 head(s) x 256 B per token, on every TP rank), index_v on layers 4-5 (1 head(s) x 256 B per "
                    "token, on every TP rank)")
    assert describe_model(make_model("dd")).endswith("no index_k, no index_v")


@pytest.mark.parametrize("a, b, kw, expected", [
    ("ddk", "dd", {}, "prefill has 3 layers, decode 2"),
    ("ddkv", "ddkk", {}, "prefill has index_v on layers 3 that decode lacks"),
    ("dkkd", "ddkk", {}, "prefill has index_k on layers 1 that decode lacks; decode has index_k on layers 3 that "
                         "prefill lacks"),
    ("ddk", "ddk", {"kv_heads": 8}, "prefill keeps kv on layers 0-2 (4 head(s) x 512 B per token, sharded over TP), "
                                    "decode kv on layers 0-2 (8 head(s)"),
    ("ddk", "ddk", {"index_dim": 64}, "prefill keeps index_k on layers 2 (1 head(s) x 256 B per token"),
])
def test_layout_difference_says_the_first_thing_that_differs(a, b, kw, expected):
    assert expected in layout_difference(make_model(a), make_model(b, **kw), me="prefill", them="decode")


def test_same_layouts_differ_in_nothing():
    assert layout_difference(make_model("ddkv"), make_model("ddkv", name="other name")) == ""


def test_a_refused_pair_is_told_what_differs_not_two_hashes():
    prefill, decode = hellos("ddk", "dd")
    with pytest.raises(ControlError) as err:
        check_hello(decode, prefill)
    assert "different KV caches: decode decode-engine has 2 layers, prefill prefill-engine 3" in str(err.value)
    assert "Serve the same model" in str(err.value)
    prefill, decode = hellos("ddk", "ddk", kv_heads=2)
    with pytest.raises(ControlError, match=r"decode decode-engine keeps kv on layers 0-2 \(2 head\(s\)"):
        check_hello(decode, prefill)


def test_the_layout_survives_the_wire_and_a_forged_one_falls_back_to_the_fingerprints():
    prefill, decode = hellos("ddkv", "ddkv")
    received = decode_frame(encode_frame(decode))
    assert layout_of_hello(received).fingerprint() == decode.fingerprint
    check_hello(received, prefill)  # same caches: accepted
    # a layout that is not what the fingerprint is of is not trusted to explain anything
    forged = msgspec.structs.replace(decode, fingerprint="0" * 16)
    with pytest.raises(ControlError, match="model fingerprints 0000000000000000 \\(decode\\) and"):
        check_hello(forged, prefill)
    # an older-style Hello without a layout still gets the fingerprints
    bare = msgspec.structs.replace(decode, layout=[], fingerprint="1" * 16)
    with pytest.raises(ControlError, match="model fingerprints 1111111111111111"):
        check_hello(bare, prefill)
