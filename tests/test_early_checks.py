"""Mistakes caught before vLLM loads a model (connector.vllm.early), in vLLM 0.33's real VllmConfig: a misspelt
kv_connector_extra_config key fails while the VllmConfig is built (the class lookup), with the key, its value, a
"did you mean" and the valid keys, by module path and by name; kv_role and the token's source too; a busy
side-channel port names the setting. And the requests that ask an engine for the other role's work: one warning,
counted in the scheduler's stats. (tests/real_engine/test_real_early_checks.py: the same on `vllm serve`.)"""

from __future__ import annotations

import logging
import socket
from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm", reason="needs vllm==0.33.0")

from tests import vllm_harness as H  # noqa: E402

if H.VLLM_IMPORT_ERROR is not None:  # pragma: no cover
    pytest.skip(f"vllm import failed: {H.VLLM_IMPORT_ERROR!r}", allow_module_level=True)

import connector  # noqa: E402
from connector.core.errors import ConfigError  # noqa: E402
from connector.transport.ports import free_ports  # noqa: E402
from connector.vllm import early  # noqa: E402
from connector.vllm.config import ConnectorSettings  # noqa: E402
from connector.vllm.stats import SparseKVConnectorStats  # noqa: E402
from tests.helpers import log_records  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return H.write_m3_config(tmp_path_factory.mktemp("m3"), num_layers=6, dense_layers=2)


@pytest.mark.parametrize("by_name", [False, True])
def test_a_misspelt_key_fails_while_the_vllm_config_is_built(model_dir, by_name, monkeypatch):
    if by_name:  # the registry's loader (the entry point's registration), no kv_connector_module_path
        connector.register()
        monkeypatch.setattr(H, "SPARSE_KV_MODULE", None)
    monkeypatch.setattr(early, "_checked", {})  # (each config is checked and logged once per process)
    built = []
    with log_records("connector.vllm.early") as logged, pytest.raises(ValueError) as err:
        cfg = H.make_vllm_config(model_dir, kv_role="kv_producer", extra_config={"side_chanel_port": 5600})
        built.append(cfg)
    assert not built  # refused inside VllmConfig(...): no scheduler, worker or model was ever made
    text = str(err.value)
    assert "unknown kv_connector_extra_config key(s) ['side_chanel_port']: 'side_chanel_port' (value 5600): did " \
           "you mean 'side_channel_port'?; valid keys are ['" in text
    assert "'side_channel_port', " in text.split("valid keys are")[1]  # the sorted list of every setting follows
    assert [r.getMessage() for r in logged if r.levelno == logging.ERROR] == [
        next(line for line in text.splitlines() if "SparseKVConnector" in line).split("Value error, ")[-1]
        .split(" [type=value_error")[0]]


def test_kv_both_passes_and_an_unset_token_variable_fails_there_too(model_dir):
    H.make_vllm_config(model_dir, kv_role="kv_both")  # each request's kv_transfer_params decide (vLLM refuses others)
    with pytest.raises(ValueError, match="auth_token_env names 'SPARSE_KV_TEST_UNSET', which is unset or empty"):
        H.make_vllm_config(model_dir, kv_role="kv_consumer", extra_config={"auth_token_env": "SPARSE_KV_TEST_UNSET"})


def test_the_token_from_a_file_or_a_variable(tmp_path, monkeypatch):
    (tmp_path / "token").write_text("  from-a-file-of-more-than-16-chars\n")
    s = ConnectorSettings.from_extra_config({"auth_token_file": str(tmp_path / "token")})
    assert s.token() == "from-a-file-of-more-than-16-chars"
    assert s.sender_config("h", 1).side_channel.auth_token == "from-a-file-of-more-than-16-chars"
    assert s.receiver_config().side_channel.auth_token == "from-a-file-of-more-than-16-chars"
    monkeypatch.setenv("T19_TOKEN", "from-a-variable")
    assert ConnectorSettings.from_extra_config({"auth_token_env": "T19_TOKEN"}).token() == "from-a-variable"
    with pytest.raises(ConfigError, match="sets \\['auth_token', 'auth_token_file'\\]: give the auth token one way"):
        ConnectorSettings.from_extra_config({"auth_token": "x", "auth_token_file": "/f"})
    with pytest.raises(ConfigError, match="auth_token_file '/nonexistent/t' cannot be read: No such file"):
        ConnectorSettings.from_extra_config({"auth_token_file": "/nonexistent/t"}).token()
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        ConnectorSettings.from_extra_config({"auth_token_file": str(tmp_path / "empty")}).token()


