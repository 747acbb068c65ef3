"""The batch-first engine: many System One requests in, one response body, RequestError or RequestFault each out.

Parsing, Kev's limits and answer assembly live here; the probabilities come from a scorer. One request never affects
the others of its batch: a request Kev refuses gets its RequestError, and any other exception while preparing or
answering one request becomes that request's RequestFault (an internal error), never its neighbours'.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Collection, Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..gpu.cublaslt import check_table
from ..gpu.memory import refusing_out_of_memory
from ..model.checkpoint import KevCheckpoint, LoadOptions, load_checkpoint
from ..protocol.answers import answers_from_probabilities, answers_json, response_body
from ..protocol.encoding import Encoded, KevTokenizer, encode
from ..protocol.request import Limits, Record, RequestError, parse_request
from ..scoring.bank import BankStats
from ..scoring.contract import Pending, Scorer
from ..scoring.growth import PrefixBank
from ..scoring.reference import ReferenceScorer

if TYPE_CHECKING:
    from ..gpu.scorer import FusedOptions

Body = str | bytes | dict
log = logging.getLogger(__name__)


class RequestFault(Exception):
    """An unexpected failure while preparing or answering one request (a server fault, not the client's): that
    request alone gets an internal error naming it."""

    @classmethod
    def of(cls, stage: str, error: BaseException) -> RequestFault:
        log.error("kev: %s failed for one request: %r", stage, error)
        return cls(f"{stage} failed: {type(error).__name__}")


Result = dict | RequestError | RequestFault | None


def unrecoverable(error: BaseException) -> bool:
    """An engine fault after which no batch can be answered in this process: a CUDA error (an illegal address, a
    launch failure) leaves the device context unusable, and only a new process helps. Running out of memory is not
    one: the scorer frees its bank and retries."""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return False
    accelerator = getattr(torch, "AcceleratorError", None)
    return (accelerator is not None and isinstance(error, accelerator)) or "CUDA error" in str(error)


@dataclass(frozen=True)
class EngineOptions:
    """How the engine runs; the defaults are the shipped configuration. The serving settings (kev_backend/settings.py)
    build one from the Triton model's parameters; values are checked when it is made."""

    device: str = "auto"  # "auto": CUDA when available, else CPU
    # "auto": the fused GPU path on CUDA and a bf16/fp16 model, else the reference path.
    backend: str = "auto"
    pass_tokens: int = 32_768  # fused path: tokens per pass (states, counted once, and their rows)
    # None: 1 GiB on CPU; on CUDA the fused path's bank takes a fifth of the GPU, or what the weights and its largest
    # pass leave if less (gpu/memory.py), the reference path's a fifth
    bank_bytes: int | None = None
    row_pass_tokens: int = 16_384
    # fused path: CUDA graphs (kev_backend/gpu/graphs.py) for passes of short rows, new states and extensions, buckets
    # up to graph_max_tokens tokens (136 up to 4,096), at most max_graphs kept. Nothing is captured without CUDA; the
    # reference path never uses them.
    graphs: bool = True
    graph_max_tokens: int = 4096
    max_graphs: int = 136
    # fused path: at start, capture every graph bucket and run each kernel family once (Triton compiles and
    # autotunes), so no request pays for them
    warm: bool = True
    # fused path: the projections' pre-tuned cuBLASLt algorithms (kev_backend/gpu/cublaslt.py): "auto" (a packaged
    # table matching the GPU and cuBLASLt version, if any), "off", or the path of a table JSON
    gemm_algos: str = "auto"
    # Kev's date preprocessing (KEV_DATE_FACTS, protocol/dates.py): each request's state gets the day counts between
    # its dates before it is rendered, in `prepare` and nowhere else on the server
    date_facts: bool = False
    limits: Limits = field(default_factory=Limits)  # truncate_states among them
    load: LoadOptions = field(default_factory=LoadOptions)

    def __post_init__(self) -> None:
        check_table(self.gemm_algos)

    def fused(self) -> FusedOptions:
        """The fused scorer's options: these options' (the request limits' for the longest state and rows)."""
        from ..gpu.scorer import FusedOptions

        return FusedOptions(
            bank_bytes=self.bank_bytes,
            pass_tokens=self.pass_tokens,
            max_state_tokens=self.limits.max_state_tokens,
            max_row_tokens=self.limits.max_row_tokens,
            graphs=self.graphs,
            graph_max_tokens=self.graph_max_tokens,
            max_graphs=self.max_graphs,
            gemm_algos=self.gemm_algos,
        )

    def resolved_bank_bytes(self, device: torch.device) -> int:
        if self.bank_bytes is not None:
            return self.bank_bytes
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device).total_memory // 5
        return 1 << 30

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


