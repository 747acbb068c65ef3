"""Triton Python-backend adapter for Kev: one System One JSON request per REQUEST element, Kev 1.0's response JSON
per RESPONSE element. The whole batch goes to the engine in one call; a bad request fails alone (INVALID_ARG)."""

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from kev_backend.engine import Engine, dumps
from kev_backend.systemone import RequestError
from kev_backend.triton_config import checkpoint_path, engine_options, parameters


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = parameters(config)
        model_dir = Path(args["model_repository"])
        gpu = args["model_instance_kind"] == "GPU"
        device = f"cuda:{args['model_instance_device_id']}" if gpu else "auto"
        path = checkpoint_path(params, model_dir)
        self.engine = Engine.from_checkpoint(path, engine_options(params, device))
        pb_utils.Logger.log_info(f"kev: {path} on {self.engine.device} ({self.engine.checkpoint.dtype})")

    def execute(self, requests):
        # A request may carry several JSON strings (batch dim n > 1); all of them are scored in one engine call.
        bodies = [pb_utils.get_input_tensor_by_name(r, "REQUEST").as_numpy().reshape(-1) for r in requests]
        try:
            results = self.engine.answer([body for items in bodies for body in items])
        except Exception as error:  # an engine fault: fail this batch's requests, keep the server serving
            pb_utils.Logger.log_error(f"kev: batch failed: {error!r}")
            failure = pb_utils.TritonError(f"kev engine error: {error}", pb_utils.TritonError.INTERNAL)
            return [pb_utils.InferenceResponse(error=failure) for _ in requests]
        responses, start = [], 0
        for items in bodies:
            mine, start = results[start : start + len(items)], start + len(items)
            errors = [(i, r) for i, r in enumerate(mine) if isinstance(r, RequestError)]
            if errors:
                i, error = errors[0]
                message = error.message if len(items) == 1 else f"REQUEST[{i}]: {error.message}"
                responses.append(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG))
                )
                continue
            out = np.array([dumps(r).encode() for r in mine], dtype=np.object_).reshape(len(items), 1)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("RESPONSE", out)]))
        return responses
