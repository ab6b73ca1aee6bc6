"""The local layout of pulled checkpoints: `DIR` is a symlink to `DIR.versions/<version id>/`.

Each version is a whole checkpoint with its `MANIFEST.json`, never written to once installed;
the link is swapped in one rename. A loader that reads the version directory it was given keeps
its files while a later pull links the next version (`cluster.storage.pull` does the transfer).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

from cluster.models import replace_directory

MANIFEST = "MANIFEST.json"
VERSIONS_SUFFIX = ".versions"
logger = logging.getLogger(__name__)


class StorageError(RuntimeError):
    """A transfer or local layout problem, stated in one line."""


def versions_dir(final: Path) -> Path:
    return final.with_name(final.name + VERSIONS_SUFFIX)


def version_id(manifest: dict[str, dict]) -> str:
    """A version's directory name: the hash of its manifest (same manifest, same files)."""
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canonical).hexdigest()[:16]


def installed(version: Path, manifest: dict[str, dict]) -> bool:
    """A completed pull of this manifest. Hashes were verified when it was installed; re-hashing
    hundreds of GB on every replica start would cost minutes, so compare manifest and sizes."""
    try:
        local = json.loads((version / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError):
        return False
    return local == manifest and all(
        (version / rel).is_file() and (version / rel).stat().st_size == entry["size"]
        for rel, entry in manifest.items()
    )


def linked_version(final: Path) -> Path | None:
    """The version `final` points at (None: nothing installed yet). A directory installed
    whole by an earlier release (no versions) becomes a version; one that is not a pulled
    checkpoint is refused, never replaced."""
    versions = versions_dir(final)
    if final.is_symlink():
        target = final.resolve()
        if target.parent != versions:
            raise StorageError(f"{final}: a link to {target}, not to a pulled version; remove it")
        return target
    if not final.exists():
        return None
    if final.is_dir() and not any(final.iterdir()):
        final.rmdir()
        return None
    try:
        legacy = versions / version_id(json.loads((final / MANIFEST).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        raise StorageError(
            f"{final}: exists and holds no {MANIFEST} (not a pulled checkpoint); pull into "
            "a new or empty directory"
        ) from None
    versions.mkdir(parents=True, exist_ok=True)
    replace_directory(final, legacy)
    link(final, legacy)
    return legacy


def link(final: Path, version: Path) -> None:
    """Point `final` at `version` in one rename (relative: the cache may be mounted elsewhere)."""
    new_link = final.with_name(final.name + ".link")
    new_link.unlink(missing_ok=True)
    new_link.symlink_to(Path(version.parent.name) / version.name)
    os.replace(new_link, final)


def remove_versions(final: Path, keep: set[Path | None]) -> None:
    """Remove what `final`'s versions directory holds besides `keep`: older versions and other
    versions' stagings. Best effort: a file system that refuses (a file still open on NFS)
    leaves it for the next pull, the pull itself has succeeded."""
    versions = versions_dir(final)
    if not versions.is_dir():
        return
    for old in set(versions.iterdir()) - keep:
        try:
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old)
            else:
                old.unlink()
        except OSError as error:
            logger.warning("could not remove %s (the next pull tries again): %s", old, error)
