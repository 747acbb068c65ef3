"""kev-serve, the supervisor (`python -m kev_backend.serve.supervisor`): supervisor.py runs and watches tritonserver
and the gateway; children.py starts and stops them; probe.py is the real-inference probe (also the container's and
Kubernetes' health check); progress.py reads the model instances' heartbeats; shm.py sizes /dev/shm; gpus.py says which
GPUs a start serves; procs.py reads the process table."""
