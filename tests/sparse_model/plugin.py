"""The `vllm.general_plugins` entry point that registers the sparse test models in every vLLM process (API
server, engine core, workers), and the entry-point metadata the real-engine tests put on the engines' PYTHONPATH
(a `.dist-info` folder: importlib.metadata finds entry points in any folder on sys.path, so nothing is installed
into the engine venv)."""

from __future__ import annotations

from pathlib import Path

from tests.sparse_model.checkpoint import DSA_ARCH, M3_ARCH
from tests.sparse_model.zoo.checkpoint import MAMBA2_ARCH, ZOO_ARCH

MODELS = {M3_ARCH: "tests.sparse_model.m3:TinySparseM3ForCausalLM",
          DSA_ARCH: "tests.sparse_model.dsa:TinySparseDsaForCausalLM",
          ZOO_ARCH: "tests.sparse_model.zoo.model:TinyZooForCausalLM",
          MAMBA2_ARCH: "tests.sparse_model.mamba_pp:TinyMamba2ForCausalLM"}
DIST_NAME = "sparse_kv_test_models"


def register() -> None:
    """Register each model by its dotted path (vLLM imports it lazily, in the processes that build it), and give
    MAMBA2_ARCH the config hooks vLLM keys by architecture name for its Mamba2 (MODELS_CONFIG_MAP: they set the
    Mamba block size, without which the mixer cannot declare its MambaSpec)."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    for arch, path in MODELS.items():
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, path)
    MODELS_CONFIG_MAP.setdefault(MAMBA2_ARCH, MODELS_CONFIG_MAP["Mamba2ForCausalLM"])


def write_entry_point(folder: str | Path) -> Path:
    """Write `<folder>/sparse_kv_test_models-0.0.dist-info` declaring `register` as a vllm.general_plugins entry
    point; put `folder` (and the repository root, for `tests.`) on PYTHONPATH. Returns the folder."""
    folder = Path(folder)
    info = folder / f"{DIST_NAME}-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST_NAME}\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{DIST_NAME} = tests.sparse_model.plugin:register\n")
    return folder
