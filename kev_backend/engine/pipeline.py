"""answer() as a three-stage pipeline over one engine, so one batch's host work overlaps another's GPU work.

The caller's thread prepares a batch (parsing, Kev's limits, tokenizing) and hands it over; a model thread launches
batches one at a time (the only thread that touches the model and the bank): it enqueues the batch's passes and
head on the GPU and returns without waiting for them (Engine.launch); a delivery thread waits for each batch's
probabilities (Engine.collect, the GIL released), builds their answers and hands them to the batch's callback.
So the next batch's host work before its first kernel (planning, bank slots, layout, uploads) and its launches run
while the GPU still works on this one, and the GPU need not idle between batches. While the GPU runs batch N, batch
N+1 is being prepared or enqueued and batch N-1's answers built.

When `submit` returns decides how many batches are in flight, and so how large they grow: its caller (Triton's
execute; the bench's batching thread) forms the next batch from the requests waiting by then. Returning as soon as
the model thread takes a batch splits the clients into three groups (scoring, prepared and waiting, arriving), and
the smaller batches lose more than the overlap gains (docs/kernels.md, The pipeline). So `submit` returns when the
next batch, formed and prepared from then on, should reach the model thread just as this one is done: this one is
expected done a service time after it was taken or after the batch before it is done, whichever is later (recent
medians), and the next batch's arrival takes the recent time from a return to the next batch being prepared
(Triton's batching, its IPC, decoding and preparing). Requests keep waiting where they arrived (Triton's queue, with
its size limit and timeouts) meanwhile.

A batch goes to the model thread in parts of at most `part_tokens` of model work (a pass's worth), each answered
once scored, so the first part's clients are back and prepared while the later parts run. A request's work is
estimated when it is prepared, from the bank as it is then (Scorer.work): a turn that continues a banked point costs
what it computes, so dozens of grown conversations share a part that a byte count would have split six ways.

Long work (engine/scheduler.py): once prepared, each request with more than `long_tokens` tokens of estimated model
work becomes a batch of its own, scheduled as long, and the rest of its Triton batch goes in normal parts. The model
thread runs batches a unit at a time (a chunk of a state on the CPU, a pass on the GPU) and takes new batches between
units, so a short request waits for at most one unit of long work, however long the long request. `submit` waits
only on its normal batch: long batches are handed over without waiting, and a request over PREPARE_APART_BYTES of
JSON is prepared on a thread of its own, so the next Triton batch is formed while they are tokenized and run.

A batch that waited for its first unit `recheck_after_s` (5 ms) or longer asks again, just before scoring,
which of its requests no longer want answers (`Job.cancelled`, asked about that batch's requests only: a request
of another batch may be answered already, and Triton cannot be asked about a request it has its answer for) and
drops them: they cost no model work. (Triton answers each `is_cancelled` through its IPC; asking for every request
of every batch would cost the model thread milliseconds per batch, and Triton's batcher has just asked.)

An engine fault fails only its own batch, delivered as the exception.
"""

from __future__ import annotations

import logging
import math
import queue
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ..protocol.request import RequestError
from .engine import Body, Engine, Launch, PreparedBatch, unrecoverable
from .scheduler import LONG_WORK_TOKENS, Scheduler

Results = list[dict | RequestError | None]
log = logging.getLogger(__name__)


@dataclass(eq=False)
class Job:
    batch: PreparedBatch
    # Called on the delivery thread with the results (a dropped request's place is None) or the engine's exception;
    # the batch's `indices` say which of the submitted bodies they answer.
    deliver: Callable[[Results | Exception, PreparedBatch], None]
    # Called on the model thread just before scoring, with the batch's own bodies' indices (of those submitted): which
    # of them to drop (cancelled). It is never asked about a body another batch holds, which may be answered already.
    cancelled: Callable[[Collection[int]], set[int]] | None = None
    long: bool = False  # scheduled as long work (engine/scheduler.py)
    launch: Launch | None = None  # its units, once the model thread has started it
    queued: float = field(default_factory=time.perf_counter)
    taken: float = 0.0  # when the model thread took it
    expected_done: float = 0.0  # when submit expects its answers on the host
    done: float = 0.0  # when they were
    launched: bool = False  # the model thread launched it (every request refused or dropped: it runs nothing)
    error: Exception | None = field(default=None)
    scored: threading.Event = field(default_factory=threading.Event)  # set once its answers are on the host


