"""Every setting of Kev on Triton, read here and nowhere else: the Triton model's `parameters` (config.pbtxt) with
their `KEV_<NAME>` environment overrides, the supervisor's and the gateway's environment variables. The rest of
the package takes what it needs as arguments; docs/configuration.md is the table of all of them.

One grammar per kind of value, the same in config.pbtxt and in the environment:
- an empty value (or an unset variable) is the default, which lives in code beside the option it sets;
- switches: 1/on/true/yes or 0/off/false/no, any case;
- integers: decimal, with a lower bound where one makes sense; seconds: a decimal number, never negative;
- anything else that does not parse is an error naming the setting and where it came from (SettingError).

This module imports no torch, so the supervisor and the gateway read their settings without it.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .protocol.request import Limits

REPO = Path(__file__).resolve().parent.parent
# The variable kev-serve sets for each start of tritonserver: where the model writes its heartbeat (ModelSettings).
HEARTBEAT_PREFIX = "KEV_HEARTBEAT_PREFIX"
TRUE = ("1", "on", "true", "yes")
FALSE = ("0", "off", "false", "no")
Environment = Mapping[str, str]


class SettingError(ValueError):
    """A setting whose value does not parse or is out of range; the message names the setting and its source."""


# --- grammars --------------------------------------------------------------------------------------------------


def boolean(raw: str) -> bool:
    value = raw.strip().lower()
    if value in TRUE or value in FALSE:
        return value in TRUE
    raise ValueError(f"must be one of {'/'.join(TRUE)} or {'/'.join(FALSE)}")


def integer(minimum: int = 1, maximum: int | None = None) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        try:
            value = int(raw.strip())
        except ValueError:
            raise ValueError("must be a whole number") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise ValueError(f"must be {minimum}..{maximum}" if maximum is not None else f"must be at least {minimum}")
        return value

    return parse


def seconds(raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise ValueError("must be a number of seconds") from None
    if not value >= 0:  # also NaN
        raise ValueError("must not be negative")
    return value


def positive_seconds(raw: str) -> float:
    """Seconds where 0 would mean nothing sensible (a window that counts nothing, a probe that cannot succeed)."""
    value = seconds(raw)
    if value == 0:
        raise ValueError("must be more than 0")
    return value


def number(raw: str) -> float:
    try:
        return float(raw.strip())
    except ValueError:
        raise ValueError("must be a number") from None


def one_of(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return value

    return parse


def text(raw: str) -> str:
    return raw.strip()


def port(raw: str) -> int:
    return integer(0, 65535)(raw)


def read(source: str, raw: str | None, parse: Callable[[str], Any], default: Any = None) -> Any:
    """`raw` parsed, or `default` when it is unset or empty; `source` names it in errors."""
    if raw is None or not raw.strip():
        return default
    try:
        return parse(raw)
    except ValueError as error:
        raise SettingError(f"{source}={raw!r}: {error}") from None


def variables(env: Environment) -> Callable[[str, Callable[[str], Any], Any], Any]:
    """`get(NAME, parse, default)` over `env`: the variable parsed, or the default when unset or empty."""

    def get(name: str, parse: Callable[[str], Any], default: Any) -> Any:
        return read(name, env.get(name), parse, default)

    return get


# --- the Triton model ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Parameter:
    """A model parameter: `name` in config.pbtxt, KEV_<NAME> in the environment (which wins when set and not empty).
    `group` says which options it sets: the engine's (EngineOptions), the checkpoint load's (LoadOptions), the
    request limits (Limits), or this model adapter's own."""

    name: str
    group: str
    parse: Callable[[str], Any]

    @property
    def variable(self) -> str:
        return f"KEV_{self.name.upper()}"


