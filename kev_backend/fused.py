"""Fused GPU path: Qwen3.5 in bf16 on fla kernels and varlen attention, with the state bank on the GPU.

One pass through the weights per batch: the tokens of every new state and of every question row share each layer's
GEMMs (concatenated projections after the LoRA merge); inside a layer the mixers run per segment kind — first the
new states (varlen, from empty caches; their conv windows, fp32 DeltaNet states and K/V are written into the bank
pool), then the rows (varlen, each continuing its state read from the pool). fp32 where Kev needs it: DeltaNet
recurrent state, norm statistics and the residual stream, the picked hidden states and the pointer head. There is
no LM head: after the last mixer only the tokens at `</opt>` and `<decide>` go on.

fla hazards (../shared/docs/qwen35-and-kernels.md §4.7): fla memoises results derived from `cu_seqlens` by tensor
identity, so every pass builds fresh `cu_seqlens` tensors and never mutates them.
"""

from __future__ import annotations

import importlib.metadata
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .encoding import Encoded, EncodedQuestion
from .gpu_bank import GpuBank, Slot, StatePool
from .head import Picked, batch_probabilities
from .qwen35 import FULL_ATTENTION, Qwen35TextModel

FLA_VERSION = "0.6.0"  # the kernels' behaviour (caching, chunk maps) is pinned; requirements-gpu.txt names it


def fla_available() -> bool:
    """fla kernels only with a CUDA device and exactly the pinned fla-core (never on a CPU: they crash there)."""
    if not torch.cuda.is_available():
        return False
    try:
        version = importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        return False
    if version != FLA_VERSION:
        return False
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


# --------------------------------------------------------------------------------------------------------------------
# weights


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


class FusedWeights:
    """Concatenated bf16 projections built from a (merged) reference model; norm weights kept in fp32."""

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
                gate_up=torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]).detach().to(dtype),
                down=layer.mlp.down_proj.weight.detach().to(dtype),
            )
            if layer.layer_type == FULL_ATTENTION:
                a = layer.self_attn
                self.layers.append(
                    LayerWeights(
                        kind=FULL_ATTENTION,
                        in_proj=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach().to(dtype),
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
                        in_proj=torch.cat(proj).detach().to(dtype),
                        out_proj=g.out_proj.weight.detach().to(dtype),
                        conv=g.conv1d.weight.detach().squeeze(1).to(dtype).contiguous(),
                        a_log=g.A_log.detach().float(),
                        dt_bias=g.dt_bias.detach().float(),
                        gated_norm=g.norm.weight.detach().float(),
                        **common,
                    )
                )


# --------------------------------------------------------------------------------------------------------------------
# one pass


# A segment this short runs the recurrent delta rule (fp32 state throughout), a longer one the chunked kernel. The
# choice depends on the segment alone, never on what shares its pass, so a question's answer does not depend on
# its batch.
RECURRENT_MAX_LEN = 64

# Batch invariance of the GEMMs: cuBLAS picks split-K by the row count M, and a split changes the summation order, so
# a row's bf16 output would depend on what shares its pass. Measured on the H200 (bench/diag.py sweep, Kev-4B
# projections, M = 1..4,096 against M = 8,192): cuBLASLt's results are identical for every M >= 52, cuBLAS's only
# from M = 257. So the fused path prefers cuBLASLt and gives every GEMM at least MIN_GEMM_ROWS rows (pad rows that
# nothing reads); at these sizes the GEMMs are bound by reading the weights, so the padding costs nothing.
MIN_GEMM_ROWS = 64


def pad_rows(x: torch.Tensor, rows: int = MIN_GEMM_ROWS) -> torch.Tensor:
    """x with zero rows appended up to `rows` (x itself when it has enough)."""
    return x if x.shape[0] >= rows else F.pad(x, (0, 0, 0, rows - x.shape[0]))


def is_short(length: int) -> bool:
    return length <= RECURRENT_MAX_LEN