_STOP = object()
# How long the model thread waits for a new batch while its only work is a long unit still running on the device.
GATED_WAIT_S = 0.0005
# Before a long unit, how long the model thread waits for the normal batch its caller is handing over: twice the recent
# time from a submit returning to the next batch arriving, within these bounds.
AWAIT_MIN_S = 0.002
AWAIT_MAX_S = 0.1


class Progress(Protocol):
    """Who hears of the model's progress (kev-serve's heartbeat, kev_backend/serve/stub/heartbeat.py): a batch taken by
    the model thread, a unit of its work done, a batch answered, and an engine that can no longer answer."""

    def started(self) -> None: ...

    def beat(self) -> None: ...

    def finished(self) -> None: ...

    def broken(self) -> None: ...


class Guarded:
    """A Progress whose failures are logged, never raised: hearing of progress must not stop the model's work."""

    def __init__(self, progress: Progress) -> None:
        self.inner = progress
        self.failures = 0

    def _call(self, method: Callable[[], None]) -> None:
        try:
            method()
        except Exception:  # noqa: BLE001
            self.failures += 1
            if self.failures == 1:
                log.exception("kev: reporting progress failed (logged once)")

    def started(self) -> None:
        self._call(self.inner.started)

    def beat(self) -> None:
        self._call(self.inner.beat)

    def finished(self) -> None:
        self._call(self.inner.finished)

    def broken(self) -> None:
        self._call(self.inner.broken)


class NoProgress:
    def started(self) -> None:
        pass

    def beat(self) -> None:
        pass

    def finished(self) -> None:
        pass

    def broken(self) -> None:
        pass


# Parts: the model thread gets a batch in parts, each answered once scored. Why: under closed-loop load of long requests
# a large batch alternates with a batch of one, and the large batch's clients come back together: the GPU idles while
# they are tokenized and planned. In parts, the first part's clients are back and prepared while the later parts run
# (docs/kernels.md, The pipeline). A part holds at most the engine's pass budget of estimated work (`part_tokens`, by
# default EngineOptions.pass_tokens), so it is one pass: up to 12 long5 requests (~2,600 tokens each), 64 short6 (~250),
# or ~50 turns of conversations near 8k tokens that continue their banked points (~650 each, weighted by the prefix).
# A request holding more JSON than this is prepared (parsed, tokenized) on the pipeline's preparation thread, on its
# own, so the caller hands the rest of its batch over and returns at once.
PREPARE_APART_BYTES = 64 << 10
DELIVERY_WAITING = 8
# Long batches handed to the model thread and not yet answered, at most; past it the caller (or the preparation thread)
# waits for a place, and requests wait where they arrived (Triton's bounded queue).
LONG_WAITING = 64


