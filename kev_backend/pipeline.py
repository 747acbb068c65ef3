"""answer() as a three-stage pipeline over one engine, so one batch's host work overlaps another's GPU work.

The caller's thread prepares a batch (parsing, Kev's limits, tokenizing) and hands it over; a model thread scores
batches one at a time (the only thread that touches the model and the bank); a delivery thread builds their answers
and hands them to each batch's callback. While the GPU runs batch N, batch N+1 is being prepared and batch N-1's
answers built: on the H200 a busy short6 batch of 32 spent ~24 ms of its 151 ms in Triton's execute outside the
model, all of it serial with the GPU before (bench/NOTES.md, session 5).

When `submit` returns decides how many batches are in flight, and so how large they grow: its caller (Triton's
execute; the bench's batching thread) forms the next batch from the requests waiting by then. Returning as soon as
the model thread takes a batch splits the clients into three groups (scoring, prepared and waiting, arriving), and
at 64 short6 clients batches of ~21 instead of ~32 lost more than the overlap gained (H200, 228 against 236
req/s in process). So `submit` returns when the next batch, formed and prepared from then on, should reach the
model thread just as this one finishes: the recent scoring time less the recent time from a return to the next
batch's arrival (Triton's batching, its IPC, decoding and preparing). Requests keep waiting where they arrived
(Triton's queue, with its size limit and timeouts) meanwhile.

A batch that waited for the model thread `recheck_after_s` (5 ms) or longer asks again, just before scoring,
which of its requests no longer want answers (`Job.cancelled`) and drops them: they cost no model work. (Triton
answers each `is_cancelled` through its IPC; asking for every request of every batch would cost the model thread
milliseconds per batch, and the caller has just asked.)

An engine fault fails only its own batch, delivered as the exception.
"""

from __future__ import annotations

import logging
import queue
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .engine import Body, Engine, PreparedBatch
from .systemone import RequestError

Results = list[dict | RequestError | None]
log = logging.getLogger(__name__)


@dataclass
class Job:
    batch: PreparedBatch
    # Called on the delivery thread with the results (a dropped request's place is None) or the engine's exception.
    deliver: Callable[[Results | Exception, PreparedBatch], None]
    # Called on the model thread just before scoring: the indices of requests to drop (cancelled meanwhile).
    cancelled: Callable[[], set[int]] | None = None
    queued: float = field(default_factory=time.perf_counter)
    error: Exception | None = field(default=None)
    scored: threading.Event = field(default_factory=threading.Event)  # set once the model thread is done with it


_STOP = object()


class Recent:
    """The median of the last few values: one idle pause or one odd batch does not move it. One thread adds, another
    reads."""

    def __init__(self, size: int = 8) -> None:
        self.values: deque[float] = deque(maxlen=size)
        self.lock = threading.Lock()

    def add(self, value: float) -> None:
        with self.lock:
            self.values.append(value)

    def median(self) -> float | None:
        with self.lock:
            return statistics.median(self.values) if self.values else None


class Pipeline:
    def __init__(self, engine: Engine, recheck_after_s: float = 0.005) -> None:
        self.engine = engine
        self.recheck_after_s = recheck_after_s
        self.scoring_s = Recent()  # model thread: from taking a batch to having scored it
        self.arrival_s = Recent()  # from submit returning to the next batch being prepared
        self._returned: float | None = None
        self._to_model: queue.Queue = queue.Queue(maxsize=1)
        self._to_delivery: queue.Queue = queue.Queue(maxsize=1)
        self._threads = [
            threading.Thread(target=self._model_loop, name="kev-model", daemon=True),
            threading.Thread(target=self._delivery_loop, name="kev-delivery", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def submit(
        self,
        bodies: Sequence[Body],
        deliver: Callable[[Results | Exception, PreparedBatch], None],
        cancelled: Callable[[], set[int]] | None = None,
    ) -> None:
        """Prepares the batch on this thread, hands it to the model thread, and returns once the next batch, formed
        from now on, would arrive about when this one is scored (or once it is, or at once without a history)."""
        job = Job(self.engine.prepare_batch(bodies), deliver, cancelled)
        if self._returned is not None:
            self.arrival_s.add(time.perf_counter() - self._returned)
        self._to_model.put(job)
        self._to_model.join()  # taken: the model thread is on it
        scoring, arrival = self.scoring_s.median(), self.arrival_s.median()
        if scoring is not None:
            job.scored.wait(timeout=max(0.0, scoring - (arrival or 0.0)))
        self._returned = time.perf_counter()

    def close(self) -> None:
        """Finishes the queued batches, then stops the threads."""
        self._to_model.put(_STOP)
        for thread in self._threads:
            thread.join()

    def _model_loop(self) -> None:
        while (job := self._to_model.get()) is not _STOP:
            self._to_model.task_done()
            started = time.perf_counter()
            try:
                if job.cancelled is not None and started - job.queued >= self.recheck_after_s:
                    if dropped := job.cancelled():
                        job.batch.drop(dropped)
                if len(job.batch.results) > job.batch.dropped:  # not everyone dropped out
                    self.engine.score(job.batch)
            except Exception as error:  # noqa: BLE001 - one batch's fault goes to its own requests
                log.exception("kev: batch failed")
                job.error = error
            self.scoring_s.add(time.perf_counter() - started)
            job.scored.set()
            self._to_delivery.put(job)
        self._to_delivery.put(_STOP)

    def _delivery_loop(self) -> None:
        while (job := self._to_delivery.get()) is not _STOP:
            try:
                results: Results | Exception = job.error or self.engine.finish(job.batch)
            except Exception as error:  # noqa: BLE001
                log.exception("kev: answers failed")
                results = error
            try:
                job.deliver(results, job.batch)
            except Exception:  # noqa: BLE001 - a failing callback must not stop the pipeline
                log.exception("kev: delivery failed")
