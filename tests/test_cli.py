"""`python -m connector plan`: the table, the JSON shape and one-line errors, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


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
