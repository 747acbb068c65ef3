"""The Kev sizes on the CPU: their configs' parameter counts, checkpoints written a tensor at a time (sharded) through
the real loader, states built to exact token counts, the compute floor's count, the truncated-depth parity config,
the bank's room for long states, and loadtest/long_states.py against a real tritonserver."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kev_backend.dev import bench, floors, sizes, synthetic
from kev_backend.dev.workloads import FIVE, sized
from kev_backend.engine.engine import Engine
from kev_backend.gpu.pool import StatePool
from kev_backend.model.checkpoint import LoadOptions, load_checkpoint
from kev_backend.model.qwen35 import FULL_ATTENTION, LINEAR_ATTENTION, Qwen35Config
from kev_backend.model.weights import safetensors_files
from tests.conftest import REPO, TritonServer

# The published names, in parameters. They round the whole released checkpoint, vision tower and multi-token-
# prediction layer included, which the text model's count (sizes.text_parameters) leaves out: 0.8B's text model is
# 6 % under its name, 4B's 5 % over it, 9B's and 27B's within 1 %.
NOMINAL = {"0.8b": 0.8e9, "4b": 4e9, "9b": 9e9, "27b": 27e9}


def by_hand(c: dict) -> int:
    """The text model's parameters from the config's numbers alone (sizes.text_parameters' convention: embedding,
    layers, final norm, plus the LM head when untied)."""
    h, mlp, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    keys = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    values = c["linear_num_value_heads"] * c["linear_value_head_dim"]
    conv = 2 * keys + values
    every = 3 * h * mlp + 2 * h  # MLP, the two layer norms
    attention = h * 2 * heads * d + 2 * h * kv * d + heads * d * h + 2 * d  # q with its gate, k, v, o, q/k norms
    delta = h * conv + h * values + 2 * h * c["linear_num_value_heads"] + values * h  # qkv, z, b, a, out
    delta += conv * c["linear_conv_kernel_dim"] + 2 * c["linear_num_value_heads"] + c["linear_value_head_dim"]
    layers = sum(every + (attention if kind == FULL_ATTENTION else delta) for kind in c["layer_types"])
    embeddings = c["vocab_size"] * h * (1 if c["tie_word_embeddings"] else 2)
    return embeddings + layers + h


@pytest.mark.parametrize("size", sorted(sizes.SIZES))
def test_size_configs_have_the_published_parameter_counts(size: str) -> None:
    config = sizes.SIZES[size].config
    count = sizes.text_parameters(config)
    assert count == by_hand(config)
    assert abs(count / NOMINAL[size] - 1) < 0.07, count
    assert config["layer_types"] == sizes.hybrid_layers(config["num_hidden_layers"])
    assert config["vocab_size"] == 248_320 and config["head_dim"] == 256


def test_sizes_are_the_published_shapes() -> None:
    """Exact counts: Qwen3.5-9B's text model is published as 8.95B (untied); Kev-27B's shapes give 26.9B."""
    assert round(sizes.text_parameters(sizes.KEV9B_CONFIG) / 1e7) == 895
    assert round(sizes.text_parameters(sizes.KEV27B_CONFIG) / 1e8) == 269
    c = sizes.KEV27B_CONFIG
    shape = (c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"], c["num_attention_heads"])
    assert shape == (64, 5120, 17408, 24) and not c["tie_word_embeddings"]
    assert (c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_conv_kernel_dim"]) == (16, 48, 4)
    assert [sizes.SIZES[s].weights for s in ("0.8b", "4b", "9b", "27b")] == ["lora", "lora", "lora", "full"]


def test_truncated_depth_keeps_the_layer_pattern() -> None:
    spec = sizes.SIZES["27b"]
    config = spec.parity_config()
    assert config["num_hidden_layers"] == len(config["layer_types"]) == 16
    assert config["layer_types"] == [LINEAR_ATTENTION] * 3 + [FULL_ATTENTION] + config["layer_types"][4:]
    assert config["layer_types"] == sizes.hybrid_layers(16)
    assert {k: v for k, v in config.items() if k not in ("num_hidden_layers", "layer_types")} == {
        k: v for k, v in spec.config.items() if k not in ("num_hidden_layers", "layer_types")
    }
    Qwen35Config.from_dict(config)  # a valid config
    for bad in (0, 6, 68):
        with pytest.raises(ValueError):
            sizes.truncated(spec.config, bad)
    assert sizes.SIZES["4b"].parity_config() is sizes.KEV4B_CONFIG


def drawn(config: dict, specs: list[synthetic.StoredSpec]) -> dict[str, torch.Tensor]:
    """What write_random drew for `specs` (the same generator and order, seed 0)."""
    make = synthetic.drawn_tensors(Qwen35Config.from_dict(config), 0, "cpu")
    return {spec.bare: make(spec) for spec in specs}


@pytest.mark.parametrize("weights", ["lora", "full"])
def test_sharded_bf16_checkpoint_round_trips_through_the_loader(tmp_path: Path, weights: str) -> None:
    """Each tensor drawn in bf16 and written at once, in shards (forced small) with HF's index: the loader reads
    back exactly what was drawn (the LoRA scaled to nothing), the safetensors library reads every file, and the
    checkpoint answers."""
    config = {**sizes.TINY_CONFIG, "vocab_size": len(synthetic.vocabulary())}
    synthetic.write_random(tmp_path, config, weights, shard_bytes=48 << 10)
    weights_dir = tmp_path / ("base" if weights == "lora" else "kev")
    files = safetensors_files(weights_dir)
    assert len(files) > 3 and (weights_dir / "model.safetensors.index.json").exists()
    index = json.loads((weights_dir / "model.safetensors.index.json").read_text())
    stored = {}
    for path in files:
        with safe_open(str(path), "pt") as f:
            stored.update((name, path.name) for name in f.keys())
    assert stored == index["weight_map"]
    assert ("lm_head.weight" in stored) == (weights == "lora")  # a full fine-tune saves no LM head
    loaded = load_checkpoint(tmp_path / "kev", "cpu", LoadOptions(dtype="bf16", lora_scale=0.0))
    assert loaded.kind == weights and loaded.dtype == torch.bfloat16
    parsed = Qwen35Config.from_dict(config)
    expected = drawn(config, synthetic.stored_specs(parsed, "", False, torch.bfloat16))
    state = loaded.model.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[name], tensor) for name, tensor in expected.items())
    default = load_checkpoint(tmp_path / "kev", "cpu")  # fp32 for the LoRA, the config's bf16 for full weights
    assert default.kind == weights
    body = Engine(default).answer([{"state": "a ticket", "questions": FIVE}])[0]
    assert list(body["answers"]) == list(FIVE)


def test_one_file_when_it_fits(tmp_path: Path) -> None:
    config = {**sizes.TINY_CONFIG, "vocab_size": len(synthetic.vocabulary())}
    synthetic.write_random(tmp_path, config, "full")
    assert [p.name for p in safetensors_files(tmp_path / "kev")] == ["model.safetensors"]
    assert not (tmp_path / "kev" / "model.safetensors.index.json").exists()


def test_shard_plan_keeps_order_and_bound() -> None:
    specs = [
        synthetic.StoredSpec(f"t{i}", f"t{i}", (n,), torch.bfloat16) for i, n in enumerate([10, 20, 200, 5, 5, 30])
    ]
    shards = synthetic.plan_shards(specs, 100)  # bytes: 20, 40, 400, 10, 10, 60
    assert [[s.stored for s in shard] for shard in shards] == [["t0", "t1"], ["t2"], ["t3", "t4", "t5"]]
    assert [s for shard in shards for s in shard] == specs


def test_synthetic_model_in_bf16_is_the_fp32_one_rounded() -> None:
    config = Qwen35Config.from_dict({**sizes.TINY_CONFIG, "vocab_size": 100})
    fp32 = synthetic.synthetic_model(config, "cpu", torch.float32).state_dict()
    bf16 = synthetic.synthetic_model(config, "cpu", torch.bfloat16).state_dict()
    assert all(torch.equal(bf16[name], tensor.to(torch.bfloat16)) for name, tensor in fp32.items())
    full = synthetic.synthetic_model(config, "cpu", torch.float32, lora_rank=0).state_dict()
    assert torch.equal(full["embed_tokens.weight"], fp32["embed_tokens.weight"])  # no LoRA on the embedding
    assert not torch.equal(full["layers.0.mlp.up_proj.weight"], fp32["layers.0.mlp.up_proj.weight"])


def test_fused_projections_are_the_fused_weights(tiny_dir: Path) -> None:
    from kev_backend.gpu.weights import FusedWeights

    model = load_checkpoint(tiny_dir / "kev", "cpu").model
    fused = FusedWeights(model)
    got = {layer.kind: [tuple(w.shape) for w in (layer.in_proj, layer.out_proj, layer.gate_up, layer.down)]
           for layer in fused.layers}  # fmt: skip
    assert got == sizes.fused_projections(model.config)


@pytest.mark.parametrize("tokens", [40, 257, 4096, 65_535])
def test_sized_states_hit_the_token_count(tiny_dir: Path, tokens: int) -> None:
    """With the tiny tokenizer (a word, a token) every requested length is met exactly, <state> included, for a new
    state (its "Ticket {i}." prefix counted) and for the same one; one under Kev's 65,536-token limit too (the
    count steps over the limit on the way: it counts past the engine's limits), and the engine takes it."""
    engine = Engine(load_checkpoint(tiny_dir / "kev", "cpu"))
    count = bench.state_length(engine)
    for i in (None, 7, 123_456):
        body = sized(tokens, count, i)
        assert len(engine.prepare(body)[1].state) == tokens
        assert body["questions"] == FIVE
    assert sized(tokens, count, 1)["state"] != sized(tokens, count, 2)["state"]