PARAMETERS = (
    Parameter("checkpoint", "model", text),
    Parameter("warmup_requests", "model", text),
    Parameter("part_tokens", "model", integer(1)),
    Parameter("device", "engine", text),
    Parameter("bank_bytes", "engine", integer(1)),
    Parameter("row_pass_tokens", "engine", integer(1)),
    Parameter("graphs", "engine", boolean),
    Parameter("graph_max_tokens", "engine", integer(1)),
    Parameter("max_graphs", "engine", integer(1)),
    Parameter("gemm_algos", "engine", text),
    Parameter("date_facts", "engine", boolean),
    Parameter("base", "load", text),
    Parameter("dtype", "load", one_of("fp32", "float32", "bf16", "bfloat16", "fp16", "float16")),
    Parameter("temperature", "load", number),
    Parameter("lora_scale", "load", number),
    Parameter("max_request_bytes", "limits", integer(1)),
    Parameter("max_json_depth", "limits", integer(2, 200)),
    Parameter("max_questions", "limits", integer(1)),
    Parameter("max_state_tokens", "limits", integer(1)),
    Parameter("max_row_tokens", "limits", integer(1)),
    Parameter("max_request_tokens", "limits", integer(1)),
    Parameter("truncate_states", "limits", boolean),
)


def parameters(model_config: Mapping[str, Any]) -> dict[str, str]:
    """The `parameters` of a model config (Triton's JSON form) as plain strings."""
    return {key: value.get("string_value", "") for key, value in model_config.get("parameters", {}).items()}


@dataclass(frozen=True)
class ModelSettings:
    """What the Triton model reads. `engine` and `load` hold only the settings given (the rest keep the defaults of
    EngineOptions and LoadOptions, which live with them); paths are resolved against the model directory."""

    checkpoint: Path
    warmup_requests: Path | None = None
    part_tokens: int | None = None  # None: the pipeline's default (the engine's pass budget)
    engine: dict[str, Any] = field(default_factory=dict)
    load: dict[str, Any] = field(default_factory=dict)
    limits: Limits = field(default_factory=Limits)
    # Where the model writes its heartbeat for kev-serve (serve/stub/heartbeat.py): KEV_HEARTBEAT_PREFIX, which
    # kev-serve sets for each start of tritonserver; None (tritonserver started otherwise): no heartbeat.
    heartbeat_prefix: str | None = None

    @classmethod
    def read(cls, params: Mapping[str, str], model_dir: Path, env: Environment = os.environ) -> ModelSettings:
        given = read_parameters(params, env)
        unknown = sorted(set(params) - {p.name for p in PARAMETERS})
        if unknown:
            raise SettingError(f"unknown model parameter(s) {', '.join(unknown)}: docs/configuration.md lists them")
        if "checkpoint" not in given:
            raise SettingError("no checkpoint: set KEV_CHECKPOINT or the model parameter `checkpoint`")
        groups: dict[str, dict[str, Any]] = {"engine": {}, "load": {}, "limits": {}, "model": {}}
        for p in PARAMETERS:
            if p.name in given:
                groups[p.group][p.name] = given[p.name]
        model, engine = groups["model"], groups["engine"]
        if engine.get("device") == "auto":
            del engine["device"]  # the instance's own device
        if "gemm_algos" in engine and engine["gemm_algos"] not in ("auto", "off"):
            engine["gemm_algos"] = str(resolve(engine["gemm_algos"], model_dir))
        try:
            limits = Limits(**groups["limits"])
        except ValueError as error:
            raise SettingError(f"request limits: {error}") from None
        warmup = model.get("warmup_requests")
        return cls(
            checkpoint=resolve(model["checkpoint"], model_dir),
            warmup_requests=resolve(warmup, model_dir) if warmup else None,
            part_tokens=model.get("part_tokens"),
            engine=engine,
            load=groups["load"],
            limits=limits,
            heartbeat_prefix=variables(env)(HEARTBEAT_PREFIX, text, None),
        )


def read_parameters(params: Mapping[str, str], env: Environment = os.environ) -> dict[str, Any]:
    """The parameters that are set (KEV_<NAME> over the config's value), parsed."""
    given = {}
    for p in PARAMETERS:
        if env.get(p.variable, "").strip():
            value = read(p.variable, env[p.variable], p.parse)
        else:
            value = read(f"parameter {p.name}", params.get(p.name), p.parse)
        if value is not None:
            given[p.name] = value
    return given


def model_limits(params: Mapping[str, str], env: Environment = os.environ) -> Limits:
    """The request limits the model enforces, from its parameters and KEV_* overrides (the gateway's too)."""
    given = read_parameters(params, env)
    return Limits(**{p.name: given[p.name] for p in PARAMETERS if p.group == "limits" and p.name in given})


