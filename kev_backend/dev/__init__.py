"""Developer tools: synthetic checkpoints, request shapes, parity figures, the in-process bench, the GEMM tuner."""
