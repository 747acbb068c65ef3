"""Which path a start serves: the GPUs that the serving environment's torch can use, asked of that environment's own
interpreter (a driver, a device and a CUDA build of torch must all be there), never assumed from an installed
library. Without an NVIDIA device node nothing is asked: a CPU machine pays nothing."""

from __future__ import annotations

import glob
import subprocess
from dataclasses import dataclass
from pathlib import Path

QUERY = (
    "import torch\n"
    "if not torch.cuda.is_available():\n"
    "    print('torch', torch.__version__, 'sees no CUDA device (CUDA build:', torch.version.cuda, ')')\n"
    "else:\n"
    "    print('cuda', torch.version.cuda)\n"
    "    for i in range(torch.cuda.device_count()):\n"
    "        print('gpu', torch.cuda.get_device_name(i))\n"
)


@dataclass(frozen=True)
class Devices:
    gpus: tuple[str, ...]  # names, in CUDA's order
    detail: str  # the CUDA version, or why there is no GPU

    def describe(self) -> str:
        if not self.gpus:
            return f"no GPU: {self.detail}"
        names = sorted(set(self.gpus))
        return f"{len(self.gpus)} GPU(s) ({', '.join(names)}; CUDA {self.detail})"


def cuda_devices(python: Path, timeout_s: float = 120.0) -> Devices:
    """The CUDA devices `python`'s torch sees."""
    if not glob.glob("/dev/nvidia[0-9]*"):
        return Devices((), "no NVIDIA device node (/dev/nvidia0, ...)")
    try:
        done = subprocess.run(
            [str(python), "-c", QUERY], capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return Devices((), f"asking {python}'s torch failed: {error}")
    if done.returncode != 0:
        return Devices((), f"{python} could not import torch: {done.stderr.strip().splitlines()[-1:]}")
    lines = done.stdout.splitlines()
    gpus = tuple(line.removeprefix("gpu ") for line in lines if line.startswith("gpu "))
    if not gpus:
        return Devices((), " ".join(lines) or "torch.cuda reports no device")
    cuda = next((line.removeprefix("cuda ") for line in lines if line.startswith("cuda ")), "?")
    return Devices(gpus, cuda)
