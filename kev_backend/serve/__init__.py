"""Serving: Triton settings and metrics, the System One gateway, the client, `kev score` and the supervisor."""
