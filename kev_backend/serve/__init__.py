"""Serving: Triton settings and metrics, the System One gateway, the client, `kev score`, the supervisor and `kev-fill`
(a checkpoint volume filled and verified)."""
