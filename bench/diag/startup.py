"""Start-up: the engine's phases with every graph bucket captured, and start-up as a Triton instance sees it (imports,
then an engine from a checkpoint on disk in fresh processes). `python -m bench.diag.startup CHECKPOINT` is one such
start (coldstart runs it)."""

from __future__ import annotations

import argparse
import os
import pstats
import re
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import torch

from .common import command, kev4b_engine, profiled

REPO = Path(__file__).resolve().parents[2]


def startup(args) -> None:
    """The engine's start-up phases with every graph bucket captured (as the GPU config loads it): seconds by phase,
    in eager warm-up passes and in captures, the graphs' count and memory; --profile: where the host spends them
    (cProfile, and which callers compile Python source at run time)."""
    engine, profiler = profiled(lambda: kev4b_engine(graphs=True), args.profile)
    stats = engine.scorer.graphs.stats
    phases = {phase: round(seconds, 2) for phase, seconds in engine.startup.items()}
    print(
        f"startup {phases} graphs {stats.count} ({stats.capture_failures} failed) "
        f"{stats.bytes / 2**20:.0f} MiB; warm passes {stats.warm_s:.2f} s, captures {stats.capture_s:.2f} s",
        flush=True,
    )
    for bucket, error in engine.scorer.graphs.failed.items():
        print(f"startup bucket {bucket.name}: {error}", flush=True)
    if profiler is not None:
        ranked = pstats.Stats(profiler).sort_stats("tottime")
        ranked.print_stats(20)
        ranked.print_callers("builtins.compile")


