"""kev_backend.settings: the one reader of the model's parameters and of the environment, with one grammar per kind of
value; docs/configuration.md documents every setting it reads."""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from kev_backend.engine.engine import EngineOptions
from kev_backend.protocol.request import Limits
from kev_backend.serve.stub.triton_config import engine_options, warmup_requests
from kev_backend.serve.supervisor.supervisor import choose_model_config
from kev_backend.settings import (
    PARAMETERS,
    GatewaySettings,
    ModelSettings,
    ServeSettings,
    SettingError,
    admin_key,
)

REPO = Path(__file__).resolve().parents[1]


def read(params: dict[str, str], model_dir: Path = Path("/models/kev"), **env: str) -> ModelSettings:
    return ModelSettings.read({"checkpoint": "embedded/kev", **params}, model_dir, env)


def test_paths_resolve_against_the_model_directory(tmp_path: Path) -> None:
    settings = read({"warmup_requests": "w.jsonl"}, tmp_path)
    assert settings.checkpoint == (tmp_path / "embedded" / "kev").resolve()
    assert read({}, tmp_path, KEV_CHECKPOINT="/abs/kev").checkpoint == Path("/abs/kev")
    (tmp_path / "w.jsonl").write_text('{"state": 1}\n\n{"state": 2}\n')
    assert warmup_requests(settings) == ['{"state": 1}', '{"state": 2}']
    assert warmup_requests(read({}, tmp_path)) == []
    with pytest.raises(SettingError, match="no checkpoint"):
        ModelSettings.read({}, tmp_path, {})


def test_unset_and_empty_settings_keep_the_defaults_in_code() -> None:
    options = engine_options(read({"bank_bytes": "", "graphs": " "}), "auto")
    assert options == EngineOptions(), "an empty parameter must mean the default, not a value"
    assert options.graphs and options.gemm_algos == "auto", "the shipped GPU choices are the defaults in code"
    assert read({}).limits == Limits()


def test_the_environment_overrides_the_parameter() -> None:
    settings = read({"max_questions": "10", "graphs": "on"}, KEV_MAX_QUESTIONS="3", KEV_GRAPHS="off", KEV_DTYPE="")
    assert settings.limits.max_questions == 3 and settings.engine["graphs"] is False
    assert "dtype" not in settings.load, "an empty variable is unset"
    load = read({"temperature": "2"}, KEV_TEMPERATURE="0.5", KEV_LORA_SCALE="2", KEV_BASE="/base").load
    assert load == {"temperature": 0.5, "lora_scale": 2.0, "base": "/base"}


def test_the_instance_device_unless_a_device_is_set() -> None:
    assert engine_options(read({}), "cuda:1").device == "cuda:1"
    assert engine_options(read({"device": "auto"}), "cuda:1").device == "cuda:1"
    assert engine_options(read({"device": "cpu"}), "cuda:1").device == "cpu"


@pytest.mark.parametrize(
    "value, expected",
    [("on", True), ("1", True), ("TRUE", True), ("yes", True), ("off", False), ("0", False), ("False", False)],
)
def test_switches_take_one_grammar_everywhere(value: str, expected: bool) -> None:
    assert read({"graphs": value}).engine["graphs"] is expected
    assert read({}, KEV_GRAPHS=value).engine["graphs"] is expected
    assert ServeSettings.read({"GATEWAY": value}).gateway is expected


@pytest.mark.parametrize(
    "params, env, message",
    [
        ({"graphs": "onn"}, {}, "parameter graphs='onn': must be one of 1/on/true/yes or 0/off/false/no"),
        ({}, {"KEV_GRAPHS": "maybe"}, "KEV_GRAPHS='maybe'"),
        ({"bank_bytes": "1GiB"}, {}, "parameter bank_bytes='1GiB': must be a whole number"),
        ({"max_json_depth": "500"}, {}, "max_json_depth='500': must be 2..200"),
        ({"long_kernels": "triton"}, {}, "unknown model parameter.*long_kernels"),  # a retired switch
        ({"submit_bytes": "262144"}, {}, "unknown model parameter.*submit_bytes"),  # parts are sized by work now
        ({"dtype": "int8"}, {}, "dtype='int8'"),
        ({"temprature": "1"}, {}, "unknown model parameter.*temprature"),
    ],
)
def test_a_bad_value_fails_the_load_naming_it(params: dict[str, str], env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingError, match=message):
        read(params, **env)


def test_every_parameter_is_documented() -> None:
    docs = (REPO / "docs" / "configuration.md").read_text()
    for p in PARAMETERS:
        assert f"`{p.name}` / `{p.variable}`" in docs, p.name


def test_serve_settings_grammar() -> None:
    assert ServeSettings.read({}) == ServeSettings()
    assert ServeSettings.read({"HTTP_PORT": "", "KEV_STOP_TIMEOUT_S": "0.5"}).stop_timeout_s == 2.0
    assert ServeSettings.read({"KEV_MODEL_CONFIG": "gpu"}).model_config == "gpu"
    for env, message in [
        ({"HTTP_PORT": "80a"}, "HTTP_PORT='80a': must be a whole number"),
        ({"GRPC_PORT": "70000"}, "GRPC_PORT='70000': must be 0..65535"),
        ({"KEV_PROBE_TIMEOUT_S": "-1"}, "must not be negative"),
        ({"KEV_PROBE_TIMEOUT_S": "0"}, "KEV_PROBE_TIMEOUT_S='0': must be more than 0"),
        ({"KEV_RESTART_WINDOW_S": "0"}, "KEV_RESTART_WINDOW_S='0': must be more than 0"),
        ({"KEV_PROBE_FAILURES": "0"}, "KEV_PROBE_FAILURES='0': must be at least 1"),
        ({"GATEWAY": "2"}, "GATEWAY='2'"),
    ]:
        with pytest.raises(SettingError, match=re.escape(message)):
            ServeSettings.read(env)


