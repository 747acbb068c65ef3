"""README.md's commands, run as a reader pastes them, against a real server this module starts: `build/serve.sh`
(what `make serve` runs) on the embedded toy checkpoint, with its gateway, on free ports.

The commands are read from README's fenced blocks, not copied here, so an edit that breaks one breaks a test: every
```bash line is either run here (the curl requests, `kev score`, the load tools, shortened) or named in ELSEWHERE
with the test file that runs it or the reason it cannot run on this machine; every ```python block runs in its own
interpreter; a block of output after a command (```json or ```text) is compared with what the command printed.
README's ports (8000, 8001, 8002, 8009) are rewritten to the server's: other servers may be listening on them.
"""

from __future__ import annotations

import ast
import csv
import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kev_backend.dev.ports import free_port
from kev_backend.serve.supervisor.procs import descendant_named
from tests.conftest import REPO, TritonServer, start_triton, stop_triton, wait_ready
from tests.helpers import README_ANSWERS, README_REQUEST

README = REPO / "README.md"
VENV = REPO / ".venv"  # README's commands name .venv/bin/..., relative to the repository
# config.pbtxt's default `checkpoint` (embedded/kev), which `make serve` serves: README prints its answers
EMBEDDED = REPO / "model_repository" / "kev" / "embedded" / "kev"

# --- README's blocks and commands ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    lang: str
    text: str
    line: int  # README's line of the opening fence, for messages
    output: Block | None = None  # the block of output printed right after it, if any


def read_blocks(text: str) -> list[Block]:
    """README's fenced blocks in order; an output block (```json or ```text) directly after a ```bash block (only
    prose between them) becomes that block's `output`."""
    found: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = re.fullmatch(r"(\s*)```(\w*)\s*", lines[i])
        if not opening:
            i += 1
            continue
        indent, lang = opening.groups()
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        assert end < len(lines), f"README line {i + 1}: a fence that never closes"
        body = "\n".join(line.removeprefix(indent) for line in lines[i + 1 : end])
        block = Block(lang, body, i + 1)
        if lang in ("json", "text") and found and found[-1].lang == "bash" and found[-1].output is None:
            previous = found.pop()
            block = Block(previous.lang, previous.text, previous.line, block)
        found.append(block)
        i = end + 1
    return found


def split_commands(text: str) -> list[str]:
    """A bash block's commands as bash reads them: comments dropped (a `#` that starts a word, outside quotes), a
    newline inside quotes or after a backslash continuing the command."""
    commands: list[str] = []
    current: list[str] = []
    quote: str | None = None
    i = 0
    while i < len(text):
        c = text[i]
        if quote:
            current.append(c)
            if c == quote:
                quote = None
            elif c == "\\" and quote == '"' and i + 1 < len(text):
                current.append(text[i + 1])
                i += 1
        elif c == "\\" and i + 1 < len(text):
            current += [c, text[i + 1]]
            i += 1
        elif c in "'\"":
            quote = c
            current.append(c)
        elif c == "#" and (not current or current[-1].isspace()):
            while i < len(text) and text[i] != "\n":
                i += 1
            continue
        elif c == "\n":
            commands.append("".join(current).strip())
            current = []
        else:
            current.append(c)
        i += 1
    assert quote is None, f"a quote ({quote}) left open in:\n{text}"
    commands.append("".join(current).strip())
    return [command for command in commands if command]


def normal(command: str) -> str:
    """One line, single spaces: how ELSEWHERE spells a command."""
    return " ".join(command.replace("\\\n", " ").split())


BLOCKS = read_blocks(README.read_text())
BASH = [block for block in BLOCKS if block.lang == "bash"]
COMMANDS = [command for block in BASH for command in split_commands(block.text)]
PYTHON = [block for block in BLOCKS if block.lang == "python"]

# --- what runs here, and what runs elsewhere ----------------------------------------------------------------------

# A command matching one of these is run by this module (the test named).
RUN_HERE = {
    r"curl -s ": "test_curl_requests",
    r"echo '.*' > requests\.jsonl": "test_kev_score",
    r"\.venv/bin/kev score ": "test_kev_score",
    r"\.venv/bin/locust ": "test_locust",
    r"\.venv/bin/python loadtest/openloop\.py ": "test_openloop",
    r"\.venv/bin/python loadtest/soak\.py ": "test_soak",
}


