"""Kev's pointer head, always in fp32.

z_j = ((W_k h_j + b_k) · (W_q h_dec + b_q)) / √dp / T, softmax over the question's own options, where h_j is the
final-norm hidden state at option j's </opt> and h_dec the one at <decide>.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..protocol.encoding import Encoded
from .transfer import HostCopy, device_ints

# The final-norm hidden states a question's answer is read from: (<decide> [d], each option's </opt> [K, d]).
Picked = tuple[torch.Tensor, torch.Tensor]


def head_softmax(
    head: dict[str, torch.Tensor],
    temperature: float,
    decide_hidden: torch.Tensor,
    option_hidden: torch.Tensor,
    options_per_question: Sequence[int],
) -> torch.Tensor:
    """Kev's pointer head in torch ops (the kernel of the same math is gpu/kernels/pointer.py): decide_hidden [Q, d]
    and option_hidden [sum K_i, d] (questions' options in order) → p [Q, max K_i] on their
    device, each question's row zero past its options. A fixed number of kernels for every question, and nothing
    that waits for the GPU: the option indices are built on the host."""
    q = torch.nn.functional.linear(decide_hidden.float(), head["q.weight"], head["q.bias"])
    k = torch.nn.functional.linear(option_hidden.float(), head["k.weight"], head["k.bias"])
    owner, column = option_indices(options_per_question, q.device)
    return option_softmax(q, k, owner, column, options_per_question, temperature)


def option_indices(widths: Sequence[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each option's question and its place among that question's options (one upload)."""
    owner, column = device_ints(
        [i for i, n in enumerate(widths) for _ in range(n)] + [j for n in widths for j in range(n)], device
    ).view(2, -1)
    return owner, column


def option_softmax(
    q: torch.Tensor,
    k: torch.Tensor,
    owner: torch.Tensor,
    column: torch.Tensor,
    widths: Sequence[int],
    temperature: float,
) -> torch.Tensor:
    """q [Q, dp] per question, k [sum K_i, dp] per option (option_indices: owner, column) → p [Q, max K_i]:
    z = (k · q) / √dp / T, softmax over each question's options, zero past them."""
    logits = (k * q[owner]).sum(-1) / (q.shape[-1] ** 0.5)
    if temperature != 1.0:
        logits = logits / temperature
    # Scatter into [Q, Kmax] padded with -inf so one softmax serves every question.
    padded = torch.full((len(widths), int(max(widths))), float("-inf"), device=q.device)
    padded[owner, column] = logits
    return torch.softmax(padded, dim=-1)


def pointer_probabilities(
    head: dict[str, torch.Tensor],
    temperature: float,
    decide_hidden: torch.Tensor,
    option_hidden: torch.Tensor,
    options_per_question: Sequence[int],
) -> list[list[float]]:
    """head_softmax on the host: per question, its options' probabilities."""
    probs = head_softmax(head, temperature, decide_hidden, option_hidden, options_per_question).cpu().tolist()
    return [row[:n] for row, n in zip(probs, options_per_question)]


@dataclass
class PendingProbabilities:
    """A batch's probabilities on their way to the host (`result()` waits for them): per request, per question."""

    requests: int
    owners: list[int] = field(default_factory=list)  # each question's request, in order
    widths: list[int] = field(default_factory=list)  # each question's option count
    copy: HostCopy | None = None  # [questions, max width]

    @classmethod
    def copying(
        cls, requests: int, order: Sequence[tuple[int, int]], widths: list[int], probs: torch.Tensor
    ) -> PendingProbabilities:
        """probs [questions, max width] of the (request, question)s in `order` (batch_questions), copied to the host."""
        return cls(requests, [r for r, _ in order], widths, HostCopy(probs))

    def result(self) -> list[list[list[float]]]:
        out: list[list[list[float]]] = [[] for _ in range(self.requests)]
        if self.copy is not None:
            for r, row, n in zip(self.owners, self.copy.get().tolist(), self.widths):
                out[r].append(row[:n])
        return out


def launch_batch_probabilities(
    head: dict[str, torch.Tensor],
    temperature: float,
    batch: Sequence[Encoded],
    picked: Mapping[tuple[int, int], Picked],
) -> PendingProbabilities:
    """Every question of the batch in one head call, from the hidden states picked for each (request, question),
    enqueued with the copy of its probabilities to the host."""
    order, widths = batch_questions(batch)
    if not order:
        return PendingProbabilities(len(batch))
    probs = head_softmax(
        head,
        temperature,
        torch.stack([picked[key][0] for key in order]),
        torch.cat([picked[key][1] for key in order]),
        widths,
    )
    return PendingProbabilities.copying(len(batch), order, widths, probs)


def batch_questions(batch: Sequence[Encoded]) -> tuple[list[tuple[int, int]], list[int]]:
    """Every (request, question) of the batch in order, and each one's option count."""
    order = [(r, q) for r, encoded in enumerate(batch) for q in range(len(encoded.questions))]
    return order, [len(batch[r].questions[q].option_ends) for r, q in order]


def warm_pointer_head(head: dict[str, torch.Tensor], rows: int = 512) -> None:
    """Runs the head's two projections once for every row count up to `rows` (questions, or options, of a batch).
    cuBLAS may pick another kernel for each count, and with CUDA's lazy module loading a kernel's first launch loads
    it: done here, at start-up, not on a request. Why: without it the first requests after start are slower than
    the next ones whatever their shape, and the head is the one eager GEMM whose row counts the warm-up batch does
    not cover (docs/kernels.md, Pointer head)."""
    weight = head["q.weight"]
    for n in range(1, rows + 1):
        hidden = torch.zeros(n, weight.shape[1], device=weight.device, dtype=torch.float32)
        torch.nn.functional.linear(hidden, weight, head["q.bias"])
        torch.nn.functional.linear(hidden, head["k.weight"], head["k.bias"])
    # The rest of the head (gathers, the padded softmax) at option widths up to System One's 255.
    decide = torch.zeros(2, weight.shape[1], device=weight.device)
    for width in (1, 2, 3, 4, 6, 8, 16, 32, 64, 128, 255):
        pointer_probabilities(
            head, 1.0, decide, torch.zeros(2 * width, weight.shape[1], device=weight.device), [width] * 2
        )
