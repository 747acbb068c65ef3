"""The Qwen3.5 text model (the fp32 oracle's forward pass), Kev checkpoints, weights and the safetensors reader."""