def test_sized_takes_the_longest_state_under_a_length_it_cannot_meet() -> None:
    """A tokenizer whose words are two tokens each cannot meet an odd count: the longest state under it."""

    def count(body: dict) -> int:
        return 1 + 2 * len(body["state"].split())

    assert count(sized(101, count)) == 101
    assert count(sized(100, count)) == 99


def test_floor_counts_by_hand() -> None:
    """TINY_CONFIG (width 64, MLP 128, 3 DeltaNet layers then 1 attention; 4 query / 2 KV heads of 32; DeltaNet 2 key
    / 4 value heads of 16): a state of 100 tokens with rows of 10 and 20."""
    config = Qwen35Config.from_dict({**sizes.TINY_CONFIG, "vocab_size": 100})
    flops = floors.pass_flops(config, 100, [10, 20])
    mlp = 64 * 2 * 128 + 128 * 64
    attention_layer = 64 * (2 * 4 * 32 + 2 * 2 * 32) + 4 * 32 * 64 + mlp  # q + gate, k, v; o; MLP
    delta_layer = 64 * (2 * 2 * 16 + 2 * 4 * 16 + 2 * 4) + 4 * 16 * 64 + mlp  # qkv, z, b, a; out; MLP
    assert flops["gemm"] == 2 * (attention_layer + 3 * delta_layer) * 130 == 47_257_600
    pairs = 100 * 101 / 2 + (10 * 100 + 10 * 11 / 2) + (20 * 100 + 20 * 21 / 2)
    assert flops["attention"] == 4 * 4 * 32 * 1 * pairs == 4_257_280
    per_head = 6 * 16 * 16 + 64 * (6 * 16 + 4 * 16) + 2 * 64 * 64 / 3
    assert flops["delta_rule"] == pytest.approx(3 * 4 * per_head * 130) == pytest.approx(22_630_400)
    assert flops["total"] == pytest.approx(flops["gemm"] + flops["attention"] + flops["delta_rule"])


