"""Records of Ray Serve's logger, whatever its propagation: Ray configures `ray.serve` with
`propagate=False` once Serve's logging is set up, which hides it from pytest's `caplog`."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def serve_log() -> Iterator[list[logging.LogRecord]]:
    logger = logging.getLogger("ray.serve")
    handler, level = _Collect(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