@dataclass
class KernelGroup:
    """Segments of one kind and one length class, contiguous in the pass: tokens [start, end). Short ones (up to
    RECURRENT_MAX_LEN tokens) run our kernels, which read or write the bank in place; longer ones fla's chunked
    kernels and torch's varlen attention. The class depends on a segment's own length, never on its company."""

    short: bool
    start: int
    end: int
    max_len: int  # longest segment (for a captured pass, the bound its grids are sized for)
    cu: torch.Tensor  # int64 offsets from `start`, [segments + 1]; fresh per eager pass (fla caches by identity)
    slots: torch.Tensor  # the pool slot of each segment (its own, or the state a row continues)
    cu_cpu: torch.Tensor | None = None  # long groups: the same on the host, so fla builds its chunk maps unsynced
    cu32: torch.Tensor | None = None  # long new states: int32 for varlen attention

    @property
    def span(self) -> slice:
        return slice(self.start, self.end)

    @classmethod
    def build(cls, start: int, lengths: list[int], slots: list[int], device: torch.device) -> KernelGroup:
        short = all(is_short(n) for n in lengths)
        assert short or not any(is_short(n) for n in lengths)
        cu_cpu = torch.tensor(_offsets(lengths), dtype=torch.int64)
        cu = cu_cpu.to(device)
        return cls(
            short=short,
            start=start,
            end=start + int(cu_cpu[-1]),
            max_len=max(lengths),
            cu=cu,
            slots=torch.tensor(slots, dtype=torch.int64, device=device),
            cu_cpu=None if short else cu_cpu,
            cu32=None if short else cu.to(torch.int32),
        )


def _offsets(lengths: list[int]) -> list[int]:
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return offsets


@dataclass
class Segments:
    """The new states, or the question rows, of a pass: tokens [start, end), short segments first, then long ones;
    `cu` and `max_len` cover them all (rows' attention runs over every row at once)."""

    start: int
    end: int
    max_len: int
    cu: torch.Tensor  # int64 offsets from `start` of every segment
    groups: list[KernelGroup]

    @classmethod
    def build(cls, start: int, lengths: list[int], slots: list[int], device: torch.device) -> Segments:
        """Segments in the given order, which must put every short one before every long one."""
        n_short = sum(is_short(n) for n in lengths)
        assert all(is_short(n) for n in lengths[:n_short])
        groups = []
        offset = start
        for part in (slice(0, n_short), slice(n_short, len(lengths))):
            if lengths[part]:
                group = KernelGroup.build(offset, lengths[part], slots[part], device)
                groups.append(group)
                offset = group.end
        cu = torch.tensor(_offsets(lengths), dtype=torch.int64, device=device)
        return cls(start, offset, max(lengths), cu, groups)


@dataclass
class PassLayout:
    """A pass on the host: new states' tokens first, then the rows'. Row picks count from the first row token."""

    state_ids: list[int] = field(default_factory=list)
    state_lengths: list[int] = field(default_factory=list)
    state_slots: list[int] = field(default_factory=list)
    state_kv_dst: list[int] = field(default_factory=list)  # pool K/V index of each state token
    row_ids: list[int] = field(default_factory=list)
    row_positions: list[int] = field(default_factory=list)
    row_lengths: list[int] = field(default_factory=list)
    row_slots: list[int] = field(default_factory=list)
    prefix: list[int] = field(default_factory=list)  # pool K/V index of each continued state's tokens, one run each
    prefix_start: list[int] = field(default_factory=list)
    prefix_len: list[int] = field(default_factory=list)
    row_picks: list[int] = field(default_factory=list)

    def state_positions(self) -> list[int]:
        return [i for n in self.state_lengths for i in range(n)]

    @property
    def all_short(self) -> bool:
        return all(is_short(n) for n in self.state_lengths) and all(is_short(n) for n in self.row_lengths)


@dataclass
class PassInput:
    ids: torch.Tensor  # [T]: new-state tokens, then row tokens, then any padding
    positions: torch.Tensor  # [T]
    states: Segments | None  # new states computed in this pass
    state_kv_dst: torch.Tensor | None  # pool K/V index of each new-state token
    rows: Segments | None  # question rows (None: a pass of new states only)
    row_prefix: torch.Tensor  # pool K/V index of the tokens of each state the rows continue, one run per state
    row_prefix_start: torch.Tensor  # where each row's state run starts in row_prefix
    row_prefix_len: torch.Tensor  # its length (the state's tokens)
    picks: torch.Tensor  # pass token index of every </opt> and <decide> read by the head


