"""The fused path's pointer head: the head's projections of a pass's picked tokens and every question's pointer
softmax in one kernel."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..scoring.head import option_indices, option_softmax
from ..scoring.transfer import device_int_fields, device_ints


class PointerHead:
    """The fused path's pointer head: one fp32 projection of each pass's picked tokens, [q | k] at once (a <decide>
    row's k and an option row's q are never read), read as soon as the pass is enqueued; then every question's
    pointer softmax in one kernel. On a GPU both are ours (kernels.pointer: a pick's numbers do not depend on the
    picks beside it); on a CPU the head's torch ops. After a captured pass only these two and the copy to the host
    run (far fewer launches than the head's torch ops: docs/kernels.md)."""

    def __init__(self, head: dict[str, torch.Tensor], temperature: float) -> None:
        self.dim = head["q.weight"].shape[0]
        self.weight_t = torch.cat([head["q.weight"], head["k.weight"]]).T.contiguous()  # [d, 2·dp]
        self.bias = torch.cat([head["q.bias"], head["k.bias"]])
        self.temperature = temperature

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, d] picked hidden states → [n, 2·dp] fp32: each row's q (first dp) and k (last dp)."""
        if hidden.is_cuda:
            from .kernels.pointer import pointer_project  # Triton: imported on a GPU only

            return pointer_project(hidden.float(), self.weight_t, self.bias)
        return torch.addmm(self.bias, hidden.float(), self.weight_t)

    def softmax(self, projected: torch.Tensor, decides: Sequence[int], widths: Sequence[int]) -> torch.Tensor:
        """Each question's option probabilities [Q, max width] on the device (zeros past its options): its <decide>
        row of `projected`, and its options the widths[i] rows after it."""
        device = projected.device
        if device.type == "cuda":
            from .kernels.pointer import pointer_softmax  # Triton: imported on a GPU only

            rows, counts = device_int_fields([decides, widths], device)
            return pointer_softmax(projected, rows, counts, int(max(widths)), self.temperature)
        owner, column = option_indices(widths, device)
        rows = device_ints(list(decides), device)
        q = projected[rows, : self.dim]
        k = projected[rows[owner] + 1 + column, self.dim :]
        return option_softmax(q, k, owner, column, widths, self.temperature)

    def warm(self) -> None:
        """The projection and the softmax kernel at each of its compiled variants (a width of one, a multiple of 16,
        any other), compiled and loaded at start-up, not on a request."""
        self.project(torch.zeros(1, self.weight_t.shape[0], device=self.weight_t.device))
        for width in (1, 2, 16, 255):
            projected = torch.zeros(2 * (width + 1), 2 * self.dim, device=self.weight_t.device)
            self.softmax(projected, [0, width + 1], [width, width])
