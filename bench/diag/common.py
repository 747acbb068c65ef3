"""Helpers shared by the diagnostics: GPU timers, Kev-4B engines and delta-rule inputs, and `patched`, the one way a
diagnostic changes a kernel module's setting."""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import torch

from kev_backend.dev.sizes import SIZES
from kev_backend.dev.synthetic import size_checkpoint

# DeltaNet key heads, value heads, key dim, value dim of Kev-4B.
KEV4B_HEADS = (16, 32, 128, 128)

# Kev-4B's projections as the fused path stores them, [N, K]: DeltaNet's and attention's input projections, the
# output projections (both K = 4,096), the MLP's gate and up together, and down.
KEV4B_PROJECTIONS = {
    "gdn_in": (12352, 2560),
    "attn_in": (10240, 2560),
    "out": (2560, 4096),
    "gate_up": (18432, 2560),
    "down": (2560, 9216),
}


@contextlib.contextmanager
def patched(owner: ModuleType | type, **values: object) -> Iterator[None]:
    """Sets a module's (or a class's) attributes for the block and restores them on leaving it, whatever happens
    inside. For kernel modules only live settings: globals read at each launch (e.g. delta_rule.CHUNK_NARROW), never
    ones read at import."""
    missing = [name for name in values if not hasattr(owner, name)]
    if missing:
        raise AttributeError(f"{owner.__name__} has no {', '.join(missing)}")
    saved = {name: getattr(owner, name) for name in values}
    try:
        for name, value in values.items():
            setattr(owner, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(owner, name, value)


def command(sub, name: str, run: Callable, summary: str, engine: bool = False) -> argparse.ArgumentParser:
    """Adds subcommand `name` (`summary` in the list, run's docstring as its --help) running run(args); with `engine`,
    the options of the Kev-4B engine it builds (kev4b_engine)."""
    parser = sub.add_parser(name, help=summary, description=run.__doc__)
    parser.set_defaults(run=run)
    if engine:
        parser.add_argument(
            "--graphs",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="replay CUDA graphs, as the GPU config does (default: on)",
        )
        parser.add_argument(
            "--graph-max-tokens",
            type=int,
            default=None,
            help="the largest graph bucket, every bucket kept (default: the engine's)",
        )
        parser.add_argument(
            "--size", choices=SIZES, default="4b", help="random weights of a Kev size's shapes, bf16 (default 4b)"
        )
    return parser


def cuda_ms(fn: Callable[[], object], repeat: int = 10, warmup: int = 3) -> float:
    """Mean GPU time of `fn` over `repeat` back-to-back calls, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


def captured_graph(fn: Callable[[], object], repeat: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `repeat` calls of `fn` back to back, replayed once (after one call outside it)."""
    fn()  # compiled and warm before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def graph_ms(fn: Callable[[], object], repeat: int = 20) -> float:
    """Mean time of `fn` replayed from a CUDA graph (`repeat` calls captured back to back, as a pass's graph holds
    them): GPU time without the host's launches, which bound small eager calls."""
    graph = captured_graph(fn, repeat)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


def replayed(graph: torch.cuda.CUDAGraph, replays: int) -> list[float]:
    """ms of each of `replays` replays of `graph` back to back."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(replays + 1)]
    events[0].record()
    for event in events[1:]:
        graph.replay()
        event.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in zip(events, events[1:])]


def graph_kernel_us(fn: Callable[[], object], repeat: int = 20) -> dict[str, float]:
    """µs a call of each kernel `fn` launches, replayed from a CUDA graph of `repeat` calls (torch's profiler sees a
    graph's kernels): which of several kernels a graph_ms difference is in."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    graph = captured_graph(fn, repeat)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    total: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            total[event.name] += event.device_time_total / repeat
    return dict(total)


def kernel_parts(fn: Callable[[], object], *keys: str) -> str:
    """`fn`'s kernels whose names contain one of `keys`, µs a call from a graph: "prep 12.3 chunked_delta_rule 40.1"."""
    return " ".join(
        f"{name.strip('_').split('_kernel')[0]} {us:.1f}"
        for name, us in graph_kernel_us(fn).items()
        if any(key in name for key in keys)
    )


def kev4b_checkpoint():
    """Random Kev-4B weights on the GPU (fp32, LoRA merged) with the tiny tokenizer."""
    from kev_backend.dev import sizes, synthetic

    directory = Path(tempfile.mkdtemp())
    synthetic.write_tokenizer(directory)
    return synthetic.synthetic_checkpoint(sizes.KEV4B_CONFIG, directory, "cuda", seed=0)


def kev4b_engine(args: argparse.Namespace | None = None, checkpoint=None, **options):
    """An engine on random Kev-4B weights (8 GiB bank; `checkpoint`: kev4b_checkpoint's, made here if not given; a
    subcommand's --size other than 4b: that size's in bf16, synthetic.size_checkpoint), otherwise with EngineOptions'
    defaults (the GPU config's), but for a subcommand's engine options in `args` (command's `engine`) and then
    `options`."""
    from kev_backend.engine.engine import Engine, EngineOptions

    size = getattr(args, "size", "4b")
    checkpoint = checkpoint or (
        kev4b_checkpoint() if size == "4b" else size_checkpoint(SIZES[size], "cuda", torch.bfloat16)
    )
    chosen: dict[str, object] = {"bank_bytes": 8 << 30}
    if args is not None:
        chosen.update(graphs=args.graphs)
        if args.graph_max_tokens is not None:
            chosen.update(graph_max_tokens=args.graph_max_tokens, max_graphs=200)
    return Engine(checkpoint, EngineOptions(device="cuda", backend="fused", **(chosen | options)))


def delta_rule_heads(size: str) -> tuple[int, int, int, int]:
    """A Kev size's DeltaNet heads: (key heads, value heads, key width, value width)."""
    c = SIZES[size].config
    names = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
    return tuple(c[name] for name in names)


def delta_rule_inputs(T: int, heads: tuple[int, int, int, int] = KEV4B_HEADS):
    """Random bf16 conv output [T, conv_dim] with its q, k, v views and raw gates a, b [T, Hv] (strided, as slices of
    the projection), at Kev-4B's DeltaNet shapes (or `heads`: delta_rule_heads)."""
    H, HV, K, V = heads
    mixed = torch.randn(T, 2 * H * K + HV * V, device="cuda", dtype=torch.bfloat16)
    q = mixed[:, : H * K].view(T, H, K)
    k = mixed[:, H * K : 2 * H * K].view(T, H, K)
    v = mixed[:, 2 * H * K :].view(T, HV, V)
    gates = torch.randn(T, 2 * HV, device="cuda", dtype=torch.bfloat16)
    return mixed, q, k, v, gates[:, :HV], gates[:, HV:]


def segments_case(lengths: list[int], heads: tuple[int, int, int, int] = KEV4B_HEADS):
    """Seeded delta-rule inputs for segments of these lengths (delta_rule_inputs), gate constants, a bank of one slot
    per segment plus scratch, its slots and the offsets on the host and the GPU."""
    from kev_backend.gpu.passes import offsets

    _, HV, K, V = heads
    torch.manual_seed(0)
    mixed, q, k, v, a, b = delta_rule_inputs(sum(lengths), heads)
    a_log, dt_bias = torch.randn(HV, device="cuda") * 0.5, torch.randn(HV, device="cuda")
    pool = torch.randn(len(lengths) + 1, HV, K, V, device="cuda") * 0.05
    cu_cpu = torch.tensor(offsets(lengths))
    return mixed, q, k, v, a, b, a_log, dt_bias, pool, torch.arange(len(lengths), device="cuda"), cu_cpu, cu_cpu.cuda()


def padded_to(slots: torch.Tensor, cu: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots and offsets of a captured pass's group of `capacity` segments: the real ones, then empty padding
    segments on segments_case's spare slot."""
    n = slots.shape[0]
    scratch = torch.full((capacity - n,), n, device=slots.device, dtype=slots.dtype)
    return torch.cat([slots, scratch]), torch.cat([cu, cu[-1:].repeat(capacity - n)])


def sweep_entry(name: str, run, reference: torch.Tensor | None, timer=None) -> tuple[str, torch.Tensor | None]:
    """One setting of a kernel sweep: "NAME ms (largest difference from the reference)", or why it did not run; and
    the reference (the sweep's first output)."""
    try:
        out = run().float()
    except Exception as error:  # noqa: BLE001 (a setting that does not compile: reported, skipped)
        return f"{name} failed {type(error).__name__}", reference
    reference = out if reference is None else reference
    return f"{name} {(timer or graph_ms)(run):.4f} ({(out - reference).abs().max().item():.1e})", reference


def profiled(make: Callable[[], object], enabled: bool):
    """make()'s value, and its host profile when `enabled` (else None)."""
    if not enabled:
        return make(), None
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        return make(), profiler
    finally:
        profiler.disable()