def coldstart(args) -> None:
    """Start-up as a Triton instance sees it, from a Kev-4B checkpoint on disk (--checkpoint, written if missing): the
    imports' cost by top-level package (-X importtime) and of a few imports in fresh processes, whether bytecode can
    be written, then Engine.from_checkpoint with the GPU config's options in fresh processes: on an empty kernel
    cache, on the kept one under cProfile, with the load phase's steps timed one by one, and with bytecode kept."""
    checkpoint = Path(args.checkpoint)
    if not checkpoint.exists():
        root = checkpoint.parent
        tiny = [sys.executable, "-m", "kev_backend.dev.synthetic", str(root), "--kev4b", "--device", "cuda"]
        subprocess.run(tiny, check=True)
    modules = "import kev_backend.engine.engine, kev_backend.gpu.fused, kev_backend.gpu.graphs"
    imports = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", modules], capture_output=True, text=True, cwd=REPO
    ).stderr
    top: dict[str, int] = {}
    for line in imports.splitlines():  # "import time: self [us] | cumulative | imported package"
        match = re.match(r"import time:\s+\d+ \|\s+(\d+) \| (\S+)$", line)
        if match:
            top[match[2]] = int(match[1])
    ranked = sorted(top.items(), key=lambda item: -item[1])[:12]
    print("coldstart imports (s, top-level): " + ", ".join(f"{name} {us / 1e6:.2f}" for name, us in ranked), flush=True)
    for names in ("torch", "torch, triton", "torch, fla.ops.gated_delta_rule", "torch, kev_backend.gpu.kernels"):
        timed = f"import time; t = time.perf_counter(); import {names}; print(time.perf_counter() - t)"
        run = subprocess.run([sys.executable, "-c", timed], capture_output=True, text=True, cwd=REPO)
        print(f"coldstart import {names}: {run.stdout.strip()} s in a fresh process", flush=True)
    site = Path(sysconfig.get_paths()["purelib"])
    pyc = sum(1 for _ in site.glob("*/__pycache__/*.pyc"))
    print(
        f"coldstart python: dont_write_bytecode {sys.dont_write_bytecode}, pycache_prefix {sys.pycache_prefix}, "
        f"{site} writable {os.access(site, os.W_OK)}, {pyc} .pyc files one level down",
        flush=True,
    )
    cache = Path(args.cache)
    subprocess.run(["rm", "-rf", str(cache)], check=True)
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "TRITON_CACHE_AUTOTUNING": "1"}
    bytecode = {"PYTHONPYCACHEPREFIX": f"{cache}-pyc", "PYTHONDONTWRITEBYTECODE": ""}
    runs = (
        ("empty cache", [], {}),
        ("kept cache", ["--profile"], {}),
        ("kept cache, load split, bytecode written", ["--load-split"], bytecode),
        ("kept cache, bytecode kept", [], bytecode),
    )
    for label, options, extra in runs:
        child = subprocess.run(
            [sys.executable, "-m", "bench.diag.startup", str(checkpoint), *options],
            env={**env, **extra},
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        lines = [line for line in child.stdout.splitlines() if "warn" not in line.lower()]
        print(f"coldstart {label}:", flush=True)
        print("\n".join(lines[:130]), flush=True)
        if child.returncode:
            print(child.stderr[-3000:], flush=True)


def load_split(directory: Path) -> None:
    """The load phase's steps, timed one by one (each ends with a device synchronize)."""
    from kev_backend.model import checkpoint as ck
    from kev_backend.model.qwen35 import Qwen35Config
    from kev_backend.model.weights import load_text_weights, read_config

    device = torch.device("cuda")
    steps = {}

    def timed(name, fn):
        started = time.perf_counter()
        value = fn()
        torch.cuda.synchronize()
        steps[name] = round(time.perf_counter() - started, 3)
        return value

    meta = timed("head.pt", lambda: ck.Meta.load(directory / "head.pt"))
    base = ck.resolve_base(directory, meta, None)
    config = timed("config", lambda: Qwen35Config.from_dict(read_config(base)))
    weights = timed("weights", lambda: load_text_weights(base, device))
    shapes = {name: tuple(tensor.shape) for name, tensor in weights.items()}
    deltas = timed("lora", lambda: ck.lora_deltas(directory, 1.0, shapes, device))
    timed("build_model", lambda: ck.build_model(config, weights, torch.bfloat16, deltas, device))
    timed("load_checkpoint", lambda: ck.load_checkpoint(directory, device))
    print(f"coldstart load steps (s): {steps}", flush=True)


def start_once(checkpoint: str, profile: bool, split: bool) -> None:
    """One engine start as coldstart describes (torch is already imported: this module imports it)."""
    from kev_backend.engine.engine import Engine, EngineOptions

    started = time.perf_counter()
    torch.cuda.init()
    torch.empty(1, device="cuda")
    context = time.perf_counter() - started
    if split:
        load_split(Path(checkpoint))
    options = EngineOptions(device="cuda", backend="fused", graphs=True)
    engine, profiler = profiled(lambda: Engine.from_checkpoint(checkpoint, options), profile)
    stats = engine.scorer.graphs.stats
    phases = {phase: round(seconds, 2) for phase, seconds in engine.startup.items()}
    print(
        f"coldstart context {context:.2f} s, phases {phases}, graphs {stats.count}, warm passes {stats.warm_s:.2f} s, "
        f"captures {stats.capture_s:.2f} s",
        flush=True,
    )
    if profiler is not None:
        ranked = pstats.Stats(profiler).sort_stats("cumulative")
        ranked.print_callers(r"builtins.compile")  # Python source compiled at run time (no bytecode cache?)
        ranked.print_stats(r"kev_backend|safetensors|tokenizers|graphs.py|jit.py|compiler|cublas", 40)
        ranked.sort_stats("tottime").print_stats(12)


def register(sub) -> None:
    parser = command(sub, "startup", startup, "start-up phases with every graph captured")
    parser.add_argument("--profile", action="store_true", help="profile the host (cProfile)")
    parser = command(sub, "coldstart", coldstart, "imports, then engine starts from a checkpoint on disk")
    parser.add_argument("--checkpoint", default="/tmp/kev4b/kev", help="a Kev-4B checkpoint (default /tmp/kev4b/kev)")
    parser.add_argument("--cache", default="/tmp/coldstart-cache", help="the kernel cache the starts fill and keep")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.diag.startup", description=start_once.__doc__)
    parser.add_argument("checkpoint")
    parser.add_argument("--profile", action="store_true", help="profile the host (cProfile)")
    parser.add_argument("--load-split", action="store_true", help="time the load phase's steps one by one first")
    args = parser.parse_args()
    start_once(args.checkpoint, args.profile, args.load_split)


if __name__ == "__main__":
    main()