def resolve(raw: str, directory: Path) -> Path:
    path = Path(raw)
    return path if path.is_absolute() else (directory / path).resolve()


# --- kev-serve (the supervisor) --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServeSettings:
    """`kev-serve`'s settings (build/serve.sh lists them); extra arguments go to tritonserver."""

    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    gateway_port: int = 8009
    gateway: bool = True
    triton_address: str = "127.0.0.1"
    bind_address: str = "127.0.0.1"
    model_repository: Path = REPO / "model_repository"
    # "auto": configs/gpu.pbtxt when the serving environment's torch sees a GPU, else config.pbtxt; "default":
    # config.pbtxt; any other name: that file of the model's configs/ directory
    model_config: str = "auto"
    # Set by the GPU image: a start that sees no GPU still serves (the CPU path) but says so first, loudly.
    expect_gpu: bool = False
    venv: Path = REPO / ".venv"
    # the malloc of tritonserver, its stubs and the gateway: "jemalloc" where the host has it
    # (serve/supervisor/allocator.py says why), else glibc's with a warning; "glibc": glibc's
    host_allocator: str = "jemalloc"
    model: str = "kev"
    probe_interval_s: float = 1.0
    probe_timeout_s: float = 10.0
    probe_failures: int = 3
    # The longest a model instance may hold a job without a beat (kev_backend/serve/stub/heartbeat.py): beats come after
    # every layer of every 4,096-token chunk on the CPU reference path and after every GPU pass, so this covers the
    # longest single unit of work (docs/operations.md, "Recovery and shutdown", says how it was chosen).
    progress_timeout_s: float = 120.0
    start_timeout_s: float = 600.0
    stop_timeout_s: float = 5.0
    max_restarts: int = 5
    restart_window_s: float = 600.0
    # Past max_restarts within the window, each start waits: restart_backoff_s, doubling up to restart_backoff_max_s,
    # until a whole window passes without a restart.
    restart_backoff_s: float = 5.0
    restart_backoff_max_s: float = 300.0
    extra_args: tuple[str, ...] = ()

    @classmethod
    def read(cls, env: Environment = os.environ, argv: Iterable[str] = ()) -> ServeSettings:
        d = cls()
        get = variables(env)
        backoff = get("KEV_RESTART_BACKOFF_S", positive_seconds, d.restart_backoff_s)
        return cls(
            http_port=get("HTTP_PORT", port, d.http_port),
            grpc_port=get("GRPC_PORT", port, d.grpc_port),
            metrics_port=get("METRICS_PORT", port, d.metrics_port),
            gateway_port=get("GATEWAY_PORT", port, d.gateway_port),
            gateway=get("GATEWAY", boolean, d.gateway),
            triton_address=get("TRITON_ADDRESS", text, d.triton_address),
            bind_address=get("BIND_ADDRESS", text, d.bind_address),
            model_repository=Path(get("MODEL_REPOSITORY", text, d.model_repository)).resolve(),
            model_config=get("KEV_MODEL_CONFIG", text, d.model_config),
            expect_gpu=get("KEV_EXPECT_GPU", boolean, d.expect_gpu),
            venv=Path(get("KEV_VENV", text, d.venv)).resolve(),
            host_allocator=get("KEV_HOST_ALLOCATOR", one_of("jemalloc", "glibc"), d.host_allocator),
            model=get("KEV_TRITON_MODEL", text, d.model),
            probe_interval_s=get("KEV_PROBE_INTERVAL_S", seconds, d.probe_interval_s),
            probe_timeout_s=get("KEV_PROBE_TIMEOUT_S", positive_seconds, d.probe_timeout_s),
            probe_failures=get("KEV_PROBE_FAILURES", integer(1), d.probe_failures),
            progress_timeout_s=get("KEV_PROGRESS_TIMEOUT_S", positive_seconds, d.progress_timeout_s),
            start_timeout_s=get("KEV_START_TIMEOUT_S", seconds, d.start_timeout_s),
            stop_timeout_s=max(2.0, get("KEV_STOP_TIMEOUT_S", seconds, d.stop_timeout_s)),
            max_restarts=get("KEV_MAX_RESTARTS", integer(0), d.max_restarts),
            restart_window_s=get("KEV_RESTART_WINDOW_S", positive_seconds, d.restart_window_s),
            restart_backoff_s=backoff,
            restart_backoff_max_s=max(
                backoff, get("KEV_RESTART_BACKOFF_MAX_S", positive_seconds, d.restart_backoff_max_s)
            ),
            extra_args=tuple(argv),
        )

    @property
    def triton_host(self) -> str:
        """Where the supervisor and the gateway reach Triton."""
        return reachable(self.triton_address)

    @property
    def gateway_url(self) -> str:
        return f"http://{reachable(self.bind_address)}:{self.gateway_port}"

    @property
    def grpc_target(self) -> str:
        return f"{self.triton_host}:{self.grpc_port}"