@dataclass(frozen=True)
class Elsewhere:
    test: str | None  # the test file (from the repository's root) that runs it or what it does, if any
    why: str  # why it does not run here


CLUSTER = "needs a Kubernetes cluster (none here); the manifests are rendered and checked offline"
ELSEWHERE: dict[str, Elsewhere] = {
    "make serve": Elsewhere(
        "tests/serve/supervisor/test_supervisor.py",
        "setup is this checkout's own; build/serve.sh, what `make serve` runs after it, is this module's server",
    ),
    "make test": Elsewhere(None, "runs the whole suite, this module included"),
    "KEV_CHECKPOINT=/models/kev-4b KEV_BASE=/models/Qwen3.5-4B-Base make serve": Elsewhere(
        "tests/model/test_checkpoint.py", "no real checkpoint here (nothing is downloaded); the tests load LoRA ones"
    ),
    "make serve TORCH=system PYTHON=/opt/torch/bin/python3": Elsewhere(
        "tests/gpu/test_stack.py", "needs a GPU host whose python has its own CUDA torch"
    ),
    "make wheelhouse": Elsewhere(
        "tests/deploy/test_image.py", "downloads ~600 MiB of wheels; `make image-test` builds the image from it"
    ),
    "make serve WHEELHOUSE=build/wheelhouse": Elsewhere(
        None, "needs a machine without network: build/image/offline_check.sh (root, unshare --net) proves it"
    ),
    "make wheelhouse WHEEL_PYTHON=3.12 WHEEL_TORCH=system SETS=serve WHEEL_HAVE=have.txt": Elsewhere(
        None, "for a GPU server's own python: have.txt is that server's `pip freeze`"
    ),
    "make serve WHEELHOUSE=DIR TORCH=system SETS=serve": Elsewhere(
        None, "on a GPU server whose python has its own torch, from the wheelhouse above"
    ),
    "make image && make image-test": Elsewhere("tests/deploy/test_image.py", "builds and runs the image with podman"),
    "podman run -d -p 127.0.0.1:8009:8009 --shm-size=1g -e KEV_API_KEY=... "
    "-v kev-cache:/var/cache/kev/triton localhost/kev-on-triton": Elsewhere(
        "tests/deploy/test_image.py", "needs podman and the image (`make image-test` runs it, gateway published)"
    ),
    "make image-gpu": Elsewhere(
        "tests/deploy/test_image.py", "the CUDA image (several GB); `make image-gpu-test` runs those tests on it"
    ),
    "podman push localhost/kev-on-triton:gpu registry.internal/kev/kev-on-triton:0.1.0": Elsewhere(
        None, "needs your registry"
    ),
    "kubectl apply -k deploy/overlays/gpu": Elsewhere("tests/deploy/test_manifests.py", CLUSTER),
    "kubectl apply -k deploy/monitoring/prometheus-adapter": Elsewhere("tests/deploy/test_manifests.py", CLUSTER),
    "export KEV_API_KEY=$(openssl rand -hex 32)": Elsewhere(
        None, "sets the shell's key for the commands after it; test_curl_requests sends one"
    ),
    'kubectl -n kev create secret generic kev-api-key --from-literal=KEV_API_KEY="$KEV_API_KEY"': Elsewhere(
        None, CLUSTER
    ),
    "kubectl -n kev rollout status deployment/kev": Elsewhere(None, CLUSTER),
    "kubectl -n kev rollout status deployment/kev-gateway": Elsewhere(None, CLUSTER),
    "kubectl -n kev port-forward service/kev-gateway 8009:8009 &": Elsewhere(None, CLUSTER),
}


def runner(command: str) -> str | None:
    names = {name for pattern, name in RUN_HERE.items() if re.match(pattern, command)}
    assert len(names) <= 1, f"{command!r} matches several runners: {names}"
    return names.pop() if names else None


