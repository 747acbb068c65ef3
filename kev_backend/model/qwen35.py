"""Qwen3.5 text model, reference PyTorch path (CPU or CUDA eager).

Module and parameter names follow transformers' `Qwen3_5TextModel`, so HF-layout weights load by name. The
math is Qwen3.5's: zero-centred RMSNorms (x̂·(1+w)), gated full attention with per-head q/k norms and partial 1-D
RoPE (text-only mRoPE reduces to it exactly), Gated DeltaNet layers with a depthwise causal conv and the gated delta
rule in fp32, SwiGLU MLPs. There is no LM head: Kev reads the final-norm
hidden states.

The forward pass continues from a `SequenceCache` (attention K/V, DeltaNet conv window and fp32 recurrent state),
which is what the state bank stores: a state pass returns its cache, and question rows continue from it.

Memory invariants (what keeps a long state linear, not quadratic):
- attention never materialises L×T: `causal_attention` runs a chunk of queries at a time, its scores at most
  ATTENTION_CHUNK_ELEMENTS (4 Mi: 16 MiB in fp32) across batch and heads, its mask a c×c triangle;
- `forward_in_chunks` runs a sequence in chunks of PASS_CHUNK_TOKENS (4,096) tokens across the batch, each continuing
  the cache of the one before, so activations are bounded by the chunk and the previous cache is released layer by
  layer; it equals one `forward` pass up to float rounding;
- a cache owns exactly its tensors (no views into larger activations), so `SequenceCache.nbytes` is what it holds:
  N tokens · attention layers · 2 · Hkv · Dh elements, plus a fixed conv window and recurrent state per DeltaNet layer.
A state of N tokens therefore needs, beyond the weights and its cache, about one attention layer's share of the cache,
one chunk's activations (~ PASS_CHUNK_TOKENS · (3 · intermediate + 4 · hidden + 3 · mixer width) floats) and
2 · ATTENTION_CHUNK_ELEMENTS floats of scores (reference.py has the formula).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"

# The gated delta rule's chunk: a pass split at multiples of it chunks the rule exactly as one pass does.
DELTA_RULE_CHUNK = 64
# Attention scores (batch · heads · queries · keys) computed at once. On a CPU 4 Mi elements (16 MiB in fp32): larger
# chunks stop fitting its caches, much smaller ones re-read K and V once per chunk. On a GPU 64 Mi (256 MiB in fp32),
# so that long sequences take few chunks, hence few kernel launches.
ATTENTION_CHUNK_ELEMENTS = 1 << 22
ATTENTION_CHUNK_ELEMENTS_GPU = 1 << 26
# Tokens (across the batch) a chunked pass runs at a time: activations scale with it, not with the sequence.
PASS_CHUNK_TOKENS = 4096
# Kev's bases have 24 to 64 layers. A config that names more is refused before the model is built (built on the meta
# device first, 10,000 layers took 14 s and 629 MB, and the time grows with the count the file names).
MAX_LAYERS = 1024


@dataclass(frozen=True)
class Qwen35Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    layer_types: tuple[str, ...]
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    partial_rotary_factor: float = 0.25
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    dtype: str | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Qwen35Config:
        """Reads a text config, or the `text_config` of a multimodal (`qwen3_5`) config."""
        text = raw.get("text_config", raw)
        n_layers = int(text["num_hidden_layers"])
        if not 1 <= n_layers <= MAX_LAYERS:
            raise ValueError(f"num_hidden_layers {n_layers}: this loader takes 1..{MAX_LAYERS} layers")
        layer_types = text.get("layer_types")
        if not layer_types:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n_layers)]
        unknown = set(layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION}
        if unknown or len(layer_types) != n_layers:
            raise ValueError(f"unsupported layer_types {layer_types!r} for {n_layers} layers")
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise ValueError(f"unsupported rope_type {rope_type!r}")
        theta = rope.get("rope_theta", text.get("rope_theta", 10_000.0))
        partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
        hidden_act = text.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r}")
        tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        return cls(
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text["intermediate_size"]),
            num_hidden_layers=n_layers,
            num_attention_heads=int(text["num_attention_heads"]),
            num_key_value_heads=int(text["num_key_value_heads"]),
            head_dim=int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]),
            linear_num_key_heads=int(text["linear_num_key_heads"]),
            linear_num_value_heads=int(text["linear_num_value_heads"]),
            linear_key_head_dim=int(text["linear_key_head_dim"]),
            linear_value_head_dim=int(text["linear_value_head_dim"]),
            layer_types=tuple(layer_types),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            partial_rotary_factor=float(partial),
            tie_word_embeddings=bool(tie),
            pad_token_id=text.get("pad_token_id"),
            dtype=text.get("dtype") or text.get("torch_dtype") or raw.get("dtype") or raw.get("torch_dtype"),
        )

    @property
    def conv_dim(self) -> int:
        return (
            2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim
        )

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


@dataclass
class SequenceCache:
    """Per-layer continuation state of a batch of sequences of equal length `length` (batch dim first).

    Attention layers keep K (after k_norm and RoPE) and V as [B, Hkv, length, Dh]; DeltaNet layers keep the last
    W-1 pre-conv `in_proj_qkv` outputs as [B, conv_dim, W-1] (zeros before the start) and the recurrent state as
    [B, Hv, Dk, Dv] in fp32. Entries of the other layer kind are None.
    """

    length: int
    keys: list[torch.Tensor | None] = field(default_factory=list)
    values: list[torch.Tensor | None] = field(default_factory=list)
    conv: list[torch.Tensor | None] = field(default_factory=list)
    recurrent: list[torch.Tensor | None] = field(default_factory=list)

    def tensors(self) -> list[torch.Tensor]:
        return [t for group in (self.keys, self.values, self.conv, self.recurrent) for t in group if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


class Qwen35RMSNorm(nn.Module):
    """Zero-centred RMSNorm: the stored weight w scales by (1 + w); statistics in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class Qwen35RMSNormGated(nn.Module):
    """DeltaNet output norm: plain weight, normalised in fp32, then gated by silu(z)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)
        return (out * F.silu(gate.float())).to(dtype)


def rope_cos_sin(
    config: Qwen35Config, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [L, rotary_dim] for 1-D NeoX RoPE, computed in fp32 like transformers."""
    dim = config.rotary_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=positions.device) / dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, L, Dh]; rotates the first rotary_dim dims, passes the rest through."""
    dim = cos.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    half = dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


class Qwen35Attention(nn.Module):
    def __init__(self, config: Qwen35Config) -> None:
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.head_dim = config.head_dim
        d = config.hidden_size
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim * 2, bias=False)
        self.k_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=False)
        self.q_norm = Qwen35RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen35RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        past_k: torch.Tensor | None,
        past_v: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, L, _ = x.shape
        # q_proj emits [q_h | gate_h] per head.
        q, gate = self.q_proj(x).view(B, L, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
        gate = gate.reshape(B, L, self.n_heads * self.head_dim)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, L, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if past_k is not None:
            k = torch.cat((past_k.expand(B, -1, -1, -1), k), dim=2)
            v = torch.cat((past_v.expand(B, -1, -1, -1), v), dim=2)
        out = causal_attention(q, k, v, self.head_dim**-0.5)
        out = out.transpose(1, 2).reshape(B, L, self.n_heads * self.head_dim)
        return self.o_proj(out * torch.sigmoid(gate)), k, v


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Eager GQA attention, aligned bottom-right: query i of L sees keys 0..(T-L+i) of T.

    q [B, H, L, Dh]; k, v [B, Hkv, T, Dh] with H a multiple of Hkv (query head h reads kv head h // (H/Hkv)).
    softmax(q·kᵀ·scale, masked) · v, computed for a chunk of queries at a time so that no L×T tensor exists: a
    chunk's scores are [B, H, c, ≤T] with B·H·c·T ≤ ATTENTION_CHUNK_ELEMENTS (its _GPU value off the CPU), c ≥ 1.
    A chunk's queries read only the keys the last of them sees; of those, only its last c keys are masked for some
    of its queries (a c×c upper triangle). Keys left out would weigh exactly 0 (exp of the fill value), so the result
    is the one-shot formula's up to float rounding. Query heads sharing a kv head are stacked as rows of one matmul,
    so K and V are not copied per query head.
    """
    B, H, L, Dh = q.shape
    n_kv, T = k.shape[1], k.shape[2]
    n_rep = H // n_kv
    offset = T - L
    grouped = q.reshape(B, n_kv, n_rep, L, Dh)
    out = q.new_empty(B, n_kv, n_rep, L, v.shape[-1])
    budget = ATTENTION_CHUNK_ELEMENTS if q.device.type == "cpu" else ATTENTION_CHUNK_ELEMENTS_GPU
    step = max(1, budget // (B * H * T))
    fill = torch.finfo(q.dtype).min
    for start in range(0, L, step):
        end = min(start + step, L)
        n, seen = end - start, offset + end
        rows = grouped[:, :, :, start:end].reshape(B, n_kv, n_rep * n, Dh)
        scores = torch.matmul(rows, k[:, :, :seen].transpose(2, 3)).mul_(scale).view(B, n_kv, n_rep, n, seen)
        blocked = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        scores[..., offset + start :].masked_fill_(blocked, fill)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        del scores
        mixed = torch.matmul(probs.view(B, n_kv, n_rep * n, seen), v[:, :, :seen])
        out[:, :, :, start:end] = mixed.view(B, n_kv, n_rep, n, -1)
    return out.view(B, H, L, -1)


def chunk_width(chunk_tokens: int, batch: int = 1) -> int:
    """The tokens of each sequence that one chunk of `Qwen35TextModel.chunks` runs: about `chunk_tokens` across the
    batch, a multiple of DELTA_RULE_CHUNK (so the delta rule chunks the sequence as one pass does)."""
    return max(DELTA_RULE_CHUNK, chunk_tokens // batch // DELTA_RULE_CHUNK * DELTA_RULE_CHUNK)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    chunk_size: int = DELTA_RULE_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule in fp32, chunked. q, k: [B, H, L, Dk] (already L2-normalised, q scaled); v: [B, H, L, Dv];
    g (log decay, <= 0), beta: [B, H, L]; state [B, H, Dk, Dv]. Returns (o [B, H, L, Dv], final state).

    The recurrence S_t = e^{g_t} S_{t-1} + k_t u_tᵀ with u_t = β_t (v_t − (e^{g_t} S_{t-1})ᵀ k_t), o_t = S_tᵀ q_t,
    unrolled over a chunk with cumulative decay γ: (I + A) U = β ⊙ (V − e^{γ} K S₀), A[t,s] = β_t e^{γ_t−γ_s} k_t·k_s
    for s < t, solved exactly by a unit lower-triangular solve;
    o_t = e^{γ_t} S₀ᵀ q_t + Σ_{s≤t} e^{γ_t−γ_s} (q_t·k_s) u_s.
    """
    B, H, L, Dk = k.shape
    Dv = v.shape[-1]
    state = q.new_zeros(B, H, Dk, Dv) if initial_state is None else initial_state.float().expand(B, -1, -1, -1)
    out = q.new_empty(B, H, L, Dv)
    for start in range(0, L, chunk_size):
        end = min(start + chunk_size, L)
        qc, kc, vc = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
        gamma = g[:, :, start:end].cumsum(-1)
        bc = beta[:, :, start:end]
        n = end - start
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        # exp of (γ_t − γ_s) only where s <= t, where it is <= 0 and cannot overflow.
        decay = torch.exp((gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower, float("-inf")))
        strict = decay.masked_fill(torch.eye(n, dtype=torch.bool, device=q.device), 0.0)
        a = bc[..., :, None] * strict * (kc @ kc.transpose(-1, -2))
        rhs = bc[..., None] * (vc - torch.exp(gamma)[..., None] * (kc @ state))
        eye = torch.eye(n, dtype=q.dtype, device=q.device)
        u = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
        out[:, :, start:end] = torch.exp(gamma)[..., None] * (qc @ state) + (decay * (qc @ kc.transpose(-1, -2))) @ u
        last = gamma[..., -1:]
        state = torch.exp(last)[..., None] * state + (kc * torch.exp(last - gamma)[..., None]).transpose(-1, -2) @ u
    return out, state


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class Qwen35GatedDeltaNet(nn.Module):
    def __init__(self, config: Qwen35Config) -> None:
        super().__init__()
        d = config.hidden_size
        self.n_k = config.linear_num_key_heads
        self.n_v = config.linear_num_value_heads
        self.dk = config.linear_key_head_dim
        self.dv = config.linear_value_head_dim
        self.kernel = config.linear_conv_kernel_dim
        self.conv_dim = config.conv_dim
        self.in_proj_qkv = nn.Linear(d, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(d, self.n_v * self.dv, bias=False)
        self.in_proj_b = nn.Linear(d, self.n_v, bias=False)
        self.in_proj_a = nn.Linear(d, self.n_v, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.n_v))
        self.A_log = nn.Parameter(torch.zeros(self.n_v))
        self.norm = Qwen35RMSNormGated(self.dv, eps=config.rms_norm_eps)
        self.out_proj = nn.Linear(self.n_v * self.dv, d, bias=False)

    def forward(
        self, x: torch.Tensor, past_conv: torch.Tensor | None, past_state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, L, _ = x.shape
        qkv = self.in_proj_qkv(x).transpose(1, 2)  # [B, C, L]
        window = self.kernel - 1
        if past_conv is None:
            past_conv = qkv.new_zeros(B, self.conv_dim, window)
        seq = torch.cat((past_conv.expand(B, -1, -1).to(qkv.dtype), qkv), dim=-1)
        conv_out = F.silu(F.conv1d(seq, self.conv1d.weight, groups=self.conv_dim))  # [B, C, L]
        new_conv = seq[..., -window:].clone()  # a copy: a view would keep all of `seq` alive in the cache
        q, k, v = torch.split(
            conv_out.transpose(1, 2), [self.n_k * self.dk, self.n_k * self.dk, self.n_v * self.dv], -1
        )
        rep = self.n_v // self.n_k  # each k-head serves `rep` consecutive v-heads
        q = q.reshape(B, L, self.n_k, self.dk).repeat_interleave(rep, dim=2).transpose(1, 2).float()
        k = k.reshape(B, L, self.n_k, self.dk).repeat_interleave(rep, dim=2).transpose(1, 2).float()
        v = v.reshape(B, L, self.n_v, self.dv).transpose(1, 2).float()
        q = l2_normalize(q) * self.dk**-0.5
        k = l2_normalize(k)
        beta = torch.sigmoid(self.in_proj_b(x)).float().transpose(1, 2)
        g = (-self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())).transpose(1, 2)
        o, state = gated_delta_rule(q, k, v, g, beta, past_state)
        o = o.transpose(1, 2).to(x.dtype)  # [B, L, Hv, Dv]
        z = self.in_proj_z(x).view(B, L, self.n_v, self.dv)
        o = self.norm(o, z).reshape(B, L, self.n_v * self.dv)
        return self.out_proj(o), new_conv, state


class Qwen35MLP(nn.Module):
    def __init__(self, config: Qwen35Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen35DecoderLayer(nn.Module):
    def __init__(self, config: Qwen35Config, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        if layer_type == FULL_ATTENTION:
            self.self_attn = Qwen35Attention(config)
        else:
            self.linear_attn = Qwen35GatedDeltaNet(config)
        self.mlp = Qwen35MLP(config)
        self.input_layernorm = Qwen35RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen35RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Qwen35TextModel(nn.Module):
    """The bare text tower; `forward` returns the final-norm hidden states and the cache it ends with."""

    def __init__(self, config: Qwen35Config) -> None:
        super().__init__()
        self.config = config
        # Weights always come from a checkpoint: no init draw. Embedding's own (normal_) on the meta device, where
        # build_model constructs the model, imports torch._dynamo: seconds of a process's start.
        embed = torch.zeros(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=embed)
        self.layers = nn.ModuleList(Qwen35DecoderLayer(config, t) for t in config.layer_types)
        self.norm = Qwen35RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # Called after each layer of each forward (a serving process's heartbeat: a long state on a CPU takes
        # minutes, a layer of one chunk seconds).
        self.layer_done: Callable[[], None] | None = None

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, cache: SequenceCache | None = None, release: bool = False
    ) -> tuple[torch.Tensor, SequenceCache]:
        """input_ids [B, L] continue `cache` (batch 1, shared by every row, or batch B), or start from nothing.

        Rows may be right-padded: every op is causal, so pads never change a real token's hidden state (the
        returned cache is then only meaningful for unpadded input). With `release`, each layer's entries of `cache`
        are dropped as soon as they are read (for a cache nothing else holds: it is spent), so the old and the new
        cache coexist one layer at a time rather than whole.
        """
        B, L = input_ids.shape
        start = cache.length if cache is not None else 0
        positions = torch.arange(start, start + L, device=input_ids.device)
        h = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(self.config, positions, h.dtype)
        out = SequenceCache(length=start + L)
        for i, layer in enumerate(self.layers):
            residual = h
            x = layer.input_layernorm(h)
            k = v = conv = state = None
            if layer.layer_type == FULL_ATTENTION:
                past = (cache.keys[i], cache.values[i]) if cache is not None else (None, None)
                if release and cache is not None:
                    cache.keys[i] = cache.values[i] = None
                x, k, v = layer.self_attn(x, cos, sin, *past)
            else:
                past = (cache.conv[i], cache.recurrent[i]) if cache is not None else (None, None)
                if release and cache is not None:
                    cache.conv[i] = cache.recurrent[i] = None
                x, conv, state = layer.linear_attn(x, *past)
            del past
            out.keys.append(k)
            out.values.append(v)
            out.conv.append(conv)
            out.recurrent.append(state)
            h = residual + x
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            if self.layer_done is not None:
                self.layer_done()
        return self.norm(h), out

    @torch.no_grad()
    def forward_in_chunks(
        self,
        input_ids: torch.Tensor,
        cache: SequenceCache | None = None,
        chunk_tokens: int = PASS_CHUNK_TOKENS,
        keep_hidden: bool = True,
    ) -> tuple[torch.Tensor | None, SequenceCache]:
        """`forward`, run over the sequence in chunks of about `chunk_tokens` tokens across the batch, each continuing
        the cache the one before returned (every op is causal, so this is the one-pass result up to float rounding).

        Chunks are a multiple of DELTA_RULE_CHUNK wide, so the delta rule chunks the sequence as one pass does; a
        sequence no wider than one chunk runs in one `forward` call. Activations are bounded by the chunk; the cache
        grows by concatenation, each chunk releasing the cache of the one before layer by layer (never `cache`, which
        the caller keeps). Without `keep_hidden` the hidden states are dropped chunk by chunk and None is returned.
        """
        steps = self.chunks(input_ids, cache, chunk_tokens, keep_hidden)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def chunks(
        self,
        input_ids: torch.Tensor,
        cache: SequenceCache | None = None,
        chunk_tokens: int = PASS_CHUNK_TOKENS,
        keep_hidden: bool = True,
    ) -> Generator[None, None, tuple[torch.Tensor | None, SequenceCache]]:
        """`forward_in_chunks` as a generator that yields after each chunk and returns what it returns, so a caller can
        do other work between chunks (a scheduler serving short requests between a long state's chunks). The chunks
        are the same whoever drives them, so the result is too."""
        B, L = input_ids.shape
        width = chunk_width(chunk_tokens, B)
        hidden: list[torch.Tensor] = []
        for start in range(0, L, width):
            if start:
                yield
            with torch.no_grad():
                h, cache = self(input_ids[:, start : start + width], cache, release=start > 0)
            if keep_hidden:
                hidden.append(h)
        if cache is None:
            raise ValueError("forward_in_chunks needs at least one token")
        if not keep_hidden:
            return None, cache
        return (hidden[0] if len(hidden) == 1 else torch.cat(hidden, dim=1)), cache
