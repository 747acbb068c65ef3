"""Kev checkpoints: the fp32 LoRA merge against PEFT's unmerged adapter, full weights, and refusals."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kev_backend.engine.engine import Engine, EngineOptions
from kev_backend.model.checkpoint import LoadOptions, Meta, load_checkpoint
from kev_backend.model.qwen35 import Qwen35Config
from kev_backend.model.safetensors_reader import read_index
from kev_backend.model.weights import load_text_weights
from kev_backend.scoring.head import pointer_probabilities
from tests.conftest import hf_qwen35_torch_path
from tests.helpers import max_gap

REQUEST = {
    "state": {"ticket": "card charged twice for the same order", "customer": {"plan": "pro", "months": 14}},
    "questions": {
        "urgent": {"type": "noul", "instructions": "is this urgent?"},
        "team": {"type": "choice", "instructions": "route", "criteria": {"billing": "refunds", "technical": None}},
        "tone": {"type": "score", "instructions": "sentiment", "criteria": ["angry", "neutral", "happy"]},
    },
}


def hf_text_model(modeling, base: Path):
    from transformers import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(**json.loads((base / "config.json").read_text()))
    config._attn_implementation = "eager"
    model = modeling.Qwen3_5TextModel(config).eval()
    model.load_state_dict(load_text_weights(base), strict=True)
    return model


def test_lora_merge_equals_peft_unmerged(tiny_dir: Path) -> None:
    from peft import PeftModel

    modeling = hf_qwen35_torch_path()
    engine = Engine.from_checkpoint(tiny_dir / "kev")
    _, encoded = engine.prepare(REQUEST)
    # PEFT applies the adapter at run time: x·Wᵀ + (x·Aᵀ·Bᵀ)·alpha/r.
    unmerged = PeftModel.from_pretrained(hf_text_model(modeling, tiny_dir / "base"), tiny_dir / "kev").eval()
    assert any("lora_A" in name for name, _ in unmerged.named_parameters())
    # Our merge, loaded into the same transformers model, isolates the merge arithmetic.
    merged = hf_text_model(modeling, tiny_dir / "base")
    merged.load_state_dict(engine.checkpoint.model.state_dict(), strict=True)
    base = hf_text_model(modeling, tiny_dir / "base")

    def row_form(model) -> list[list[float]]:
        decide, options, counts = [], [], []
        for row in encoded.questions:
            with torch.no_grad():
                hidden = model(input_ids=torch.tensor([encoded.state + row.tokens])).last_hidden_state[0]
            decide.append(hidden[len(encoded.state) + row.decide])
            options.append(hidden[[len(encoded.state) + i for i in row.option_ends]])
            counts.append(len(row.option_ends))
        return pointer_probabilities(engine.checkpoint.head, 2.0, torch.stack(decide), torch.cat(options), counts)

    expected = row_form(unmerged)
    assert max_gap(row_form(merged), expected) <= 1e-6
    assert max_gap(row_form(base), expected) > 1e-3  # the adapter matters, so the check above means something
    # Our own model with the merged weights (the engine's row form) agrees with transformers + PEFT.
    assert max_gap(engine.scorer.row_form_probabilities(encoded), expected) <= 1e-5


def test_full_weight_checkpoint_answers_like_the_lora(tiny_dir: Path) -> None:
    lora, full = Engine.from_checkpoint(tiny_dir / "kev"), Engine.from_checkpoint(tiny_dir / "kev-full")
    assert (lora.checkpoint.kind, full.checkpoint.kind) == ("lora", "full")
    _, encoded = lora.prepare(REQUEST)
    a = lora.scorer.probabilities([encoded])[0]
    b = full.scorer.probabilities([encoded])[0]
    assert max_gap(a, b) <= 1e-6


def test_head_pt_defaults_and_temperature_override(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    meta = Meta.load(tiny_dir / "kev" / "head.pt")
    assert (meta.weights, meta.lora, meta.head_dim, meta.temperature) == ("lora", 16, 32, 2.0)
    raw = Engine.from_checkpoint(tiny_dir / "kev", EngineOptions(load=LoadOptions(temperature=1.0)))
    assert raw.checkpoint.temperature == 1.0
    calibrated = Engine.from_checkpoint(tiny_dir / "kev")
    _, encoded = raw.prepare(REQUEST)
    p_raw = raw.scorer.probabilities([encoded])[0][1]
    p_cal = calibrated.scorer.probabilities([encoded])[0][1]
    # softmax(z/T) = normalised p_raw^(1/T): T changes the spread, never the argmax.
    sharpened = [p**0.5 for p in p_raw]
    assert all(abs(x / sum(sharpened) - y) <= 1e-6 for x, y in zip(sharpened, p_cal))


def test_default_dtype_is_fp32_on_cpu(tiny_dir: Path) -> None:
    assert load_checkpoint(tiny_dir / "kev", "cpu").dtype == torch.float32
    assert load_checkpoint(tiny_dir / "kev", "cpu", LoadOptions(dtype="bf16")).dtype == torch.bfloat16


def copy_checkpoint(tiny_dir: Path, tmp_path: Path, kind: str = "kev") -> Path:
    shutil.copytree(tiny_dir / "base", tmp_path / "base")
    return Path(shutil.copytree(tiny_dir / kind, tmp_path / kind))


def test_head_pt_weights_must_agree_with_the_files(tiny_dir: Path, tmp_path: Path) -> None:
    directory = copy_checkpoint(tiny_dir, tmp_path)
    meta = torch.load(directory / "head.pt", weights_only=True)
    torch.save({**meta, "weights": "full"}, directory / "head.pt")
    with pytest.raises(ValueError, match="head.pt says weights='full'"):
        load_checkpoint(directory)


def test_trainable_token_indices_are_refused(tiny_dir: Path, tmp_path: Path) -> None:
    directory = copy_checkpoint(tiny_dir, tmp_path)
    config = json.loads((directory / "adapter_config.json").read_text())
    (directory / "adapter_config.json").write_text(json.dumps({**config, "trainable_token_indices": [2, 3]}))
    with pytest.raises(ValueError, match="trainable_token_indices"):
        load_checkpoint(directory)


class Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_head_pt_is_read_without_arbitrary_pickles(tiny_dir: Path, tmp_path: Path) -> None:
    directory = copy_checkpoint(tiny_dir, tmp_path)
    meta = torch.load(directory / "head.pt", weights_only=True)
    with open(directory / "head.pt", "wb") as f:
        pickle.dump({**meta, "extra": Payload()}, f)
    with pytest.raises(pickle.UnpicklingError):
        load_checkpoint(directory)


def test_a_hub_base_needs_a_local_copy(tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = copy_checkpoint(tiny_dir, tmp_path)
    meta = torch.load(directory / "head.pt", weights_only=True)
    torch.save({**meta, "base": "Qwen/Qwen3.5-4B-Base"}, directory / "head.pt")
    with pytest.raises(FileNotFoundError, match="KEV_BASE"):
        load_checkpoint(directory)
    assert load_checkpoint(directory, options=LoadOptions(base=str(tmp_path / "base"))).kind == "lora"


def test_a_file_that_is_not_a_regular_file_is_refused(tiny_dir: Path, tmp_path: Path) -> None:
    """A FIFO named model.safetensors would block the load until something writes to it: it is refused unread."""
    directory = copy_checkpoint(tiny_dir, tmp_path, "kev-full")
    (directory / "model.safetensors").unlink()
    os.mkfifo(directory / "model.safetensors")
    with pytest.raises(ValueError, match="model.safetensors: not a regular file"):
        load_checkpoint(directory)


def test_a_shard_index_names_files_inside_its_directory(tiny_dir: Path, tmp_path: Path) -> None:
    directory = copy_checkpoint(tiny_dir, tmp_path, "kev-full")
    names = [stored.name for stored in read_index(directory / "model.safetensors")]
    (directory / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    for outside in ("../elsewhere.safetensors", str(tmp_path / "elsewhere.safetensors")):
        index = {"metadata": {}, "weight_map": dict.fromkeys(names, outside)}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(ValueError, match="not a file in this directory"):
            load_checkpoint(directory)


def adapter_with(directory: Path, change) -> None:
    """The adapter's first tensor (a lora_A) replaced by `change(it)`."""
    path = directory / "adapter_model.safetensors"
    tensors = load_file(path)
    first = sorted(tensors)[0]  # a lora_A
    save_file({name: (change(tensor) if name == first else tensor) for name, tensor in tensors.items()}, path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a[:, :1].contiguous(), r"the weight is \("),  # would broadcast across every column
        (lambda a: a[:8].contiguous(), "not a pair of rank"),  # r is 16
        (lambda a: a.to(torch.int32), "not two floating-point matrices"),
    ],
)
def test_a_malformed_lora_pair_is_refused_before_its_product(tiny_dir: Path, tmp_path: Path, change, message) -> None:
    directory = copy_checkpoint(tiny_dir, tmp_path)
    adapter_with(directory, change)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(directory)


