"""The fused path's projections on cuBLASLt algorithms without split-K: a row's output never depends on the rows
beside it, so an answer never depends on the batch it rides in.

cuBLAS chooses an algorithm by the GEMM's shape, and for some row counts one that splits the inner dimension and sums
the partial products in another order (split-K): a row's output then moves with the number of rows in its GEMM. Every
bf16 GEMM here runs on an algorithm of cuBLASLt's without split-K. Those all sum in the same order, so they give the
same bits (checked against each other when a table is tuned and by the GPU tests), and which one runs is a matter of
speed alone: a pre-tuned table (one per GPU and cuBLASLt version) names the fastest for the shapes where it beats the
heuristic's first without split-K, which runs every other shape.

A table file holds, for one GPU and cuBLASLt version, the algorithm of each (rows, out features, in features) worth
changing; `python -m kev_backend.dev.gemm_tuner tune CHECKPOINT OUT.json` makes one. At run time `pretuned(device,
table)` reads a matching table ("auto": the packaged gpu/gemm_algos/*.json; or a table's path; "off": none) into the
GemmAlgos whose `linear` runs every projection. No table for this GPU and library: every shape on the heuristic's
choice without split-K; the start-up line names the tables passed over and what they were tuned on.

cuBLASLt is called through ctypes on the library torch itself loaded. An algorithm is stored as its 64-byte opaque
structure and used only on the GPU model and cuBLASLt version it was tuned on (both named in the table); the GPU
test runs a stored table against the heuristic's choice."""

from __future__ import annotations

import ctypes
import json
from collections import OrderedDict
from pathlib import Path

import torch
import torch.nn.functional as F

from . import process

TABLES = Path(__file__).parent / "gemm_algos"  # the packaged tables, one per GPU and cuBLASLt version

# cublasLt.h and library_types.h values used here.
_CUDA_R_32F, _CUDA_R_16BF = 0, 14
_COMPUTE_32F = 68
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_PREF_MAX_WORKSPACE_BYTES = 1
_CONFIG_SPLITK_NUM = 2
_WORKSPACE_BYTES = 1 << 20
_CANDIDATES = 16


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _HeuristicResult(ctypes.Structure):
    _fields_ = [
        ("algo", _Algo),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what}: status {status}")


_library: ctypes.CDLL | None = None


def library(device: torch.device) -> ctypes.CDLL:
    """The libcublasLt torch loaded (after one bf16 GEMM through cuBLASLt on `device`: no other GPU's context)."""
    global _library
    if _library is None:
        process.configure(device)  # torch's BLAS is cuBLASLt: the GEMM below loads it
        ones = torch.ones(64, 64, device=device, dtype=torch.bfloat16)
        F.linear(ones, ones)
        path = next((line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                     if "libcublasLt.so" in line), None)  # fmt: skip
        if path is None:
            raise RuntimeError("libcublasLt is not loaded in this process")
        lt = ctypes.CDLL(path)
        lt.cublasLtMatrixLayoutCreate.argtypes = [
            ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64
        ]  # fmt: skip
        lt.cublasLtGetVersion.restype = ctypes.c_size_t
        _library = lt
    return _library


def identity(device: torch.device) -> dict[str, object]:
    """What a table is valid for: the GPU's name and cuBLASLt's version."""
    return {"gpu": torch.cuda.get_device_name(device), "cublaslt_version": int(library(device).cublasLtGetVersion())}