def test_every_command_is_run_here_or_mapped() -> None:
    """A new README command fails here until it is run by this module or named in ELSEWHERE; so does a stale
    ELSEWHERE entry, one matched by both, and one whose test file does not exist."""
    assert len(BASH) >= 6 and len(PYTHON) >= 3, "README's blocks were not found"
    unmapped = [c for c in COMMANDS if runner(c) is None and normal(c) not in ELSEWHERE]
    assert not unmapped, "README commands neither run here nor in ELSEWHERE:\n" + "\n".join(unmapped)
    both = [c for c in COMMANDS if runner(c) is not None and normal(c) in ELSEWHERE]
    assert not both, f"run here and named in ELSEWHERE: {both}"
    stale = set(ELSEWHERE) - {normal(c) for c in COMMANDS}
    assert not stale, f"ELSEWHERE names commands README no longer has: {sorted(stale)}"
    for command, where in ELSEWHERE.items():
        assert where.why, command
        assert where.test is None or (REPO / where.test).is_file(), f"{command}: no {where.test}"
    # every runner has something to run: a README edit that renames a tool's command is caught here too
    ran = {runner(c) for c in COMMANDS} - {None}
    assert ran == set(RUN_HERE.values()), f"runners with no README command: {set(RUN_HERE.values()) - ran}"


# --- the server ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Served:
    triton: TritonServer
    gateway_port: int

    @property
    def ports(self) -> dict[str, str]:
        """README's port → this server's."""
        t = self.triton
        triton = {"8000": t.http_url, "8001": t.grpc_url, "8002": t.metrics_url}
        return {readme: url.rsplit(":", 1)[1] for readme, url in triton.items()} | {"8009": str(self.gateway_port)}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One server for the module, as `make serve` runs it: tritonserver and the gateway, open (README's first
    request sends no key), on the embedded toy checkpoint whose answers README prints."""
    gateway_port = free_port()
    log = tmp_path_factory.mktemp("readme") / "serve.log"
    with pytest.MonkeyPatch.context() as env:
        env.delenv("KEV_API_KEY", raising=False)
        triton = start_triton(EMBEDDED, log, GATEWAY="1", GATEWAY_PORT=str(gateway_port))
    try:
        if not wait_ready(f"http://127.0.0.1:{gateway_port}/ready", triton.process, 60):
            pytest.fail(f"the gateway never became ready:\n{triton.log_tail()}")
        yield Served(triton, gateway_port)
    finally:
        stop_triton(triton)


def on_test_ports(command: str, served: Served) -> str:
    """README's addresses pointed at this module's server; a default port left anywhere would reach another one."""
    ports = served.ports
    rewritten = re.sub(
        r"\b(?:localhost|127\.0\.0\.1):(800[0129])\b", lambda m: f"127.0.0.1:{ports[m.group(1)]}", command
    )
    assert not re.search(r":800[0129]\b", rewritten), f"a default port left in: {rewritten}"
    return rewritten


def in_repo_paths(command: str) -> str:
    """README's repository-relative tool paths made absolute: commands run in a temporary directory, so their
    relative outputs (out/..., answers.jsonl) land there."""
    command = re.sub(r"(?<![\w/])\.venv/", f"{VENV}/", command)
    return re.sub(r"(?<![\w/])loadtest/", f"{REPO}/loadtest/", command)


def shorter(command: str, **options: str) -> str:
    """`command` with each option's value replaced (`-t 60s` → `-t 5s`); each must be in the command once."""
    for option, value in options.items():
        flag = ("-" if len(option) == 1 else "--") + option.replace("_", "-")
        command, n = re.subn(rf"(?<!\S){re.escape(flag)} \S+", f"{flag} {value}", command)
        assert n == 1, f"{flag} is not in the command once: {command}"
    return command


def bash(command: str, cwd: Path, timeout: float, **env: str) -> subprocess.CompletedProcess[str]:
    """The command as a reader's shell runs it (quotes, $(...), redirections), without a key in its environment
    unless given."""
    environment = {k: v for k, v in os.environ.items() if k != "KEV_API_KEY"} | env
    return subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=environment, capture_output=True, text=True, timeout=timeout
    )


def commands_of(name: str) -> list[str]:
    found = [c for c in COMMANDS if runner(c) == name]
    assert found, f"README has no command for {name}"
    return found


