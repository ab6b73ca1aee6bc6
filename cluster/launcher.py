"""Run `cluster serve` in a child process, the way a user does, for tests and benchmarks.

`ServeProcess(config_data)` writes the config to a temporary file (on a free port unless one is
given), starts `python -m cluster serve`, waits for its ready line, and on exit sends Ctrl-C and
records the exit code, so no Ray or vLLM process outlives the caller.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

READY_MARKER = "ready in "


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    def __init__(self, config_data: dict[str, Any], *, start_timeout_s: float = 600):
        self.config = {**config_data, "server": {**config_data.get("server", {})}}
        self.config["server"].setdefault("port", free_port())
        self.port = self.config["server"]["port"]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.start_timeout_s = start_timeout_s
        self._workdir = tempfile.TemporaryDirectory(prefix="cluster-serve-")
        self.config_path = Path(self._workdir.name) / "cluster.yaml"
        self.log_path = Path(self._workdir.name) / "serve.log"
        self.ready_s: float | None = None
        self.exit_code: int | str | None = None
        self._process: subprocess.Popen | None = None

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def __enter__(self) -> ServeProcess:
        self.config_path.write_text(yaml.safe_dump(self.config))
        started = time.monotonic()
        with open(self.log_path, "w") as out:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "cluster", "serve", str(self.config_path)],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        while READY_MARKER not in self.log():
            if (
                self._process.poll() is not None
                or time.monotonic() - started > self.start_timeout_s
            ):
                self.stop()
                raise RuntimeError(f"cluster serve did not start:\n{self.log()[-4000:]}")
            time.sleep(1)
        self.ready_s = time.monotonic() - started
        return self

    def stop(self, timeout_s: float = 120) -> int | str:
        if self._process is not None and self.exit_code is None:
            self._process.send_signal(signal.SIGINT)
            try:
                self.exit_code = self._process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self.exit_code = f"killed after {timeout_s:.0f}s"
        return self.exit_code

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._workdir.cleanup()
