"""kev-serve: runs tritonserver on the Kev model repository and the System One gateway beside it, and keeps them
answering (what `make serve` runs, through build/serve.sh).

Topology: the gateway (`kev-gateway`, BIND_ADDRESS) is the front door: request limits, bodies validated before they
reach Triton, the bearer key (KEV_API_KEY). Triton's HTTP, gRPC and metrics ports (TRITON_ADDRESS) stay on loopback
by default: Triton's own HTTP front end is not meant to face clients, and its admin key travels in its argv.

The model configuration: configs/gpu.pbtxt when the serving environment's torch sees a GPU (KEV_MODEL_CONFIG=auto),
config.pbtxt otherwise; the first log line says which path, which GPUs and which configuration, and why.

Supervision restarts Triton only when it is dead or truly stuck, never because it is busy with valid work or
because of what other clients send. Once Triton is ready:
- dead: tritonserver exits, or one of the Python backend's stub processes (children of tritonserver) dies
  (tritonserver 2.51 never restarts a stub that died, kill -9 or the OOM killer, and keeps answering "ready" while
  every request fails): restart at once;
- broken: a model instance's heartbeat says its engine is broken (a CUDA error poisons its process): restart at once;
- hung: an instance holds jobs and its heartbeat's beats have not moved for KEV_PROGRESS_TIMEOUT_S. The model beats
  after every layer of every chunk on the CPU reference path, after every GPU pass, and when it takes or answers a
  batch (kev_backend/serve/stub/heartbeat.py; kev-serve gives each start its own KEV_HEARTBEAT_PREFIX, inside the
  start's shared-memory prefix, so the files go with its regions);
- the probe: every KEV_PROBE_INTERVAL_S a real inference (a one-question System One request, at priority 1 so no
  client queue holds or refuses it, errors tagged) goes through Triton's gRPC port (serve/supervisor/probe.py). A
  reply saying the stub is not healthy restarts at once. A probe failed with its batch while Triton gathered the
  batch's inputs (a batch-mate's malformed tensor: an INVALID_ARGUMENT the model did not tag; or the stub's pool in
  /dev/shm too small for the batch) says nothing of the model and never counts. Any other failure (no reply within
  KEV_PROBE_TIMEOUT_S, a refusal, an error) counts only when the model showed no progress over the probe's wait or
  the last probe timeout, whichever is longer: no instance holding jobs whose beats moved within
  KEV_PROGRESS_TIMEOUT_S, no beat at all, no stub keeping at least 10 % of a CPU busy (a batch is parsed and
  tokenized before the model takes it as a job: minutes for large ones, with no beat), and no inference completed by
  Triton (its statistics). KEV_PROBE_FAILURES such failures in a row restart Triton; progress ends the run. The
  probe is one request a second in Triton's and Kev's metrics; KEV_PROBE_INTERVAL_S=0 turns it off (the stub and
  heartbeat watches stay);
- the gateway exiting on its own is restarted too; Triton being away does not touch it (it answers 503 meanwhile).
A restart: SIGTERM, SIGKILL of its process group after a short grace, its shared-memory regions removed, a fresh
start. Every restart is one log line ("TRITON RESTART n: what was seen"); recovery is another ("answering again
after X s"). Restarts are never given up: past KEV_MAX_RESTARTS within KEV_RESTART_WINDOW_S, and after any restart
that did not become ready, each start first waits a backoff (KEV_RESTART_BACKOFF_S, doubling up to
KEV_RESTART_BACKOFF_MAX_S, logged), until a whole window passes without a restart. Only the first start of the
service exits non-zero when it does not become ready (exits, or is not ready within KEV_START_TIMEOUT_S), with the
reason: a model that cannot load must not loop.

At start kev-serve logs a warning when /dev/shm has less free than the request limits let Triton's Python backend
need (kev_backend/serve/supervisor/shm.py).

SIGTERM, SIGINT or SIGHUP stop everything within KEV_STOP_TIMEOUT_S (SIGKILL at the deadline, or at a second
signal), remove the shared-memory regions and exit 0.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from google.protobuf import text_format

from ...protocol.request import STATE_KEY_HEADER
from ...settings import HEARTBEAT_PREFIX, REPO, ServeSettings, SettingError, admin_key
from ..version import version_line
from . import procs, shm
from .allocator import use_host_allocator
from .children import (
    Child,
    child_env,
    describe_exit,
    python_stubs,
    remove_shm,
    remove_stale_shm,
    shm_prefix,
    stop_children,
    supervisor_prefix,
)
from .gpus import Devices, cuda_devices
from .metrics import ServeState
from .ports import taken_ports
from .probe import FAILED, POISONED, UNHEALTHY_STUB, Probe, answered, successes, verdict
from .progress import Watch, heartbeat_prefix
from .shm import SHM_DIR

# Triton forwards the headers this RE2 pattern matches as request parameters. It matches names as sent, and a (?i)
# flag did not make 2.51 match other cases: over HTTP the header must come in lower case, as gRPC metadata, Envoy
# and our clients always send it.
STATE_KEY_PATTERN = f"^{re.escape(STATE_KEY_HEADER)}$"

TICK_S = 0.1
# A server being restarted is broken (its stub is dead or hung): nothing it holds is worth waiting for, so it is
# killed at once (a grace of 2 s was 2 s more of outage on every restart) and its shared memory removed here.
RESTART_GRACE_S = 0.0


def log(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} kev-serve: {message}", file=sys.stderr, flush=True)


class GiveUp(Exception):
    """The service's first start did not become ready (a model that cannot load): the reason is logged, everything is
    stopped, the exit code is 1. Nothing later gives up: restarts back off instead."""


@dataclass
class RestartBudget:
    """Restarts of one process: at most `limit` at once within any `window_s`; past that, and after a start that
    failed, each start waits a backoff that doubles from `backoff_s` up to `max_backoff_s`. A whole window without a
    restart ends the backoff: the crash loop is over."""

    limit: int
    window_s: float
    backoff_s: float
    max_backoff_s: float
    times: deque[float] = field(default_factory=deque)
    wait_s: float = 0.0  # the last backoff; 0 while restarts are within the budget

    @classmethod
    def of(cls, config: ServeSettings) -> RestartBudget:
        return cls(config.max_restarts, config.restart_window_s, config.restart_backoff_s, config.restart_backoff_max_s)

    def spend(self, now: float, failed_start: bool = False) -> tuple[int, float]:
        """Records a restart at `now`: the restarts within the window (this one included), and how long to wait
        before starting again (0: at once)."""
        if self.times and now - self.times[-1] >= self.window_s:
            self.wait_s = 0.0
        self.times.append(now)
        while self.times[0] <= now - self.window_s:
            self.times.popleft()
        if failed_start or self.wait_s or len(self.times) > self.limit:
            self.wait_s = min(self.max_backoff_s, self.wait_s * 2 if self.wait_s else self.backoff_s)
        return len(self.times), self.wait_s

    def describe(self, recent: int, wait_s: float) -> str:
        """The log's account of a restart's place in the budget."""
        within = f"{recent} restart(s) within the last {self.window_s:g} s, limit {self.limit}"
        if not wait_s:
            return within
        return (
            f"{within}: waiting {wait_s:g} s before starting it again (KEV_RESTART_BACKOFF_S, doubling up to"
            f" {self.max_backoff_s:g} s until {self.window_s:g} s pass without a restart)"
        )


class Supervisor:
    def __init__(self, config: ServeSettings, env: dict[str, str], key: str) -> None:
        self.config = config
        self.env = env
        self.key = key  # only ever in tritonserver's argv
        self.model_config: str | None = None  # --model-config-name, chosen when run() starts
        self.devices: Devices | None = None  # the GPUs the serving environment sees, once asked
        self.stop_signal: int | None = None
        self.hurry = False  # a second signal: SIGKILL without waiting for the deadline
        self.triton_budget = RestartBudget.of(config)
        self.gateway_budget = RestartBudget.of(config)
        self.triton: Child | None = None  # None between a restart's stop and its (backed-off) start
        self.gateway: Child | None = None
        self.next_start = 0.0  # when to start tritonserver again, while it is None
        self.next_gateway_start = 0.0
        self.gateway_restarts = 0
        self.triton_restarts = 0
        self.starts = 0
        self.ready = False
        self.ever_ready = False  # some start became ready: from then on nothing gives up
        self.start_deadline = 0.0
        self.outage_since: float | None = None  # when the failure behind the current restart was seen
        self.stubs: dict[int, str] = {}
        self.watch: Watch | None = None
        self.probe: Probe | None = None
        self.readiness: grpc.Future | None = None
        self.inference: grpc.Future | None = None
        self.inference_sent = 0.0
        self.statistics: grpc.Future | None = None
        self.statistics_sent = 0.0
        self.next_check = 0.0
        self.next_probe = 0.0
        self.next_statistics = 0.0
        self.failures = 0
        self.successes: deque[tuple[float, int]] = deque(maxlen=256)  # (time, Triton's successful inferences)
        self.state = ServeState()  # restarts and readiness, for Prometheus (supervisor/metrics.py)

    # Processes

    def triton_command(self) -> list[str]:
        c = self.config
        restricted = f"model-repository,shared-memory,trace,logging:admin-key={self.key}"
        return [
            str(REPO / "build" / "tritonserver.sh"),
            f"--model-repository={c.model_repository}",
            "--model-control-mode=none",
            "--strict-readiness=true",
            "--disable-auto-complete-config",  # config.pbtxt is complete: no short-lived stub process at model load
            f"--http-address={c.triton_address}",
            f"--http-port={c.http_port}",
            f"--grpc-address={c.triton_address}",
            f"--grpc-port={c.grpc_port}",
            f"--metrics-address={c.triton_address}",
            f"--metrics-port={c.metrics_port}",
            f"--http-restricted-api={restricted}",
            f"--grpc-restricted-protocol={restricted}",
            # The routing key's header (clients, the gateway, the router) reaches the model as a request parameter
            # of the same name, where it is checked against the request's state (model.py).
            f"--http-header-forward-pattern={STATE_KEY_PATTERN}",
            f"--grpc-header-forward-pattern={STATE_KEY_PATTERN}",
            # At SIGTERM Triton waits at most this long for in-flight requests and the model unloads together (its
            # default, 30 s, is also what a dead stub costs); its teardown then takes ~0.5 s, within the second left
            # before the supervisor's SIGKILL at 1 s before the stop timeout.
            f"--exit-timeout-secs={max(1, int(c.stop_timeout_s) - 2)}",
            *([f"--model-config-name={self.model_config}"] if self.model_config else []),
            *c.extra_args,
            # Last, so an extra argument cannot rename the regions the supervisor removes.
            f"--backend-config=python,shm-region-prefix-name={shm_prefix(os.getpid(), self.starts)}",
        ]

    def start_triton(self) -> None:
        self.starts += 1
        prefix = heartbeat_prefix(shm_prefix(os.getpid(), self.starts))
        # The gateway's bearer key stays out of Triton and its Python stubs, which parse what clients send.
        triton_env = {name: value for name, value in self.env.items() if name != "KEV_API_KEY"}
        triton_env[HEARTBEAT_PREFIX] = prefix
        self.state.start(prefix)  # before Triton starts: its stubs find it from their first look
        self.triton = Child("tritonserver", self.triton_command(), triton_env)
        now = time.monotonic()
        self.ready = False
        self.start_deadline = now + self.config.start_timeout_s
        self.stubs = {}
        self.watch = Watch(prefix, self.config.progress_timeout_s, keep_s=2 * self.config.probe_timeout_s + 10)
        if self.probe is not None:
            self.probe.close()
        self.probe = Probe(self.config.grpc_target, self.config.model)
        self.readiness = self.inference = self.statistics = None
        self.failures = 0
        self.successes.clear()
        self.next_check = now
        c = self.config
        log(
            f"tritonserver pid {self.triton.pid} starting (start {self.starts}): {c.triton_address} http {c.http_port}"
            f" grpc {c.grpc_port} metrics {c.metrics_port}, repository {c.model_repository}"
        )

    def stop_triton(self) -> None:
        assert self.triton is not None
        deadline = time.monotonic() + RESTART_GRACE_S
        killed = stop_children([self.triton], deadline, lambda: self.hurry or self.stop_signal is not None)
        code = self.triton.process.returncode
        self.state.stop()  # before its regions go: a later write would leave the file behind
        removed = remove_shm(shm_prefix(os.getpid(), self.starts))
        how = "was killed" if killed else describe_exit(code)
        log(f"tritonserver pid {self.triton.pid} {how}; {len(removed)} shared-memory region(s) removed")
        self.triton, self.ready = None, False

    def start_gateway(self) -> None:
        c = self.config
        # `python -m`: runs wherever the project imports, with or without its console scripts installed
        gateway = [str(c.venv / "bin" / "python"), "-m", "kev_backend.serve.gateway"]
        command = [*gateway, "--host", c.bind_address, "--port", str(c.gateway_port)]
        metrics = f"{c.triton_host}:{c.metrics_port}"
        self.gateway = Child("kev-gateway", [*command, "--triton", c.grpc_target, "--metrics", metrics], self.env)
        log(f"System One gateway pid {self.gateway.pid} on {c.bind_address}:{c.gateway_port}")

    def restart(self, cause: str, reason: str) -> None:
        """restart_triton, counted by `cause` in kev_serve_restarts_total (stub/metrics.py, RESTART_CAUSES) when it
        restarts (the first start's failure gives up instead)."""
        if self.ever_ready:
            self.state.restarted("triton", cause)
        self.restart_triton(reason)

    def restart_triton(self, reason: str) -> None:
        """Stops tritonserver and schedules its next start: at once, or after the backoff (RestartBudget). Only the
        service's first start is not retried: its cause (a model that fails to load) would stay."""
        if not self.ever_ready:
            raise GiveUp(f"tritonserver did not become ready: {reason}")
        now = time.monotonic()
        failed_start = not self.ready
        recent, wait_s = self.triton_budget.spend(now, failed_start)
        self.triton_restarts += 1
        self.outage_since = self.outage_since or now
        when = " before it was ready" if failed_start else ""
        log(
            f"TRITON RESTART {self.triton_restarts}: {reason}{when}; restarting tritonserver"
            f" ({self.triton_budget.describe(recent, wait_s)})"
        )
        self.stop_triton()
        self.next_start = time.monotonic() + wait_s

    def restart_gateway(self, now: float) -> None:
        """The gateway exited on its own: started again at once, or after the backoff (RestartBudget)."""
        assert self.gateway is not None
        reason = f"gateway pid {self.gateway.pid} {describe_exit(self.gateway.reap())}"
        recent, wait_s = self.gateway_budget.spend(now)
        self.gateway_restarts += 1
        self.state.restarted("gateway", "exited")
        budget = self.gateway_budget.describe(recent, wait_s)
        log(f"GATEWAY RESTART {self.gateway_restarts}: {reason}; restarting it ({budget})")
        self.gateway = None
        self.next_gateway_start = now + wait_s

    # Supervision

    def step(self, now: float) -> None:
        try:
            self.supervise(now)
        finally:  # ready: Triton is, and its last probe (when probing) did not fail
            self.state.set_ready(self.triton is not None and self.ready and self.failures == 0)

    def supervise(self, now: float) -> None:
        self.step_gateway(now)
        if self.triton is None:  # stopped by a restart: started again once its backoff has passed
            if now >= self.next_start:
                self.start_triton()
            return
        if self.triton.exited():
            self.restart("exited", f"tritonserver pid {self.triton.pid} {describe_exit(self.triton.reap())}")
            return
        if not self.ready:
            self.step_starting(now)
            return
        if any(self.stub_dead(pid) for pid in self.stubs):
            dead = ", ".join(f"{name} (pid {pid})" for pid, name in self.stubs.items() if self.stub_dead(pid))
            self.restart("stub_died", f"Python backend stub {dead} died")
            return
        if self.step_heartbeats(now):
            return
        if self.config.probe_interval_s > 0:
            self.step_probing(now)

    def step_gateway(self, now: float) -> None:
        if self.gateway is not None and self.gateway.exited():
            self.restart_gateway(now)
        if self.gateway is None and self.config.gateway and now >= self.next_gateway_start:
            self.start_gateway()

    def step_starting(self, now: float) -> None:
        assert self.probe is not None
        if self.readiness is not None and self.readiness.done():
            try:
                ready = self.readiness.result().ready
            except grpc.RpcError:
                ready = False
            self.readiness = None
            if ready:
                self.became_ready(now)
                return
        if now > self.start_deadline:
            reason = f"tritonserver not ready within {self.config.start_timeout_s:g} s (KEV_START_TIMEOUT_S)"
            if not self.ever_ready:
                raise GiveUp(reason)
            self.restart("start_timeout", reason)
            return
        if self.readiness is None and now >= self.next_check:
            self.readiness = self.probe.ready()
            self.next_check = now + 0.2

    def became_ready(self, now: float) -> None:
        assert self.triton is not None
        self.ready = self.ever_ready = True
        self.stubs = python_stubs(self.triton.pid)
        stubs = ", ".join(f"{name} pid {pid}" for pid, name in self.stubs.items()) or "none"
        log(f"tritonserver ready after {now - self.triton.started:.1f} s (pid {self.triton.pid}; stubs: {stubs})")
        self.next_probe = self.next_statistics = now
        if self.config.probe_interval_s <= 0:
            self.recovered(now)

    def recovered(self, now: float) -> None:
        if self.outage_since is not None:
            log(f"tritonserver answering again after {now - self.outage_since:.1f} s (restart {self.triton_restarts})")
            self.outage_since = None

    def stub_dead(self, pid: int) -> bool:
        assert self.triton is not None
        stat = procs.proc_stat(pid)
        return stat is None or stat[1] == "Z" or stat[2] != self.triton.pid

    def step_heartbeats(self, now: float) -> bool:
        """Reads the instances' heartbeats; restarts Triton (True) when one is broken or hung."""
        assert self.watch is not None
        self.watch.observe(self.stubs, now)
        if broken := self.watch.broken():
            self.restart("engine_broken", f"model instance {', '.join(broken)} reports its engine broken")
            return True
        if hung := self.watch.hung(now):
            limit = f"KEV_PROGRESS_TIMEOUT_S={self.config.progress_timeout_s:g}"
            self.restart("hung", f"no progress: model instance {'; '.join(hung)} ({limit})")
            return True
        return False

    def step_probing(self, now: float) -> None:
        assert self.probe is not None
        c = self.config
        if self.statistics is not None and self.statistics.done():
            try:
                self.successes.append((self.statistics_sent, successes(self.statistics.result())))
            except grpc.RpcError:
                pass  # no sample: no evidence of progress
            self.statistics = None
        if self.statistics is None and now >= self.next_statistics:
            self.statistics, self.statistics_sent = self.probe.statistics(), now
            self.next_statistics = now + c.probe_interval_s
        if self.inference is not None and (self.inference.done() or now > self.inference_sent + c.probe_timeout_s + 2):
            self.judge(self.inference, self.inference_sent, now)
            self.inference = None
            if not self.ready:  # judged broken: restarted
                return
        if self.inference is None and now >= self.next_probe:
            self.inference, self.inference_sent = self.probe.infer(c.probe_timeout_s), now
            self.next_probe = now + c.probe_interval_s

    def judge(self, reply: grpc.Future, sent: float, now: float) -> None:
        """The verdict on a probe sent at `sent` (probe.verdict): answered, unhealthy (restart), poisoned by other
        requests (nothing learnt), or failed, which counts toward KEV_PROBE_FAILURES only while the model shows no
        progress (and progress ends the run)."""
        if not reply.done():
            reply.cancel()
            error, kind = f"no reply within {self.config.probe_timeout_s:g} s", FAILED
        else:
            try:
                error = "" if answered(reply.result()) else "the reply holds no answer"
                kind = FAILED
            except grpc.RpcError as rpc_error:
                error = f"{rpc_error.code().name}: {rpc_error.details()}"
                kind = verdict(rpc_error.code(), rpc_error.details() or "")
        if not error:
            self.failures = 0
            self.recovered(now)
        elif kind == UNHEALTHY_STUB:
            self.restart("probe_unhealthy", f"probe: {error}")
        elif kind == POISONED:
            pass  # its batch failed for other requests' sake: no evidence about the model either way
        elif self.progressing(sent, now):
            self.failures = 0  # busy, not failing
        else:
            self.failures += 1
            if self.failures >= self.config.probe_failures:
                self.restart(
                    "probe_failed",
                    f"{self.failures} probes failed in a row while the model made no progress and Triton completed"
                    f" no inference, the last: {error}",
                )

    def progressing(self, sent: float, now: float) -> bool:
        """The model shows progress for a probe sent at `sent`, over its wait or the last probe timeout, whichever is
        longer: an instance holds jobs whose beats moved within the progress timeout, an instance's beats moved, a
        stub kept a CPU busy (preparing a batch, which the heartbeat does not cover), or Triton completed
        inferences."""
        assert self.watch is not None
        since = min(sent, now - self.config.probe_timeout_s)
        watch = self.watch
        return watch.busy(now) or watch.moved_since(since) or watch.worked_since(since) or self.triton_completed(now)

    def triton_completed(self, now: float) -> bool:
        """Triton completed inferences within the last probe timeout (by its statistics, sampled every interval)."""
        window = self.config.probe_timeout_s
        fresh = [count for t, count in self.successes if t >= now - window]
        older = [count for t, count in self.successes if t < now - window]
        if not fresh:
            return False
        return max(fresh) > (older[-1] if older else min(fresh))

    def check_shm(self) -> None:
        """Logs a warning when /dev/shm has less free than the request limits let the Python backend need."""
        name = self.model_config or config_name_in(self.config.extra_args)
        path = shm.config_path(self.config.model_repository, self.config.model, name)
        try:
            needed = shm.need(path, lambda: len(self.visible_devices().gpus), self.env)
        except (OSError, ValueError, text_format.ParseError) as error:
            log(f"{SHM_DIR} not checked: {path}: {error}")
            return
        if warning := shm.check(needed, shm.free_bytes()):
            log(warning)

    def visible_devices(self) -> Devices:
        if self.devices is None:
            self.devices = cuda_devices(self.config.venv / "bin" / "python")
        return self.devices

    # Lifecycle

    def on_signal(self, signum: int, frame: object) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum
        else:
            self.hurry = True

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self.on_signal)
        # The path chosen is the first line: an operator reading the log's head sees the GPU, or that there is none.
        self.model_config, why = choose_model_config(self.config, self.visible_devices)
        log(why)
        log(use_host_allocator(self.env, self.config.host_allocator))
        if stale := remove_stale_shm():
            log(f"removed {len(stale)} shared-memory region(s) left by supervisors no longer running")
        if self.config.triton_address not in ("127.0.0.1", "::1", "localhost"):
            log(
                f"WARNING: Triton's ports bind {self.config.triton_address}: they face the network, and the admin key"
                " guarding its restricted APIs is readable by local users in tritonserver's argv"
            )
        self.check_shm()
        if taken := taken_ports(self.config):
            log(f"EXITING: {taken}")
            return 1
        code = 0
        try:
            self.start_triton()
            if self.config.gateway:
                self.start_gateway()
            while self.stop_signal is None:
                self.step(time.monotonic())
                time.sleep(TICK_S)
            log(f"{signal.Signals(self.stop_signal).name} received: stopping")
        except GiveUp as error:
            log(f"EXITING: {error}")
            code = 1
        finally:
            self.shutdown()
        return code

    def shutdown(self) -> None:
        started = time.monotonic()
        children = [child for child in (self.gateway, self.triton) if child is not None]
        # SIGKILL 1 s before the stop timeout: the supervisor's own exit fits in what is left.
        killed = stop_children(children, started + self.config.stop_timeout_s - 1.0, lambda: self.hurry)
        removed = remove_shm(supervisor_prefix(os.getpid()))
        if self.probe is not None:
            self.probe.close()
        late = f"; SIGKILL to {' and '.join(killed)}, not exited by the deadline" if killed else ""
        log(f"stopped in {time.monotonic() - started:.1f} s ({len(removed)} shared-memory region(s) removed{late})")


