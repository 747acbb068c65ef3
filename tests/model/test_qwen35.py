"""Our Qwen3.5 text model against transformers' (torch path, eager attention, fp32) on tiny random configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kev_backend.model.checkpoint import build_model
from kev_backend.model.qwen35 import Qwen35Config
from kev_backend.model.weights import load_text_weights
from tests.conftest import hf_qwen35_torch_path

LIN, FULL = "linear_attention", "full_attention"
CONFIGS = {
    # Kev's 3:1 pattern, GQA 4/2, GVA 2 k-heads → 4 v-heads, tied embeddings, saved as CausalLM in shards.
    "tied-causal-lm-sharded": dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        layer_types=[LIN, LIN, LIN, FULL],
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    ),
    # Alternating layers, MHA-like heads 2/2 but 1 kv group, equal k/v heads, untied, multimodal layout.
    "untied-multimodal": dict(
        vocab_size=131,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        linear_num_key_heads=3,
        linear_num_value_heads=3,
        linear_key_head_dim=8,
        linear_value_head_dim=24,
        layer_types=[LIN, FULL, LIN, LIN, FULL, FULL],
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5},
    ),
}


def random_hf_model(modeling, kwargs: dict, seed: int):
    from transformers import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = modeling.Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(-torch.rand_like(p) * 2)
            elif "norm" in name:
                p.normal_(0.0, 0.2)  # non-zero, so a missing (1 + w) shows
            else:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
    return model


def write_multimodal(model, directory: Path) -> None:
    """The released Qwen3.5 layout: `model.language_model.*`, plus vision and MTP tensors Kev must skip."""
    directory.mkdir()
    text = model.config.to_dict()
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": text}))
    tensors = {
        name.replace("model.", "model.language_model.", 1): t.contiguous()
        for name, t in model.state_dict().items()
        if name.startswith("model.")
    }
    tensors["lm_head.weight"] = model.lm_head.weight.detach().clone()
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(8, 8)
    tensors["mtp.fc.weight"] = torch.randn(4, 4)
    save_file(tensors, str(directory / "model.safetensors"))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_hidden_states_match_transformers(name: str, tmp_path: Path) -> None:
    modeling = hf_qwen35_torch_path()
    assert modeling.torch_chunk_gated_delta_rule.__wrapped__.__module__ == modeling.__name__
    hf = random_hf_model(modeling, CONFIGS[name], seed=len(name))
    directory = tmp_path / name
    if name == "untied-multimodal":
        write_multimodal(hf, directory)
    else:
        hf.save_pretrained(directory, max_shard_size="20KB")
        assert (directory / "model.safetensors.index.json").exists()
    raw = json.loads((directory / "config.json").read_text())
    ours = build_model(Qwen35Config.from_dict(raw), load_text_weights(directory), torch.float32)

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIGS[name]["vocab_size"], (2, 150), generator=generator)
    with torch.no_grad():
        reference = hf.model(ids).last_hidden_state
    hidden, _ = ours(ids)
    relative = ((hidden - reference).abs().max() / reference.abs().max()).item()
    assert relative <= 1e-5, relative

    # Continuing a cached prefix equals the single pass (what the state bank relies on), to fp32 rounding relative to
    # the hidden states' scale, as above (an absolute 1e-5 failed by 1.4e-5 on another CPU, torch 2.13's kernels).
    _, prefix = ours(ids[:, :97])
    continued, _ = ours(ids[:, 97:], prefix)
    relative = ((continued - hidden[:, 97:]).abs().max() / hidden[:, 97:].abs().max()).item()
    assert relative <= 1e-5, relative


def test_multimodal_names_skip_vision_and_mtp(tmp_path: Path) -> None:
    modeling = hf_qwen35_torch_path()
    hf = random_hf_model(modeling, CONFIGS["untied-multimodal"], seed=3)
    write_multimodal(hf, tmp_path / "mm")
    names = set(load_text_weights(tmp_path / "mm"))
    stored = set(load_file(str(tmp_path / "mm" / "model.safetensors")))
    assert "embed_tokens.weight" in names and "layers.1.self_attn.q_norm.weight" in names
    assert not any(n.startswith(("visual", "mtp", "lm_head", "model.")) for n in names)
    assert len(names) == len(stored) - 3  # lm_head, one vision and one MTP tensor skipped
