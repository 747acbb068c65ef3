"""Real servers on loopback for the fill's tests: an S3-compatible store (moto's server, with IAM authentication on,
so every request's SigV4 signature is checked) and a small hub that serves the two endpoints the fill uses, with
LFS files behind a redirect to a second host, as the real hub sends them to its CDN."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kev_backend.dev.ports import free_port

# What the fill moves for a Kev deployment: the LoRA checkpoint and its base, side by side (dev/synthetic's layout).
FILLED = ("kev", "base")


def checkpoint_files(tiny_dir: Path) -> dict[str, bytes]:
    """kev/... and base/... of the synthetic checkpoint: relative name -> bytes."""
    return {
        path.relative_to(tiny_dir).as_posix(): path.read_bytes()
        for top in FILLED
        for path in sorted((tiny_dir / top).rglob("*"))
        if path.is_file()
    }


def sha256sums(files: dict[str, bytes]) -> bytes:
    return "".join(f"{hashlib.sha256(data).hexdigest()}  {name}\n" for name, data in files.items()).encode()


# --- S3 -----------------------------------------------------------------------------------------------------------


@dataclass
class S3Store:
    url: str
    access_key: str
    secret_key: str
    client: object  # boto3's S3 client, signed with the same user's keys

    def bucket(self) -> str:
        name = f"kev-{uuid.uuid4().hex[:12]}"
        self.client.create_bucket(Bucket=name)
        return name

    def put(self, bucket: str, files: dict[str, bytes], prefix: str = "") -> None:
        for name, data in files.items():
            self.client.put_object(Bucket=bucket, Key=prefix + name, Body=data)

    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL_S3": self.url,
            "AWS_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
        }


@pytest.fixture(scope="session")
def s3_store() -> Iterator[S3Store]:
    import boto3  # moto[server]'s dependency: the tests set the store up with the official SDK

    port = free_port()
    # Authentication on after the first 3 requests (the IAM user, its policy and its key): from then on moto checks
    # every request's SigV4 signature against that user's secret, as S3 does.
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"}
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("moto's server did not start") from None
                time.sleep(0.1)
        root = {"endpoint_url": url, "region_name": "us-east-1", "aws_access_key_id": "x", "aws_secret_access_key": "x"}
        iam = boto3.client("iam", **root)
        iam.create_user(UserName="kev-fill")
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
        iam.put_user_policy(UserName="kev-fill", PolicyName="s3", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="kev-fill")["AccessKey"]
        client = boto3.client(
            "s3",
            endpoint_url=url,
            region_name="us-east-1",
            aws_access_key_id=key["AccessKeyId"],
            aws_secret_access_key=key["SecretAccessKey"],
        )
        yield S3Store(url, key["AccessKeyId"], key["SecretAccessKey"], client)
    finally:
        server.terminate()
        server.wait(timeout=10)


# --- the hub ------------------------------------------------------------------------------------------------------


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class HubRepo:
    commit: str
    files: dict[str, bytes]
    lfs: set[str]
    served: dict[str, bytes] = field(default_factory=dict)  # bytes served instead of the listed ones
    extra_siblings: list[dict] = field(default_factory=list)  # listed as they are (hostile names)
    answer_sha: str | None = None  # the listing's `sha`, when it is not `commit`

    def siblings(self) -> list[dict]:
        out = []
        for name, data in self.files.items():
            sibling = {"rfilename": name, "size": len(data), "blobId": git_blob_id(data)}
            if name in self.lfs:
                pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(data).hexdigest()}"
                pointer += f"\nsize {len(data)}\n"
                sibling["blobId"] = git_blob_id(pointer.encode())
                sibling["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 130}
            out.append(sibling)
        return out + self.extra_siblings


@dataclass
class Hub:
    """Serves /api/models/{repo}/revision/{commit} and /{repo}/resolve/{commit}/{path}; LFS files answer with a 302
    to the CDN server (another host name: `localhost` instead of 127.0.0.1)."""

    url: str = ""
    cdn: str = ""
    token: str = "hf_test_token"
    repos: dict[str, HubRepo] = field(default_factory=dict)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # (server, path, Authorization)
    fail: dict[str, int] = field(default_factory=dict)  # path -> how many more 503s
    stall_s: dict[str, float] = field(default_factory=dict)  # path -> seconds to wait before answering
    lock: threading.Lock = field(default_factory=threading.Lock)

    def resolves(self) -> list[str]:
        return [path for server, path, _ in self.requests if "/resolve/" in path or server == "cdn"]


def _handler(hub: Hub, server: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            for key, value in {"Content-Length": str(len(body)), **(headers or {})}.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = urllib.parse.urlsplit(self.path).path
            with hub.lock:
                hub.requests.append((server, path, self.headers.get("Authorization")))
                failing = hub.fail.get(path, 0)
                if failing:
                    hub.fail[path] = failing - 1
            if hub.stall_s.get(path):
                time.sleep(hub.stall_s[path])
            if failing:
                return self.send(503, b"try again")
            if server == "cdn":
                repo_id, commit, name = path.removeprefix("/cdn/").split("/", 2)
                repo = hub.repos[repo_id.replace("--", "/")]
                return self.send(200, repo.served.get(name, repo.files[name]))
            if self.headers.get("Authorization") != f"Bearer {hub.token}":
                return self.send(401, b"", {"X-Error-Message": "Invalid credentials in Authorization header"})
            if path.startswith("/api/models/"):
                repo_id, _, commit = path.removeprefix("/api/models/").partition("/revision/")
                repo = hub.repos.get(repo_id)
                if repo is None or commit != repo.commit:
                    return self.send(404, b"", {"X-Error-Code": "RevisionNotFound"})
                body = {"id": repo_id, "sha": repo.answer_sha or repo.commit, "siblings": repo.siblings()}
                return self.send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})
            repo_id, _, rest = path.lstrip("/").partition("/resolve/")
            commit, _, name = rest.partition("/")
            repo, name = hub.repos.get(repo_id), urllib.parse.unquote(name)
            if repo is None or commit != repo.commit or name not in repo.files:
                return self.send(404, b"", {"X-Error-Code": "EntryNotFound"})
            if name in repo.lfs:
                location = f"{hub.cdn}/cdn/{repo_id.replace('/', '--')}/{commit}/{name}"
                return self.send(302, b"", {"Location": location})
            return self.send(200, repo.served.get(name, repo.files[name]))

    return Handler


@pytest.fixture
def hub() -> Iterator[Hub]:
    state = Hub()
    servers = []
    for name in ("hub", "cdn"):
        server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state, name))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    state.url = f"http://127.0.0.1:{servers[0].server_port}"
    state.cdn = f"http://localhost:{servers[1].server_port}"
    yield state
    for server in servers:
        server.shutdown()
        server.server_close()