# GPU memory that stays flat under mixed traffic, and a large model's start on a GPU it nearly fills: torch's caching
# allocator, holding fixed-size segments, keeps reserving more as pass shapes vary while the memory in use stays flat,
# and the segments left by loading the weights can leave no room for the largest pass; expandable segments grow one
# mapping instead (CUDA graphs capture as before). Kev-27B's shapes start on an 80 GB H100 with them, not without.
CUDA_ALLOCATOR = "expandable_segments:True"


def use_cuda_allocator(env: MutableMapping[str, str] = os.environ) -> None:
    """PYTORCH_CUDA_ALLOC_CONF's default for the processes that run the engine, unless it is set. Torch reads it at the
    process's first CUDA allocation: the engine's processes call this before they load weights (the Triton model's
    initialize, whether kev-serve or a plain tritonserver started it; the bench), and kev-serve sets it for
    tritonserver's children."""
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", CUDA_ALLOCATOR)


def reachable(address: str) -> str:
    """Where to reach, from this host, a server bound to `address`: loopback when it binds every address."""
    if address in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{address}]" if ":" in address else address


ADMIN_KEY = re.compile(r"[A-Za-z0-9._~+/-]+")


def admin_key(env: Environment = os.environ) -> str:
    """The value of the `admin-key` header Triton's restricted APIs require.

    TRITON_ADMIN_KEY_FILE names a file holding a chosen key; TRITON_ADMIN_KEY (an environment variable, readable only
    by the same user) is still accepted; otherwise a random key per supervisor start, which is never printed.
    tritonserver 2.51 takes the key only in its argv, where local users of the host can read it: see build/serve.sh.
    """
    if path := env.get("TRITON_ADMIN_KEY_FILE"):
        try:
            key = Path(path).read_text().strip()
        except OSError as error:
            raise SettingError(f"TRITON_ADMIN_KEY_FILE: {error}") from None
    else:
        key = env.get("TRITON_ADMIN_KEY") or secrets.token_hex(16)
    # The key sits inside "<apis>:admin-key=<key>", which Triton splits on ',', ':' and '='.
    if not ADMIN_KEY.fullmatch(key):
        raise SettingError("the admin key must be non-empty and use only letters, digits and ._~+/-")
    return key


# --- the gateway -----------------------------------------------------------------------------------------------

# Kev's 65,536-token state at ~64 bytes a token: no request Kev would answer is refused for its size.
MAX_BODY_BYTES = 4 << 20