@dataclass(frozen=True)
class PassKernels:
    """The GPU kernels of a pass: fla's causal conv and chunked delta rule for segments over RECURRENT_MAX_LEN
    tokens and torch's varlen attention for new states; ours (kev_backend.kernels) for norms and for short segments,
    which read (rows) or write (new states) the bank in place. A CPU test substitutes
    torch references with the same signatures to check the pass's plumbing."""

    conv: Callable
    chunk: Callable
    attention: Callable
    rms_norm: Callable
    rms_norm_rope: Callable
    gated_rms_norm: Callable
    silu_mul: Callable
    recurrent_rows: Callable
    chunked_rows: Callable
    conv_tiles: Callable
    conv_rows: Callable
    rows_attention: Callable

    @classmethod
    def gpu(cls) -> PassKernels:
        from fla.modules.causal_conv1d import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from torch.nn.attention.varlen import varlen_attn

        from . import kernels

        return cls(
            causal_conv1d,
            chunk_gated_delta_rule,
            varlen_attn,
            kernels.rms_norm,
            kernels.rms_norm_rope,
            kernels.gated_rms_norm,
            kernels.silu_mul,
            kernels.recurrent_rows,
            kernels.chunked_rows,
            kernels.conv_tiles,
            kernels.conv_rows,
            kernels.rows_attention,
        )


