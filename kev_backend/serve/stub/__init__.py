"""What the Triton model (model_repository/kev/1/model.py, in the Python backend's stub process) imports of the
serving package: `triton_config` (the engine's options and warm-up requests from the model's settings), `metrics`
(the model's Prometheus metrics on Triton's port) and `heartbeat` (the progress it writes for kev-serve)."""