class _Plan:
    """y [M, N] = x [M, K] @ w [N, K]ᵀ, bf16 with fp32 accumulation: cuBLASLt's column-major yᵀ = op(w) xᵀ, w read
    transposed (F.linear's "TN")."""

    def __init__(self, lt: ctypes.CDLL, handle: ctypes.c_void_p, m: int, n: int, k: int) -> None:
        self.lt, self.handle = lt, handle
        self.desc = ctypes.c_void_p()
        _check(lt.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _CUDA_R_32F), "desc")
        for attribute, op in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N)):
            value = ctypes.c_int(op)
            _check(lt.cublasLtMatmulDescSetAttribute(self.desc, attribute, ctypes.byref(value), 4), "transpose")
        self.w_layout, self.x_layout, self.y_layout = (ctypes.c_void_p() for _ in range(3))
        shapes = ((self.w_layout, (k, n, k)), (self.x_layout, (k, m, k)), (self.y_layout, (n, m, n)))
        for layout, (rows, cols, ld) in shapes:
            _check(lt.cublasLtMatrixLayoutCreate(ctypes.byref(layout), _CUDA_R_16BF, rows, cols, ld), "layout")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._default: _Algo | None = None

    def close(self) -> None:
        """Frees the descriptors (a plan dropped from GemmAlgos' plans)."""
        for layout in (self.w_layout, self.x_layout, self.y_layout):
            self.lt.cublasLtMatrixLayoutDestroy(layout)
        self.lt.cublasLtMatmulDescDestroy(self.desc)

    @property
    def default(self) -> _Algo | None:
        """The heuristic's first algorithm without split-K for this shape (None if it offers none)."""
        if self._default is None:
            self._default = next(iter(self.candidates()), None)
        return self._default

    def candidates(self) -> list[_Algo]:
        """The heuristic's algorithms for this shape that run without split-K (the others sum partial products in
        another order, split by the row count)."""
        preference = ctypes.c_void_p()
        _check(self.lt.cublasLtMatmulPreferenceCreate(ctypes.byref(preference)), "preference")
        size = ctypes.c_uint64(_WORKSPACE_BYTES)
        _check(
            self.lt.cublasLtMatmulPreferenceSetAttribute(preference, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(size), 8),
            "preference",
        )
        results, returned = (_HeuristicResult * _CANDIDATES)(), ctypes.c_int()
        _check(
            self.lt.cublasLtMatmulAlgoGetHeuristic(
                self.handle, self.desc, self.w_layout, self.x_layout, self.y_layout, self.y_layout, preference,
                _CANDIDATES, ctypes.byref(results), ctypes.byref(returned),
            ),
            "heuristic",
        )  # fmt: skip
        self.lt.cublasLtMatmulPreferenceDestroy(preference)
        return [r.algo for r in results[: returned.value] if r.state == 0 and _split_k(self.lt, r.algo) == 1]

    def run(self, algo: _Algo, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, workspace: torch.Tensor) -> None:
        _check(
            self.lt.cublasLtMatmul(
                self.handle, self.desc, ctypes.byref(self.alpha),
                ctypes.c_void_p(w.data_ptr()), self.w_layout, ctypes.c_void_p(x.data_ptr()), self.x_layout,
                ctypes.byref(self.beta), ctypes.c_void_p(y.data_ptr()), self.y_layout,
                ctypes.c_void_p(y.data_ptr()), self.y_layout, ctypes.byref(algo),
                ctypes.c_void_p(workspace.data_ptr()), ctypes.c_size_t(workspace.numel()),
                ctypes.c_void_p(torch.cuda.current_stream(y.device).cuda_stream),
            ),
            "matmul",
        )  # fmt: skip


def _split_k(lt: ctypes.CDLL, algo: _Algo) -> int:
    value, written = ctypes.c_uint32(), ctypes.c_size_t()
    _check(
        lt.cublasLtMatmulAlgoConfigGetAttribute(
            ctypes.byref(algo), _CONFIG_SPLITK_NUM, ctypes.byref(value), 4, ctypes.byref(written)
        ),
        "algorithm's split",
    )
    return value.value


class GemmAlgos:
    """Every projection on a cuBLASLt algorithm without split-K: `linear(x, w)` for a contiguous bf16 x [M, K] and w
    [N, K] (rows contiguous) runs the table's algorithm for its (M, N, K), else the heuristic's first without split-K
    for that shape (kept with its plan). Anything else (another dtype or layout, no rows, a shape with no such
    algorithm: none on Kev's models) goes through F.linear."""

    # Plans kept, the most recently used: a server sees a few hundred shapes (graph buckets × projections), plus one
    # per projection for each eager pass's token count.
    PLANS = 4096

    def __init__(
        self, table: dict[tuple[int, int, int], _Algo], device: torch.device, source: str = "", passed_over: str = ""
    ) -> None:
        self.source = source  # the table's file name ("" for none)
        self.passed_over = passed_over  # without a table: the tables looked at and why none is used ("" if none)
        self.lt = library(device)
        self.handle = ctypes.c_void_p()
        with torch.cuda.device(device):  # the handle on this GPU's context
            _check(self.lt.cublasLtCreate(ctypes.byref(self.handle)), "create")
        self.algos = table
        self.plans: OrderedDict[tuple[int, int, int], _Plan] = OrderedDict()
        self.workspace = torch.empty(_WORKSPACE_BYTES, device=device, dtype=torch.uint8)

    def plan(self, m: int, n: int, k: int) -> _Plan:
        plan = self.plans.get((m, n, k))
        if plan is None:
            plan = self.plans[m, n, k] = _Plan(self.lt, self.handle, m, n, k)
            if len(self.plans) > self.PLANS:
                self.plans.popitem(last=False)[1].close()
        else:
            self.plans.move_to_end((m, n, k))
        return plan

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] == 0 or not _lt_ready(x, w):
            return F.linear(x, w)
        shape = (x.shape[0], w.shape[0], w.shape[1])
        plan = self.plan(*shape)
        algo = self.algos.get(shape)
        if algo is None:
            algo = plan.default
        if algo is None:
            return F.linear(x, w)
        y = torch.empty(shape[0], shape[1], device=x.device, dtype=x.dtype)
        plan.run(algo, x, w, y, self.workspace)
        return y

    @classmethod
    def load(cls, path: Path, device: torch.device) -> GemmAlgos | str:
        """The table in `path` if it was tuned on this GPU and cuBLASLt version, else what it was tuned on."""
        tuned_on, shapes = read_table(path)
        if tuned_on != identity(device):
            return f"{path.name}: {describe(tuned_on)}"
        table = {}
        for shape, words in shapes.items():
            algo = table[shape] = _Algo()
            algo.data[:] = words
        return cls(table, device, path.name)


