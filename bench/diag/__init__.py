"""Diagnostics on the GPU machine (not a benchmark): where a pass spends GPU and host time, kernel configurations
timed against each other and against fla's (the kernels ours replaced), start-up phases, and whether answers depend
on the batch.

    python -m bench.diag SUBCOMMAND [OPTIONS]      (from the repository root; `--help` lists the subcommands)

One module per family: `passes` (latency, GPU time by kernel, idle gaps, batch invariance), `sweeps` (kernel
configurations and fla's kernels), `gemm` (the projections' GEMMs), `gemm_epilogues` (the MLP's memory-bound work in
Triton GEMMs' epilogues), `host` (the host's work around a pass), `startup` (start-up phases); shared helpers in
`common`. bench/gpu.sh steps runs them as steps."""
