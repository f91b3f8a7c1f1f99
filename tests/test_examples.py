"""The serve scripts build a --kv-transfer-config that vLLM 0.33 and the connector accept. A fake `vllm` on PATH
records the command line instead of starting a server (the real one needs GPUs and weights)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _serve_args(script: str, tmp_path: pathlib.Path, **env: str) -> list[str]:
    fake = tmp_path / "vllm"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    fake.chmod(0o755)
    run_env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", PYTHON=sys.executable,
                   SIDE_CHANNEL_HOST="10.0.0.5", SPARSE_KV_AUTH_TOKEN='se"cret\\', PREFILL_KEY_FILE="/k/prefill.key",
                   TRUSTED_PREFILL_KEYS="ab" * 32, ALLOWED_PREFILL_HOSTS="10.0.0.5", **env)
    out = subprocess.run(["bash", str(ROOT / "examples" / script), "/models/m3"], env=run_env, check=True,
                         capture_output=True, text=True, timeout=60)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("script,role", [("serve_prefill.sh", "kv_producer"), ("serve_decode.sh", "kv_consumer")])
def test_serve_scripts_build_a_valid_kv_transfer_config(tmp_path, script, role):
    from connector.vllm.config import ConnectorSettings

    args = _serve_args(script, tmp_path)
    assert args[:2] == ["serve", "/models/m3"]
    config = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "SparseKVConnector" and config["kv_role"] == role
    settings = ConnectorSettings.from_extra_config(config["kv_connector_extra_config"])
    assert settings.auth_token_env == "SPARSE_KV_AUTH_TOKEN" and settings.staging_mb == 256
    assert 'se"cret' not in " ".join(args)  # the token is read from the environment, never on the command line
    os.environ["SPARSE_KV_AUTH_TOKEN"] = 'se"cret\\'
    try:
        assert settings.token() == 'se"cret\\'
    finally:
        del os.environ["SPARSE_KV_AUTH_TOKEN"]
    settings.check_trust(role)  # keys on: a decode trusts the prefills' key, a prefill signs with its own
    if role == "kv_producer":
        assert settings.prefill_key_file == "/k/prefill.key"
        assert (settings.side_channel_host, settings.side_channel_port) == ("10.0.0.5", 5600)
        assert args[args.index("--pipeline-parallel-size") + 1] == "2"
    else:
        assert settings.trusted_prefill_keys == ["ab" * 32] and settings.allowed_prefill_hosts == ["10.0.0.5"]
    vllm_config = pytest.importorskip("vllm.config")
    vllm_config.KVTransferConfig(**config)  # vLLM's own validation of the whole object
    off = _serve_args(script, tmp_path, STAGING_MB="0")
    extra = json.loads(off[off.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert ConnectorSettings.from_extra_config(extra).staging_mb == 0