def ran(result: subprocess.CompletedProcess[str], command: str) -> None:
    assert result.returncode == 0, (
        f"{command}\nexit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )


# --- curl ---------------------------------------------------------------------------------------------------------


def kev_response(printed: str) -> dict:
    """Kev's response from a curl's output: the gateway's body, or the RESPONSE inside Triton's KServe reply."""
    reply = json.loads(printed)
    if "outputs" in reply:
        assert reply["outputs"][0]["name"] == "RESPONSE", reply
        return json.loads(reply["outputs"][0]["data"][0])
    return reply


def sent_body(command: str) -> dict:
    """The Kev request a curl command sends (the JSON after -d; inside a KServe body, its REQUEST)."""
    words = shlex.split(command)
    body = json.loads(words[words.index("-d") + 1])
    if "inputs" in body:
        return json.loads(body["inputs"][0]["data"][0])
    return body


CURL_BLOCKS = [block for block in BASH for c in split_commands(block.text) if runner(c) == "test_curl_requests"]


@pytest.mark.parametrize("block", CURL_BLOCKS, ids=lambda b: f"README:{b.line}")
def test_curl_requests(served: Served, block: Block, tmp_path: Path) -> None:
    """Each curl as pasted (shell quoting included): a Kev response answering the questions it sent, and, where
    README prints the output, the same answers (latency_ms varies)."""
    if shutil.which("curl") is None:
        pytest.skip("no curl on this machine")
    (command,) = [c for c in split_commands(block.text) if runner(c) == "test_curl_requests"]
    # The cluster check sends $KEV_API_KEY: an open gateway takes any bearer key.
    result = bash(on_test_ports(command, served), tmp_path, 60, KEV_API_KEY="readme-test-key")
    ran(result, command)
    response = kev_response(result.stdout)
    assert set(response) >= {"model", "answers", "usage", "latency_ms"}, response
    assert list(response["answers"]) == list(sent_body(command)["questions"]), response
    if block.output is not None:
        printed = kev_response(block.output.text)
        assert response["answers"] == printed["answers"], (response, printed)
        assert response["usage"] == printed["usage"] and response["model"] == printed["model"]
        assert printed["answers"] == README_ANSWERS  # the output block tests/helpers.py reads agrees


def test_the_gateway_and_triton_examples_send_one_request() -> None:
    """README shows one request through both doors, so both print the same answers: the bodies must be equal."""
    printed = [block for block in CURL_BLOCKS if block.output is not None]
    assert len(printed) == 2, "README prints the output of the gateway's curl and of Triton's"
    bodies = [sent_body(*[c for c in split_commands(b.text) if c.startswith("curl")]) for b in printed]
    assert bodies[0] == bodies[1] == README_REQUEST
    assert "localhost:8009/v1/systemone" in printed[0].text, "the first request goes to the gateway"


# --- Python -------------------------------------------------------------------------------------------------------


def probability(x: object) -> bool:
    return isinstance(x, float) and 0.0 <= x <= 1.0


def check_tritonclient(stdout: str) -> None:
    response = ast.literal_eval(stdout.strip())  # print() of the parsed response
    assert response["model"] == "kev-latest" and response["answers"]["tone"]["type"] == "score", response
    tone = response["answers"]["tone"]
    assert list(tone["legend"].values()) == ["angry", "neutral", "happy"] and 0.0 <= tone["score"] <= 2.0, tone


def check_kev_client(stdout: str) -> None:
    answers = ast.literal_eval(stdout.strip())
    assert answers["team"]["choice"] in ("billing", "technical") and probability(answers["team"]["confidence"])


def check_typesafe(stdout: str) -> None:
    noul, choice = stdout.split()
    assert probability(float(noul)) and choice in ("calm", "angry"), stdout


# Each Python block, by what it imports, and what its output must be: a new block needs its check here.
PYTHON_CHECKS: dict[str, Callable[[str], None]] = {
    "tritonclient.grpc as grpcclient": check_tritonclient,
    "from kev_backend.serve.client import KevClient": check_kev_client,
    "from typesafe_sdk import": check_typesafe,
}


@pytest.mark.parametrize("block", PYTHON, ids=lambda b: f"README:{b.line}")
def test_python_blocks(served: Served, block: Block, tmp_path: Path) -> None:
    checks = [check for marker, check in PYTHON_CHECKS.items() if marker in block.text]
    assert len(checks) == 1, f"README line {block.line}: no single check in PYTHON_CHECKS for this block"
    code = on_test_ports(block.text, served)
    assert code != block.text, f"README line {block.line}: the block names no server address"
    result = subprocess.run(
        [str(VENV / "bin" / "python"), "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    ran(result, f"README line {block.line}")
    checks[0](result.stdout)


# --- kev score ----------------------------------------------------------------------------------------------------


def test_kev_score(served: Served, tmp_path: Path) -> None:
    """README's input line and `kev score` (the console script), in order, in an empty directory."""
    for command in commands_of("test_kev_score"):
        ran(bash(in_repo_paths(on_test_ports(command, served)), tmp_path, 120), command)
    requests = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    answers = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert requests and len(answers) == len(requests)
    for number, (request, answer) in enumerate(zip(requests, answers, strict=True), start=1):
        assert answer["line"] == number and list(answer["answers"]) == list(request["questions"]), answer


# --- load tools, shortened ----------------------------------------------------------------------------------------


def addresses(served: Served) -> str:
    """The load tools' own address options (README relies on their defaults, `make serve`'s ports), for this
    server; argparse takes the last of a repeated option."""
    p = served.ports
    return f"--triton-grpc 127.0.0.1:{p['8001']} --triton-http 127.0.0.1:{p['8000']}"


@pytest.mark.parametrize("command", [c for c in COMMANDS if runner(c) == "test_locust"], ids=lambda c: c.split()[3])
def test_locust(served: Served, command: str, tmp_path: Path) -> None:
    """Each Locust line, headless, 2 users for 5 s (gevent's clock includes the locustfile's import): it exits 0
    and writes its CSV with answered requests and no failures."""
    csv_prefix = re.search(r"--csv (\S+)", command)
    assert csv_prefix, f"the line writes no CSV: {command}"
    run = shorter(in_repo_paths(on_test_ports(command, served)), u="2", r="2", t="5s")
    result = bash(f"{run} {addresses(served)}", tmp_path, 120)
    ran(result, command)
    with (tmp_path / f"{csv_prefix.group(1)}_stats.csv").open() as f:
        total = {row["Name"]: row for row in csv.DictReader(f)}["Aggregated"]
    assert int(total["Request Count"]) > 0 and int(total["Failure Count"]) == 0, total


def test_openloop(served: Served, tmp_path: Path) -> None:
    (command,) = commands_of("test_openloop")
    out = re.search(r"--out (\S+)", command)
    assert out, command
    run = shorter(in_repo_paths(on_test_ports(command, served)), rates="2,4", seconds="3")
    ran(bash(f"{run} --triton-grpc 127.0.0.1:{served.ports['8001']}", tmp_path, 180), command)
    record = json.loads((tmp_path / f"{out.group(1)}.json").read_text())
    assert [r["offered_rps"] for r in record["rates"]] == [2.0, 4.0]
    assert all(r["sent"] > 0 and not r["errors"] for r in record["rates"]), record["rates"]
    assert (tmp_path / f"{out.group(1)}.png").read_bytes()[:4] == b"\x89PNG"


def test_soak(served: Served, tmp_path: Path) -> None:
    """6 s at 4 requests/s (--minutes takes fractions), sampled every 2 s; `$(pgrep -x tritonserver)` becomes this
    server's tritonserver (another may run on the machine). soak.py exits 1 on any unexpected error."""
    (command,) = commands_of("test_soak")
    out = re.search(r"--out (\S+)", command)
    assert out and "$(pgrep -x tritonserver)" in command, command
    pid = descendant_named(served.triton.process.pid, "tritonserver")
    assert pid is not None, "no tritonserver below the server's process"
    run = shorter(in_repo_paths(on_test_ports(command, served)), minutes="0.1", rate="4")
    run = run.replace("$(pgrep -x tritonserver)", str(pid))
    p = served.ports
    targets = (
        f"--triton-grpc 127.0.0.1:{p['8001']} --gateway http://127.0.0.1:{p['8009']}"
        f" --metrics http://127.0.0.1:{p['8002']}/metrics --sample-seconds 2"
    )
    ran(bash(f"{run} {targets}", tmp_path, 180), command)
    soak = json.loads((tmp_path / out.group(1) / "soak.json").read_text())["soak"]
    assert soak["requests"] > 0 and soak["answered"] > 0 and soak["unexpected_errors"] == 0, soak
    assert (tmp_path / out.group(1) / "soak.png").is_file()
