"""Filling a checkpoint volume: `kev-fill` (`python -m kev_backend.serve.fill`) copies a Kev checkpoint or its base
into a directory from a model hub snapshot at a pinned commit or from an S3-compatible object store, every file
checked against a sha256 (or the hub's git blob id) before it takes its final name. Standard library only: it runs
from the serving image, which holds nothing else for it.

Modules: names (which relative names are allowed), digest (what a file must hash to), transport (HTTP with bounded
retries), sigv4 (AWS Signature V4), remote (what a source is), hub and s3 (the two sources), sums (S3's SHA256SUMS),
place (verify-then-rename into the directory, and the completion marker), cli (the command).
"""
