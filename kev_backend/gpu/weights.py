"""The fused path's weights: each layer's projections concatenated (one GEMM where the reference model runs several)
in the serving dtype, after the LoRA merge; norm weights kept in fp32 as (1 + w) where the model adds one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.qwen35 import FULL_ATTENTION, Qwen35TextModel


@dataclass
class LayerWeights:
    kind: str
    input_norm: torch.Tensor  # (1 + w), fp32
    post_norm: torch.Tensor  # (1 + w), fp32
    in_proj: torch.Tensor  # GDN: [qkv | z | b | a]; attention: [q+gate | k | v]
    out_proj: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    conv: torch.Tensor | None = None  # [conv_dim, W]
    a_log: torch.Tensor | None = None  # fp32
    dt_bias: torch.Tensor | None = None  # fp32
    gated_norm: torch.Tensor | None = None  # plain weight, fp32
    q_norm: torch.Tensor | None = None  # (1 + w), fp32
    k_norm: torch.Tensor | None = None


def stacked(parts: list[torch.nn.Parameter], dtype: torch.dtype) -> torch.Tensor:
    """The parts' weights stacked by rows, in `dtype`. Where the parts already are `dtype` on one device, each part
    then becomes a view of the stack, so the model's weights and the fused ones are one copy in memory: building the
    fused weights of a model that fills most of a GPU (Kev-27B's 54 GB on an 80 GB H100) costs one layer's largest
    stack more, not a second copy of the model."""
    stack = torch.cat([part.detach() for part in parts]).to(dtype)
    if all(part.dtype == dtype and part.device == stack.device for part in parts):
        start = 0
        for part in parts:
            part.data = stack[start : start + part.shape[0]]
            start += part.shape[0]
    return stack


class FusedWeights:
    """Concatenated bf16 projections built from a (merged) reference model; norm weights kept in fp32. A model already
    in `dtype` shares its projections' memory with them (`stacked`); the embedding is the model's own tensor."""

    def __init__(self, model: Qwen35TextModel, dtype: torch.dtype = torch.bfloat16) -> None:
        self.config = model.config
        self.dtype = dtype
        self.embed = model.embed_tokens.weight.detach().to(dtype)
        self.final_norm = 1.0 + model.norm.weight.detach().float()
        self.layers: list[LayerWeights] = []
        for layer in model.layers:
            common = dict(
                input_norm=1.0 + layer.input_layernorm.weight.detach().float(),
                post_norm=1.0 + layer.post_attention_layernorm.weight.detach().float(),
                gate_up=stacked([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight], dtype),
                down=layer.mlp.down_proj.weight.detach().to(dtype),
            )
            if layer.layer_type == FULL_ATTENTION:
                a = layer.self_attn
                self.layers.append(
                    LayerWeights(
                        kind=FULL_ATTENTION,
                        in_proj=stacked([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], dtype),
                        out_proj=a.o_proj.weight.detach().to(dtype),
                        q_norm=1.0 + a.q_norm.weight.detach().float(),
                        k_norm=1.0 + a.k_norm.weight.detach().float(),
                        **common,
                    )
                )
            else:
                g = layer.linear_attn
                proj = [g.in_proj_qkv.weight, g.in_proj_z.weight, g.in_proj_b.weight, g.in_proj_a.weight]
                self.layers.append(
                    LayerWeights(
                        kind=layer.layer_type,
                        in_proj=stacked(proj, dtype),
                        out_proj=g.out_proj.weight.detach().to(dtype),
                        conv=g.conv1d.weight.detach().squeeze(1).to(dtype).contiguous(),
                        a_log=g.A_log.detach().float(),
                        dt_bias=g.dt_bias.detach().float(),
                        gated_norm=g.norm.weight.detach().float(),
                        **common,
                    )
                )

    @property
    def projection_flops(self) -> int:
        """A token's FLOPs in the layers' projections: 2 × their weights."""
        return 2 * sum(w.in_proj.numel() + w.out_proj.numel() + w.gate_up.numel() + w.down.numel() for w in self.layers)
