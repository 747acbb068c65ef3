"""Kernel configurations on Kev-4B shapes, timed against each other and against fla's kernels. A configuration the
kernel functions take as an argument (`new_states`, `padded`, `lead_apart`) is passed as one; the others are live
module settings, read at each launch, set with common.patched for one sweep and restored after it."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kev_backend.dev.sizes import SIZES

from .common import (
    KEV4B_HEADS,
    command,
    cuda_ms,
    delta_rule_heads,
    delta_rule_inputs,
    graph_kernel_us,
    graph_ms,
    kernel_parts,
    padded_to,
    patched,
    segments_case,
    sweep_entry,
)


def long(args) -> None:
    """Our chunked delta rule against fla's chunked kernel on Kev-4B heads (new states from zero; rows continuing
    banked states): ms and largest difference. For new states the conv: the pass's scanning kernel against the
    token-by-token one and fla's. --rows: the row cases only; --tokens N: one new state of N tokens only (how each
    scales to Kev's longest states)."""
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from kev_backend.gpu import kernels

    cases = (
        ([2200], True),
        ([2200] * 8, True),
        ([2200] * 24, True),
        ([100] * 40, False),
        ([39] * 192, False),
        ([34] * 32, True),
        ([39] * 6, False),
        ([34], True),
    )
    if args.tokens:
        cases = (([args.tokens], True),)
    for lengths, new in cases:
        if args.rows and new:
            continue
        mixed, q, k, v, a, b, a_log, dt_bias, pool, slots, cu_cpu, cu = segments_case(lengths)
        n = len(lengths)
        rule_args = (q, k, v, a, b, a_log, dt_bias, pool, slots, cu)
        ours = functools.partial(kernels.chunked_rows, *rule_args, new_states=new)
        g = (-a_log.exp() * F.softplus(a.float() + dt_bias)).unsqueeze(0)

        def theirs(new=new, q=q, k=k, v=v, b=b, g=g, pool=pool, slots=slots, cu=cu, cu_cpu=cu_cpu):
            return chunk_gated_delta_rule(
                q.unsqueeze(0),
                k.unsqueeze(0),
                v.unsqueeze(0),
                g=g,
                beta=torch.sigmoid(b).unsqueeze(0),
                initial_state=None if new else pool.index_select(0, slots),
                output_final_state=new,
                use_qk_l2norm_in_kernel=True,
                cu_seqlens=cu,
                cu_seqlens_cpu=cu_cpu,
            )[0][0]

        diff = (ours().float() - theirs().float()).abs().max().item()
        label = f"{n}x{lengths[0]} {'new' if new else 'rows'}"
        print(f"delta rule {label}: ours {cuda_ms(ours):.3f} ms, fla {cuda_ms(theirs):.3f} ms, max diff {diff:.2e}")
        if new:
            conv_w = torch.randn(mixed.shape[1], 4, device="cuda", dtype=torch.bfloat16)
            window = torch.zeros(n + 1, mixed.shape[1], 4, device="cuda", dtype=torch.bfloat16)
            by_token = functools.partial(kernels.conv_rows, mixed, conv_w, window, slots, cu, new_states=True)
            scan = functools.partial(kernels.conv_tokens, mixed, conv_w, window, slots, cu, new_states=True)
            fla_conv = functools.partial(
                causal_conv1d,
                mixed.unsqueeze(0),
                conv_w,
                output_final_state=True,
                activation="silu",
                cu_seqlens=cu,
                cu_seqlens_cpu=cu_cpu,
            )
            print(
                f"conv {label}: token by token {cuda_ms(by_token):.3f} ms, scan (the pass's) {cuda_ms(scan):.3f} ms, "
                f"fla {cuda_ms(fla_conv):.3f} ms",
                flush=True,
            )


def _config(c) -> str:
    return "/".join(map(str, c))


