"""A real Redis for the campaign's tests: a ``redis-server`` of its own on a free loopback port.

Skipped, with the reason, where ``redis-server`` (Debian: ``apt-get install
redis-server``) or the ``redis`` client is missing; under ``CI=true`` that fails instead,
since CI installs both (``.ci/run``, the ``dev`` extra).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.campaign.location import INSTALL_HINT

STARTUP_SECONDS = 20.0


def require(missing: str | None) -> None:
    if missing is None:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{missing} (CI installs it: .ci/run)")
    pytest.skip(missing)


def require_redis_client() -> None:
    installed = importlib.util.find_spec("redis") is not None
    require(None if installed else f"the redis client is not installed ({INSTALL_HINT})")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def start_server(server: str, folder: Path) -> tuple[subprocess.Popen[bytes], int]:
    """A ``redis-server`` answering on a free loopback port (another port if the one
    found free was taken before the server bound it)."""
    exits = []
    for _ in range(3):
        port = free_port()
        process = subprocess.Popen(
            [
                server,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            cwd=folder,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + STARTUP_SECONDS
        while process.poll() is None and time.monotonic() < deadline:
            if answers(port):
                return process, port
            time.sleep(0.05)
        process.kill()
        exits.append(process.wait())
    pytest.fail(f"redis-server did not start on a free loopback port (exits {exits})")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``redis://127.0.0.1:PORT/0`` of a fresh server, stopped after the session."""
    server = shutil.which("redis-server")
    require(None if server else "redis-server is not installed (apt-get install redis-server)")
    require_redis_client()
    assert server is not None
    folder: Path = tmp_path_factory.mktemp("redis")
    process, port = start_server(server, folder)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(timeout=10)
