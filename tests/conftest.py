"""Shared fixtures: a micro recipe, a real Prefect test server and a real S3 server on 127.0.0.1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from infra.env import apply_offline_defaults
from tests.helpers import REPO

apply_offline_defaults()


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    """Recipes name repo-relative paths (eval sets), as when run from the repo root."""
    monkeypatch.chdir(REPO)


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """A real (test-harness) Prefect API server; results go to a temp dir, not the user's home."""
    from prefect.testing.utilities import prefect_test_harness

    os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = str(tmp_path_factory.mktemp("prefect-results"))
    with prefect_test_harness(server_startup_timeout=180):
        yield


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """A real moto S3 server on 127.0.0.1 with dummy credentials in the environment."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env={**os.environ, "S3_UPLOAD_PART_MIN_SIZE": "1024"},  # lets tests force multipart uploads with small files
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("moto_server did not start")
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret", "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield {"endpoint": endpoint, "port": port, "proc": proc}
    proc.kill()
    proc.wait()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
