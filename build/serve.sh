#!/usr/bin/env bash
# Serve Kev: tritonserver on the Kev model repository and the System One gateway beside it, both run and supervised
# by kev_backend/serve/supervisor/supervisor.py (`kev-serve`). The command behind `make serve`; the end-to-end tests run it with
# GATEWAY=0.
#
# Topology: the gateway is the front door (request limits, bodies validated before Triton sees them, the bearer key
# KEV_API_KEY) and binds BIND_ADDRESS. Triton's HTTP, gRPC and metrics ports bind TRITON_ADDRESS, loopback by
# default: they are for the gateway and for operators on the host, not for clients.
#
# The admin key: Triton's model-repository, shared-memory, trace and logging APIs need an `admin-key` header.
# tritonserver 2.51 takes that key only on its command line (--http-restricted-api, --grpc-restricted-protocol; no
# file, no environment variable), so ANY LOCAL USER OF THE HOST CAN READ IT in tritonserver's argv (ps,
# /proc/<pid>/cmdline; unless /proc is mounted with hidepid). That is why Triton binds loopback only: the key guards
# nothing against local users, and Triton's ports must not be reachable from elsewhere. The key is random per start
# and never printed unless TRITON_ADMIN_KEY_FILE names a file holding a chosen one (TRITON_ADMIN_KEY is still read).
#
# Environment (defaults in parentheses):
#   HTTP_PORT (8000) GRPC_PORT (8001) METRICS_PORT (8002)  Triton's ports
#   TRITON_ADDRESS (127.0.0.1)  address Triton's ports bind; 0.0.0.0 exposes the admin key's guard to the network
#   GATEWAY (1; 0 = no gateway)  GATEWAY_PORT (8009)
#   BIND_ADDRESS (127.0.0.1)  address the gateway binds; a container or host deployment sets 0.0.0.0
#   MODEL_REPOSITORY (<repo>/model_repository)
#   KEV_MODEL_CONFIG (auto)  auto: configs/gpu.pbtxt when KEV_VENV's torch sees a GPU (one instance per GPU), else
#     config.pbtxt; "default": config.pbtxt; a name: that file of model_repository/kev/configs/. The first log line
#     says which path, GPUs and configuration it chose.
#   KEV_EXPECT_GPU (0)  1 (the GPU image sets it): a start that sees no GPU serves on the CPU path and its first
#     log line is a warning saying so
#   KEV_CHECKPOINT  Kev checkpoint directory (default: the model's `checkpoint` parameter, the embedded tiny one)
#   KEV_API_KEY     bearer key the gateway requires on /v1/* (none: open)
#   KEV_VENV        the venv that runs the supervisor, the gateway and the Python stub (<repo>/.venv)
#   KEV_HOST_ALLOCATOR (jemalloc)  the malloc of tritonserver, its stubs and the gateway: jemalloc where the host has
#     it (Debian: libjemalloc2; preloaded, the second log line says so; a warning where it is missing), or glibc
#   TRITON_CACHE_DIR  compiled GPU kernels and autotuning results, kept across restarts (build/.triton-cache)
#   PYTORCH_CUDA_ALLOC_CONF (expandable_segments:True)  GPU memory that stays flat under load
#   TRITON_ADMIN_KEY_FILE  file holding the admin key (letters, digits, ._~+/-); default: random per start
# Supervision (kev_backend/serve/supervisor/supervisor.py says more): Triton is restarted only when it is dead or truly stuck,
# never for being busy with valid work or for what other clients send:
#   - at once: tritonserver exits, a Python stub dies, a probe reply says the stub "is not healthy", or an instance's
#     heartbeat says its engine is broken;
#   - KEV_PROGRESS_TIMEOUT_S (120): an instance holds jobs and its heartbeat's beats have not moved that long (the
#     model beats after every layer of every chunk on the CPU, every GPU pass, every batch taken or answered; each
#     start gets KEV_HEARTBEAT_PREFIX inside its /dev/shm prefix, which kev-serve sets itself);
#   - KEV_PROBE_INTERVAL_S (1; 0 = no inference probe)  KEV_PROBE_TIMEOUT_S (10)  KEV_PROBE_FAILURES (3)
#     a one-question inference through Triton's gRPC port every interval, at priority 1 (config.pbtxt's
#     priority_levels: clients' full or long queue never holds or refuses it). That many failed probes in a row
#     restart, counted only while the model shows no progress (no job whose beats moved, no beat, no stub keeping a
#     CPU busy, no inference completed); a probe failed with its batch by a batch-mate's malformed tensor (an
#     untagged INVALID_ARGUMENT) or a /dev/shm too small for the batch never counts. One log line per restart, then "answering again after X s". A gateway that
#     exits is restarted too; Triton's restarts never touch it.
#   KEV_MAX_RESTARTS (5) within KEV_RESTART_WINDOW_S (600): past that, and after a restart that did not become
#     ready, each start waits KEV_RESTART_BACKOFF_S (5), doubling up to KEV_RESTART_BACKOFF_MAX_S (300), logged,
#     until a window passes without a restart. Restarts never end the service.
#   KEV_START_TIMEOUT_S (600)  the FIRST start not ready by then, or exiting first, exits with code 1 and the reason
#   A port it would bind already in use (another server still running) ends the start at once: exit code 1, the port
#   and its setting named, nothing started
#   KEV_STOP_TIMEOUT_S (5)  SIGTERM/SIGINT: everything stopped by then (SIGKILL at the deadline), exit code 0
# Shared memory: Triton's Python backend needs up to 832 MiB of /dev/shm per model instance by the default limits
# (a batch of 64 requests of 4 MiB and their responses; docs/operations.md); kev-serve warns at start with less free.
# Extra arguments go to tritonserver.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
venv=$(realpath -m "${KEV_VENV:-$here/../.venv}")
[[ -x $venv/bin/python ]] || { echo "error: $venv/bin/python not found (set KEV_VENV, or run: make setup)" >&2; exit 1; }
export KEV_VENV=$venv
exec "$venv/bin/python" -m kev_backend.serve.supervisor "$@"
