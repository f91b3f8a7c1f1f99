"""Secure by default (issue 33, item 4): a decode that would hand its memory to any token holder does not start that
way silently, a request cannot steer decode to a host it is not configured for, and a transfer without a secret is
refused unless the operator opts out. Pure checks of the settings and of decode's kv_transfer_params; the handshake
itself is tests/test_prefill_keys.py, real engines with keys on are tests/real_engine."""

from __future__ import annotations

import pytest

from connector.core.errors import ConfigError
from connector.protocol.addressing import host_allowed
from connector.protocol.auth import engine_public_key, new_engine_key
from connector.vllm.config import ConnectorSettings
from connector.vllm.requests import check_params

PUBLIC = engine_public_key(new_engine_key()).hex()


@pytest.mark.parametrize("role", ["kv_consumer", "kv_both"])
def test_a_decode_without_trusted_prefill_keys_refuses_to_start_saying_how_to_fix_it(role):
    with pytest.raises(ConfigError) as err:
        ConnectorSettings.from_extra_config({"auth_token": "t" * 32}).check_trust(role)
    text = str(err.value)
    for needle in ("no trusted_prefill_keys", "keygen", "prefill_key_file", "insecure_any_prefill", "WRITE"):
        assert needle in text, text


def test_keys_or_the_explicit_opt_out_let_a_decode_start_and_a_prefill_needs_neither():
    ConnectorSettings.from_extra_config({"trusted_prefill_keys": [PUBLIC]}).check_trust("kv_consumer")
    ConnectorSettings.from_extra_config({"insecure_any_prefill": True}).check_trust("kv_both")
    ConnectorSettings.from_extra_config({}).check_trust("kv_producer")


def test_transfers_without_a_secret_are_refused_by_default():
    assert ConnectorSettings.from_extra_config({}).require_transfer_secret is True


@pytest.mark.parametrize("host, allowed, ok", [
    ("10.0.0.5", [], True),
    ("10.0.0.5", ["10.0.0.5"], True),
    ("10.0.0.5", ["10.0.0.0/16"], True),
    ("10.1.0.5", ["10.0.0.0/16"], False),
    ("prefill-0.prefill.svc", ["prefill-0.prefill.svc"], True),
    ("evil.example", ["prefill-0.prefill.svc", "10.0.0.0/8"], False),
    ("::1", ["::1/128"], True),
    ("127.0.0.1", ["10.0.0.0/8"], False),
])
def test_allowed_prefill_hosts_match_names_addresses_and_networks(host, allowed, ok):
    assert host_allowed(host, allowed) is ok


def test_a_request_cannot_steer_decode_to_a_host_it_is_not_configured_for():
    params = {"do_remote_prefill": True, "transfer_id": "t1", "prefill_addr": "203.0.113.9:5600"}
    problem = check_params(params, decode=True, allowed_hosts=("10.0.0.0/16",))
    assert "allowed_prefill_hosts" in problem and "203.0.113.9" in problem, problem
    assert check_params(dict(params, prefill_addr="10.0.3.4:5600"), decode=True, allowed_hosts=("10.0.0.0/16",)) == ""


@pytest.mark.parametrize("entry", ["10.0.0.0/99", "not a host!", ""])
def test_a_bad_allowed_prefill_hosts_entry_is_named(entry):
    with pytest.raises(ConfigError, match=r"allowed_prefill_hosts\[0\]"):
        ConnectorSettings.from_extra_config({"allowed_prefill_hosts": [entry], "insecure_any_prefill": True}
                                            ).check_trust("kv_consumer")
