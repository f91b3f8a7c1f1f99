"""A zoo model's greedy generation in plain torch (no vLLM): the same weights and kernels as the vLLM model, the
Llama around them (RMSNorm, SiLU MLP, residuals) written out. For tuning the seeded weights without an engine and
for checking an engine's tokens against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.sparse_model.attention import Batch
from tests.sparse_model.zoo.checkpoint import TinyZoo
from tests.sparse_model.zoo.kernels import KINDS, layer_step


class ZooReference:
    def __init__(self, model: TinyZoo, max_tokens: int = 4096) -> None:
        self.model, self.w = model, model.weights()
        self.geometry = model.cache_geometry()
        self.blocks = {kind: 1 if kind == "ring" else -(-max_tokens // g.block_size) + 1
                       for kind, g in self.geometry.items()}

    def rms(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.w[name]

    def generate(self, prompt: list[int], max_tokens: int = 16) -> list[int]:
        model, dims = self.model, self.model.dims
        caches = [{kind: torch.zeros(self.blocks[kind] + 1, 1, self.geometry[kind].states,
                                     self.geometry[kind].content_bytes // 4) for kind in kinds}
                  for kinds in model.zoo_layers]
        tokens, out, start = list(prompt), [], 0
        while len(out) < max_tokens:
            ids = torch.tensor(tokens[start:])
            length = len(tokens)
            batches = {}
            for kind, g in self.geometry.items():
                table = torch.arange(1, self.blocks[kind] + 1)[None]
                slots = torch.arange(start, length) if kind != "ring" else torch.full((length - start,), -1)
                slots = torch.where(slots >= 0, (slots // g.block_size + 1) * g.block_size + slots % g.block_size,
                                    slots)
                batches[kind] = Batch([0, length - start], [length], table, slots, length - start)
            x = self.w["model.embed_tokens.weight"][ids]
            for i, kinds in enumerate(model.zoo_layers):
                p = f"model.layers.{i}."
                h = self.rms(x, p + "input_layernorm.weight")
                proj, parts, at = h @ self.w[p + "self_attn.zoo_proj.weight"].t(), {}, 0
                ordered = [k for k in KINDS if k in kinds]
                for kind in ordered:
                    widths = dims.proj_widths(kind)
                    parts[kind] = tuple(proj[:, at + sum(widths[:j]):at + sum(widths[:j + 1])]
                                        for j in range(len(widths)))
                    at += sum(widths)
                terms = layer_step(parts, caches[i], {k: batches[k] for k in ordered}, dims,
                                   self.w.get(p + "self_attn.compressor"))
                x = x + sum(terms[k] @ self.w[p + f"self_attn.o_{k}.weight"].t() for k in ordered)
                h = self.rms(x, p + "post_attention_layernorm.weight")
                mlp = F.silu(h @ self.w[p + "mlp.gate_proj.weight"].t()) * (h @ self.w[p + "mlp.up_proj.weight"].t())
                x = x + mlp @ self.w[p + "mlp.down_proj.weight"].t()
            logits = self.rms(x[-1:], "model.norm.weight") @ self.w["lm_head.weight"].t()
            out.append(int(logits.argmax()))
            start = length
            tokens.append(out[-1])
        return out
