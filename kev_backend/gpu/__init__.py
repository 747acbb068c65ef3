"""The fused GPU path: the forward pass, pass layouts, CUDA graphs, the state pool, pre-tuned GEMMs and kernels."""