def version_text(version: int) -> str:
    """cuBLASLt's version number (major × 10,000 + minor × 100 + patch) as people read it: 130100 is "13.1.0"."""
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}"


def describe(tuned_on: dict[str, object]) -> str:
    """A GPU and cuBLASLt version as people read them: "NVIDIA H200, cuBLASLt 13.1.0"."""
    return f"{tuned_on['gpu']}, cuBLASLt {version_text(int(str(tuned_on['cublaslt_version'])))}"


def read_table(path: Path) -> tuple[dict[str, object], dict[tuple[int, int, int], list[int]]]:
    """A table file: what it was tuned on (identity's keys) and each (M, N, K)'s algorithm as its eight 64-bit
    words. Refuses a malformed one."""
    data = json.loads(path.read_text())
    tuned_on = {key: data[key] for key in ("gpu", "cublaslt_version")}
    shapes: dict[tuple[int, int, int], list[int]] = {}
    for entry in data["shapes"]:
        shape = (int(entry["m"]), int(entry["n"]), int(entry["k"]))
        words = [int(word, 16) for word in entry["algo"]]
        if shape in shapes or len(words) != 8 or not all(0 <= word < 2**64 for word in words):
            raise ValueError(f"{path}: bad entry for {shape}")
        shapes[shape] = words
    return tuned_on, shapes


def _lt_ready(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (
        x.dtype == w.dtype == torch.bfloat16
        and x.is_contiguous()
        and w.stride(1) == 1
        and w.stride(0) == w.shape[1]
        and x.data_ptr() % 16 == 0
        and w.data_ptr() % 16 == 0
    )


def check_table(table: str) -> str:
    """`table` if pretuned can take it ("auto", "off", or the path of an existing file), else a ValueError saying
    what it takes. A file's contents are read (and a malformed one refused) when a model is built."""
    if table not in ("auto", "off") and not Path(table).is_file():
        raise ValueError(f"gemm_algos must be auto, off or the path of a table JSON file, not {table!r} (no such file)")
    return table


def pretuned(device: torch.device, table: str = "auto") -> GemmAlgos | None:
    """The projections' GEMMs on a CUDA device (None elsewhere): the pre-tuned algorithms of a table that matches
    this GPU and cuBLASLt version (with `table` "auto" a packaged one, TABLES; anything but "off" the table at that
    path, used only if it matches too), and every other shape on the heuristic's choice without split-K."""
    if device.type != "cuda":
        return None
    if check_table(table) == "off":
        paths = []
    elif table == "auto":
        paths = sorted(TABLES.glob("*.json"))
    else:
        paths = [Path(table)]
    passed_over = []
    for path in paths:
        algos = GemmAlgos.load(path, device)
        if isinstance(algos, GemmAlgos):
            return algos
        passed_over.append(algos)
    # A table tuned on another GPU or cuBLASLt version names algorithms this one may not have, or run them at
    # another speed: none is used, and the start-up line says which were passed over and why.
    said = f"this is {describe(identity(device))}; tables for " + "; ".join(passed_over) if passed_over else ""
    return GemmAlgos({}, device, passed_over=said)