def test_weights_must_be_floating_point(tiny_dir: Path, tmp_path: Path) -> None:
    directory = copy_checkpoint(tiny_dir, tmp_path, "kev-full")
    tensors = load_file(directory / "model.safetensors")
    name = sorted(tensors)[0]
    save_file({**tensors, name: tensors[name].to(torch.bool)}, directory / "model.safetensors")
    with pytest.raises(ValueError, match="not a floating-point type"):
        load_checkpoint(directory)
    meta = torch.load(directory / "head.pt", weights_only=True)
    torch.save({**meta, "head": {k: v.to(torch.int64) for k, v in meta["head"].items()}}, directory / "head.pt")
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(ValueError, match="must all be floating-point tensors"):
        load_checkpoint(directory)


def test_a_config_of_absurd_depth_is_refused_before_a_model_is_built(tiny_dir: Path, tmp_path: Path) -> None:
    directory = copy_checkpoint(tiny_dir, tmp_path, "kev-full")
    config = json.loads((directory / "config.json").read_text())
    text = config.get("text_config", config)
    text["num_hidden_layers"], text["layer_types"] = 10_000_000, None
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="num_hidden_layers 10000000: this loader takes 1..1024 layers"):
        load_checkpoint(directory)


def test_config_reads_text_config_of_multimodal(tiny_dir: Path) -> None:
    text = json.loads((tiny_dir / "base" / "config.json").read_text())
    assert Qwen35Config.from_dict({"model_type": "qwen3_5", "text_config": text}) == Qwen35Config.from_dict(text)


def test_random_checkpoint_of_any_shape_loads(tmp_path: Path) -> None:
    """`python -m kev_backend.dev.synthetic OUT --kev4b` writes Kev-4B shapes this way (bf16 base, LoRA, head.pt)."""
    from kev_backend.dev import sizes, synthetic

    config = {**sizes.TINY_CONFIG, "vocab_size": len(synthetic.vocabulary())}
    synthetic.build_random(tmp_path, config)
    checkpoint = load_checkpoint(tmp_path / "kev", "cpu")
    assert checkpoint.kind == "lora" and checkpoint.head_dim == 256 and checkpoint.dtype == torch.float32
    engine = Engine(checkpoint)
    body = engine.answer([REQUEST])[0]
    assert list(body["answers"]) == list(REQUEST["questions"])
