"""`python -m kev_backend.serve.gateway`: `kev-gateway`."""

from .app import main

main()
