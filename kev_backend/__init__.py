"""Kev decision models served from a Triton Python backend.

Packages, each depending only on those listed after it:
    serve     the Triton model's engine options, metrics, the System One gateway, the client, `kev score`, the
              supervisor, the health probe, the router's configuration
    dev       synthetic checkpoints, request shapes, parity, the in-process bench, the GEMM tuner
    settings  (a module) the one reader of configuration: model parameters, KEV_* and the serving environment
    engine    engine options, the staged engine, the pipeline that overlaps batches
    gpu       the fused forward pass, pass layouts, CUDA graphs, the state pool, pre-tuned GEMMs, kernels/
    scoring   the head's math, the state bank's LRU, host copies, the fp32 reference scorer
    model     the Qwen3.5 text model, checkpoints, weights, the safetensors reader
    protocol  System One validation, rendering, answers and Kev's token layout (no torch)
gpu/kernels are leaves: Triton-language kernels with nothing of ours above them.
"""