def chunkvariants(args) -> None:
    """The chunked delta rule's chain by (value block, warps, register cap) (delta_rule's live CHUNK_NARROW and
    CHUNK_WIDE; the default picks one by program count) on Kev-4B heads (--size: another Kev size's): prep and chain
    ms a layer for 1 / 8 / 24 new 2,200-token states and 40 rows of 100 tokens (--tokens N: one new state of N tokens
    instead); the largest difference from the default (must be 0)."""
    from kev_backend.gpu import kernels
    from kev_backend.gpu.kernels import delta_rule as R

    narrow, wide = R.CHUNK_NARROW, R.CHUNK_WIDE
    variants = {"auto": (narrow, wide), f"narrow {_config(narrow)}": (narrow, narrow)}
    variants[f"wide {_config(wide)}"] = (wide, wide)
    for config in ((16, 1, None), (16, 2, None), (32, 2, None), (64, 8, None)):
        variants[_config(config)] = (config, config)
    cases = (([2200], True), ([2200] * 8, True), ([2200] * 24, True), ([100] * 40, False))
    for lengths, new in (([args.tokens], True),) if args.tokens else cases:
        _, q, k, v, a, b, a_log, dt_bias, pool, slots, _, cu = segments_case(lengths, delta_rule_heads(args.size))
        run = functools.partial(kernels.chunked_rows, q, k, v, a, b, a_log, dt_bias, pool, slots, cu, new_states=new)
        reference, line = None, []
        for name, (chain_narrow, chain_wide) in variants.items():
            with patched(R, CHUNK_NARROW=chain_narrow, CHUNK_WIDE=chain_wide):
                entry, reference = sweep_entry(name, run, reference, cuda_ms)
            line.append(entry)
        print(f"chunkvariants {len(lengths)}x{lengths[0]} {'new' if new else 'rows'}: " + ", ".join(line), flush=True)


def chainwaves(args) -> None:
    """The chain's value block by new long-state count (how WIDE_ABOVE should fall): a program per (state, value
    head, value block), each carrying its state through all of its chunks, so a launch whose programs fill part of a
    last wave of resident programs waits a whole program's time for it. Prep and chain ms a layer, from a CUDA graph,
    for 1-24 new 2,465-token states, narrow and wide forced (live CHUNK_NARROW, CHUNK_WIDE) and the choice by count;
    the outputs must not differ."""
    from kev_backend.gpu import kernels
    from kev_backend.gpu.kernels import delta_rule as R

    narrow, wide = R.CHUNK_NARROW, R.CHUNK_WIDE
    settings = {"by count": (narrow, wide), "narrow": (narrow, narrow), "wide": (wide, wide)}
    for n in (1, 2, 4, 6, 8, 10, 12, 13, 14, 16, 17, 18, 20, 24):
        _, q, k, v, a, b, a_log, dt_bias, pool, slots, _, cu = segments_case([2465] * n)
        run = functools.partial(kernels.chunked_rows, q, k, v, a, b, a_log, dt_bias, pool, slots, cu, new_states=True)
        line, reference = [], None
        for name, (chain_narrow, chain_wide) in settings.items():
            with patched(R, CHUNK_NARROW=chain_narrow, CHUNK_WIDE=chain_wide):
                entry, reference = sweep_entry(name, run, reference)
            line.append(entry)
        print(f"chainwaves {n}x2465: " + ", ".join(line), flush=True)


def prepregs(args) -> None:
    """The chunked delta rule (prep and chain) by the prep's register cap and warps (live PREP_MAXNREG, PREP_WARPS):
    ms a layer from a CUDA graph for 1 / 8 / 24 new 2,465-token states and one short6's rows; the largest difference
    from the default (a cap never changes the arithmetic: must be 0); the prep's own µs."""
    from kev_backend.gpu import kernels
    from kev_backend.gpu.kernels import delta_rule as R

    chosen = R.PREP_WARPS, R.PREP_MAXNREG
    settings = [chosen, *((2, cap) for cap in (None, 144, 192) if cap != chosen[1])]
    for lengths, new in (([2465], True), ([2465] * 8, True), ([2465] * 24, True), ([31] * 6, False)):
        _, q, k, v, a, b, a_log, dt_bias, pool, slots, _, cu = segments_case(lengths)
        run = functools.partial(kernels.chunked_rows, q, k, v, a, b, a_log, dt_bias, pool, slots, cu, new_states=new)
        line, reference = [], None
        for warps, cap in settings:
            with patched(R, PREP_WARPS=warps, PREP_MAXNREG=cap):
                entry, reference = sweep_entry(f"{warps}/{cap}", run, reference)
                prep_us = sum(us for name, us in graph_kernel_us(run).items() if "prep" in name)
            line.append(f"{entry} [prep {prep_us:.1f} µs]")
        print(f"prepregs {len(lengths)}x{lengths[0]} {'new' if new else 'rows'}: " + ", ".join(line), flush=True)


