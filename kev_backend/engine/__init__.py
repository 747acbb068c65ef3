"""The batch-first engine (options, stages, per-request faults) and the pipeline that overlaps batches."""
