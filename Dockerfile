# Kev on Triton: tritonserver 2.51 (the Python backend and its stub), the System One gateway and kev-serve, with the
# embedded tiny checkpoint baked in so the image answers out of the box. Built with no network: every wheel comes
# from the wheelhouse (`make wheelhouse`), the base image is local. `make image` builds it; docs/image.md says more.
#
#   podman build --network=none --format docker -t localhost/kev-on-triton .         (--format docker: HEALTHCHECK)
#   --build-arg BASE_IMAGE=...   default localhost/debian-base:bookworm (build/image/base.sh)
#   --build-arg WHEELHOUSE=...   the wheelhouse, inside the build context (default build/wheelhouse)
#   --build-arg REQUIREMENTS=... the requirement files installed (default requirements.txt; the GPU image:
#                                "requirements.txt requirements-gpu.txt", the measured GPU stack, from a
#                                WHEEL_TORCH=cuda wheelhouse) and --build-arg KEV_EXPECT_GPU=1 (`make image-gpu`)
ARG BASE_IMAGE=localhost/debian-base:bookworm

FROM ${BASE_IMAGE} AS build
ARG WHEELHOUSE=build/wheelhouse
ARG REQUIREMENTS=requirements.txt
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /opt/kev
# pip sees the wheelhouse and nothing else.
ENV PIP_NO_INDEX=1 \
    PIP_FIND_LINKS=/tmp/wheelhouse \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore
COPY ${WHEELHOUSE} /tmp/wheelhouse
COPY requirements*.txt ./
COPY build/requirements.py build/
# One line a project: a later file's pin wins (requirements-gpu.txt's torch over requirements.txt's CPU build).
RUN python3 -m venv .venv \
    && python3 build/requirements.py ${REQUIREMENTS} > build/requirements-installed.txt \
    && .venv/bin/pip install --quiet -r build/requirements-installed.txt
COPY build/install_tritonserver.sh build/
RUN PYTRITON_WHEELHOUSE=/tmp/wheelhouse build/install_tritonserver.sh .venv build/.tritonserver \
    && rm -rf build/.downloads
COPY pyproject.toml README.md LICENSE ./
COPY kev_backend kev_backend
RUN find kev_backend -name __pycache__ -prune -exec rm -rf {} + \
    && .venv/bin/pip install --quiet --no-deps -e . \
    && .venv/bin/python -m compileall -q kev_backend
# The embedded tiny checkpoint is built here, as `make setup` does (a host's copy in the context is dropped).
COPY model_repository model_repository
RUN find model_repository -name __pycache__ -prune -exec rm -rf {} + \
    && rm -rf model_repository/kev/embedded \
    && .venv/bin/python -m kev_backend.dev.synthetic model_repository/kev/embedded \
    && .venv/bin/python -m compileall -q model_repository
COPY build/serve.sh build/tritonserver.sh build/
# Everything readable by the non-root user (the checkpoint writer makes its files 0600), nothing writable by it.
RUN chmod -R a+rX,go-w /opt/kev

FROM ${BASE_IMAGE}
ARG KEV_UID=10001
ARG KEV_EXPECT_GPU=0
LABEL org.opencontainers.image.title="kev-on-triton" \
      org.opencontainers.image.description="Kev decision models on Triton Inference Server 2.51 (Python backend)"
# A non-root user; its Triton kernel cache is the one writable place the server needs (and /dev/shm, /tmp).
RUN groupadd --gid "${KEV_UID}" kev \
    && useradd --uid "${KEV_UID}" --gid kev --create-home --home-dir /home/kev --shell /usr/sbin/nologin kev \
    && mkdir -p /var/cache/kev/triton \
    && chown -R kev:kev /var/cache/kev
COPY --from=build /opt/kev /opt/kev
# The gateway is the front door (0.0.0.0 inside the container, published with -p); Triton's HTTP, gRPC and metrics
# ports stay on the container's loopback. Real checkpoints are mounted and named at run time: KEV_CHECKPOINT,
# KEV_BASE (unset here: the model's `checkpoint` parameter, the embedded tiny one, is the default).
ENV KEV_VENV=/opt/kev/.venv \
    PATH=/opt/kev/.venv/bin:/usr/local/bin:/usr/bin:/bin \
    BIND_ADDRESS=0.0.0.0 \
    TRITON_ADDRESS=127.0.0.1 \
    GATEWAY_PORT=8009 \
    TRITON_CACHE_DIR=/var/cache/kev/triton \
    KEV_STOP_TIMEOUT_S=2 \
    KEV_EXPECT_GPU=${KEV_EXPECT_GPU} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
VOLUME ["/var/cache/kev/triton"]
WORKDIR /opt/kev
USER ${KEV_UID}:${KEV_UID}
EXPOSE 8009
# Triton ready AND a real inference answered (tritonserver 2.51 reports ready with a dead stub), then the gateway's
# /ready. The start period covers loading a real checkpoint (kev-serve allows KEV_START_TIMEOUT_S, 600 s).
HEALTHCHECK --interval=30s --timeout=20s --start-period=600s --retries=3 \
    CMD ["/opt/kev/.venv/bin/python", "-m", "kev_backend.serve.supervisor.probe"]
STOPSIGNAL SIGTERM
# tini is PID 1: it forwards SIGTERM to kev-serve (a Python PID 1 would ignore it) and reaps orphans. kev-serve
# stops tritonserver and the gateway and exits 0; tini exits with that code. KEV_STOP_TIMEOUT_S=2 (above) bounds that
# stop at 2 s: requests in flight get 1 s (Triton's --exit-timeout-secs), then what still runs, the Python stub
# mid-unload included, is killed and its shared memory removed. A graceful unload of the model takes ~2 s more
# (the stub's teardown, Triton's 1-s polling): -e KEV_STOP_TIMEOUT_S=5 with `podman stop -t 10` for a longer drain.
# Arguments go to tritonserver.
ENTRYPOINT ["/usr/bin/tini", "--", "/opt/kev/build/serve.sh"]
