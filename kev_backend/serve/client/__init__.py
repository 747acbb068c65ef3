"""Clients of a running Kev server: `KevClient` and `AsyncKevClient` over Triton's gRPC or HTTP (clients.py; the
names users import are here), `kev score` for JSONL files (cli.py), and a reader of Prometheus' text format for the
metrics ports (prometheus.py)."""

from .clients import AsyncKevClient, KevClient, KevError

__all__ = ["AsyncKevClient", "KevClient", "KevError"]