def padded(args) -> None:
    """The delta rule on a captured pass's groups, whose segments count the bucket's capacity and end in empty
    padding segments: unpadded, padded (`padded=True`: the chain's programs take items in turn), and for a long new
    group its first segment apart (`lead_apart=True`). ms a layer on Kev-4B heads from a CUDA graph, as a captured
    pass runs them, with each kernel's µs. Outputs must be identical."""
    from kev_backend.gpu import kernels

    for label, lengths, capacity, new in (
        ("short6 rows r192", [31] * 6, 48, False),
        ("short6 state s64", [33], 8, True),
        ("32 short6 rows r6144", [31] * 192, 1536, False),
        ("long5 state s2560", [2200], 20, True),
        ("long5 rows r768", [100] * 5, 192, False),
        ("three long states s4096", [1500, 900, 600], 32, True),
        ("six long states s4096", [600] * 6, 32, True),
    ):
        _, q, k, v, a, b, a_log, dt_bias, pool, slots, _, cu = segments_case(lengths)
        padded_slots, padded_cu = padded_to(slots, cu, capacity)
        inputs = (q, k, v, a, b, a_log, dt_bias, pool)
        settings = {
            "unpadded": ((*inputs, slots, cu), {}),
            "padded": ((*inputs, padded_slots, padded_cu), {"padded": True}),
        }
        if new and max(lengths) > 64:
            settings["lead apart"] = ((*inputs, padded_slots, padded_cu), {"padded": True, "lead_apart": True})
        line, reference = [], None
        for setting, (call_args, options) in settings.items():
            run = functools.partial(kernels.chunked_rows, *call_args, new_states=new, **options)
            out = run().float()
            reference = out if reference is None else reference
            same = "" if torch.equal(out, reference) else " DIFFERS"
            parts = kernel_parts(run, "delta_rule", "prep")
            line.append(f"{setting} {graph_ms(run):.4f} [{parts} µs]{same}")
        print(f"padded {label}: " + ", ".join(line), flush=True)