def part_ends(sizes: Sequence[int], work: Iterable[int], budget: int) -> Iterator[int]:
    """Where consecutive parts of items end (exclusive), each holding at most `budget` of work (an item over it: a
    part of its own), as even as the fewest parts allow: 20 items of 16 under a budget of 256 make two parts of 10,
    not 16 and 4. Each item's work is known only once it is reached (`work` yields it as the item is prepared), so
    the whole's is estimated from the sizes (bytes of JSON) at the work per size seen so far. Each end is yielded as
    soon as it is known, before the next item's work is asked for."""
    total_size = sum(max(1, size) for size in sizes)
    seen_size, seen_work, held = 0, 0, 0
    for i, (size, cost) in enumerate(zip(sizes, work, strict=True)):
        if held and held + cost > budget:
            yield i
            held = 0
        held += cost
        seen_size, seen_work = seen_size + max(1, size), seen_work + cost
        total = seen_work * total_size / seen_size  # the whole's work, estimated
        if held and held >= total / max(1, math.ceil(total / budget)) and i + 1 < len(sizes):
            yield i + 1
            held = 0
    if sizes:
        yield len(sizes)


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
    def __init__(
        self,
        engine: Engine,
        recheck_after_s: float = 0.005,
        part_tokens: int | None = None,
        progress: Progress | None = None,
        long_tokens: int = LONG_WORK_TOKENS,
    ) -> None:
        self.part_tokens = engine.options.pass_tokens if part_tokens is None else part_tokens
        if self.part_tokens < 1:
            raise ValueError(f"part_tokens must be at least 1, not {self.part_tokens}")
        self.engine = engine
        self.long_tokens = long_tokens
        self.progress = Guarded(progress or NoProgress())
        engine.on_progress(self.progress.beat)
        self.recheck_after_s = recheck_after_s
        # A batch's service time: from when it was taken, or when the batch before it was done if later, to its
        # answers on the host.
        self.service_s = Recent()
        self.arrival_s = Recent()  # from submit returning to the next batch being prepared
        self._returned: float | None = None
        self._submitting = 0  # submits under way (the caller's thread)
        self._previous: Job | None = None  # the last batch submitted
        self._last_done = 0.0  # delivery thread: when the last batch was done
        # To the model thread: a normal batch is put and joined (the caller waits until it is taken); long ones are
        # put and not waited on, at most LONG_WAITING not yet finished (then the putter waits for a place).
        self._to_model: queue.Queue = queue.Queue()
        self._long_places = threading.BoundedSemaphore(LONG_WAITING)
        # Batches whose work is all enqueued, waiting for the delivery thread: a few, so the model thread keeps taking
        # and enqueueing normal batches while the delivery thread waits on a long unit's answers.
        self._to_delivery: queue.Queue = queue.Queue(maxsize=DELIVERY_WAITING)
        # Large requests, prepared on their own thread (tokenizing a 65,536-token state is about a second on a CPU).
        self._to_preparer: queue.Queue = queue.Queue(maxsize=LONG_WAITING)
        self._threads = [
            threading.Thread(target=self._model_loop, name="kev-model", daemon=True),
            threading.Thread(target=self._delivery_loop, name="kev-delivery", daemon=True),
            threading.Thread(target=self._preparer_loop, name="kev-prepare", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def submit(
        self,
        bodies: Sequence[Body],
        deliver: Callable[[Results | Exception, PreparedBatch], None],
        cancelled: Callable[[Collection[int]], set[int]] | None = None,
        usage_by_question: Collection[int] = (),
        requests: Sequence[range] | None = None,
    ) -> None:
        """Prepares the batch on this thread and hands it to the model thread in parts (`parts`: each delivered once
        scored), and returns once the next batch, formed from now on, would arrive about when its last part is scored
        (or once it is, or at once without a history). `usage_by_question`: the bodies whose responses report each
        question's usage (Engine.prepare_batch). `requests`: the bodies answered together, one range each (a Triton
        request may carry several; default: each body alone); a request with more than `long_tokens` of estimated
        work is delivered on its own, as long work."""
        self._submitting += 1
        try:
            self._submit(bodies, deliver, cancelled, usage_by_question, requests)
        finally:
            self._submitting -= 1
            self._returned = time.perf_counter()

    def _submit(
        self,
        bodies: Sequence[Body],
        deliver: Callable[[Results | Exception, PreparedBatch], None],
        cancelled: Callable[[Collection[int]], set[int]] | None,
        usage_by_question: Collection[int],
        requests: Sequence[range] | None,
    ) -> None:
        if self._returned is not None:
            self.arrival_s.add(time.perf_counter() - self._returned)
        requests = requests if requests is not None else [range(i, i + 1) for i in range(len(bodies))]
        small, large = self.by_size(bodies, requests)
        usage = frozenset(usage_by_question)
        for request in large:  # prepared and handed over by the preparation thread, not this one
            self._to_preparer.put((bodies, [request], usage, deliver, cancelled))
        job = None
        service, arrival = self.service_s.median(), self.arrival_s.median()
        for part, long in self.parts(bodies, small, usage):
            new = Job(part, deliver, cancelled, long)
            self._hand_over(new)
            if not long:
                job = new
                self._expect(job, service)
        if job is None:  # long work only: the next Triton batch may form now
            return
        if service is not None:
            job.scored.wait(timeout=max(0.0, job.expected_done - (arrival or 0.0) - time.perf_counter()))

    def _expect(self, job: Job, service: float | None) -> None:
        """When a normal batch just taken is expected done: a service time after it was taken or after the batch before
        it (of this submit or an earlier one) is done, whichever is later: its work is queued behind that one's."""
        previous, self._previous = self._previous, job
        if service is None:
            return
        before = 0.0
        if previous is not None:
            before = previous.done if previous.scored.is_set() else previous.expected_done
        job.expected_done = max(job.taken, before) + service

    @staticmethod
    def by_size(bodies: Sequence[Body], requests: Sequence[range]) -> tuple[list[range], list[range]]:
        """The requests with at most PREPARE_APART_BYTES of JSON, prepared on the caller's thread, and the larger ones,
        each prepared on the preparation thread: tokenizing a 65,536-token state takes about a second on a CPU, and
        the caller (Triton's execute) forms no new batch meanwhile."""
        small: list[range] = []
        large: list[range] = []
        for request in requests:
            (small if Pipeline.size(bodies, request) <= PREPARE_APART_BYTES else large).append(request)
        return small, large

    @staticmethod
    def size(bodies: Sequence[Body], request: range) -> int:
        """The request's bytes of JSON (0 for bodies given as objects)."""
        return sum(len(body) for i in request if isinstance(body := bodies[i], (str, bytes)))

    def parts(
        self, bodies: Sequence[Body], requests: Sequence[range], usage: frozenset[int]
    ) -> Iterator[tuple[PreparedBatch, bool]]:
        """The requests, prepared one at a time, as the model thread runs them, each with whether it is long: a
        request with more than `long_tokens` of estimated work alone, the rest in parts of at most `part_tokens`
        (part_ends), each yielded as soon as it is complete, so it runs while the next is prepared."""
        prepared: list[tuple[PreparedBatch, bool]] = []

        def work() -> Iterator[int]:
            for request in requests:
                batch = self.prepared(bodies, request, usage)
                cost = batch.work_tokens()
                long = cost > self.long_tokens
                prepared.append((batch, long))
                yield 0 if long else cost

        sizes = [self.size(bodies, request) for request in requests]
        start = 0
        for end in part_ends(sizes, work(), self.part_tokens):
            normal = [batch for batch, long in prepared[start:end] if not long]
            if normal:
                yield PreparedBatch.join(normal), False
            yield from ((batch, True) for batch, long in prepared[start:end] if long)
            start = end

    def prepared(self, bodies: Sequence[Body], request: range, usage: frozenset[int]) -> PreparedBatch:
        """The bodies of `request` prepared as one batch (whose `indices` are their places in `bodies`)."""
        usage_here = [k for k, i in enumerate(request) if i in usage]
        batch = self.engine.prepare_batch([bodies[i] for i in request], usage_here)
        batch.indices = list(request)
        return batch

    def _hand_over(self, job: Job) -> None:
        """To the model thread: a normal batch once it is taken (the caller's pace follows the model's); long work at
        once, unless LONG_WAITING long batches are already waiting or under way."""
        if job.long:
            self._long_places.acquire()
            self._to_model.put(job)
        else:
            self._to_model.put(job)
            self._to_model.join()  # taken: the model thread is on it

    def _preparer_loop(self) -> None:
        while (item := self._to_preparer.get()) is not _STOP:
            bodies, requests, usage, deliver, cancelled = item
            try:
                parts = list(self.parts(bodies, requests, usage))
            except Exception as error:  # noqa: BLE001 - one request's fault goes to it alone
                log.exception("kev: preparing a large request failed")
                batch = PreparedBatch(results=[None] * len(requests[0]), indices=list(requests[0]))
                deliver(error, batch)
                continue
            for part, long in parts:
                self._hand_over(Job(part, deliver, cancelled, long))

    def close(self) -> None:
        """Finishes the queued batches, then stops the threads."""
        model, delivery, preparer = self._threads
        self._to_preparer.put(_STOP)
        preparer.join()
        self._to_model.put(_STOP)
        model.join()
        delivery.join()

    def _model_loop(self) -> None:
        scheduler: Scheduler[Job] = Scheduler()
        stopping = awaited = False
        while True:
            if not stopping:
                stopping = self._take(scheduler)
            job = scheduler.next()
            if job is not None and job.long and not awaited and not stopping:
                # Before a long unit, once: the normal batch the caller is preparing (or about to) gets its turn.
                awaited = True
                if self._await_batch(scheduler):
                    continue
            if job is not None:
                awaited = awaited and not job.long
                self._step(job, scheduler)
            elif not len(scheduler) and stopping:
                break
            elif stopping:  # only long work left, its last unit still on the device
                time.sleep(GATED_WAIT_S)
        self._to_delivery.put(_STOP)

    def _take(self, scheduler: Scheduler[Job]) -> bool:
        """Moves the batches handed over so far into the scheduler, waiting for one when there is nothing to run (or
        briefly, when only long work is left and its last unit still runs on the device); True once told to stop."""
        if not len(scheduler):
            wait: float | None = None
        else:
            wait = 0.0 if scheduler.next() is not None else GATED_WAIT_S
        while True:
            try:
                job = self._to_model.get_nowait() if wait == 0.0 else self._to_model.get(timeout=wait)
            except queue.Empty:
                return False
            self._to_model.task_done()
            if job is _STOP:
                return True
            self._admit(job, scheduler)
            wait = 0.0

    def _admit(self, job: Job, scheduler: Scheduler[Job]) -> None:
        job.taken = time.perf_counter()
        self.progress.started()
        scheduler.add(job)

    def _await_batch(self, scheduler: Scheduler[Job]) -> bool:
        """Waits, briefly, for the batch a submit under way (or one just returned, whose caller forms the next) is
        handing over; True if one came, with its turn before the long work."""
        deadline = time.perf_counter() + AWAIT_MAX_S
        grace = min(AWAIT_MAX_S, max(AWAIT_MIN_S, 2 * (self.arrival_s.median() or 0.0)))
        while (now := time.perf_counter()) < deadline:
            returned = self._returned
            if not self._submitting and (returned is None or now - returned > grace):
                return False
            try:
                job = self._to_model.get(timeout=min(AWAIT_MIN_S, deadline - now))
            except queue.Empty:
                continue
            self._to_model.task_done()
            if job is _STOP:
                self._to_model.put(_STOP)  # seen again by _take
                return False
            self._admit(job, scheduler)
            if not job.long:
                scheduler.grant()
            return True
        return False

    def _step(self, job: Job, scheduler: Scheduler[Job]) -> None:
        """Runs (on a GPU, enqueues) the job's next unit; hands it to the delivery thread once it has run its last."""
        try:
            if job.launch is None:
                self._drop_cancelled(job)
                job.launch = self.engine.start(job.batch)
            done = job.launch.step()
            scheduler.ran(job, self.engine.in_flight() if job.long else None)
            self.progress.beat()
        except Exception as error:  # noqa: BLE001 - one batch's fault goes to its own requests
            self._failed(job, error)
            if job.launch is not None:
                job.launch.close()
            scheduler.ran(job)
            done = True
        if done:
            job.launched = job.error is None and len(job.batch.results) > job.batch.dropped
            scheduler.finished(job)
            self._to_delivery.put(job)  # blocks while DELIVERY_WAITING wait for the delivery thread already

    def _drop_cancelled(self, job: Job) -> None:
        """Takes the requests whose clients left out of a batch that waited, before any of its work. It waited from its
        hand-over to now: the model thread takes batches between units, so a batch may wait in the scheduler, behind
        the batches before it, long after it was taken."""
        if job.cancelled is None or time.perf_counter() - job.queued < self.recheck_after_s:
            return
        local = {index: k for k, index in enumerate(job.batch.indices)}
        if dropped := {local[i] for i in job.cancelled(job.batch.indices) if i in local}:
            job.batch.drop(dropped)

    def _delivery_loop(self) -> None:
        while (job := self._to_delivery.get()) is not _STOP:
            if job.error is None and job.launched:
                try:
                    self.engine.collect(job.batch)  # waits for the GPU (the GIL released); the batch's report
                except Exception as error:  # noqa: BLE001 - a fault surfacing at the sync fails its own batch
                    self._failed(job, error)
            job.done = time.perf_counter()
            if not job.long:  # the pace `submit` keeps is the normal batches'
                self.service_s.add(job.done - max(job.taken, self._last_done))
                self._last_done = job.done
            job.scored.set()
            try:
                results: Results | Exception = job.error or self.engine.finish(job.batch)
            except Exception as error:  # noqa: BLE001
                log.exception("kev: answers failed")
                results = error
            try:
                job.deliver(results, job.batch)
            except Exception:  # noqa: BLE001 - a failing callback must not stop the pipeline
                log.exception("kev: delivery failed")
            if job.long:
                self._long_places.release()
            self.progress.finished()

    def _failed(self, job: Job, error: Exception) -> None:
        log.exception("kev: batch failed")
        job.error = error
        if unrecoverable(error):
            self.progress.broken()
