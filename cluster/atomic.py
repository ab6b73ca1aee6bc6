"""Files that readers and interrupted runs see whole: results, summaries, the README table."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_atomically(path: Path, document: dict[str, Any]) -> None:
    """`document` as indented JSON, written with `replace_text`."""
    replace_text(path, json.dumps(document, indent=1) + "\n")


def replace_text(path: Path, text: str) -> None:
    """Write `text` to `path` so that a reader (or an interrupted run) sees the old file or the
    new one, never a part: a temporary file beside it, flushed, then renamed over it."""
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
