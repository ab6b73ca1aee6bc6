"""Stopping servers the harness started: `cluster serve` must act on Ctrl-C / SIGTERM whichever
of its threads the signal lands on, also after a benchmark froze and thawed it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.bench.servers import Frozen
from cluster.launcher import ChildServer, ServerStartError, interrupt_and_wait

# `cluster serve`'s idle loop; a second thread stands in for Ray's many threads: on "go" it
# sends SIGINT to itself, as the kernel does when a process-directed signal picks that thread.
SERVER_LIKE = """
import signal, sys, threading
from cluster.serve import idle_until_interrupted
signal.signal(signal.SIGINT, signal.default_int_handler)
def land_on_me():
    if sys.stdin.readline().strip() == "go":
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)
threading.Thread(target=land_on_me, daemon=True).start()
print("ready", flush=True)
try:
    idle_until_interrupted()
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def _server_like() -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-c", SERVER_LIKE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    assert process.stdout.readline().strip() == "ready"
    return process


def test_a_signal_on_another_thread_stops_the_idle_server():
    process = _server_like()
    started = time.monotonic()
    process.stdin.write("go\n")
    process.stdin.flush()
    try:
        assert process.wait(timeout=10) == 0
    finally:
        process.kill()
    assert process.stdout.read().strip() == "interrupted"
    assert time.monotonic() - started < 5


def test_a_frozen_server_is_thawed_then_interrupted():
    process = _server_like()
    frozen = Frozen(process)
    for _ in range(3):  # a benchmark freezes and thaws a server between its turns
        frozen.freeze()
        time.sleep(0.2)
        frozen.thaw()
    frozen.freeze()
    assert interrupt_and_wait(process, 15, group=False) == 0
    assert process.stdout.read().strip() == "interrupted"


def test_a_server_that_dies_while_starting_leaves_no_process_or_log():
    server = ChildServer([sys.executable, "-c", "print('no marker'); raise SystemExit(3)"], {})
    log = Path(server._log.name)
    with pytest.raises(ServerStartError, match="server did not start:\nno marker"):
        with server:
            pass
    assert server.process.poll() == 3
    assert not log.exists()
