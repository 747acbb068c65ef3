"""Triton Python-backend adapter for Kev: one System One JSON request per REQUEST element, Kev 1.0's response JSON
per RESPONSE element. The whole batch goes to the engine in one call; a bad request fails alone (INVALID_ARG)."""

import json
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from kev_backend.engine import Engine, dumps
from kev_backend.metrics import KevMetrics
from kev_backend.systemone import RequestError
from kev_backend.triton_config import checkpoint_path, engine_options, parameters, warmup_requests


def error_response(message, code):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


class TritonPythonModel:
    def initialize(self, args):
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

    def execute(self, requests):
        responses = [None] * len(requests)
        # A request cancelled while queued costs no model work.
        live = []
        for i, request in enumerate(requests):
            if request.is_cancelled():
                responses[i] = error_response("request cancelled", pb_utils.TritonError.CANCELLED)
            else:
                live.append(i)
        if not live:
            return responses
        # A request may carry several JSON strings (batch dim n > 1); all are scored in one engine call.
        bodies = [pb_utils.get_input_tensor_by_name(requests[i], "REQUEST").as_numpy().reshape(-1) for i in live]
        try:
            results = self.engine.answer([body for items in bodies for body in items])
        except Exception as error:  # an engine fault fails this batch's requests; the server keeps serving
            pb_utils.Logger.log_error(f"kev: batch failed: {error!r}")
            for i in live:
                responses[i] = error_response(f"kev engine error: {error}", pb_utils.TritonError.INTERNAL)
            return responses
        self.metrics.record(self.engine)
        start = 0
        for i, items in zip(live, bodies):
            mine, start = results[start : start + len(items)], start + len(items)
            errors = [(j, r) for j, r in enumerate(mine) if isinstance(r, RequestError)]
            if errors:
                j, error = errors[0]
                message = error.message if len(items) == 1 else f"REQUEST[{j}]: {error.message}"
                responses[i] = error_response(message, pb_utils.TritonError.INVALID_ARG)
                continue
            out = np.array([dumps(r).encode() for r in mine], dtype=np.object_).reshape(len(items), 1)
            responses[i] = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("RESPONSE", out)])
        return responses