class FusedQwen35:
    """The fused forward over a PassInput; returns the final-norm hidden states at the picks (fp32)."""

    def __init__(
        self, weights: FusedWeights, pool: StatePool, kernels: PassKernels | None = None, long_kernels: str = "fla"
    ) -> None:
        # cuBLAS may otherwise reduce split-K partial sums in bf16, with a split chosen by the token count: answers
        # would then move with the batch they ride in.
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        if weights.embed.is_cuda:
            torch.backends.cuda.preferred_blas_library("cublaslt")  # see MIN_GEMM_ROWS (a process-wide setting)
        k = kernels or PassKernels.gpu()
        self.w = weights
        self.pool = pool
        self.c = weights.config
        self._conv, self._chunk, self._attn = k.conv, k.chunk, k.attention
        self._rms_norm, self._gated_norm, self._silu_mul = k.rms_norm, k.gated_rms_norm, k.silu_mul
        self._norm_rope = k.rms_norm_rope
        self._chunked_rows, self._conv_tiles = k.chunked_rows, k.conv_tiles
        # Segments over RECURRENT_MAX_LEN tokens: fla's conv and chunked delta rule ("fla"), or ours ("ours":
        # conv_tiles and chunked_rows, reading and writing the bank in place, no host chunk maps). Being measured.
        if long_kernels not in ("fla", "ours"):
            raise ValueError(f"long_kernels must be fla or ours, not {long_kernels!r}")
        self.long_kernels = long_kernels
        self._recurrent_rows, self._conv_rows, self._rows_attention = k.recurrent_rows, k.conv_rows, k.rows_attention
        c = self.c
        self.key_dim = c.linear_num_key_heads * c.linear_key_head_dim
        self.value_dim = c.linear_num_value_heads * c.linear_value_head_dim
        dim = c.rotary_dim
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.inv_freq = inv_freq.to(weights.embed.device)  # no host copy inside a pass (it may be captured)

    def norm(self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None):
        """Residual add + RMSNorm in one kernel; the residual stream stays fp32."""
        return self._rms_norm(x, weight, self.c.rms_norm_eps, residual, store_residual=True)

    @torch.no_grad()
    def forward(self, p: PassInput) -> torch.Tensor:
        w = self.w
        freqs = p.positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        rope = (emb.cos(), emb.sin())  # fp32, [T, rotary dims]
        hidden = F.embedding(p.ids, w.embed)
        residual = None
        gdn = attn = 0
        last = len(w.layers) - 1
        for i, layer in enumerate(w.layers):
            x, residual = self.norm(hidden, layer.input_norm, residual)
            if layer.kind == FULL_ATTENTION:
                hidden = self.attention(layer, attn, x, rope, p)
                attn += 1
            else:
                hidden = self.gated_deltanet(layer, gdn, x, p)
                gdn += 1
            if i == last:
                break
            x, residual = self.norm(hidden, layer.post_norm, residual)
            hidden = self.mlp(layer, x)
        if p.picks.numel() == 0:  # a pass of new states only: their caches are in the bank now
            return hidden.new_empty(0, hidden.shape[-1], dtype=torch.float32)
        # Only the picked tokens go through the last MLP and the final norm.
        h = residual[p.picks] + hidden[p.picks].float()
        x = self.rms_fp32(h, w.layers[last].post_norm)
        h = h + self.mlp(w.layers[last], pad_rows(x.to(w.dtype)))[: h.shape[0]].float()
        return self.rms_fp32(h, w.final_norm)

    def rms_fp32(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.c.rms_norm_eps) * weight

    def mlp(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self._silu_mul(F.linear(x, layer.gate_up)), layer.down)

    # -- Gated DeltaNet ------------------------------------------------------------------------------------------

    def gated_deltanet(self, layer: LayerWeights, index: int, x: torch.Tensor, p: PassInput) -> torch.Tensor:
        c = self.c
        proj = F.linear(x, layer.in_proj)
        qkv, z, b, a = proj.split([c.conv_dim, self.value_dim, c.linear_num_value_heads, c.linear_num_value_heads], -1)
        # Padding tokens belong to no segment: their rows keep whatever is here, row by row, and are never read.
        out = torch.empty(x.shape[0], c.linear_num_value_heads, c.linear_value_head_dim, device=x.device, dtype=x.dtype)
        conv_pool, state_pool = self.pool.conv[index], self.pool.recurrent[index]
        # New states start from zero and leave their conv window and DeltaNet state in their (fresh) bank slots;
        # rows continue theirs, read in place by slot, and write nothing back.
        for seg, new in ((p.states, True), (p.rows, False)):
            for group in seg.groups if seg is not None else ():
                span = group.span
                if not group.short and self.long_kernels == "ours":  # tokens in parallel, windows in place
                    mixed = self._conv_tiles(
                        qkv[span], layer.conv, conv_pool, group.slots, group.cu, group.max_len, new_states=new
                    )
                elif new and not group.short:  # fla's conv; the windows are copied into the slots
                    mixed, window = self._conv(
                        qkv[span].contiguous().unsqueeze(0),
                        layer.conv,
                        output_final_state=True,
                        activation="silu",
                        cu_seqlens=group.cu,
                        cu_seqlens_cpu=group.cu_cpu,
                    )
                    mixed = mixed[0]
                    conv_pool.index_copy_(0, group.slots, window.to(conv_pool.dtype))
                else:  # ours, in place (rows of any length: the conv is cheap token by token)
                    mixed = self._conv_rows(qkv[span], layer.conv, conv_pool, group.slots, group.cu, new_states=new)
                self.delta_rule(layer, group, mixed, a[span], b[span], state_pool, new, out[span])
        normed = self._gated_norm(
            out.view(-1, c.linear_value_head_dim),
            z.unflatten(-1, (c.linear_num_value_heads, c.linear_value_head_dim)),  # read in place
            layer.gated_norm,
            c.rms_norm_eps,
        )
        return F.linear(normed.view(x.shape[0], self.value_dim), layer.out_proj)

    def delta_rule(
        self,
        layer: LayerWeights,
        group: KernelGroup,
        mixed: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        state_pool: torch.Tensor,
        new: bool,
        out: torch.Tensor,
    ) -> None:
        """The delta rule over a group's conv outputs `mixed` [T, conv_dim] into `out` [T, Hv, Dv]: new states from
        zero into their slots of `state_pool` [slots, Hv, Dk, Dv], or rows from their states' slots. Short segments
        on our token-by-token kernel, long ones on our chunked kernel (`long_kernels` "ours"; both read and write
        states in place, gates computed inside) or fla's chunked kernel (rows from a gathered copy of their
        states)."""
        c = self.c
        T = mixed.shape[0]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.unflatten(-1, (c.linear_num_key_heads, c.linear_key_head_dim))
        k = k.unflatten(-1, (c.linear_num_key_heads, c.linear_key_head_dim))
        v = v.unflatten(-1, (c.linear_num_value_heads, c.linear_value_head_dim))
        if group.short or self.long_kernels == "ours":
            kernel = self._recurrent_rows if group.short else self._chunked_rows
            kernel(
                q, k, v, a, b, layer.a_log, layer.dt_bias, state_pool, group.slots, group.cu, new_states=new, out=out
            )
            return
        g = (-layer.a_log.exp() * F.softplus(a.float() + layer.dt_bias)).unsqueeze(0)
        o, final = self._chunk(
            q.unsqueeze(0),
            k.unsqueeze(0),
            v.unsqueeze(0),
            g=g,
            beta=torch.sigmoid(b).unsqueeze(0),
            initial_state=None if new else state_pool.index_select(0, group.slots),
            output_final_state=new,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=group.cu,
            cu_seqlens_cpu=group.cu_cpu,
        )
        if new:
            state_pool.index_copy_(0, group.slots, final)
        out.copy_(o[0].view(T, c.linear_num_value_heads, c.linear_value_head_dim))

    # -- gated attention -----------------------------------------------------------------------------------------

    def attention(self, layer: LayerWeights, index: int, x: torch.Tensor, rope, p: PassInput) -> torch.Tensor:
        c = self.c
        T, Hq, Hkv, D = x.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        proj = F.linear(x, layer.in_proj)
        qg, k, v = proj.split([2 * Hq * D, Hkv * D, Hkv * D], dim=-1)
        q, gate = qg.view(T, Hq, 2 * D).chunk(2, dim=-1)
        # Per-head norm and partial RoPE in one kernel each, reading the projection's per-head views in place.
        q = self._norm_rope(q, layer.q_norm, c.rms_norm_eps, *rope)
        k = self._norm_rope(k.unflatten(-1, (Hkv, D)), layer.k_norm, c.rms_norm_eps, *rope)
        v = v.unflatten(-1, (Hkv, D))  # read in place by our kernel; varlen_attn (long states) gets a copy
        out = torch.empty(T, Hq, D, device=x.device, dtype=x.dtype)  # padding tokens' rows: never read
        keys, values = self.pool.keys[index], self.pool.values[index]
        if (s := p.states) is not None:
            for group in s.groups:
                span = group.span
                if group.short:  # ours: causal over the state's own tokens
                    self._rows_attention(
                        q[span], k[span], v[span], keys, values, None, None, None, group.cu, group.max_len, out[span]
                    )
                else:
                    out[span] = self._attn(
                        q[span],
                        k[span],
                        v[span].contiguous(),
                        group.cu32,
                        group.cu32,
                        group.max_len,
                        group.max_len,
                        window_size=(-1, 0),
                    )
            keys.index_copy_(0, p.state_kv_dst, k[s.start : s.end])
            values.index_copy_(0, p.state_kv_dst, v[s.start : s.end])
        # Each row attends to [its state's K/V, read in place from the bank | its own K/V], bottom-right causal.
        if (r := p.rows) is not None:
            self._rows_attention(
                q[r.start : r.end],
                k[r.start : r.end],
                v[r.start : r.end],
                keys,
                values,
                p.row_prefix,
                p.row_prefix_start,
                p.row_prefix_len,
                r.cu,
                r.max_len,
                out[r.start : r.end],
            )
        out = out.view(T, Hq * D) * torch.sigmoid(gate.reshape(T, Hq * D))
        return F.linear(out, layer.out_proj)


