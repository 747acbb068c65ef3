"""What bounds the engine's speed on this GPU: the measured ceilings (bf16 GEMM rate, in bursts and sustained at the
power limit; copy bandwidth), a request's or a pass's FLOPs and weight bytes, and the floors they set (a latency
at the GEMM rate, requests/s at the GEMM rate or the weights' read, whichever is slower). The bench reports each
figure beside its floor."""

from __future__ import annotations

import statistics

import torch

from ..engine.engine import Engine
from ..model.qwen35 import DELTA_RULE_CHUNK, FULL_ATTENTION, Qwen35Config
from . import sizes

SUSTAINED_S = 0.5  # the sustained GEMM rate's run (ceilings)


def ceilings(device: torch.device) -> dict[str, float]:
    """Measured bf16 GEMM rates and device-to-device copy bandwidth (bytes read + written). The GEMM rate twice: the
    8,192³ GEMM with the GPU idle before each call (bf16_gemm_tflops: what a short pass's GEMMs get), and back to
    back for SUSTAINED_S (bf16_gemm_tflops_sustained: by then an H200 runs at its power limit, its SM clock ~1,500
    MHz against 1,980, and a pass over ~50 ms runs its GEMMs near this rate)."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    src = torch.randn(1 << 28, device=device)
    dst = torch.empty_like(src)

    def timed(fn, repeat: int, calls: int = 1) -> float:
        """Median seconds a call over `repeat` timings of `calls` calls back to back, after 3 calls."""
        for _ in range(3):
            fn()
        times = []
        for _ in range(repeat):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000 / calls)
        return statistics.median(times)

    gemm_s = timed(lambda: a @ b, 10)
    sustained_s = timed(lambda: a @ b, 1, calls=max(1, round(SUSTAINED_S / gemm_s)))
    copy_s = timed(lambda: dst.copy_(src), 10)
    return {
        "bf16_gemm_tflops": 2 * 8192**3 / gemm_s / 1e12,
        "bf16_gemm_tflops_sustained": 2 * 8192**3 / sustained_s / 1e12,
        "copy_tb_s": 2 * src.numel() * 4 / copy_s / 1e12,
    }


def floors(flops: float, ceil: dict[str, float]) -> dict[str, float]:
    """ms of `flops` at the burst and at the sustained GEMM rate (ceilings)."""
    return {
        "floor_ms": 1000 * flops / (ceil["bf16_gemm_tflops"] * 1e12),
        "floor_sustained_ms": 1000 * flops / (ceil["bf16_gemm_tflops_sustained"] * 1e12),
    }


def request_cost(engine: Engine, body: dict) -> dict[str, float]:
    """Tokens, FLOPs (2·params per token + attention scores) and weight bytes of one request on a new state."""
    _, encoded = engine.prepare(body)
    model = engine.checkpoint.model
    config = model.config
    params = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("embed_tokens"))
    state = len(encoded.state)
    rows = [len(q.tokens) for q in encoded.questions]
    tokens = state + sum(rows)
    attn_layers = sum(t == "full_attention" for t in config.layer_types)
    width = config.num_attention_heads * config.head_dim
    # q·k and p·v: 4·width per (query, key) pair; causal state pass, rows over state + own prefix.
    pairs = state * (state + 1) / 2 + sum(n * state + n * (n + 1) / 2 for n in rows)
    flops = 2 * params * tokens + 4 * width * attn_layers * pairs
    return {"tokens": tokens, "flops": flops, "weight_bytes": params * 2}


def floor_rps(
    cost: dict[str, float], ceil: dict[str, float], clients: int = 64, rate: str = "bf16_gemm_tflops"
) -> float:
    """Requests/s at `clients` at once: their FLOPs at the GEMM rate `rate` (a ceilings key) or the weights read once,
    whichever takes longer."""
    compute = clients * cost["flops"] / (ceil[rate] * 1e12)
    weights = cost["weight_bytes"] / (ceil["copy_tb_s"] * 1e12)
    return clients / max(compute, weights)


def pass_flops(config: Qwen35Config, state_tokens: int, row_lengths: list[int]) -> dict[str, float]:
    """bf16 FLOPs of a new state of `state_tokens` tokens and its question rows, as the floor counts them:
    - gemm: 2 · out · in of every fused projection of every layer (sizes.fused_projections; LoRA merged), per token;
    - attention: 4 · heads · head_dim per (query, key) pair of each attention layer (q·k and p·v): the state causal,
      each row over the state and its own prefix;
    - delta_rule: the chunked gated delta rule per token and value head, with C = DELTA_RULE_CHUNK and dk, dv the
      head widths: 6·dk·dv for the products with the state (q·S, k·S, the state update), C·(6·dk + 4·dv) for those
      inside a chunk (k·kᵀ, q·kᵀ, T·k; T·v, p·v), (2/3)·C² for the triangular solve. Rows counted like the state.
    Norms, the conv, gates and the pointer head (each under 0.1 %) are left out."""
    tokens = state_tokens + sum(row_lengths)
    projections = sizes.fused_projections(config)
    per_token = sum(2 * n * k for kind in config.layer_types for n, k in projections[kind])
    attention_layers = sum(kind == FULL_ATTENTION for kind in config.layer_types)
    pairs = state_tokens * (state_tokens + 1) / 2 + sum(n * state_tokens + n * (n + 1) / 2 for n in row_lengths)
    attention = 4 * config.num_attention_heads * config.head_dim * attention_layers * pairs
    dk, dv, chunk = config.linear_key_head_dim, config.linear_value_head_dim, DELTA_RULE_CHUNK
    per_head = 6 * dk * dv + chunk * (6 * dk + 4 * dv) + 2 * chunk * chunk / 3
    delta = (len(config.layer_types) - attention_layers) * config.linear_num_value_heads * per_head * tokens
    gemm = per_token * tokens
    return {"gemm": gemm, "attention": attention, "delta_rule": delta, "total": gemm + attention + delta}