def test_a_busy_side_channel_port_names_the_setting():
    from vllm.config import KVTransferConfig, ParallelConfig

    port = free_ports(2)
    ktc = KVTransferConfig(kv_connector="SparseKVConnector", kv_role="kv_producer",
                           kv_connector_extra_config={"side_channel_host": "127.0.0.1", "side_channel_port": port})
    starting = SimpleNamespace(parallel_config=ParallelConfig(tensor_parallel_size=2))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port + 1))
        busy.listen()
        with pytest.raises(ConfigError) as err:
            early.check_transfer_config(ktc, starting)
    assert str(err.value) == (
        f"SparseKVConnector: side_channel_port {port}: port {port + 1} (prefill rank (pp, tp) = (0, 1)) is already in "
        f"use on 127.0.0.1: stop what listens there (`ss -ltnp 'sport = :{port + 1}'` names it) or set "
        f"side_channel_port to a free range (2 port(s) from it; now {port}-{port + 1})")
    # A config built for anything but an engine about to start here (a test, a copy) probes no port.
    assert early.check_transfer_config(ktc) is not None




@pytest.mark.parametrize("role, params, needle", [
    ("kv_consumer", {"do_remote_decode": True}, "asks this kv_consumer (decode) engine to do_remote_decode, which "
                                                "only a kv_producer (prefill) engine does: the router sent its "
                                                "prefill leg to a decode engine"),
    ("kv_producer", {"do_remote_prefill": True, "transfer_id": "t", "prefill_addr": "127.0.0.1:5600"},
     "asks this kv_producer (prefill) engine to do_remote_prefill, which only a kv_consumer (decode) engine does: "
     "the router sent its decode leg to a prefill engine"),
])
def test_a_request_for_the_other_role_is_warned_and_counted(model_dir, role, params, needle):
    cfg = H.make_vllm_config(model_dir, kv_role=role, block_size=16)
    sched = H.make_scheduler(cfg, H.make_kv_cache_config(cfg, num_blocks=64), log_stats=True)
    counted = 0
    with log_records("connector.vllm.scheduler") as logged:
        for i in range(3):
            sched.add_request(H.make_request(f"r{i}", 40, kv_transfer_params=dict(params), max_tokens=2))
        for _ in range(6):
            _, outputs = H.run_step(sched)
            for eco in outputs.values():  # what vLLM hands its stat loggers (KVConnectorLogging, Prometheus)
                stats = eco.scheduler_stats and eco.scheduler_stats.kv_connector_stats
                counted += SparseKVConnectorStats(data=dict(stats)).data["role_mismatches"] if stats else 0
    warnings = [r.getMessage() for r in logged if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and needle in warnings[0], warnings  # one line per interval, with the count
    assert "(1 such request(s) so far, counted in vllm:sparse_kv_role_mismatches_total)" in warnings[0]
    assert counted == 3
    assert SparseKVConnectorStats(data={"role_mismatches": 3}).reduce()["role_mismatches"] == 3


def test_an_encoder_decoder_model_is_refused_while_the_vllm_config_is_built(tmp_path, monkeypatch):
    # Its cross-attention cache is the encoder's output, which the connector refuses (connector.vllm.specs) once the
    # weights are loaded; the model's config already says so, so the refusal comes before anything loads.
    from transformers import WhisperConfig

    WhisperConfig(d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                  encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=1000, max_source_positions=64,
                  max_target_positions=448, architectures=["WhisperForConditionalGeneration"]).save_pretrained(tmp_path)
    monkeypatch.setattr(early, "_checked", {})
    with log_records("connector.vllm.early") as logged, pytest.raises(ValueError) as err:
        H.make_vllm_config(tmp_path, kv_role="kv_producer", max_model_len=448)
    assert "Value error, SparseKVConnector: " in str(err.value)  # (pydantic shortens the message it shows)
    assert [r.getMessage() for r in logged if r.levelno >= logging.WARNING] == [
        f"SparseKVConnector: {tmp_path} (WhisperForConditionalGeneration) is an encoder-decoder model: its "
        f"cross-attention cache (vLLM's CrossAttentionSpec) holds the encoder's output, not prefill/decode state, "
        f"and SparseKVConnector does not move it: serve this model without --kv-transfer-config"]