@dataclass(frozen=True)
class GatewaySettings:
    """`kev-gateway`'s settings. Its request limits are the model's (`limits`, from Triton's model config and the same
    KEV_* overrides, once Triton has answered), with the body limit replaced by `max_decoded_bytes`."""

    triton_url: str = "127.0.0.1:8001"
    metrics_url: str = "127.0.0.1:8002"  # Triton's metrics port: the serving statistics of GET /v1/models
    model: str = "kev"
    api_key: str | None = None
    max_in_flight: int = 512  # requests the gateway holds at once; more get 429 at once
    timeout_s: float = 120.0
    retry_after_s: int = 1
    release_date: str = "2026-10-01"
    max_body_bytes: int = MAX_BODY_BYTES  # a request body on the wire; more is a 413
    max_decoded_bytes: int = MAX_BODY_BYTES  # a compressed body once decoded; more is a 413
    # Requests whose body is being read, not yet admitted (they hold no in-flight slot): how many, and the body bytes
    # they hold together; more get 429 at once.
    max_arriving: int = 4096
    max_arriving_bytes: int = 512 << 20
    # The connections (serve/gateway/front.py): deadlines for a request's head, a body's pauses and its whole
    # arrival, and a connection with no request in progress; the head's and the URL's bytes; connections open at once
    # (None: the descriptor limit less an eighth).
    header_timeout_s: float = 10.0
    body_idle_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    # 60 s, as proxies keep idle connections (nginx 75 s): shorter, idle sockets that reconnect cost the host more
    # than they hold (at 5 s, 20,000 reopening sockets doubled other clients' p99 on 2 CPUs; at 60 s, 1.68x, the
    # connection limit closing the idle ones instead)
    keepalive_timeout_s: float = 60.0
    max_header_bytes: int = 32 << 10
    max_url_bytes: int = 8 << 10
    max_connections: int | None = None
    access_log: bool = True  # a JSON line a request on stdout (serve/gateway/access.py)
    env: Mapping[str, str] = field(default_factory=dict, repr=False)  # for the model's KEV_* limit overrides

    @classmethod
    def read(cls, env: Environment = os.environ) -> GatewaySettings:
        d = cls()
        get = variables(env)
        return cls(
            triton_url=get("TRITON_GRPC_URL", text, d.triton_url),
            metrics_url=get("TRITON_METRICS_URL", text, d.metrics_url),
            model=get("KEV_TRITON_MODEL", text, d.model),
            api_key=get("KEV_API_KEY", text, None),
            max_in_flight=get("KEV_GATEWAY_MAX_IN_FLIGHT", integer(1), d.max_in_flight),
            access_log=get("KEV_GATEWAY_ACCESS_LOG", boolean, d.access_log),
            timeout_s=get("KEV_GATEWAY_TIMEOUT_S", seconds, d.timeout_s),
            release_date=get("KEV_RELEASE_DATE", text, d.release_date),
            max_body_bytes=get("KEV_GATEWAY_MAX_BODY_BYTES", integer(1), d.max_body_bytes),
            max_decoded_bytes=get("KEV_GATEWAY_MAX_DECODED_BYTES", integer(1), d.max_decoded_bytes),
            max_arriving=get("KEV_GATEWAY_MAX_ARRIVING", integer(1), d.max_arriving),
            max_arriving_bytes=get("KEV_GATEWAY_MAX_ARRIVING_BYTES", integer(1), d.max_arriving_bytes),
            header_timeout_s=get("KEV_GATEWAY_HEADER_TIMEOUT_S", positive_seconds, d.header_timeout_s),
            body_idle_timeout_s=get("KEV_GATEWAY_BODY_IDLE_TIMEOUT_S", positive_seconds, d.body_idle_timeout_s),
            body_timeout_s=get("KEV_GATEWAY_BODY_TIMEOUT_S", positive_seconds, d.body_timeout_s),
            keepalive_timeout_s=get("KEV_GATEWAY_KEEPALIVE_TIMEOUT_S", positive_seconds, d.keepalive_timeout_s),
            max_header_bytes=get("KEV_GATEWAY_MAX_HEADER_BYTES", integer(256), d.max_header_bytes),
            max_url_bytes=get("KEV_GATEWAY_MAX_URL_BYTES", integer(64), d.max_url_bytes),
            max_connections=get("KEV_GATEWAY_MAX_CONNECTIONS", integer(1), d.max_connections),
            env={k: v for k, v in env.items() if k.startswith("KEV_")},
        )

    def limits(self, params: Mapping[str, str]) -> Limits:
        """The model's limits (`params` from Triton's model config), the body limit being the decoded one."""
        return replace(model_limits(params, self.env), max_request_bytes=self.max_decoded_bytes)

    def dtype(self, params: Mapping[str, str]) -> str | None:
        """The weights' dtype the model was given (its parameter, or KEV_DTYPE), None for the load's default."""
        return read_parameters(params, self.env).get("dtype")


def gateway_address(env: Environment = os.environ) -> tuple[str, int]:
    """A stand-alone gateway's listening address: GATEWAY_HOST and GATEWAY_PORT (kev-serve passes its own)."""
    get = variables(env)
    return get("GATEWAY_HOST", text, "127.0.0.1"), get("GATEWAY_PORT", port, 8009)


def api_key(env: Environment = os.environ) -> str | None:
    """The gateway's bearer key (KEV_API_KEY), for clients such as the load tests."""
    return variables(env)("KEV_API_KEY", text, None)
