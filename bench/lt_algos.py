"""Does cuBLASLt hold a faster algorithm for Kev-4B's projections than the one its heuristic gives torch? (H200 only.)

For each projection at the row counts of short6 on a banked state (192) and long5 on a new one (2,688), asks
cuBLASLt's heuristic for up to 64 algorithms (ctypes on the libcublasLt torch loaded), times each as the fused path
runs its GEMMs (bf16 in and out, fp32 accumulation, weights cold: four copies in turn, from a CUDA graph) and prints
F.linear's time, the heuristic's first, the fastest, and whether each algorithm's output equals F.linear's bit for bit
(a row's answer must not depend on the GEMM that ran it). `python3 bench/lt_algos.py` on the GPU machine."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diag import KEV4B_PROJECTIONS, graph_ms  # noqa: E402

# cublasLt.h / library_types.h values used here.
CUDA_R_32F, CUDA_R_16BF = 0, 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB = 3, 4
PREF_MAX_WORKSPACE_BYTES = 1
CONFIG_NAMES = {0: "id", 1: "tile", 2: "splitk", 3: "reduction", 4: "swizzle", 5: "custom", 6: "stages"}
WORKSPACE_BYTES = 32 << 20


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    _fields_ = [
        ("algo", Algo),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


def load_cublaslt() -> ctypes.CDLL:
    """The libcublasLt this process loaded (torch's, after a GEMM through cuBLASLt)."""
    torch.backends.cuda.preferred_blas_library("cublaslt")
    ones = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
    F.linear(ones, ones)
    for line in Path("/proc/self/maps").read_text().splitlines():
        if "libcublasLt.so" in line:
            lt = ctypes.CDLL(line.split()[-1])
            lt.cublasLtMatrixLayoutCreate.argtypes = [
                ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64
            ]  # fmt: skip
            return lt
    raise RuntimeError("libcublasLt is not loaded")


def check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what}: cuBLAS status {status}")


class LtGemm:
    """y [M, N] = x [M, K] @ w [N, K]ᵀ in bf16 (fp32 accumulation), as cuBLASLt's column-major TN:
    yᵀ = op(w) xᵀ with w read transposed."""

    def __init__(self, lt: ctypes.CDLL, m: int, n: int, k: int) -> None:
        self.lt = lt
        self.handle = ctypes.c_void_p()
        check(lt.cublasLtCreate(ctypes.byref(self.handle)), "create")
        self.desc = ctypes.c_void_p()
        check(lt.cublasLtMatmulDescCreate(ctypes.byref(self.desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc")
        for attribute, op in ((DESC_TRANSA, CUBLAS_OP_T), (DESC_TRANSB, CUBLAS_OP_N)):
            value = ctypes.c_int(op)
            check(lt.cublasLtMatmulDescSetAttribute(self.desc, attribute, ctypes.byref(value), 4), "trans")
        self.a, self.b, self.d = (ctypes.c_void_p() for _ in range(3))
        for layout, (rows, cols, ld) in ((self.a, (k, n, k)), (self.b, (k, m, k)), (self.d, (n, m, n))):
            check(lt.cublasLtMatrixLayoutCreate(ctypes.byref(layout), CUDA_R_16BF, rows, cols, ld), "layout")
        self.workspace = torch.empty(WORKSPACE_BYTES, device="cuda", dtype=torch.uint8)
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def algorithms(self, count: int = 64) -> list[HeuristicResult]:
        preference = ctypes.c_void_p()
        check(self.lt.cublasLtMatmulPreferenceCreate(ctypes.byref(preference)), "preference")
        size = ctypes.c_uint64(WORKSPACE_BYTES)
        check(
            self.lt.cublasLtMatmulPreferenceSetAttribute(preference, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(size), 8),
            "workspace",
        )
        results = (HeuristicResult * count)()
        returned = ctypes.c_int()
        check(
            self.lt.cublasLtMatmulAlgoGetHeuristic(
                self.handle,
                self.desc,
                self.a,
                self.b,
                self.d,
                self.d,
                preference,
                count,
                ctypes.byref(results),
                ctypes.byref(returned),
            ),
            "heuristic",
        )
        return [results[i] for i in range(returned.value) if results[i].state == 0]

    def config(self, algo: Algo) -> str:
        parts = []
        for attribute, name in CONFIG_NAMES.items():
            value, written = ctypes.c_uint32(), ctypes.c_size_t()
            status = self.lt.cublasLtMatmulAlgoConfigGetAttribute(
                ctypes.byref(algo), attribute, ctypes.byref(value), 4, ctypes.byref(written)
            )
            if status == 0:
                parts.append(f"{name} {value.value}")
        return " ".join(parts)

    def run(self, algo: HeuristicResult, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
        check(
            self.lt.cublasLtMatmul(
                self.handle,
                self.desc,
                ctypes.byref(self.alpha),
                ctypes.c_void_p(w.data_ptr()),
                self.a,
                ctypes.c_void_p(x.data_ptr()),
                self.b,
                ctypes.byref(self.beta),
                ctypes.c_void_p(y.data_ptr()),
                self.d,
                ctypes.c_void_p(y.data_ptr()),
                self.d,
                ctypes.byref(algo.algo),
                ctypes.c_void_p(self.workspace.data_ptr()),
                ctypes.c_size_t(WORKSPACE_BYTES),
                ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
            ),
            "matmul",
        )


def main() -> None:
    lt = load_cublaslt()
    torch.manual_seed(0)
    for m in (192, 2688):
        for name, (n, k) in KEV4B_PROJECTIONS.items():
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(4)]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            torch_us = graph_ms(lambda x=x, ws=weights: [F.linear(x, w) for w in ws], repeat=2) * 1000 / 4
            expected = F.linear(x, weights[0])
            gemm = LtGemm(lt, m, n, k)
            timed = []
            for rank, result in enumerate(gemm.algorithms()):
                try:
                    calls = lambda r=result, g=gemm, x=x, y=y, ws=weights: [g.run(r, x, w, y) for w in ws]  # noqa: E731
                    us = graph_ms(calls, repeat=2) * 1000 / 4
                    gemm.run(result, x, weights[0], y)
                    torch.cuda.synchronize()
                except RuntimeError as error:
                    print(f"ltalgos {name} M={m} #{rank} failed: {error}", flush=True)
                    continue
                same = torch.equal(y, expected)
                timed.append((us, rank, gemm.config(result.algo), result.workspace_size, same))
            first = next((t for t in timed if t[1] == 0), None)
            best = min(timed, default=None)
            print(
                f"ltalgos {name} M={m}: F.linear {torch_us:.1f} µs, heuristic's first "
                f"{first[0] if first else float('nan'):.1f}, {len(timed)} algorithms",
                flush=True,
            )
            for us, rank, config, workspace, same in sorted(timed)[:6]:
                print(
                    f"ltalgos   #{rank} {us:.1f} µs [{config}] workspace {workspace}"
                    f"{'' if same else ' DIFFERS from F.linear'}",
                    flush=True,
                )
            if best is not None and first is not None:
                print(f"ltalgos {name} M={m} best/first {best[0] / first[0]:.3f}", flush=True)


if __name__ == "__main__":
    main()
