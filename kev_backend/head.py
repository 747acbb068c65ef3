"""Kev's pointer head (kev-model.md §2.4), always in fp32.

z_j = ((W_k h_j + b_k) · (W_q h_dec + b_q)) / √dp / T, softmax over the question's own options, where h_j is the
final-norm hidden state at option j's </opt> and h_dec the one at <decide>.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pointer_probabilities(
    head: dict[str, torch.Tensor],
    temperature: float,
    decide_hidden: torch.Tensor,
    option_hidden: torch.Tensor,
    options_per_question: Sequence[int],
) -> list[list[float]]:
    """decide_hidden [Q, d] and option_hidden [sum K_i, d] (questions' options in order) → per question p.

    All questions are scored in a fixed number of kernels, with one device→host copy at the end.
    """
    device = decide_hidden.device
    q = torch.nn.functional.linear(decide_hidden.float(), head["q.weight"], head["q.bias"])
    k = torch.nn.functional.linear(option_hidden.float(), head["k.weight"], head["k.bias"])
    counts = torch.tensor(list(options_per_question), device=device)
    owner = torch.repeat_interleave(torch.arange(len(counts), device=device), counts)
    logits = (k * q[owner]).sum(-1) / (q.shape[-1] ** 0.5)
    if temperature != 1.0:
        logits = logits / temperature
    # Scatter into [Q, Kmax] padded with -inf so one softmax serves every question.
    widest = int(max(options_per_question))
    starts = torch.cumsum(counts, 0) - counts
    column = torch.arange(len(owner), device=device) - starts[owner]
    padded = torch.full((len(counts), widest), float("-inf"), device=device)
    padded[owner, column] = logits
    probs = torch.softmax(padded, dim=-1).cpu().tolist()
    return [row[:n] for row, n in zip(probs, options_per_question)]