# --------------------------------------------------------------------------------------------------------------------
# the scorer: plans passes over a batch and reads the head


@dataclass
class Row:
    request: int
    question: int
    tokens: EncodedQuestion
    state: tuple[int, ...]


class FusedScorer:
    """Same interface as ReferenceScorer: per request, per question, the option probabilities."""

    def __init__(
        self,
        model: Qwen35TextModel,
        head: dict[str, torch.Tensor],
        temperature: float,
        pad_id: int,
        bank_bytes: int,
        pass_tokens: int = 32_768,
        max_state_tokens: int = 65_536,
        dtype: torch.dtype = torch.bfloat16,
        kernels: PassKernels | None = None,
        split_passes: bool = False,
        graphs: bool = False,
        graph_max_tokens: int = 4096,
        max_graphs: int = 64,
        long_kernels: str = "fla",
    ) -> None:
        self.device = next(model.parameters()).device
        self.long_kernels = long_kernels
        self.weights = FusedWeights(model, dtype)
        self.head = head
        self.temperature = temperature
        self.pad_id = pad_id
        self.pass_tokens = pass_tokens
        self.max_state_tokens = max_state_tokens
        self.bank_bytes = bank_bytes
        self.dtype = dtype
        self.kernels = kernels
        # One pass per batch: new states' and rows' tokens share every GEMM (False), or states then rows (True).
        self.split_passes = split_passes
        # CUDA graphs for passes of short segments (graphs.py); off, or no CUDA: every pass eagerly (on a CPU with
        # graphs on, the padded passes run eagerly from the graphs' buffers).
        self.use_graphs = graphs
        self.graph_max_tokens = graph_max_tokens
        self.max_graphs = max_graphs
        self.bank = self._new_bank()
        self.model = FusedQwen35(self.weights, self.bank.pool, kernels, long_kernels)
        self.graphs = self._new_graphs()
        self.oom_retries = 0

    def _new_bank(self) -> GpuBank:
        pool = StatePool.sized(
            self.weights.config,
            self.bank_bytes,
            self.device,
            self.dtype,
            min_slots=1,
            min_tokens=self.max_state_tokens + 64,
        )
        return GpuBank(pool)

    def _new_graphs(self):
        if not self.use_graphs:
            return None
        from .graphs import PassGraphs

        return PassGraphs(
            self.model,
            self.bank.pool,
            self.pad_id,
            max_tokens=self.graph_max_tokens,
            prefix_tokens=self.pass_tokens,
            max_graphs=self.max_graphs,
            capture=self.device.type == "cuda",
        )

    @property
    def graph_replays(self) -> int:
        return self.graphs.stats.replays if self.graphs is not None else 0

    @property
    def graph_captures(self) -> int:
        return self.graphs.stats.captures if self.graphs is not None else 0

    def probabilities(self, batch: Sequence[Encoded]) -> list[list[list[float]]]:
        try:
            return self._probabilities(batch)
        except torch.cuda.OutOfMemoryError:
            # Drop the bank (and its pool), free the failed pass, retry once; a second failure fails the batch.
            self.oom_retries += 1
            self.bank.clear()
            del self.model
            self.bank = None  # type: ignore[assignment]
            self.graphs = None
            torch.cuda.empty_cache()
            self.bank = self._new_bank()
            self.model = FusedQwen35(self.weights, self.bank.pool, self.kernels, self.long_kernels)
            self.graphs = self._new_graphs()
            return self._probabilities(batch)

    def _probabilities(self, batch: Sequence[Encoded]) -> list[list[list[float]]]:
        rows = [Row(r, q, tokens, e.state) for r, e in enumerate(batch) for q, tokens in enumerate(e.questions)]
        picked: dict[tuple[int, int], Picked] = {}
        for group in self.plan(rows):
            picked.update(self.run_group(group))
        return batch_probabilities(self.head, self.temperature, batch, picked)

    def plan(self, rows: list[Row]) -> list[list[Row]]:
        """Groups of rows per pass: whole states at a time, split only by the token budget (a state's tokens, counted
        whether it is new or banked, plus its rows' tokens) and by the bank's capacity (states pinned in one pass)."""
        by_state: OrderedDict[tuple[int, ...], list[Row]] = OrderedDict()
        for row in rows:
            by_state.setdefault(row.state, []).append(row)
        groups: list[list[Row]] = []
        current: list[Row] = []
        cost = 0
        states = 0
        max_states = len(self.bank.pool.recurrent[0]) if len(self.bank.pool.recurrent) else 1 << 30
        for state, members in by_state.items():
            need = len(state) + sum(len(m.tokens.tokens) for m in members)
            if current and (cost + need > self.pass_tokens or states + 1 > max_states):
                groups.append(current)
                current, cost, states = [], 0, 0
            current.extend(members)
            cost += need
            states += 1
        if current:
            groups.append(current)
        return groups

    def run_group(self, rows: list[Row]) -> dict[tuple[int, int], Picked]:
        states = list(OrderedDict.fromkeys(row.state for row in rows))
        pinned = set(states)
        slots: dict[tuple[int, ...], Slot] = {}
        new: list[tuple[int, ...]] = []
        for state in states:
            slot = self.bank.get(state)
            if slot is None:
                slot = self.bank.allocate(state, pinned)
                if slot is None:
                    raise RuntimeError("the state bank cannot hold one pass's states: raise bank_bytes")
                new.append(state)
            slots[state] = slot
        # Short segments before long ones, within the states and within the rows (stable): each length class is one
        # contiguous kernel group.
        new.sort(key=lambda state: not is_short(len(state)))
        rows = sorted(rows, key=lambda row: not is_short(len(row.tokens.tokens)))
        try:
            if self.split_passes and new:
                # States first, in their own pass through the weights; then every row from the bank.
                self.forward(self.layout([], new, slots))
                new_in_pass: list[tuple[int, ...]] = []
            else:
                new_in_pass = new
            picked = self.forward(self.layout(rows, new_in_pass, slots))
        except BaseException:
            for state in new:
                self.bank.forget(state)
            raise
        out = {}
        offset = 0
        for row in rows:
            n = len(row.tokens.option_ends)
            out[(row.request, row.question)] = (picked[offset], picked[offset + 1 : offset + 1 + n])
            offset += 1 + n
        return out

    def forward(self, layout: PassLayout) -> torch.Tensor:
        """One pass: replayed from its bucket's CUDA graph when it has one, else eagerly."""
        if self.graphs is not None and (bucket := self.graphs.bucket_for(layout)) is not None:
            return self.graphs.run(bucket, layout)
        return self.model.forward(self.pass_input(layout))

    def layout(self, rows: list[Row], new: list[tuple[int, ...]], slots: dict[tuple[int, ...], Slot]) -> PassLayout:
        page = self.bank.pool.page_size
        out = PassLayout()
        for state in new:
            out.state_ids.extend(state)
            out.state_lengths.append(len(state))
            out.state_slots.append(slots[state].slot)
            out.state_kv_dst.extend(slots[state].kv_index(page))
        # Each state's pool K/V index once; every row points at its state's run.
        runs: dict[tuple[int, ...], int] = {}
        for row in rows:
            if row.state not in runs:
                runs[row.state] = len(out.prefix)
                out.prefix.extend(slots[row.state].kv_index(page))
            out.prefix_start.append(runs[row.state])
            out.prefix_len.append(len(row.state))
            start = len(out.row_ids)
            tokens = row.tokens.tokens
            out.row_ids.extend(tokens)
            out.row_positions.extend(range(len(row.state), len(row.state) + len(tokens)))
            out.row_lengths.append(len(tokens))
            out.row_slots.append(slots[row.state].slot)
            out.row_picks.append(start + row.tokens.decide)
            out.row_picks.extend(start + i for i in row.tokens.option_ends)
        return out

    def pass_input(self, layout: PassLayout) -> PassInput:
        """The pass on the device, exactly sized (padded only to MIN_GEMM_ROWS tokens)."""
        n_state = len(layout.state_ids)
        padding = max(0, MIN_GEMM_ROWS - n_state - len(layout.row_ids))
        device = self.device

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return PassInput(
            ids=tensor(layout.state_ids + layout.row_ids + [self.pad_id] * padding),
            positions=tensor(layout.state_positions() + layout.row_positions + [0] * padding),
            states=Segments.build(0, layout.state_lengths, layout.state_slots, device) if n_state else None,
            state_kv_dst=tensor(layout.state_kv_dst) if n_state else None,
            rows=Segments.build(n_state, layout.row_lengths, layout.row_slots, device) if layout.row_ids else None,
            row_prefix=tensor(layout.prefix),
            row_prefix_start=tensor(layout.prefix_start),
            row_prefix_len=tensor(layout.prefix_len),
            picks=tensor([n_state + i for i in layout.row_picks]),
        )