def test_scaling_point_on_the_reference_path(tiny_dir: Path) -> None:
    engine = Engine(load_checkpoint(tiny_dir / "kev", "cpu"))
    point = bench.scaling_point(engine, 300, {"bf16_gemm_tflops": 1.0, "bf16_gemm_tflops_sustained": 0.8}, repeat=2)
    assert point["state_tokens"] == 300
    assert point["new_ms"] > 0 and point["same_ms"] > 0
    _, encoded = engine.prepare(sized(300, bench.state_length(engine)))
    rows = [len(q.tokens) for q in encoded.questions]
    expected = floors.pass_flops(engine.checkpoint.model.config, 300, rows)["total"]
    assert point["floor_ms"] == pytest.approx(expected / 1e9)  # ms at 1 TFLOP/s
    assert point["floor_sustained_ms"] == pytest.approx(expected / 0.8e9)
    assert engine.bank_stats.hits >= 2  # the same state came from the bank


def test_pool_capacity_is_what_the_pool_gives() -> None:
    """A pool sized like the engine's (half slots, half K/V pages) holds exactly `states` long states at once."""
    config = Qwen35Config.from_dict({**sizes.TINY_CONFIG, "vocab_size": 100})
    pool = StatePool.sized(config, 80 << 20, torch.device("cpu"), torch.bfloat16, min_tokens=65_600)
    capacity = bench.pool_capacity(pool, 65_535)
    assert capacity["pages_per_state"] == 1024 and capacity["states"] >= 2
    slots = [pool.allocate(65_535) for _ in range(capacity["states"])]
    assert all(slots) and pool.allocate(65_535) is None


