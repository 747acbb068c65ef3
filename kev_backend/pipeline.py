"""answer() as a three-stage pipeline over one engine, so one batch's host work overlaps another's GPU work.

The caller's thread prepares a batch (parsing, Kev's limits, tokenizing) and hands it over; a model thread scores
batches one at a time (the only thread that touches the model and the bank); a delivery thread builds their answers
and hands them to each batch's callback. While the GPU runs batch N, batch N+1 is being prepared and batch N-1's
answers built: on the H200 a busy short6 batch of 32 spent ~24 ms of its 151 ms in Triton's execute outside the
model, all of it serial with the GPU before (bench/NOTES.md, session 5).

`submit` returns once the model thread has taken the batch, so at most one prepared batch waits for the GPU and
new requests keep waiting where they arrived (Triton's queue, with its size limit and timeouts; the bench's inbox),
forming the next batch meanwhile. (Returning as soon as the batch is queued would put one more batch in flight and
split the same clients into smaller batches.) Just before scoring, a batch may drop requests that no longer want
answers (`Job.cancelled`): they cost no model work. An engine fault fails only its own batch, delivered as the
exception.
"""

from __future__ import annotations

import logging
import queue
import threading
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
    error: Exception | None = field(default=None)


_STOP = object()


class Pipeline:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
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
        """Prepares the batch on this thread and returns once the model thread has taken it."""
        self._to_model.put(Job(self.engine.prepare_batch(bodies), deliver, cancelled))
        self._to_model.join()

    def close(self) -> None:
        """Finishes the queued batches, then stops the threads."""
        self._to_model.put(_STOP)
        for thread in self._threads:
            thread.join()

    def _model_loop(self) -> None:
        while (job := self._to_model.get()) is not _STOP:
            self._to_model.task_done()  # submit() returns: its caller may form the next batch
            try:
                if job.cancelled is not None:
                    if dropped := job.cancelled():
                        job.batch.drop(dropped)
                if len(job.batch.results) > job.batch.dropped:  # not everyone dropped out
                    self.engine.score(job.batch)
            except Exception as error:  # noqa: BLE001 - one batch's fault goes to its own requests
                log.exception("kev: batch failed")
                job.error = error
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
