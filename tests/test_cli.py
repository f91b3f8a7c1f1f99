"""`python -m connector plan`: the table, the JSON shape and one-line errors, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from connector.core.hf_config import PRESETS


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "connector", *args], capture_output=True, text=True, timeout=120)


def test_m3_table_shows_the_compaction_example():
    out = run("plan", "--model", "minimax-m3", "--prefill", "tp=4,pp=2", "--decode", "tp=4,pp=1")
    assert out.returncode == 0, out.stderr
    assert "index_k  layers 30-59: P(pp1,tp0) slots 0-29 -> D(pp0,tp0) slots 27-56" in out.stdout
    assert "D(pp0,tp3):" in out.stdout


@pytest.mark.parametrize("model, pools", [
    ("minimax-m3", {"kv": 60, "index_k": 57, "index_v": 0}),
    ("deepseek-v3.2", {"kv": 61, "index_k": 61, "index_v": 0}),
    ("qwen3-8b", {"kv": 36, "index_k": 0, "index_v": 0}),
])
def test_json_shape(model, pools):
    out = run("plan", "--model", model, "--prefill", "tp=4,pp=2", "--decode", "tp=2,pp=1", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert {k: len(v) for k, v in data["model"]["pools"].items()} == pools
    assert data["model"]["num_layers"] == pools["kv"]
    assert data["prefill"]["tp"] == 4 and data["prefill"]["pp"] == 2 and len(data["prefill"]["stages"]) == 2
    assert data["decode"]["stages"] == [[0, pools["kv"]]]
    route = data["routes"][0]
    assert set(route) >= {"pool", "layer", "src", "dst", "heads", "bytes_per_token"}
    assert set(route["src"]) == {"pp", "tp", "slot"} and set(route["dst"]) == {"pp", "tp", "slot"}
    for r in data["routes"]:
        if r["pool"] == "kv":
            assert r["dst"]["slot"] == r["layer"]  # decode pp=1: kv slot = layer - 0


def test_fp8_sizes_for_deepseek():
    out = run("plan", "--model", "deepseek-v3.2", "--prefill", "tp=1,pp=1", "--decode", "tp=1,pp=1", "--json",
              "--kv-cache-dtype", "fp8")
    sizes = {(r["pool"]): r["bytes_per_token"] for r in json.loads(out.stdout)["routes"]}
    assert sizes == {"kv": 656, "index_k": 132}


def test_explicit_layer_split():
    out = run("plan", "--model", "minimax-m3", "--prefill", "tp=1,pp=3,layers=10:25:25", "--decode", "tp=1,pp=1",
              "--json")
    assert json.loads(out.stdout)["prefill"]["stages"] == [[0, 10], [10, 35], [35, 60]]


@pytest.mark.parametrize("args, needle", [
    (("--prefill", "tp=1,pp=2,layers=30:31", "--decode", "tp=1,pp=1"), "adds up to 61 but the model has 60 layers"),
    (("--prefill", "tp=3,pp=1", "--decode", "tp=1,pp=1"), "tp=3 neither divides nor is a multiple of the 4 KV heads"),
    (("--prefill", "tp=x", "--decode", "tp=1"), "must be integers"),
    (("--prefill", "foo=1", "--decode", "tp=1"), "expected tp=T,pp=P"),
])
def test_bad_input_is_one_line_exit_2(args, needle):
    out = run("plan", "--model", "minimax-m3", *args)
    assert out.returncode == 2
    assert needle in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_unknown_model_is_one_line_exit_2(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"]}))
    for model in (str(tmp_path), "no-such-preset"):
        out = run("plan", "--model", model, "--prefill", "tp=1,pp=1", "--decode", "tp=1,pp=1")
        assert out.returncode == 2, out.stderr
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def _huge_layers(tmp_path):
    config = json.loads((PRESETS["qwen3-8b"]).read_text())
    config["num_hidden_layers"] = 1_000_000_000
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


M3 = ("--model", "minimax-m3")
QWEN = ("--model", "qwen3-8b")
BAD_INPUTS = [
    # (arguments, needle in the error line); a model path of None is replaced by a config with 1e9 layers
    (("demo", *QWEN, "--chunks", "0"), "--chunks: 0 is out of range"),
    (("demo", *QWEN, "--chunks", "-1"), "--chunks: -1 is out of range"),
    (("demo", *QWEN, "--tokens", "100", "--chunks", "101"), "--chunks 101: each chunk needs a token; give 1..100"),
    (("bench", *QWEN, "--tokens", "1000000000"), "--tokens: 1000000000 is out of range"),
    (("bench", *QWEN, "--tokens", "16000000"), "GiB of memory is available: use fewer --tokens"),
    (("demo", *QWEN, "--tokens", "1e9"), "--tokens: '1e9' is not an integer"),
    (("demo", *QWEN, "--tokens", "0"), "--tokens: 0 is out of range"),
    (("demo", *QWEN, "--block-size", "1e8"), "--block-size: '1e8' is not an integer"),
    (("demo", *QWEN, "--block-size", "100000000"), "--block-size: 100000000 is out of range"),
    (("demo", *QWEN, "--requests", "0"), "--requests: 0 is out of range"),
    (("demo", *QWEN, "--requests", "10000", "--tokens", "1000000"), "GiB of memory is available"),
    (("demo", *QWEN, "--staging-mb", "-1"), "--staging-mb: -1 is out of range"),
    (("bench", *QWEN, "--nixl-threads", "65"), "--nixl-threads: 65 is out of range"),
    (("demo", *QWEN, "--staging-mb", "1048576"), "GiB of memory is available: use fewer --tokens"),
    (("demo", *QWEN, "--timeout", "0"), "--timeout: 0 is out of range"),
    (("demo", *QWEN, "--timeout", "inf"), "--timeout: inf is out of range"),
    (("bench", *QWEN, "--repeats", "0"), "--repeats: 0 is out of range"),
    (("demo", *QWEN, "--layer-ms", "1e12"), "--layer-ms: 1e12 is out of range"),
    (("demo", *QWEN, "--layer-ms", "-1"), "--layer-ms: -1 is out of range"),
    (("demo", *QWEN, "--layer-ms", "nan"), "--layer-ms: nan is out of range"),
    (("demo", *QWEN, "--layer-ms", "5000"), "--layer-ms 5000 x 36 layers is 180 s of compute per chunk, over --timeout"),
    (("demo", *QWEN, "--run-blocks", "0"), "--run-blocks: 0 is out of range"),
    (("demo", *QWEN, "--prefix-tokens", "-16"), "--prefix-tokens: -16 is out of range"),
    (("demo", *QWEN, "--prefix-tokens", "1024"), "--prefix-tokens 1024 must be a multiple of --block-size 16 below"),
    (("demo", *QWEN, "--prefill", "tp=128"), "--prefill tp=128,pp=1 is 128 ranks; at most 64"),
    (("demo", *QWEN, "--prefill-node", "host=a b"), "--prefill-node host='a b': use letters"),
    (("demo", *QWEN, "--decode-node", "host=10.0.0.2,netns=no-such-ns-8b"), "netns=no-such-ns-8b: no such network"),
    (("demo", *QWEN, "--decode-node", "dev=eth0,dev=eth1"), "dev is given twice"),
    (("plan", *M3, "--prefill", "tp=1048576", "--decode", "tp=1"), "--prefill tp=1048576,pp=1 is 1048576 ranks"),
    (("plan", *M3, "--prefill", "tp=1,pp=61", "--decode", "tp=1"), "pp=61 is larger than the model's 60 layers"),
    (("plan", *M3, "--prefill", "tp=1", "--decode", "tp=0"), "--decode: tp=0 must be at least 1"),
    (("plan", "--model", None, "--prefill", "tp=1", "--decode", "tp=1"),
     'field "num_hidden_layers" is 1000000000 (dense GQA config): set it to an integer 1..1024'),
    (("bench-pd", "--requests", "0"), "--requests: 0 is out of range"),
    (("bench-pd", "--warmup", "-1"), "--warmup: -1 is out of range"),
    (("bench-pd", "--max-tokens", "0"), "--max-tokens: 0 is out of range"),
    (("bench-pd", "--prompt-tokens", "1,x"), "--prompt-tokens '1,x': give integers"),
    (("bench-pd", "--prompt-tokens", "5000"), "--prompt-tokens [5000]: each must be 2..4080"),
    (("bench-pd", "--max-model-len", "10"), "--max-model-len: 10 is out of range"),
    (("bench-pd", "--max-model-len", "8192", "--prompt-tokens", "9000"), "--prompt-tokens [9000]: each must be 2..8176"),
    (("demo", *QWEN, "--mode", "fast"), "argument --mode: invalid choice: 'fast'"),
]
if not _cuda_available():
    BAD_INPUTS.append((("demo", *QWEN, "--device", "cuda"), "--device cuda: CUDA is not available"))


@pytest.mark.parametrize("args, needle", BAD_INPUTS, ids=[" ".join(a[:1] + a[3:]) for a, _ in BAD_INPUTS])
def test_every_bad_cli_input_is_one_line_exit_2_at_once(args, needle, tmp_path):
    """Each refused before any process or NIXL agent starts: exit 2, one `error:` line naming the value, no
    traceback, and quickly (a hang fails the 20 s timeout)."""
    args = tuple(_huge_layers(tmp_path) if a is None else a for a in args)
    out = subprocess.run([sys.executable, "-m", "connector", *args], capture_output=True, text=True, timeout=20)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    lines = out.stderr.strip().splitlines()
    assert "Traceback" not in out.stderr and len(lines) == 1, out.stderr[-2000:]
    assert lines[0].startswith("error: ") and needle in lines[0], lines[0]
    assert out.stdout == ""


def test_options_must_be_spelt_out_and_help_shows_every_command_and_default():
    out = run("plan", "--model", "qwen3-8b", "--prefil", "tp=1,pp=1", "--decode", "tp=1,pp=1")
    assert out.returncode == 2 and "the following arguments are required: --prefill" in out.stderr, out.stderr
    out = run("demo", "--model", "qwen3-8b", "--prefil", "tp=1,pp=2")
    assert out.returncode == 2 and "unrecognized arguments: --prefil" in out.stderr, out.stderr
    top = run("--help").stdout
    for command in ("serve-local", "doctor", "settings", "plan", "demo", "bench", "bench-pd"):
        assert f"  {command} " in top, command
    bench = run("bench", "--help").stdout
    assert "(default: 16)" in bench and "(default: 5)" in bench and "(default: cpu)" in bench


def test_every_option_of_every_command_has_help():
    import argparse

    from connector.cli.main import build_parser

    subs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    bare = [(name, a.option_strings[0]) for name, p in subs.choices.items() for a in p._actions
            if a.option_strings and a.dest != "help" and not a.help]
    assert bare == []


def test_serve_local_names_a_port_given_twice_or_taken_before_anything_starts(tmp_path):
    import socket

    from connector.transport.ports import free_ports

    port = free_ports()
    out = run("serve-local", "--engine-python", sys.executable, "--work-dir", str(tmp_path), "--port", str(port),
              "--decode-port", str(port))
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"error: --decode-port {port} is also --port: every server needs a port of its own" in out.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        out = run("serve-local", "--engine-python", sys.executable, "--work-dir", str(tmp_path),
                  "--side-channel-port", str(port))
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"error: --side-channel-port {port} is not free on 127.0.0.1" in out.stderr, out.stderr
    assert not (tmp_path / "logs").exists()  # nothing started
