"""Triton Python-backend adapter for Kev: one System One JSON request per REQUEST element, Kev 1.0's response JSON
per RESPONSE element. Each batch goes to the engine, in parts of a pass's work, through a pipeline that overlaps
batches' host and GPU work (kev_backend/engine/pipeline.py).

Every request gets exactly one response, whatever happens to its neighbours: a request Kev refuses gets INVALID_ARG
with Kev's message, a fault while preparing or answering one request gets INTERNAL for that request alone, a
cancelled one CANCELLED, and an engine fault INTERNAL for the requests of its batch. Each is counted by reason in
`kev_request_errors_total`.
"""

import json
import threading
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

# kev_backend (torch with it) is imported where it is first used, not here: at model load Triton's python backend
# first imports this file in a short-lived auto-complete stub of its own, where torch's import was 3-4 s of the time
# to ready (H200 and CPU alike); the instance's stub imports it once, in initialize.


def error_response(message, code):
    from kev_backend.protocol.request import printable

    # A message quoting the request may hold text UTF-8 cannot encode; the stub could not send it at all.
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(printable(message), code))


class TritonPythonModel:
    """The model `kev`. Input REQUEST: TYPE_STRING [n, 1] per request, each element one System One request (JSON).
    Output RESPONSE: TYPE_STRING [n, 1], each element Kev 1.0's response body (JSON) for the element at its place. A
    request fails as a whole, naming the element (REQUEST[j]) when it carries several: INVALID_ARG for a request Kev
    refuses, INTERNAL for a fault, CANCELLED when its client left. `max_batch_size` and the batcher come from
    config.pbtxt."""

    def initialize(self, args):
        from kev_backend.engine.pipeline import Pipeline
        from kev_backend.serve.stub.heartbeat import Heartbeat
        from kev_backend.serve.stub.metrics import KevMetrics, SupervisorMetrics
        from kev_backend.serve.stub.provenance import BuildInfo
        from kev_backend.settings import ModelSettings, parameters, use_cuda_allocator

        use_cuda_allocator()  # before the weights take the GPU: a plain tritonserver sets none
        config = json.loads(args["model_config"])
        settings = ModelSettings.read(parameters(config), Path(args["model_repository"]))
        self.engine = load_engine(settings, args)
        labels = {"model": args["model_name"], "instance": args["model_instance_name"]}
        self.metrics = KevMetrics(pb_utils, labels)
        warmed = warm_up(self.engine, self.metrics, settings, config)
        self.heartbeat = Heartbeat.for_instance(settings.heartbeat_prefix, args["model_instance_name"])
        self.supervisor_metrics = SupervisorMetrics(pb_utils, settings.heartbeat_prefix)
        self.pipeline = Pipeline(self.engine, part_tokens=settings.part_tokens, progress=self.heartbeat)
        self.build_info = BuildInfo(pb_utils, labels, self.engine, settings.checkpoint)
        pb_utils.Logger.log_info(
            f"kev: {settings.checkpoint}; {warmed} warm-up requests; {self.engine.summary()}; {self.build_info.line()}"
        )
        self.build_info.hash_in_background(pb_utils.Logger.log_info)
        if self.engine.backend == "reference" and gpu_visible():
            pb_utils.Logger.log_warn(
                f"kev: WARNING: a GPU is visible but the slow fp32 reference path serves: {self.engine.backend_why}"
            )

    def execute(self, requests):
        # Responses go out through each request's sender once the pipeline has answered (execute returns None, so
        # Triton hands over the next batch while this one is on the GPU). A request cancelled while queued costs no
        # model work: Triton's batcher answers it CANCELLED before any batch takes it, and a batch that waits in the
        # pipeline asks again before it is scored. Asking here too would cost an IPC round trip a request on the
        # thread that forms the next batch, for the microseconds since the batcher asked.
        bodies, senders = [], []
        for request in requests:
            sender = Sender(request.get_response_sender(), self.metrics)
            try:  # a malformed BYTES tensor fails here, for this request alone
                items = pb_utils.get_input_tensor_by_name(request, "REQUEST").as_numpy().reshape(-1)
            except Exception as error:  # noqa: BLE001
                message = f"REQUEST could not be read: {error}"
                sender.fail(message, pb_utils.TritonError.INVALID_ARG, "invalid", status=400)
                continue
            try:
                read_parameters(request, sender)
            except ValueError as error:
                sender.fail(str(error), pb_utils.TritonError.INVALID_ARG, "invalid", status=400)
                continue
            bodies.append(items)
            senders.append(sender)
        # A request may carry several JSON strings (batch dim n > 1); all are scored together. The pipeline runs a
        # large batch in parts (whole requests each), each answered once scored.
        if bodies:
            self._submit(bodies, senders)
        return None

    def _submit(self, bodies, senders):
        """Scores the requests' bodies (one list per request) through the pipeline; answers through their senders.
        The pipeline answers them in parts (a long request on its own): each part's callback answers its own."""
        spans, owner, start = [], {}, 0
        for s, items in enumerate(bodies):
            spans.append(range(start, start + len(items)))
            owner.update(dict.fromkeys(spans[-1], s))
            start += len(items)

        keys = {j: sender.key for sender, span in zip(senders, spans) if sender.key is not None for j in span}

        def cancelled(indices):
            # Only the asking batch's requests: another part's may be answered, its sender spent.
            asked = {owner[i] for i in indices}
            return {j for s in asked if senders[s].is_cancelled() for j in spans[s]}

        def deliver(results, batch):
            # The requests this part answers (every request when the batch never reached the model).
            mine = range(len(senders)) if batch is None else sorted({owner[i] for i in batch.indices})
            try:
                if isinstance(results, Exception):  # an engine fault fails this part's requests; the server goes on
                    pb_utils.Logger.log_error(f"kev: batch failed: {results!r}")
                    message = f"kev engine error: {type(results).__name__}: {results}"
                    for s in mine:
                        senders[s].fail(message, pb_utils.TritonError.INTERNAL, "engine_error")
                    return
                at = {index: k for k, index in enumerate(batch.indices)}
                for s in mine:
                    senders[s].answer([results[at[j]] for j in spans[s]])
                # Counted once the answers are on their way: each metric update is a round trip to Triton's side of
                # the backend (0.4 ms a batch on a 2-core CPU host), which would otherwise delay every answer of the
                # batch. A client reading the metrics just after its answer may see its batch a moment later.
                try:
                    if batch.report.requests:
                        self.metrics.record(self.engine, batch.report)
                    tokens = [encoded.input_tokens for _, _, encoded in batch.accepted]
                    self.metrics.record_requests([senders[s].answered_ms for s in mine], tokens)
                    count_state_keys(self.metrics, keys, batch)
                except Exception as error:  # noqa: BLE001 - counting must never cost an answer
                    pb_utils.Logger.log_error(f"kev: batch metrics not recorded: {error!r}")
            finally:  # whatever failed above, no request is left without its one response
                for s in mine:
                    senders[s].fail("kev internal error: the request was not answered", pb_utils.TritonError.INTERNAL)

        usage = [j for sender, span in zip(senders, spans) if sender.usage_by_question for j in span]
        flat = [body for items in bodies for body in items]
        try:
            self.pipeline.submit(flat, deliver, cancelled, usage, spans)
        except Exception as error:  # noqa: BLE001 - the batch never reached the model: fail its requests, go on
            deliver(error, None)

    def finalize(self):
        self.pipeline.close()
        self.heartbeat.close()
        self.supervisor_metrics.close()