def rowsattn(args) -> None:
    """Rows' attention by (query rows per program, keys per step, pipeline stages) (attention's live TILE_ROWS,
    WIDE_HEAD_KEYS, WIDE_HEAD_STAGES) on Kev-4B heads (16 query heads, 4 key/value heads of 256): ms for one long5
    (five rows over a 2,200-token state), the same with its K/V in one contiguous run (whether the bank's page
    gather bounds the key loop), 17 long5s, one short6 on its banked state and 32; each configuration's largest
    output difference from the default."""
    from kev_backend.gpu.kernels import attention as A

    HQ, HKV, D, PAGE = 16, 4, 256, 64
    row_lengths = [44, 57, 41, 36, 47, 40]
    cases = {
        "long5": (1, 2200, 5, False),
        "long5contig": (1, 2200, 5, True),
        "long5x17": (17, 2200, 5, False),
        "short6same": (1, 34, 6, False),
        "short6x32": (32, 34, 6, False),
    }
    default = (A.TILE_ROWS, A.WIDE_HEAD_KEYS, A.WIDE_HEAD_STAGES)
    tiles = [default, *(t for t in ((64, 32, 3), (64, 32, 2), (32, 64, 2), (64, 128, 1)) if t != default)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for label, (states, prefix_len, rows, contiguous) in cases.items():
        pages = -(-prefix_len // PAGE)
        pool_tokens = states * pages * PAGE
        kp = torch.randn(pool_tokens, HKV, D, device="cuda", generator=gen).bfloat16()
        vp = torch.randn(pool_tokens, HKV, D, device="cuda", generator=gen).bfloat16()
        # Each state's tokens in whole 64-token pages (as the bank keeps them), pages in random order; or one run.
        order = torch.arange(states * pages, device="cuda")
        if not contiguous:
            order = order[torch.randperm(states * pages, device="cuda", generator=gen)]
        within = torch.arange(PAGE, device="cuda")
        runs = (order.view(states, pages, 1) * PAGE + within).view(states, pages * PAGE)[:, :prefix_len]
        prefix = runs.reshape(-1)
        lengths = [row_lengths[r] for _ in range(states) for r in range(rows)]
        cu = torch.tensor([0] + lengths, device="cuda").cumsum(0)
        starts = torch.tensor([s * prefix_len for s in range(states) for _ in range(rows)], device="cuda")
        plens = torch.full_like(starts, prefix_len)
        T = int(cu[-1])
        q = torch.randn(T, HQ, D, device="cuda", generator=gen).bfloat16()
        k = torch.randn(T, HKV, D, device="cuda", generator=gen).bfloat16()
        v = torch.randn(T, HKV, D, device="cuda", generator=gen).bfloat16()
        run = functools.partial(A.rows_attention, q, k, v, kp, vp, prefix, starts, plens, cu, max(lengths))
        reference = None
        for tile_rows, keys, stages in tiles:
            with patched(A, TILE_ROWS=tile_rows, WIDE_HEAD_KEYS=keys, WIDE_HEAD_STAGES=stages):
                entry, reference = sweep_entry(f"rows {tile_rows} keys {keys} stages {stages}", run, reference, cuda_ms)
            print(f"rowsattn {label:11s} {entry}", flush=True)


def longattn(args) -> None:
    """New long states' causal attention (Kev-4B heads; --size: another Kev size's): torch's varlen attention
    (FlashAttention 2, the reference), scaled_dot_product_attention by backend, and our kernel by (query rows per
    program, keys per step, warps, stages) (attention's live LONG_TILE_ROWS, WIDE_HEAD_KEYS, WIDE_HEAD_WARPS,
    WIDE_HEAD_STAGES); ms, TFLOP/s and the largest difference from varlen's output for --states states (default one
    and eight) of about --tokens tokens each (default 2,200; up to 65,535, Kev's longest state: how near each gets to
    the bf16 rate on long states)."""
    from torch.nn.attention.varlen import varlen_attn

    from kev_backend.gpu.kernels import attention as A

    c = SIZES[args.size].config
    HQ, HKV, D = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    chosen = (A.LONG_TILE_ROWS, A.WIDE_HEAD_KEYS, A.WIDE_HEAD_WARPS, A.WIDE_HEAD_STAGES)
    tiles = [chosen, *(t for t in ((128, 32, 8, 3), (128, 128, 8, 1), (64, 64, 8, 2)) if t != chosen)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for tokens, states in ((t, n) for t in args.tokens for n in args.states):
        lengths = [tokens - 37 * i for i in range(states)]
        case = f"{states}x{tokens}"
        cu = torch.tensor([0] + lengths, device="cuda").cumsum(0)
        cu32 = cu.to(torch.int32)
        T = int(cu[-1])
        q = torch.randn(T, HQ, D, device="cuda", generator=gen).bfloat16()
        k = torch.randn(T, HKV, D, device="cuda", generator=gen).bfloat16()
        v = torch.randn(T, HKV, D, device="cuda", generator=gen).bfloat16()
        flops = sum(n * (n + 1) / 2 for n in lengths) * HQ * D * 4
        fa = functools.partial(varlen_attn, q, k, v, cu32, cu32, max(lengths), max(lengths), window_size=(-1, 0))
        reference = fa().float()
        ms = cuda_ms(fa)
        print(f"longattn {case} varlen: {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s)", flush=True)
        for name, run in _sdpa_variants(q, k, v, lengths).items():
            print(f"longattn {case} sdpa {name}: {_attention_result(run, reference, flops)}", flush=True)
        ours = functools.partial(A.states_attention, q, k, v, k, v, None, None, None, cu, max(lengths))
        for rows, keys, warps, stages in tiles:
            with patched(A, LONG_TILE_ROWS=rows, WIDE_HEAD_KEYS=keys, WIDE_HEAD_WARPS=warps, WIDE_HEAD_STAGES=stages):
                result = _attention_result(ours, reference, flops)
            print(
                f"longattn {case} ours rows {rows} keys {keys} warps {warps} stages {stages}: {result}",
                flush=True,
            )


def turnattn(args) -> None:
    """A conversation's next turn's attention (Kev-4B heads; --size: another Kev size's), ms a layer: --tokens tokens
    (default 256) after a point of each of --points tokens, as the engine launches them (their parts in parallel),
    with a graph's parts (LONG_PREFIX_MAX keys) and folded in turn; --batch such turns at once (default 6, on
    8,192-token points); and the state computed whole, which folds its parts in turn. "rows' tiles": the turns in
    rows' 64-row tiles (TILE_ROWS) instead of long states' (LONG_TILE_ROWS: half the programs, each key block read for
    twice the rows). Each turn's output is compared bit for bit with the whole state's ("same bits")."""
    from kev_backend.gpu.graphs import LONG_PREFIX_MAX
    from kev_backend.gpu.kernels import attention as A

    c = SIZES[args.size].config
    HQ, HKV, D = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    n = args.tokens
    for point in args.points:
        L = point + n
        q = torch.randn(L, HQ, D, device="cuda", generator=gen).bfloat16()
        k = torch.randn(L, HKV, D, device="cuda", generator=gen).bfloat16()
        v = torch.randn(L, HKV, D, device="cuda", generator=gen).bfloat16()
        whole_run = functools.partial(
            A.states_attention, q, k, v, k, v, None, None, None, torch.tensor([0, L]).cuda(), L
        )
        whole = whole_run()
        # The turn's tokens after the point; the point's K/V where the bank would keep them (here: k, v themselves).
        tq, tk, tv = (t[point:].contiguous() for t in (q, k, v))
        index, start, length = torch.arange(point).cuda(), torch.tensor([0]).cuda(), torch.tensor([point]).cuda()
        cu = torch.tensor([0, n]).cuda()
        turn = functools.partial(A.states_attention, tq, tk, tv, k, v, index, start, length, cu, n)
        cases = {
            "turn": dict(max_keys=L),
            "graph": dict(max_keys=LONG_PREFIX_MAX),
            "in turn": dict(max_keys=L),
            "turn, rows' tiles": dict(max_keys=L),
        }
        line = [f"whole {cuda_ms(whole_run):.3f}"]
        for name, kw in cases.items():
            entries = 0 if name == "in turn" else A.PARALLEL_PARTS_ENTRIES
            rows = A.TILE_ROWS if name.endswith("rows' tiles") else A.LONG_TILE_ROWS
            with patched(A, PARALLEL_PARTS_ENTRIES=entries, LONG_TILE_ROWS=rows):
                out = turn(**kw)
                ms = cuda_ms(functools.partial(turn, **kw))
            line.append(f"{name} {ms:.3f} same bits {torch.equal(out, whole[point:])}")
        print(f"turnattn point {point} +{n}: " + "; ".join(line), flush=True)
        del q, k, v, whole
    point, b = 8192, args.batch
    L = point + n
    q = torch.randn(L, HQ, D, device="cuda", generator=gen).bfloat16()
    k = torch.randn(L, HKV, D, device="cuda", generator=gen).bfloat16()
    v = torch.randn(L, HKV, D, device="cuda", generator=gen).bfloat16()
    tq, tk, tv = (t[point:].repeat(b, 1, 1).contiguous() for t in (q, k, v))
    index = torch.arange(point).cuda().repeat(b)
    start, length = torch.arange(b).cuda() * point, torch.full((b,), point).cuda()
    cu = torch.arange(b + 1).cuda() * n
    batch = functools.partial(A.states_attention, tq, tk, tv, k, v, index, start, length, cu, n, max_keys=L)
    line = [f"as launched {cuda_ms(batch):.3f}"]
    for name, entries, rows in (
        ("in parallel", 1 << 30, A.LONG_TILE_ROWS),
        ("in turn", 0, A.LONG_TILE_ROWS),
        ("in parallel, rows' tiles", 1 << 30, A.TILE_ROWS),
        ("in turn, rows' tiles", 0, A.TILE_ROWS),
    ):
        with patched(A, PARALLEL_PARTS_ENTRIES=entries, LONG_TILE_ROWS=rows):
            line.append(f"{name} {cuda_ms(batch):.3f}")
    print(f"turnattn {b} turns at {point} +{n}: " + "; ".join(line), flush=True)


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def _attention_result(run, reference: torch.Tensor, flops: float) -> str:
    """One attention variant's ms, TFLOP/s and largest difference from the reference output, or why it did not run."""
    try:
        diff = (run().float() - reference).abs().max().item()
        ms = cuda_ms(run)
    except Exception as error:  # noqa: BLE001 (a backend refusing these shapes, a tile out of shared memory)
        return f"failed: {type(error).__name__}: {str(error)[:80]}"
    return f"{ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s), max diff {diff:.1e}"


def _sdpa_variants(q, k, v, lengths: list[int]) -> dict:
    """torch's scaled_dot_product_attention by backend, a call per state ([1, heads, n, D] views of the packed
    [T, heads, D] tensors), key/value heads shared (enable_gqa) or repeated: each a function writing the packed
    [T, HQ, D] output."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    groups = q.shape[1] // k.shape[1]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]

    def run(backend, gqa: bool):
        out = torch.empty_like(q)
        with sdpa_kernel(backend):
            for start, n in zip(starts, lengths):
                qq, kk, vv = (x[start : start + n].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
                if not gqa:
                    kk, vv = kk.repeat_interleave(groups, dim=1), vv.repeat_interleave(groups, dim=1)
                o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=gqa)
                out[start : start + n] = o[0].transpose(0, 1)
        return out

    backends = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }
    return {
        f"{name}{' gqa' if gqa else ' repeated'}": functools.partial(run, backend, gqa)
        for name, backend in backends.items()
        for gqa in (True, False)
    }


# (tokens, channels, warps) a conv program.
SCAN_CONFIGS = (
    *((8, 256, 2), (16, 256, 2), (32, 256, 2), (64, 256, 2), (128, 256, 2), (32, 128, 1), (32, 512, 4)),
    *((4, 128, 1), (8, 128, 1), (16, 128, 1), (8, 64, 1)),
)


def convscan(args) -> None:
    """The pass's conv (conv_tokens) on Kev-4B's 8,192 channels: ms for new states (1, 8 and 24 of 2,200 tokens) and
    rows (6×31, 6×40, 192×39, 40×100) and the largest difference from the token-by-token conv_rows; then from a CUDA
    graph by (tokens, channels, warps) a program (conv's live SCAN_TOKENS, SCAN_CHANNELS, SCAN_WARPS, with
    SCAN_SMALL_TOKENS at 0 so that every pass size takes them)."""
    from kev_backend.gpu import kernels
    from kev_backend.gpu.kernels import conv

    C = 8192
    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = {"new 1x2200": [2200], "new 8x2200": [2200] * 8, "new 24x2200": [2200] * 24}
    cases |= {"rows 6x31": [31] * 6, "rows 6x40": [40] * 6, "rows 192x39": [39] * 192, "rows 40x100": [100] * 40}
    weight = torch.randn(C, 4, device="cuda", generator=gen).bfloat16()
    for label, lengths in cases.items():
        new = label.startswith("new")
        n = len(lengths)
        cu = torch.tensor([0] + lengths, device="cuda").cumsum(0)
        x = torch.randn(int(cu[-1]), C, device="cuda", generator=gen).bfloat16()
        slots = torch.arange(n, device="cuda")
        pool = torch.randn(n, C, 4, device="cuda", generator=gen).bfloat16()
        by_token = kernels.conv_rows(x, weight, pool.clone(), slots, cu, new_states=new).float()
        run = functools.partial(kernels.conv_tokens, x, weight, pool, slots, cu, new_states=new)
        reference = run().float()
        diff = (reference - by_token).abs().max().item()
        print(f"convscan {label}: {cuda_ms(run):.4f} ms, max diff from conv_rows {diff:.1e}", flush=True)
        timings = [f"chosen {graph_ms(run):.4f}"]
        for tokens, channels, warps in SCAN_CONFIGS:
            with patched(conv, SCAN_SMALL_TOKENS=0, SCAN_TOKENS=tokens, SCAN_CHANNELS=channels, SCAN_WARPS=warps):
                diff = (run().float() - reference).abs().max().item()
                timings.append(f"{tokens}x{channels}/{warps} {graph_ms(run):.4f} ({diff:.0e})")
        print(f"convscan {label} by tokens x channels/warps: " + ", ".join(timings), flush=True)


def ncuprobe(args) -> None:
    """Three calls each (the first two warm) of the chunked delta rule on 8 new 2,200-token states and on 6 rows of 40
    tokens: for Nsight Compute to profile the third (bench/gpu.sh steps ncu)."""
    from kev_backend.gpu import kernels

    _, HV, K, V = KEV4B_HEADS
    for lengths, new in (([2200] * 8, True), ([40] * 6, False)):
        T, n = sum(lengths), len(lengths)
        _, q, k, v, a, b = delta_rule_inputs(T)
        a_log, dt_bias = torch.randn(HV, device="cuda"), torch.randn(HV, device="cuda")
        pool = torch.randn(n + 1, HV, K, V, device="cuda") * 0.01
        slots = torch.arange(n, device="cuda")
        cu = torch.tensor([0] + lengths, device="cuda").cumsum(0)
        for _ in range(3):
            kernels.chunked_rows(q, k, v, a, b, a_log, dt_bias, pool, slots, cu, new_states=new)
        torch.cuda.synchronize()


def overlap(args) -> None:
    """What two streams could hide if a long new state ran in two halves, one half's delta rule and memory-bound
    kernels beside the other half's GEMMs: a Kev size's (--size) MLP input projection at --rows rows (cycling 4 weights,
    cold), back to back, beside (a) one new state of --tokens tokens through the chunked delta rule (prep and chain),
    (b) the MLP activation (silu·mul) at --rows rows; each alone and both at once on two streams, from CUDA graphs,
    each side repeated to take about as long as the other. Prints ms and the share of the shorter side hidden."""
    from kev_backend.dev import sizes
    from kev_backend.gpu import cublaslt, kernels
    from kev_backend.model.qwen35 import LINEAR_ATTENTION, Qwen35Config

    device = torch.device("cuda")
    config = Qwen35Config.from_dict(SIZES[args.size].config)
    n, k = sizes.fused_projections(config)[LINEAR_ATTENTION][2]  # the MLP's gate and up together
    gemms = cublaslt.pretuned(device, "off")
    plan = gemms.plan(args.rows, n, k)
    torch.manual_seed(0)
    weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(4)]
    x = torch.randn(args.rows, k, device=device, dtype=torch.bfloat16)
    y = torch.empty(args.rows, n, device=device, dtype=torch.bfloat16)

    def gemm() -> None:
        for w in weights:
            plan.run(plan.default, x, w, y, gemms.workspace)

    _, q, kk, v, a, b, a_log, dt_bias, pool, slots, _, cu = segments_case([args.tokens], delta_rule_heads(args.size))
    delta = functools.partial(kernels.chunked_rows, q, kk, v, a, b, a_log, dt_bias, pool, slots, cu, new_states=True)
    activation = functools.partial(kernels.silu_mul, torch.randn_like(y))
    beside = torch.cuda.Stream()
    for name, side in (("delta rule", delta), ("silu_mul", activation)):
        gemm_ms, side_ms = graph_ms(gemm, repeat=4), graph_ms(side, repeat=4)
        gemm_calls = max(1, round(side_ms / gemm_ms)) if side_ms > gemm_ms else 1
        side_calls = max(1, round(gemm_ms / side_ms)) if gemm_ms >= side_ms else 1

        def both(gemm_calls=gemm_calls, side_calls=side_calls, side=side) -> None:
            main = torch.cuda.current_stream()
            beside.wait_stream(main)
            with torch.cuda.stream(beside):
                for _ in range(side_calls):
                    side()
            for _ in range(gemm_calls):
                gemm()
            main.wait_stream(beside)

        alone = graph_ms(lambda c=gemm_calls: [gemm() for _ in range(c)], repeat=4)
        alone_side = graph_ms(lambda side=side, c=side_calls: [side() for _ in range(c)], repeat=4)
        together = graph_ms(both, repeat=4)
        hidden = (alone + alone_side - together) / min(alone, alone_side)
        print(f"overlap {args.size} {n}x{k} M={args.rows} x{4 * gemm_calls} beside {name} x{side_calls}: alone "
              f"{alone:.3f} + {alone_side:.3f} ms, together {together:.3f} ms; {hidden:.0%} of the shorter hidden",
              flush=True)  # fmt: skip


def register(sub) -> None:
    parser = command(sub, "long", long, "our delta rule and conv against fla's, new long states and rows")
    parser.add_argument("--rows", action="store_true", help="the row cases only")
    parser.add_argument("--tokens", type=int, default=0, help="one new state of this many tokens only")
    summary = "the chunked delta rule's chain by value block, warps, register cap"
    parser = command(sub, "chunkvariants", chunkvariants, summary)
    parser.add_argument("--tokens", type=int, default=0, help="one new state of this many tokens only")
    parser.add_argument("--size", choices=SIZES, default="4b", help="a Kev size's DeltaNet heads (default 4b)")
    command(sub, "chainwaves", chainwaves, "the chain narrow and wide by new long-state count (WIDE_ABOVE)")
    command(sub, "prepregs", prepregs, "the chunked delta rule by the prep's register cap")
    command(sub, "padded", padded, "the delta rule on captured groups: unpadded, padded, lead apart")
    command(sub, "rowsattn", rowsattn, "rows' attention by query rows, keys per step and stages")
    parser = command(sub, "longattn", longattn, "new long states' attention: varlen, SDPA and our tiles")
    parser.add_argument("--tokens", type=_ints, default=[2200], help="a state's tokens, comma-separated (2200)")
    parser.add_argument("--states", type=_ints, default=[1, 8], help="states a call, comma-separated (1,8)")
    parser.add_argument("--size", choices=SIZES, default="4b", help="a Kev size's attention heads (default 4b)")
    parser = command(sub, "turnattn", turnattn, "a conversation's turn's attention: in parallel, in turn, whole")
    parser.add_argument(
        "--points", type=_ints, default=[2048, 8192, 32768, 65024], help="points' tokens (comma-separated)"
    )
    parser.add_argument("--tokens", type=int, default=256, help="a turn's tokens after its point (256)")
    parser.add_argument("--batch", type=int, default=6, help="turns at once on 8,192-token points (6)")
    parser.add_argument("--size", choices=SIZES, default="4b", help="a Kev size's attention heads (default 4b)")
    command(sub, "convscan", convscan, "the pass's conv by tokens, channels and warps a program")
    parser = command(sub, "overlap", overlap, "a GEMM beside the delta rule or the activation, on two streams")
    parser.add_argument("--size", choices=SIZES, default="27b", help="a Kev size's shapes (default 27b)")
    parser.add_argument("--rows", type=int, default=1315, help="the GEMM's rows (default 1315: half of long5's pass)")
    parser.add_argument("--tokens", type=int, default=1232, help="the state's tokens (default 1232: half of long5's)")
    command(sub, "ncuprobe", ncuprobe, "a few delta-rule calls for Nsight Compute (bench/gpu.sh steps ncu)")