@dataclass
class BatchReport:
    """What the last `answer` call did, for metrics and tests."""

    requests: int = 0
    errors: int = 0
    questions: int = 0
    state_tokens: int = 0
    row_tokens: int = 0
    model_ms: float = 0.0


@dataclass
class PreparedBatch:
    """A batch between answer()'s stages: each request's place in `results` holds its RequestError if refused;
    `accepted` the rest, in order; `probabilities` and `report` come from `collect` (after `launch`)."""

    results: list[Result]
    accepted: list[tuple[int, Record, Encoded]] = field(default_factory=list)
    dropped: int = 0  # requests taken out before scoring (cancelled): not counted in the report
    probabilities: list[list[list[float]]] = field(default_factory=list)
    report: BatchReport = field(default_factory=BatchReport)
    # Requests whose response reports each question's own usage (protocol/envelope.py, USAGE_BY_QUESTION).
    usage_by_question: frozenset[int] = frozenset()
    pending: Pending | None = None  # launched, not yet collected
    launched_at: float = 0.0
    # Where each request came from in the bodies the batch was prepared from (a part of them: `part`).
    indices: list[int] = field(default_factory=list)
    # Each accepted request's model work in tokens as estimated when it was prepared (Scorer.work), by its place.
    work: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.indices:
            self.indices = list(range(len(self.results)))

    @property
    def refused(self) -> int:
        return sum(isinstance(r, (RequestError, RequestFault)) for r in self.results)

    def part(self, positions: Sequence[int]) -> PreparedBatch:
        """The requests at `positions` (in this batch) as a batch of their own, scored and answered on its own."""
        local = {i: k for k, i in enumerate(positions)}
        return PreparedBatch(
            results=[self.results[i] for i in positions],
            accepted=[(local[i], record, encoded) for i, record, encoded in self.accepted if i in local],
            usage_by_question=frozenset(local[i] for i in self.usage_by_question if i in local),
            indices=[self.indices[i] for i in positions],
            work={local[i]: w for i, w in self.work.items() if i in local},
        )

    @staticmethod
    def join(batches: Sequence[PreparedBatch]) -> PreparedBatch:
        """The batches' requests, in order, as one batch (none of them launched yet)."""
        joined = PreparedBatch(results=[])
        for batch in batches:
            at = len(joined.results)
            joined.results += batch.results
            joined.accepted += [(at + i, record, encoded) for i, record, encoded in batch.accepted]
            joined.usage_by_question |= {at + i for i in batch.usage_by_question}
            joined.indices += batch.indices
            joined.work.update((at + i, w) for i, w in batch.work.items())
        return joined

    def work_tokens(self, positions: Sequence[int] | None = None) -> int:
        """The estimated model work of the requests at `positions` (default: all) in tokens (`work`)."""
        return sum(self.work[i] for i in (self.work if positions is None else positions) if i in self.work)

    def drop(self, indices: set[int]) -> None:
        """Takes the requests at `indices` out before scoring: their places stay None and they cost no model work."""
        self.accepted = [a for a in self.accepted if a[0] not in indices]
        for i in indices:
            self.results[i] = None
        self.dropped += len(indices)


@dataclass
class Launch:
    """A batch being launched a unit at a time: `step` runs (on a GPU, enqueues) its next unit of model work."""

    batch: PreparedBatch
    units: Generator[None, None, Pending] | None
    steps: int = 0  # units run so far

    @property
    def done(self) -> bool:
        return self.units is None

    def step(self) -> bool:
        """Runs the next unit; True once every unit has (the batch's probabilities are then pending)."""
        if self.units is None:
            return True
        self.steps += 1
        try:
            next(self.units)
        except StopIteration as finished:
            self.batch.pending, self.units = finished.value, None
            return True
        return False

    def finish(self) -> None:
        """Every unit left, at once."""
        while not self.step():
            pass

    def close(self) -> None:
        """Abandons the units left (a failed or cancelled batch): the generator's own cleanup runs now."""
        if self.units is not None:
            self.units.close()
            self.units = None