def load_engine(settings, args):
    """The engine on this instance's device (cuda:N for a KIND_GPU instance), from the model's settings."""
    from kev_backend.engine.engine import Engine
    from kev_backend.serve.stub.triton_config import engine_options

    gpu = args["model_instance_kind"] == "GPU"
    device = f"cuda:{args['model_instance_device_id']}" if gpu else "auto"
    return Engine.from_checkpoint(settings.checkpoint, engine_options(settings, device))


def warm_up(engine, metrics, settings, config):
    """Answers the `warmup_requests` JSONL before the model reports ready, in batches of up to max_batch_size; returns
    how many there were."""
    from kev_backend.protocol.request import RequestError
    from kev_backend.serve.stub.triton_config import warmup_requests

    warmup = warmup_requests(settings)
    size = max(1, config.get("max_batch_size", 1))
    started = time.perf_counter()
    for start in range(0, len(warmup), size):
        results = engine.answer(warmup[start : start + size])
        metrics.record(engine)
        metrics.count_error("invalid", sum(isinstance(r, RequestError) for r in results))
    engine.startup["warmup_requests"] = time.perf_counter() - started
    return len(warmup)


def read_parameters(request, sender):
    """The request's parameters (kev_backend/protocol/envelope.py) onto its sender: whether its errors are tagged
    (read first, so a bad parameter is refused in the form the client asked for), whether it reports usage by
    question, and its routing key: its x-kev-state-key parameter, sent as one by a client or forwarded by Triton
    from the header of that name (kev-serve starts it with --*-header-forward-pattern). ValueError for a parameter
    the model cannot take."""
    from kev_backend.protocol import envelope

    parameters = envelope.read_parameters(request.parameters)
    sender.tagged = envelope.flag(parameters.get(envelope.TAGGED_ERRORS))
    sender.usage_by_question = envelope.flag(parameters.get(envelope.USAGE_BY_QUESTION))
    sender.key = envelope.check_state_key(parameters.get(envelope.STATE_KEY))