def test_the_model_config_follows_the_gpus() -> None:
    """kev-serve picks configs/gpu.pbtxt when the serving environment's torch sees a GPU, and says so."""
    import torch

    config = ServeSettings(venv=Path(sys.prefix))
    name, line = choose_model_config(config)
    if torch.cuda.is_available():
        assert name == "gpu" and line.startswith("GPU path: ") and torch.cuda.get_device_name(0) in line, line
    else:
        assert name is None and line.startswith("CPU path (no GPU: "), line
    assert choose_model_config(replace(config, model_config="default"))[0] is None
    assert choose_model_config(replace(config, model_config="gpu"))[0] == "gpu"
    assert choose_model_config(replace(config, extra_args=("--model-config-name=gpu",)))[0] is None
    if not torch.cuda.is_available():  # the GPU image on a machine without one: the CPU path, said loudly
        name, line = choose_model_config(replace(config, expect_gpu=True))
        assert name is None and line.startswith("WARNING: NO GPU. This is the GPU image (KEV_EXPECT_GPU=1)"), line
        assert ServeSettings.read({"KEV_EXPECT_GPU": "1"}).expect_gpu and not ServeSettings.read({}).expect_gpu


def test_admin_key(tmp_path: Path) -> None:
    (tmp_path / "key").write_text("s3cret-key\n")
    assert admin_key({"TRITON_ADMIN_KEY_FILE": str(tmp_path / "key"), "TRITON_ADMIN_KEY": "other"}) == "s3cret-key"
    assert admin_key({"TRITON_ADMIN_KEY": "k.1"}) == "k.1"
    assert admin_key({}) != admin_key({}), "a random key per start"
    for bad in ("", "a,b", "k:v", "x=y", "with space"):  # Triton splits its key option on ',', ':' and '='
        (tmp_path / "key").write_text(bad)
        with pytest.raises(SettingError, match="letters, digits"):
            admin_key({"TRITON_ADMIN_KEY_FILE": str(tmp_path / "key")})


def test_the_gateway_takes_the_models_limits() -> None:
    settings = GatewaySettings.read({"KEV_MAX_QUESTIONS": "7", "KEV_GATEWAY_MAX_DECODED_BYTES": "5000"})
    limits = settings.limits({"max_json_depth": "9", "max_questions": "100", "max_request_bytes": "99"})
    assert (limits.max_json_depth, limits.max_questions, limits.max_request_bytes) == (9, 7, 5000)
    assert settings.limits({}) == Limits(max_questions=7, max_request_bytes=5000)
    with pytest.raises(SettingError, match="KEV_GATEWAY_TIMEOUT_S"):
        GatewaySettings.read({"KEV_GATEWAY_TIMEOUT_S": "soon"})


def test_the_gateways_connection_settings() -> None:
    """The front's and the arrivals' settings: defaults in code, each variable read with its grammar."""
    default = GatewaySettings.read({})
    assert (default.header_timeout_s, default.body_idle_timeout_s, default.body_timeout_s) == (10.0, 10.0, 60.0)
    assert (default.keepalive_timeout_s, default.max_connections, default.max_arriving) == (60.0, None, 4096)
    given = GatewaySettings.read(
        {
            "KEV_GATEWAY_HEADER_TIMEOUT_S": "2.5",
            "KEV_GATEWAY_MAX_HEADER_BYTES": "4096",
            "KEV_GATEWAY_MAX_URL_BYTES": "1024",
            "KEV_GATEWAY_MAX_CONNECTIONS": "100",
            "KEV_GATEWAY_MAX_ARRIVING_BYTES": "1000000",
        }
    )
    assert (given.header_timeout_s, given.max_header_bytes, given.max_url_bytes) == (2.5, 4096, 1024)
    assert (given.max_connections, given.max_arriving_bytes) == (100, 1_000_000)
    for name, bad in (
        ("KEV_GATEWAY_BODY_TIMEOUT_S", "0"),
        ("KEV_GATEWAY_KEEPALIVE_TIMEOUT_S", "-1"),
        ("KEV_GATEWAY_MAX_HEADER_BYTES", "100"),
        ("KEV_GATEWAY_MAX_CONNECTIONS", "many"),
    ):
        with pytest.raises(SettingError, match=name):
            GatewaySettings.read({name: bad})


def environment_reads(path: Path) -> list[str]:
    """`os.environ.get(...)`, `os.getenv(...)` and `os.environ[...]` reads in a Python file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        target = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "getenv" or (node.func.attr in ("get", "pop") and "environ" in ast.unparse(node.func)):
                target = node
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and "environ" in ast.unparse(node):
            target = node
        if target is not None:
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(target)}")
    return found


def test_settings_is_the_only_reader_of_the_environment() -> None:
    files = [
        path
        for folder in ("kev_backend", "model_repository", "bench", "loadtest")
        for path in sorted((REPO / folder).rglob("*.py"))
        if path != REPO / "kev_backend" / "settings.py"
    ]
    assert len(files) > 40
    reads = [read for path in files for read in environment_reads(path)]
    assert reads == []
