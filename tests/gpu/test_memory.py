"""How the fused path divides a GPU's memory (kev_backend/gpu/memory.py) and the refusals of a model that cannot fit:
the arithmetic and the messages on a CPU, with the GPU's figures given; the measured plan on a GPU in
tests/gpu/test_fused_gpu.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kev_backend.dev import sizes
from kev_backend.gpu.memory import GIB, MARGIN_BYTES, GpuMemoryError, MemoryPlan, refusing_out_of_memory
from kev_backend.model import checkpoint
from kev_backend.model.qwen35 import Qwen35Config
from tests.gpu.fused_cpu_ops import engines


def plan(total_gib: float, free_gib: float, working_gib: float, minimum_gib: float = 4.6) -> MemoryPlan:
    return MemoryPlan(
        total=int(total_gib * GIB),
        free=int(free_gib * GIB),
        weights=int((total_gib - free_gib) * GIB),
        working=int(working_gib * GIB),
        graphs=GIB // 2,
        minimum=int(minimum_gib * GIB),
        max_state_tokens=65_536,
        largest_pass_tokens=73_728,
    )


def test_the_bank_takes_a_fifth_where_there_is_room_and_what_is_left_where_not() -> None:
    roomy = plan(139.8, 137.0, 6.0)  # Kev-4B on an H200: a fifth, as always
    assert roomy.bank_bytes() == roomy.total // 5
    tight = plan(79.2, 28.4, 13.0)  # Kev-27B on an H100 (about): what the weights and the largest pass leave
    assert tight.bank_bytes() == tight.free - tight.working - tight.graphs - MARGIN_BYTES < tight.total // 5
    assert tight.bank_bytes() >= tight.minimum


def test_a_gpu_without_room_for_one_state_is_refused_with_what_to_change() -> None:
    small = plan(39.4, 25.0, 20.0)  # Kev-27B's pass beside a bank of one 65,536-token state: not on 40 GB
    with pytest.raises(GpuMemoryError) as refused:
        small.bank_bytes()
    message = str(refused.value)
    short = small.minimum - (small.free - small.working - small.graphs - MARGIN_BYTES)
    for said in ("39.4 GiB", "25.0 GiB", "20.0 GiB", "4.6 GiB", f"{short / GIB:.1f} GiB short", "73,728 tokens"):
        assert said in message, message
    assert "KEV_MAX_STATE_TOKENS" in message and "a GPU with more memory" in message


def test_weights_that_cannot_fit_are_refused_before_any_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kev-27B's weights in bf16 need 47.7 GiB: a GPU with 40 GiB free refuses them at once, saying both."""
    config = Qwen35Config.from_dict(sizes.SIZES["27b"].config)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * GIB, 79 * GIB))
    refusal = r"need 4\d\.\d GiB on the GPU, which has 40\.0 GiB free of 79"
    with pytest.raises(checkpoint.WeightsDoNotFit, match=refusal):
        checkpoint.check_weights_fit(config, torch.bfloat16, torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * GIB, 79 * GIB))
    checkpoint.check_weights_fit(config, torch.bfloat16, torch.device("cuda"))  # fits: no refusal


def test_running_out_of_memory_while_loading_is_refused_with_what_was_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU other processes fill: the weights fit, then the load runs out on the way (their fused forms, a pass).
    The start fails with what was free when the load began and what it had taken, not the allocator's message about
    one allocation; anything else the load raises goes through as it is."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(4.4 * GIB), int(79.2 * GIB)))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: int(2.7 * GIB))
    with pytest.raises(GpuMemoryError) as refused, refusing_out_of_memory(torch.device("cuda")):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 14.00 MiB.")
    message = str(refused.value)
    for said in ("does not fit this GPU", "2.7 GiB of the 4.4 GiB free", "79.2 GiB in all", "KEV_MAX_STATE_TOKENS"):
        assert said in message, message
    assert "Tried to allocate" not in message
    with pytest.raises(ValueError, match="not memory"), refusing_out_of_memory(torch.device("cuda")):
        raise ValueError("not memory")
    with refusing_out_of_memory(torch.device("cpu")):  # a CPU load asks the GPU nothing
        pass


def test_the_start_up_line_says_what_the_bank_holds(tiny_dir: Path) -> None:
    _, fused = engines(tiny_dir, bank_bytes=64 << 20)
    said = fused.bank_summary()
    pool = fused.bank.pool
    assert said.startswith(f"state bank {pool.nbytes / GIB:.1f} GiB, holding states of tokens: ")
    assert "of 65,536" in said and "of 2,048" in said