def count_state_keys(metrics, keys, batch):
    """Counts, for each scored state whose request carried a routing key, whether the key is that state's. `keys`:
    the submitted bodies' keys by index (the batch's `indices` say which bodies it scored)."""
    for i, record, _ in batch.accepted:
        if (key := keys.get(batch.indices[i])) is not None:
            metrics.count_state_key(key == record.state_key)


def gpu_visible():
    import torch

    return torch.cuda.is_available()


class Sender:
    """One request's response sender, which sends exactly one final response and counts an error by its reason."""

    def __init__(self, sender, metrics):
        self.sender = sender
        self.metrics = metrics
        self.lock = threading.Lock()
        self.done = False
        self.key = None  # the request's routing key (read_parameters)
        self.tagged = False  # its own errors' messages tagged for our doors (envelope.TAGGED_ERRORS)
        self.usage_by_question = False
        self.arrived = time.perf_counter()  # execute() took the request (Triton's queue is behind it)
        self.answered_ms = None  # its time in the model once answered (kev_request_ms)

    def is_cancelled(self):
        """Whether the client left. Never asked once the response is on its way: Triton frees the request's response
        factory once its final response is sent, and asking about it then would read freed memory (tritonserver's
        segmentation fault). The lock keeps an ask in flight from overlapping the send that follows it."""
        with self.lock:
            return not self.done and self.sender.is_cancelled()

    def send(self, reply, reason=None):
        with self.lock:
            if self.done:
                return
            self.done = True
        if reason is not None:
            self.metrics.count_error(reason)
        try:
            self.sender.send(reply, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as error:  # noqa: BLE001 - e.g. the client is gone; nothing else to tell it
            pb_utils.Logger.log_warn(f"kev: a response could not be sent: {error!r}")
            return
        if reason is None:
            self.answered_ms = (time.perf_counter() - self.arrived) * 1000

    def fail(self, message, code, reason="internal", status=None):
        """Fails the request. `status`: the error is about the request itself (the HTTP status Kev would answer),
        tagged so for a door that asked (envelope.TAGGED_ERRORS); None: a fault of the server or of its batch."""
        if not self.done:
            self.send(error_response(self.message(message, status), code), reason)

    def message(self, message, status, detail=None):
        """The error's message: tagged with `status` and `detail` (else the message) for a door that asked."""
        from kev_backend.protocol.envelope import tag_error
        from kev_backend.protocol.request import printable

        if not self.tagged or status is None:
            return message
        return tag_error(status, printable(message) if detail is None else detail)

    def answer(self, results):
        """Sends this request's response built from its results; a fault while building it fails it alone."""
        if self.done:
            return
        try:
            reply, reason = response(results, self.message)
        except Exception as error:  # noqa: BLE001
            pb_utils.Logger.log_error(f"kev: a response could not be built: {error!r}")
            message = self.message(f"kev internal error: {type(error).__name__}", 500)
            reply, reason = error_response(message, pb_utils.TritonError.INTERNAL), "internal"
        self.send(reply, reason)


def response(results, message):
    """One request's response and the reason it failed (None when answered): its answers, or the first refusal,
    fault or cancellation among them. `message(text, status)` writes an error's message (Sender.message)."""
    from kev_backend.engine.engine import RequestFault, dumps
    from kev_backend.protocol.request import RequestError

    if any(r is None for r in results):  # dropped before scoring
        return error_response("request cancelled", pb_utils.TritonError.CANCELLED), "cancelled"
    for j, result in enumerate(results):
        if isinstance(result, (RequestError, RequestFault)):
            invalid = isinstance(result, RequestError)
            text = result.message if invalid else f"kev internal error: {result}"
            text = text if len(results) == 1 else f"REQUEST[{j}]: {text}"
            if invalid:
                reason = "too_large" if result.status == 413 else "invalid"
                tagged = message(text, result.status, result.json_detail if len(results) == 1 else None)
                return error_response(tagged, pb_utils.TritonError.INVALID_ARG), reason
            return error_response(message(text, 500), pb_utils.TritonError.INTERNAL), "internal"
    out = np.array([dumps(r).encode() for r in results], dtype=np.object_).reshape(len(results), 1)
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("RESPONSE", out)]), None
