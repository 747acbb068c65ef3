"""Triton Python-backend adapter for Kev: one System One JSON request per REQUEST element, Kev 1.0's response JSON
per RESPONSE element. Each batch (in parts when large) goes to the engine through a pipeline that overlaps batches'
host and GPU work (kev_backend/pipeline.py); a bad request fails alone (INVALID_ARG)."""

import json
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

# kev_backend (torch with it) is imported where it is first used, not here: at model load Triton's python backend
# first imports this file in a short-lived auto-complete stub of its own, where torch's import was 3-4 s of the time
# to ready (H200 and CPU alike); the instance's stub imports it once, in initialize.


def error_response(message, code):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


class TritonPythonModel:
    def initialize(self, args):
        from kev_backend.engine import Engine
        from kev_backend.metrics import KevMetrics
        from kev_backend.pipeline import Pipeline
        from kev_backend.triton_config import checkpoint_path, engine_options, parameters, warmup_requests

        config = json.loads(args["model_config"])
        params = parameters(config)
        gpu = args["model_instance_kind"] == "GPU"
        device = f"cuda:{args['model_instance_device_id']}" if gpu else "auto"
        path = checkpoint_path(params, Path(args["model_repository"]))
        self.engine = Engine.from_checkpoint(path, engine_options(params, device))
        labels = {"model": args["model_name"], "instance": args["model_instance_name"]}
        self.metrics = KevMetrics(pb_utils, labels)
        warmup = warmup_requests(params, Path(args["model_repository"]))
        started = time.perf_counter()
        for start in range(0, len(warmup), 64):  # in batches of up to max_batch_size, before the model is ready
            self.engine.answer(warmup[start : start + 64])
            self.metrics.record(self.engine)
        self.engine.startup["warmup_requests"] = time.perf_counter() - started
        pb_utils.Logger.log_info(f"kev: {path}; {len(warmup)} warm-up requests; {self.engine.summary()}")
        self.pipeline = Pipeline(self.engine)

    def execute(self, requests):
        # Responses go out through each request's sender once the pipeline has answered (execute returns None, so
        # Triton hands over the next batch while this one is on the GPU). A request cancelled while queued costs no
        # model work, here or just before its batch is scored.
        live = []  # (request, its response sender) of each request still wanted
        for request in requests:
            sender = request.get_response_sender()
            if request.is_cancelled():
                send(sender, error_response("request cancelled", pb_utils.TritonError.CANCELLED))
            else:
                live.append((request, sender))
        if not live:
            return None
        # A request may carry several JSON strings (batch dim n > 1); all are scored together. A large batch goes to
        # the pipeline in parts (whole requests each), each answered once scored (pipeline.parts_by_size).
        from kev_backend.pipeline import parts_by_size

        bodies = [pb_utils.get_input_tensor_by_name(r, "REQUEST").as_numpy().reshape(-1) for r, _ in live]
        senders = [sender for _, sender in live]
        for part in parts_by_size([sum(len(body) for body in items) for items in bodies]):
            self._submit([bodies[i] for i in part], [senders[i] for i in part])
        return None

    def _submit(self, bodies, senders):
        """Scores the requests' bodies (one list per request) in one pipeline batch; answers through their senders."""
        spans, start = [], 0
        for items in bodies:
            spans.append(range(start, start + len(items)))
            start += len(items)

        def cancelled():
            return {j for sender, span in zip(senders, spans) if sender.is_cancelled() for j in span}

        def deliver(results, batch):
            if isinstance(results, Exception):  # an engine fault fails this batch's requests; the server keeps serving
                fail(results)
                return
            if batch.report.requests:
                self.metrics.record(self.engine, batch.report)
            for sender, span in zip(senders, spans):
                send(sender, response(results[span.start : span.stop]))

        def fail(error):
            pb_utils.Logger.log_error(f"kev: batch failed: {error!r}")
            for sender in senders:
                send(sender, error_response(f"kev engine error: {error}", pb_utils.TritonError.INTERNAL))

        try:
            self.pipeline.submit([body for items in bodies for body in items], deliver, cancelled)
        except Exception as error:  # preparing the batch failed (not a bad request: those are refused one by one)
            fail(error)

    def finalize(self):
        self.pipeline.close()


def send(sender, reply):
    sender.send(reply, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def response(results):
    """One request's response: its answers, or the first refusal (INVALID_ARG) or cancellation among them."""
    from kev_backend.engine import dumps
    from kev_backend.systemone import RequestError

    if any(r is None for r in results):  # dropped before scoring
        return error_response("request cancelled", pb_utils.TritonError.CANCELLED)
    errors = [(j, r) for j, r in enumerate(results) if isinstance(r, RequestError)]
    if errors:
        j, error = errors[0]
        message = error.message if len(results) == 1 else f"REQUEST[{j}]: {error.message}"
        return error_response(message, pb_utils.TritonError.INVALID_ARG)
    out = np.array([dumps(r).encode() for r in results], dtype=np.object_).reshape(len(results), 1)
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("RESPONSE", out)])
