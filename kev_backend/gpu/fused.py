"""Fused GPU path: Qwen3.5 in bf16 on our Triton kernels (kev_backend.gpu.kernels), with the state bank on the GPU.

One pass through the weights per batch: the tokens of every new state and of every question row share each layer's
GEMMs (concatenated projections after the LoRA merge); inside a layer the mixers run per segment kind — first the
new states (varlen, from empty caches; their conv windows, fp32 DeltaNet states and K/V are written into the bank
pool), then the rows (varlen, each continuing its state read from the pool). fp32 where Kev needs it: DeltaNet
recurrent state, norm statistics and the residual stream, the picked hidden states and the pointer head. There is
no LM head: after the last mixer only the tokens at `</opt>` and `<decide>` go on.

The pass's inputs are described in passes.py, its weights in weights.py, which kernel runs each step in
pass_kernels.py; the scorer that plans passes and reads the head is scorer.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model.qwen35 import FULL_ATTENTION
from . import cublaslt, process
from .kernels.streams import beside
from .pass_kernels import PassKernels
from .passes import RECURRENT_MAX_LEN, KernelGroup, PassInput, pad_rows
from .pool import StatePool
from .weights import FusedWeights, LayerWeights


class FusedQwen35:
    """The fused forward over a PassInput; returns the final-norm hidden states at the picks (fp32)."""

    def __init__(
        self,
        weights: FusedWeights,
        pool: StatePool,
        kernels: PassKernels | None = None,
        gemm_algos: str = "auto",
    ) -> None:
        process.configure(weights.embed.device)  # batch-invariant GEMMs on cuBLASLt
        k = kernels or PassKernels.gpu()
        self.w = weights
        self.pool = pool
        self.c = weights.config
        self._rms_norm, self._gated_norm, self._silu_mul = k.rms_norm, k.gated_rms_norm, k.silu_mul
        self._sigmoid_gate = k.sigmoid_gate
        self._norm_rope = k.rms_norm_rope
        self._chunked_rows, self._conv = k.chunked_rows, k.conv
        self._rows_attention, self._states_attention = k.rows_attention, k.states_attention
        self._bank_kv = k.bank_kv
        c = weights.config
        # The projections on cuBLASLt algorithms without split-K, so that a row's output is the same in any batch
        # (kev_backend/gpu/cublaslt.py); `gemm_algos` chooses a pre-tuned table of the fastest. F.linear on a CPU.
        self.gemm_algos = cublaslt.pretuned(weights.embed.device, gemm_algos)
        self._linear = self.gemm_algos.linear if self.gemm_algos is not None else F.linear
        self.key_dim = c.linear_num_key_heads * c.linear_key_head_dim
        self.value_dim = c.linear_num_value_heads * c.linear_value_head_dim
        dim = c.rotary_dim
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.inv_freq = inv_freq.to(weights.embed.device)  # no host copy inside a pass (it may be captured)

    def norm(self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None):
        """Residual add + RMSNorm in one kernel; the residual stream stays fp32: rounding it to bf16 would make it
        follow the GEMMs' accumulation order and break the parity bars (docs/kernels.md)."""
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
            if i == last and layer.kind == FULL_ATTENTION:
                # Qwen3.5's last layer: only the picks' outputs are read, and only the new states' K/V are kept.
                picked = self.last_attention(layer, attn, x, rope, p)
                if picked is None:  # no rows, so no picks (below)
                    break
                return self.head_inputs(residual[p.picks] + picked.float(), layer)
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
            return x.new_empty(0, x.shape[-1], dtype=torch.float32)
        return self.head_inputs(residual[p.picks] + hidden[p.picks].float(), w.layers[last])

    def head_inputs(self, h: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        """The picked tokens' residual stream after the last mixer (fp32) through the last MLP and the final norm:
        what the pointer head reads."""
        w, eps = self.w, self.c.rms_norm_eps
        # The norms' kernel in fp32, a row a program: torch's reductions split a row by the number of rows.
        x, _ = self._rms_norm(h, layer.post_norm, eps)
        h = h + self.mlp(layer, pad_rows(x.to(w.dtype)))[: h.shape[0]].float()
        return self._rms_norm(h, w.final_norm, eps)[0]

    def mlp(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        return self._linear(self._silu_mul(self._linear(x, layer.gate_up)), layer.down)

    # -- Gated DeltaNet ------------------------------------------------------------------------------------------

    def gated_deltanet(self, layer: LayerWeights, index: int, x: torch.Tensor, p: PassInput) -> torch.Tensor:
        c = self.c
        proj = self._linear(x, layer.in_proj)
        qkv, z, b, a = proj.split([c.conv_dim, self.value_dim, c.linear_num_value_heads, c.linear_num_value_heads], -1)
        # Padding tokens belong to no segment: their rows keep whatever is here, row by row, and are never read.
        out = torch.empty(x.shape[0], c.linear_num_value_heads, c.linear_value_head_dim, device=x.device, dtype=x.dtype)
        conv_pool, state_pool = self.pool.conv[index], self.pool.recurrent[index]
        if p.point_windows is not None:  # the conv inputs before each point this pass saves, into its slot
            tokens, slots = p.point_windows
            conv_pool.index_copy_(0, slots, qkv[tokens.flatten()].unflatten(0, tokens.shape).transpose(1, 2))
        # New states start from zero (extensions from the point copied into their slots) and leave their conv window
        # and DeltaNet state in their bank slots; rows continue theirs, read in place by slot, and write nothing back.
        for seg, new, extend in ((p.states, True, False), (p.extends, True, True), (p.rows, False, False)):
            for group in seg.groups if seg is not None else ():
                span = group.span
                # Tokens in parallel, each finding its segment; windows read or written in place.
                mixed = self._conv(
                    qkv[span], layer.conv, conv_pool, group.slots, group.cu, new_states=new, extend=extend
                )
                self.delta_rule(layer, group, mixed, a[span], b[span], state_pool, new, out[span], extend)
        normed = self._gated_norm(
            out.view(-1, c.linear_value_head_dim),
            z.unflatten(-1, (c.linear_num_value_heads, c.linear_value_head_dim)),  # read in place
            layer.gated_norm,
            c.rms_norm_eps,
        )
        return self._linear(normed.view(x.shape[0], self.value_dim), layer.out_proj)

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
        extend: bool = False,
    ) -> None:
        """The delta rule over a group's conv outputs `mixed` [T, conv_dim] into `out` [T, Hv, Dv]: new states from
        zero (`extend`: from the point in their slot) into their slots of `state_pool` [slots, Hv, Dk, Dv], saving
        their points on the way, or rows from their states' slots, on our chunked kernel (rows read their states in
        place, no gathered copy)."""
        c = self.c
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.unflatten(-1, (c.linear_num_key_heads, c.linear_key_head_dim))
        k = k.unflatten(-1, (c.linear_num_key_heads, c.linear_key_head_dim))
        v = v.unflatten(-1, (c.linear_num_value_heads, c.linear_value_head_dim))
        args = (q, k, v, a, b, layer.a_log, layer.dt_bias, state_pool, group.slots, group.cu)
        # A captured pass's group counts its capacity (a 2,560-token bucket: 20 long states), not its work: a graph's
        # bucket of up to 4,096 tokens holds one or two long chains, which the narrow configuration runs fastest
        # (kernels.delta_rule.CHUNK_NARROW), and mostly empty padding segments. Its first long chain on a launch of its
        # own (lead_apart) pays only for long new states: rows and short states stay in turn.
        lead_apart = group.padded and new and not group.short  # a captured pass's long new states
        saves = {} if group.save_at is None else {"save_at": group.save_at, "save_slots": group.save_slots}
        self._chunked_rows(
            *args,
            new_states=new,
            out=out,
            padded=group.padded,
            lead_apart=lead_apart,
            lead=group.short_segments,
            extend=extend,
            **saves,
        )

    # -- gated attention -----------------------------------------------------------------------------------------

    def attention(self, layer: LayerWeights, index: int, x: torch.Tensor, rope, p: PassInput) -> torch.Tensor:
        c = self.c
        T, Hq, Hkv, D = x.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        proj = self._linear(x, layer.in_proj)
        qg, k, v = proj.split([2 * Hq * D, Hkv * D, Hkv * D], dim=-1)
        q, gate = qg.view(T, Hq, 2 * D).chunk(2, dim=-1)
        # Per-head norm and partial RoPE in one kernel each, reading the projection's per-head views in place.
        q = self._norm_rope(q, layer.q_norm, c.rms_norm_eps, *rope)
        k = self._norm_rope(k.unflatten(-1, (Hkv, D)), layer.k_norm, c.rms_norm_eps, *rope)
        v = v.unflatten(-1, (Hkv, D))  # read in place by our kernel
        out = torch.empty(T, Hq, D, device=x.device, dtype=x.dtype)  # padding tokens' rows: never read
        keys, values = self.pool.keys[index], self.pool.values[index]
        self._bank_states_kv(p, keys, values, k, v)  # first: the rows read the new states' K/V from the bank
        if (r := p.rows) is None:
            self._attend_states(p, q, k, v, keys, values, out)
        else:
            rows = slice(r.start, r.end)

            def attend_rows() -> None:
                self._attend_rows(p, q[rows], k[rows], v[rows], keys, values, out[rows])

            if self._rows_beside_states(p):  # the same kernels and arithmetic at once: the same answers
                with beside(x.device) as lead:
                    lead(attend_rows)
                    self._attend_states(p, q, k, v, keys, values, out)
            else:
                self._attend_states(p, q, k, v, keys, values, out)
                attend_rows()
        return self._linear(self._sigmoid_gate(out, gate), layer.out_proj)  # the gate read in place

    def _rows_beside_states(self, p: PassInput) -> bool:
        """Whether the rows' attention runs on a side stream beside the new states' own: in a pass with long new
        states. Over
        a long prefix the rows' attention is a few programs bound by latency, and a lone state's causal attention
        leaves SMs idle in its last blocks, so the two overlap. Short new states' attention stays in turn (forking it
        too is slower: docs/kernels.md); same-state passes have no new states."""
        if p.states is None:
            return False
        return any(not group.short for group in p.states.groups)

    def _attend_states(
        self,
        p: PassInput,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """The new states' causal attention over their own tokens (an extension's: over its point's tokens' K/V, then
        its own), into `out`'s state rows."""
        if (e := p.extends) is not None:
            # A token attends to every key in key blocks of 64 from the state's first (points are on 64-token pages),
            # in parts of kernels.attention.FOLD_KEYS folded in order, as in the state computed whole: its output is
            # the same bit for bit. A turn's parts run in parallel (max_keys sizes them).
            span = slice(e.start, e.end)
            self._states_attention(
                q[span],
                k[span],
                v[span],
                keys,
                values,
                p.extend_prefix,
                p.extend_prefix_start,
                p.extend_prefix_len,
                e.cu,
                e.max_len,
                out[span],
                max_keys=p.extend_keys_max,
            )
        if (s := p.states) is not None:
            for group in s.groups:
                span = group.span
                # Causal, own tokens, on our kernel at any length: a state grown from a point must be what the state
                # computed whole is, bit for bit (cuDNN's kernel, faster on single states of 8k-64k tokens, is not
                # ours: docs/kernels.md). A captured pass's short and long new states in one group: by class.
                n = group.short_segments
                classes = [(group.cu[: n + 1], RECURRENT_MAX_LEN), (group.cu[n:], group.max_len)]
                for cu, max_len in classes if n else [(group.cu, group.max_len)]:
                    self._states_attention(
                        q[span], k[span], v[span], keys, values, None, None, None, cu, max_len, out[span]
                    )

    def _bank_states_kv(
        self, p: PassInput, keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """The new states' K and V (of the pass's tokens) into their pages of the layer's bank pool."""
        if (s := p.states) is not None:
            self._bank_kv(keys, values, p.state_kv_dst, k[s.start : s.end], v[s.start : s.end])
        if (e := p.extends) is not None:
            self._bank_kv(keys, values, p.extend_kv_dst, k[e.start : e.end], v[e.start : e.end])

    def _attend_rows(
        self,
        p: PassInput,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """Each row (q, k, v and out: the rows' tokens) attends to [its state's K/V, read in place from the bank |
        its own K/V], bottom-right causal."""
        r = p.rows
        self._rows_attention(
            q,
            k,
            v,
            keys,
            values,
            p.row_prefix,
            p.row_prefix_start,
            p.row_prefix_len,
            r.cu,
            r.max_len,
            out,
            max_prefix=p.row_prefix_max,
            parallel=p.row_parts_parallel,
        )

    def last_attention(
        self, layer: LayerWeights, index: int, x: torch.Tensor, rope, p: PassInput
    ) -> torch.Tensor | None:
        """The last layer's gated attention for what is read after it: the new states' K/V into the bank, and the
        attention output (through the gate and o_proj) at the picks alone. New states' queries, their attention and
        every other token's output projection are skipped (on a 2,200-token state: 80 % of the layer's input
        projection, all of its attention and its output projection). Returns [picks, hidden], or None for a pass
        without rows."""
        c = self.c
        Hq, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        queries = 2 * Hq * D  # the [q+gate | k | v] projection's first rows
        k, v = self._linear(x, layer.in_proj[queries:]).split([Hkv * D, Hkv * D], dim=-1)
        k = self._norm_rope(k.unflatten(-1, (Hkv, D)), layer.k_norm, c.rms_norm_eps, *rope)
        v = v.unflatten(-1, (Hkv, D))
        keys, values = self.pool.keys[index], self.pool.values[index]
        self._bank_states_kv(p, keys, values, k, v)
        if (r := p.rows) is None:
            return None
        rows = slice(r.start, r.end)
        n = r.end - r.start
        qg = self._linear(pad_rows(x[rows]), layer.in_proj[:queries])[:n]
        q, gate = qg.view(n, Hq, 2 * D).chunk(2, dim=-1)
        q = self._norm_rope(q, layer.q_norm, c.rms_norm_eps, rope[0][rows], rope[1][rows])
        out = torch.empty(n, Hq, D, device=x.device, dtype=x.dtype)
        self._attend_rows(p, q, k[rows], v[rows], keys, values, out)
        picks = p.picks - r.start  # a captured pass pads its picks with the rows' first token (never read)
        gated = self._sigmoid_gate(out[picks], gate[picks])
        return self._linear(pad_rows(gated), layer.out_proj)[: picks.shape[0]]
