"""Host-to-device copies of a pass's index fields (kev_backend.scoring.transfer)."""

from __future__ import annotations

import torch

from kev_backend.scoring.transfer import device_int_fields, device_ints


def test_device_int_fields_keep_each_field_in_order() -> None:
    """Fields of any length, empty ones included, come back as int64 tensors with their own values in order: views
    of one tensor, so a wrong offset would show as one field's values in another's place."""
    fields = [[3, 1, 2], [], list(range(1000, 1005)), [-7], []]
    tensors = device_int_fields(fields, torch.device("cpu"))
    assert [t.dtype for t in tensors] == [torch.int64] * len(fields)
    assert [t.tolist() for t in tensors] == fields
    assert all(t.is_contiguous() for t in tensors)
    assert device_ints((5, 4, 2**40), torch.device("cpu")).tolist() == [5, 4, 2**40]
    assert device_ints([], torch.device("cpu")).shape == (0,)


def test_fields_start_on_16_bytes() -> None:
    """Triton specialises kernels on 16-byte aligned pointers: every field (and every bucket's input view) starts on
    16 bytes whatever the lengths before it, so the lengths of a pass's fields never pick a kernel variant."""
    from kev_backend.gpu.graphs import StaticInputs, all_buckets

    for lengths in ([3, 1, 2], [1, 1, 1, 5], [7, 0, 9]):
        fields = [list(range(n)) for n in lengths]
        for tensor in device_int_fields(fields, torch.device("cpu")):
            assert tensor.data_ptr() % 16 == 0, lengths
    inputs = StaticInputs(all_buckets(4096)[-1], 4099, torch.device("cpu"))
    for name in inputs.offsets:
        assert inputs.view(name, 1).data_ptr() % 16 == 0, name