class Engine:
    def __init__(self, checkpoint: KevCheckpoint, options: EngineOptions | None = None) -> None:
        self.options = options or EngineOptions()
        self.checkpoint = checkpoint
        # Seconds spent per start-up phase (load, build, graphs, warm_batch), logged at model load: the time to ready
        # is their sum plus the server's own start.
        self.startup: dict[str, float] = {}
        started = time.perf_counter()
        self.tokenizer = KevTokenizer(checkpoint.tokenizer_dir)
        self.device = next(checkpoint.model.parameters()).device
        self.backend, self.backend_why = self._choose_backend()
        pad = self.tokenizer.delimiters.pad
        self.stack: dict[str, str] = {}  # the GPU stack the fused path runs on (gpu/stack.py)
        if self.backend == "fused":
            from ..gpu import stack
            from ..gpu.scorer import FusedScorer

            self.scorer: Scorer = FusedScorer(
                checkpoint.model, checkpoint.head, checkpoint.temperature, pad, self.options.fused()
            )
            self.stack = stack.running(self.device)
            if stack.differences(self.stack):
                log.warning("kev: %s", stack.summary(self.stack))
        else:
            self.scorer = ReferenceScorer(
                checkpoint.model,
                checkpoint.head,
                checkpoint.temperature,
                pad,
                PrefixBank(self.options.resolved_bank_bytes(self.device)),
                self.options.row_pass_tokens,
            )
        self.startup["build"] = time.perf_counter() - started
        if self.backend == "fused" and self.options.warm:
            self.warm()
        self.last_batch = BatchReport()

    def _choose_backend(self) -> tuple[str, str]:
        """The path that serves, and why it is the reference path when it is (empty when it is the fused one)."""
        requested = self.options.backend
        if requested not in ("auto", "fused", "reference"):
            raise ValueError(f"unknown backend {requested!r}: auto, fused or reference")
        if requested == "reference":
            return "reference", "backend 'reference' was asked for"
        why = ""
        if self.device.type != "cuda":
            why = f"the device is {self.device}, not CUDA"
        elif requested == "auto" and self.checkpoint.dtype == torch.float32:
            why = "the weights are fp32 (dtype): the fused path runs bf16 or fp16"
        if requested == "fused" and why:
            raise RuntimeError(f"the fused path cannot run: {why}")
        return ("reference", why) if why else ("fused", "")

    def warm(self) -> None:
        """Captures the graph buckets, runs one batch with a short and a long state and question and one with enough
        long states and questions that the chunked delta rule runs in its configuration for many (every kernel
        family and configuration compiles and tunes now, not on a request), and the pointer head at every row count
        up to 512."""
        started = time.perf_counter()
        self.scorer.warm_graphs()
        self.startup["graphs"] = time.perf_counter() - started
        words = ("one two three four five six seven eight nine ten " * 20).strip()
        question = {"type": "choice", "instructions": "Which?", "criteria": {"a": None, "b": None}}
        long_question = {"type": "noul", "instructions": words}
        # Best effort: under limits tighter than these ~200 tokens the long request is refused like any other, and
        # its kernels compile on the first request that needs them.
        started = time.perf_counter()
        self.answer(
            [
                {"state": "a short warm-up state", "questions": {"q": question}},
                {"state": words, "questions": {"q": question, "r": long_question}},
            ]
        )
        if wide := self.scorer.wide_states():
            self.answer([{"state": f"{words} {i}", "questions": {"r": long_question}} for i in range(wide)])
        self.scorer.warm_head()
        self.startup["warm_batch"] = time.perf_counter() - started

    def on_progress(self, beat: Callable[[], None]) -> None:
        """`beat` is called after each unit of model work from now on (a layer of a chunk on the reference path)."""
        self.scorer.on_progress = beat

    def in_flight(self) -> Callable[[], bool] | None:
        """Whether the work enqueued so far on this thread's stream still runs on the device; None on a CPU, where
        every unit has run by the time it returns."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return lambda: not event.query()

    @classmethod
    def from_checkpoint(cls, path: str | Path, options: EngineOptions | None = None) -> Engine:
        options = options or EngineOptions()
        device = options.resolved_device()
        with refusing_out_of_memory(device):
            started = time.perf_counter()
            checkpoint = load_checkpoint(path, device, options.load)
            loaded = time.perf_counter() - started
            engine = cls(checkpoint, options)
        engine.startup = {"load": loaded, **engine.startup}
        return engine

    def summary(self) -> str:
        """One line for the server's log: device, path, the GPU stack, CUDA graphs and the seconds of each start-up
        phase."""
        stats = self.scorer.stats()
        graphed = "no CUDA graphs"
        if stats.graphs is not None:
            graphed = f"{stats.graphs} CUDA graphs ({stats.graph_capture_failures} failed to capture)"
        phases = ", ".join(f"{phase} {seconds:.2f}" for phase, seconds in self.startup.items())
        path = f"{self.backend} path" + (f" ({self.backend_why})" if self.backend_why else "")
        bank = f"{summary}; " if (summary := self.scorer.bank_summary()) else ""
        stack = ""
        if self.stack:
            from ..gpu.stack import summary

            stack = f"{summary(self.stack)}; "
        return (
            f"on {self.device}, {path}; {stack}{graphed}; {bank}{self._gemms()}{self._preparation()}"
            f"start-up seconds {phases}"
        )

    def _gemms(self) -> str:
        """How the fused path's projections run on a GPU, for the start-up line."""
        algos = self.gemm_algos
        if algos is None:
            return ""
        if algos["shapes"]:
            table = f"{algos['shapes']} GEMM shapes on pre-tuned cuBLASLt algorithms ({algos['table']}), the rest"
        elif algos["passed_over"]:
            table = f"GEMMs (no pre-tuned table used: {algos['passed_over']})"
        else:
            table = "GEMMs (no pre-tuned table)"
        return f"{table} on cuBLASLt's choice without split-K; "

    def _preparation(self) -> str:
        """What the server does to states that Kev does only when asked, for the start-up line."""
        limits, said = self.options.limits, []
        if limits.truncate_states:
            said.append(f"states over {limits.max_state_tokens:,} tokens truncated")
        if self.options.date_facts:
            said.append("date facts added to states")
        return "".join(f"{part}; " for part in said)

    @property
    def gemm_algos(self) -> dict[str, object] | None:
        """The pre-tuned cuBLASLt table the fused path uses (kev_backend/gpu/cublaslt.py): its file and shape count,
        and with none in use, the tables passed over and what they were tuned on."""
        stats = self.scorer.stats()
        if stats.gemm_shapes is None:
            return None
        return {"table": stats.gemm_table, "shapes": stats.gemm_shapes, "passed_over": stats.gemm_passed_over}

    @property
    def bank(self):
        return self.scorer.bank

    @property
    def bank_stats(self) -> BankStats:
        return self.scorer.bank.stats

    def prepare(self, body: Body) -> tuple[Record, Encoded]:
        """Validates and encodes one request; raises RequestError with Kev's 422 message."""
        record = parse_request(body, self.options.limits, date_facts=self.options.date_facts)
        return record, encode(record, self.tokenizer, self.options.limits)

    def answer(self, bodies: Sequence[Body]) -> list[Result]:
        """One response body (a dict, Kev 1.0's JSON), RequestError or RequestFault per request, in order."""
        return self.finish(self.score(self.prepare_batch(bodies)))

    # answer() in three stages, so a pipeline (engine/pipeline.py) can run them on different threads: one batch's host
    # work (parsing, tokenizing; answers and their token counts) overlaps another's GPU work. Only `score` touches the
    # model and changes the bank; `prepare_batch` and `finish` read the tokenizer, which is safe to share, and
    # `prepare_batch` looks the bank up for an estimate of each request's work (Scorer.work: dict lookups alone).

    def prepare_batch(self, bodies: Sequence[Body], usage_by_question: Collection[int] = ()) -> PreparedBatch:
        """Validates and encodes each request (host work only); a refused one keeps its RequestError, one that failed
        otherwise its RequestFault. The requests at `usage_by_question` get each question's usage in their response."""
        batch = PreparedBatch(results=[None] * len(bodies), usage_by_question=frozenset(usage_by_question))
        for i, body in enumerate(bodies):
            try:
                record, encoded = self.prepare(body)
                work = self.scorer.work(encoded)
            except RequestError as error:
                batch.results[i] = error
            except Exception as error:  # noqa: BLE001 - one request's fault is its own
                batch.results[i] = RequestFault.of("preparing the request", error)
            else:
                batch.accepted.append((i, record, encoded))
                batch.work[i] = work
        return batch

    def score(self, batch: PreparedBatch) -> PreparedBatch:
        """Runs the model on the batch's accepted requests (none: nothing runs) and records the batch's report."""
        self.launch(batch)
        return self.collect(batch)

    def launch(self, batch: PreparedBatch) -> None:
        """Enqueues the model work of the batch's accepted requests and returns without waiting for the GPU, so the
        next batch can be enqueued behind it (kev_backend/engine/pipeline.py); `collect` waits for the answers."""
        self.start(batch).finish()

    def start(self, batch: PreparedBatch) -> Launch:
        """`launch` a unit of work at a time (Launch.step), for a scheduler that serves other batches between the
        units of a long one."""
        batch.launched_at = time.perf_counter()
        units = self.scorer.units([e for _, _, e in batch.accepted]) if batch.accepted else None
        return Launch(batch, units)

    def collect(self, batch: PreparedBatch) -> PreparedBatch:
        """Waits for a launched batch's probabilities and records its report. model_ms runs from its launch to
        its probabilities on the host: Kev's latency_ms, the model time of the whole batch (with batches enqueued
        back to back, it includes the wait behind the one before)."""
        report = BatchReport(requests=len(batch.results) - batch.dropped, errors=batch.refused)
        if batch.pending is not None:
            batch.probabilities = batch.pending.result()
            batch.pending = None
            report.model_ms = (time.perf_counter() - batch.launched_at) * 1000.0
            encoded = [e for _, _, e in batch.accepted]
            report.questions = sum(len(e.questions) for e in encoded)
            report.state_tokens = sum(len(state) for state in {e.state for e in encoded})
            report.row_tokens = sum(len(q.tokens) for e in encoded for q in e.questions)
        batch.report = self.last_batch = report
        return batch

    def finish(self, batch: PreparedBatch) -> list[Result]:
        """The scored batch's response bodies, with refusals in place (a dropped request's place stays None)."""
        results = list(batch.results)
        answered: list[tuple[int, Record, Encoded, dict]] = []
        for (i, record, encoded), probabilities in zip(batch.accepted, batch.probabilities):
            try:
                answered.append((i, record, encoded, answers_from_probabilities(record, probabilities)))
            except Exception as error:  # noqa: BLE001
                results[i] = RequestFault.of("building the answers", error)
        # Each request's answers, then each question's alone for the requests that report usage by question.
        texts = [answers_json(answers) for *_, answers in answered]
        for i, _, _, answers in answered:
            if i in batch.usage_by_question:
                texts.extend(answers_json({qid: answer}) for qid, answer in answers.items())
        counts = self._count_tokens_of(texts)
        singles = len(answered)
        for (i, record, encoded, answers), tokens in zip(answered, counts):
            by_question: list[int | None] = []
            if i in batch.usage_by_question:
                by_question = counts[singles : singles + len(answers)]
                singles += len(answers)
            if tokens is None or None in by_question:
                results[i] = RequestFault("counting the output tokens failed")
                continue
            body = response_body(
                record.model, answers, encoded.input_tokens, tokens, batch.report.model_ms, self._state_marks(encoded)
            )
            if i in batch.usage_by_question:
                body["usage"]["questions"] = {
                    question.id: {"input_tokens": len(encoded.state) + len(branch.tokens), "output_tokens": count}
                    for question, branch, count in zip(record.questions, encoded.questions, by_question)
                }
            results[i] = body
        return results

    def _count_tokens_of(self, texts: list[str]) -> list[int | None]:
        """Each text's token count (usage.output_tokens), None for a text that could not be counted."""
        try:
            return list(self.tokenizer.count_tokens_batch(texts))
        except Exception:  # noqa: BLE001 - find the one text at fault
            return [self._count_tokens(text) for text in texts]

    def _state_marks(self, encoded: Encoded) -> tuple[int, int] | None:
        """(whole state, state read) in tokens for a server that truncates states: it marks every response."""
        return (encoded.state_tokens, len(encoded.state)) if self.options.limits.truncate_states else None

    def _count_tokens(self, text: str) -> int | None:
        try:
            return self.tokenizer.count_tokens(text)
        except Exception as error:  # noqa: BLE001
            RequestFault.of("counting the output tokens", error)
            return None


def dumps(body: dict) -> str:
    """The response as FastAPI's JSONResponse renders it."""
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