def config_name_in(extra_args: tuple[str, ...]) -> str | None:
    """The --model-config-name given among tritonserver's arguments, if any."""
    for arg in extra_args:
        if arg.startswith("--model-config-name="):
            return arg.partition("=")[2] or None
    return None


def choose_model_config(config: ServeSettings, devices: Callable[[], Devices] | None = None) -> tuple[str | None, str]:
    """The model configuration Triton loads (a name for --model-config-name; None: config.pbtxt), and the start-up
    line that says which path, GPUs and configuration were chosen, and why. `devices` asks which GPUs the serving
    environment sees (cuda_devices by default), only when the choice depends on it."""
    if any(arg.startswith("--model-config-name") for arg in config.extra_args):
        return None, "model config: as tritonserver's arguments say"
    if config.model_config == "default":
        return None, "model config: config.pbtxt (KEV_MODEL_CONFIG=default)"
    if config.model_config != "auto":
        return config.model_config, f"model config: configs/{config.model_config}.pbtxt (KEV_MODEL_CONFIG)"
    seen = devices() if devices is not None else cuda_devices(config.venv / "bin" / "python")
    if seen.gpus:
        return "gpu", f"GPU path: {seen.describe()}; model config configs/gpu.pbtxt (an instance per GPU)"
    if config.expect_gpu:
        return None, (
            f"WARNING: NO GPU. This is the GPU image (KEV_EXPECT_GPU=1) and it sees none ({seen.describe()}): serving "
            "on the CPU path, config.pbtxt, far slower than on a GPU. Give the container a GPU (podman run --device "
            "nvidia.com/gpu=all, docker run --gpus all, Kubernetes resources.limits nvidia.com/gpu: 1)"
        )
    return None, f"CPU path ({seen.describe()}); model config config.pbtxt"


def main(argv: list[str] | None = None) -> None:
    """Arguments go to tritonserver (but a lone --version); everything else comes from the environment (build/serve.sh
    lists it)."""
    args = sys.argv[1:] if argv is None else argv
    if args == ["--version"]:
        print(version_line("kev-serve"))
        sys.exit(0)
    env = dict(os.environ)
    try:
        config = ServeSettings.read(env, args)
        key = admin_key(env)
    except SettingError as error:
        log(f"EXITING: {error}")
        sys.exit(2)
    sys.exit(Supervisor(config, child_env(env, config), key).run())


if __name__ == "__main__":
    main()