def test_long_states_against_tritonserver(triton: TritonServer, tiny_dir: Path, tmp_path: Path) -> None:
    """loadtest/long_states.py briefly, short states on the CPU model: one at a time, then three at once."""
    out = tmp_path / "long.json"
    command = [
        sys.executable,
        str(REPO / "loadtest" / "long_states.py"),
        "--grpc",
        triton.grpc_url,
        "--tokenizer",
        str(tiny_dir / "base"),
        "--tokens",
        "300",
        "--concurrent",
        "3",
        "--alone",
        "2",
        "--rounds",
        "1",
        "--out",
        str(out),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["state_tokens"] == 300
    assert record["alone"]["requests"] == 2 and record["alone"]["state_tokens_per_s"] > 0
    concurrent = record["concurrent"]
    assert concurrent["states"] == 3 and len(concurrent["latencies_ms"][0]) == 3
    assert concurrent["state_tokens_per_s"] > 0 and concurrent["server"]["requests"] == 3
    assert record["speedup"] == pytest.approx(concurrent["state_tokens_per_s"] / record["alone"]["state_tokens_per_s"])


def test_size_projections_are_those_the_committed_table_holds() -> None:
    from kev_backend.dev.gemm_tuner import size_projections
    from tests.gpu.test_cublaslt import kev4b_projections

    assert size_projections("4b") == kev4b_projections()
    assert (2 * 17408, 5120) in size_projections("27b") and (5120, 48 * 128) in size_projections("27b")


def test_gemm_tables_merge_into_one(tmp_path: Path) -> None:
    """Tables of several sizes, one GPU: one table with every shape, the fastest entry where two hold one; tables
    of another GPU or cuBLASLt version are refused."""
    from kev_backend.dev.gemm_tuner import merge_tables
    from kev_backend.gpu.cublaslt import read_table

    def table(name: str, shapes: list[tuple[int, float]], gpu: str = "NVIDIA H200") -> Path:
        entries = [
            {"m": m, "n": 18432, "k": 2560, "algo": [f"{m:x}"] * 8, "us": us, "linear_us": 9.0} for m, us in shapes
        ]
        path = tmp_path / name
        path.write_text(json.dumps({"gpu": gpu, "cublaslt_version": 130100, "torch": "t", "shapes": entries}))
        return path

    first, second = table("a.json", [(64, 5.0), (128, 6.0)]), table("b.json", [(128, 4.0), (192, 7.0)])
    merged = merge_tables(tmp_path / "merged.json", [first, second])
    assert [(e["m"], e["us"]) for e in merged["shapes"]] == [(64, 5.0), (128, 4.0), (192, 7.0)]
    tuned_on, shapes = read_table(tmp_path / "merged.json")
    assert tuned_on == {"gpu": "NVIDIA H200", "cublaslt_version": 130100} and len(shapes) == 3
    with pytest.raises(ValueError, match="tuned on"):
        merge_tables(tmp_path / "bad.json", [first, table("c.json", [(64, 1.0)], gpu="NVIDIA A100")])


def test_sizes_report_merges_a_size_and_prints_its_table(tmp_path: Path) -> None:
    """bench/sizes_report.py on the files the sizes suite writes (here: made up, a step that failed missing)."""
    (tmp_path / "steps-27b.txt").write_text("write 98 0\ntune 20 0\nbench 121 0\nparity 60 0\nserve 110 1\n")
    latency = {"new_ms": 250.0, "same_ms": 30.0}
    bench_json = {
        "gpu": "NVIDIA H200",
        "commit": "abc",
        "date": "2026-12-02T00:00:00Z",
        "model": "kev-27b-shapes",
        "engine_gpu_gib": 103.0,
        "gpu_gib_peak": 110.0,
        "workloads": {
            "short6": latency | {"rps": {"64": 50.0}, "floor_rps": 80.0},
            "long5": latency | {"rps": {}, "floor_rps": 4.0},
            "scaling": [{"state_tokens": 2048, "floor_ms": 80.0, "gpu_gib": 105.0} | latency],
        },
        "bank_capacity": {"states": 3, "state_tokens": 65535, "bank_gib": 24.0, "checked": 3, "hits_on_second_ask": 3},
    }
    (tmp_path / "bench-27b").mkdir()
    (tmp_path / "bench-27b" / "2026-12-02-nvidia-h200-abc-27b.json").write_text(json.dumps(bench_json))
    versus = {"max_abs": 0.02, "decided_flips": 0, "decided_questions": 280}
    parity_json = {
        "vs_reference": versus,
        "alone_vs_batch": {"max_abs": 1e-6},
        "bank_hit_vs_miss": {"max_abs": 0.0},
        "verdict": {"vs_reference_max_abs": True},
        "layers": 16,
        "model_layers": 64,
        "depth": "the first 16 of 64 layers",
    }
    (tmp_path / "parity-27b").mkdir()
    (tmp_path / "parity-27b" / "parity.json").write_text(json.dumps(parity_json))
    (tmp_path / "facts-27b.json").write_text(json.dumps({"checkpoint_bytes": 51 << 30, "served_gpu_mib": 120_000}))
    out = tmp_path / "sizes-27b.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "sizes_report.py"), "27b", str(tmp_path), str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    record = json.loads(out.read_text())
    assert record["model"] == "kev-27b-shapes" and record["gpu"] == "NVIDIA H200" and record["commit"] == "abc"
    assert record["steps"]["serve"] == {"s": 110.0, "rc": 1} and "served" not in record
    assert record["bench"] == bench_json and record["parity"] == parity_json
    lines = result.stdout.splitlines()
    assert lines[0].startswith("kev-27b-shapes: write 98 s (rc 0)")
    assert any("parity (16 of 64 layers)" in line and "bars met: True" in line for line in lines)
    assert any("3 states of 65535 tokens" in line for line in lines)


def test_quick_workloads_and_their_table_on_the_reference_path(tiny_dir: Path, capsys: pytest.CaptureFixture) -> None:
    """--quick's plumbing on the CPU engine: latencies, throughput only at the clients asked, no profiler passes, no
    serial loop; the table prints what was measured."""
    from kev_backend.dev.workloads import long5, short6

    engine = Engine(load_checkpoint(tiny_dir / "kev", "cpu"))
    ceil = {"bf16_gemm_tflops": 1.0, "bf16_gemm_tflops_sustained": 0.5, "copy_tb_s": 1.0}
    short = bench.measure(engine, short6, ceil, 0.3, (2,), full=False, baseline=False, label="short6")
    long = bench.measure(engine, long5, ceil, 0.3, (), full=False, baseline=False, label="long5")
    assert set(short["rps"]) == {"2"} and long["rps"] == {}
    assert not {"profile_new", "serial_rps_64"} & (set(short) | set(long))
    assert short["baseline_rps"] is None and short["new_ms"] > 0 and long["floor_new_ms"] > 0
    assert long["floor_new_sustained_ms"] == pytest.approx(2 * long["floor_new_ms"])  # compute-bound at 1 TFLOP/s
    point = bench.scaling_point(engine, 100, ceil, repeat=1)
    bench.print_table({"short6": short, "long5": long, "scaling": [point]})
    out = capsys.readouterr().out
    assert "state    100 tokens" in out and out.count("n/a") >= 4


def test_a_checkpoint_of_other_shapes_is_refused_for_a_size(tiny_dir: Path) -> None:
    import argparse

    args, cpu = argparse.Namespace(size="4b", checkpoint=tiny_dir / "kev", base=None), torch.device("cpu")
    with pytest.raises(SystemExit, match="is not of kev-4b-shapes"):
        bench.load_model(args, cpu)
    _, model, _ = bench.load_model(argparse.Namespace(size=None, checkpoint=tiny_dir / "kev", base=None), cpu)
    assert model == "kev"


def test_parity_of_a_size_at_a_truncated_depth_says_so() -> None:
    from kev_backend.dev.parity import size_checkpoint

    checkpoint, about = size_checkpoint("0.8b", torch.device("cpu"), layers=4)
    assert checkpoint.kind == "lora" and checkpoint.dtype == torch.float32
    assert checkpoint.model.config.layer_types == tuple(sizes.hybrid_layers(4))
    assert about["model"] == "kev-0.8b-shapes" and (about["layers"], about["model_layers"]) == (4, 24)
    assert "the first 4 of 24 layers" in about["depth"]


def test_parity_verdict_holds_the_bars() -> None:
    from kev_backend.dev.parity import verdict

    def report(max_abs: float, flips: int, alone: float) -> dict:
        versus = {"max_abs": max_abs, "decided_flips": flips, "questions": 600}
        return {"vs_reference": versus, "alone_vs_batch": {"max_abs": alone}, "bank_hit_vs_miss": {"max_abs": 0.0}}

    assert all(verdict(report(0.02, 2, 1e-5)).values())
    assert verdict(report(0.031, 3, 0.02)) == {
        "vs_reference_max_abs": False,
        "decided_flips": False,
        "alone_vs_batch": False,
        "bank_hit_vs_miss": True,
    }


def test_fused_weights_share_a_bf16_models_memory(tiny_dir: Path) -> None:
    """A model already in bf16 (as the GPU path loads it) and its fused projections are one copy in memory: each
    projection of the model is a view of its stack, with the same values, and the model answers as before."""
    from kev_backend.gpu.weights import FusedWeights

    model = load_checkpoint(tiny_dir / "kev", "cpu", LoadOptions(dtype="bf16")).model
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    hidden_before, _ = model(ids)
    fused = FusedWeights(model)
    for layer, weights in zip(model.layers, fused.layers, strict=True):
        for projection in (layer.mlp.gate_proj, layer.mlp.up_proj):
            assert projection.weight.untyped_storage().data_ptr() == weights.gate_up.untyped_storage().data_ptr()
        assert layer.mlp.down_proj.weight.data_ptr() == weights.down.data_ptr()
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert torch.equal(model(ids)[0], hidden_before)
    # Nothing held twice: the buffers behind the model's parameters and the fused projections together are exactly
    # the model's parameters' bytes.
    projections = [w for layer in fused.layers for w in (layer.in_proj, layer.out_proj, layer.gate_up, layer.down)]
    tensors = [*model.parameters(), *projections]
    buffers = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    assert sum(buffers.values()) == sum(p.numel() * p.element_size() for p in model.parameters())
    # An fp32 model (the CPU reference) keeps its own weights: the fused ones are bf16 copies.
    fp32 = load_checkpoint(tiny_dir / "kev", "cpu").model
    copy = FusedWeights(fp32)
    assert fp32.layers[0].mlp.gate_proj.weight.dtype == torch.float32
    assert copy.layers[0].gate_up.untyped_storage().data_ptr() != fp32.layers[0].mlp.gate_proj.weight.data_ptr()
