"""Model and drafter weights in S3: push and pull checkpoints with a SHA-256 manifest.

- `push LOCAL_DIR s3://bucket/prefix`: multipart, parallel uploads (boto3 `TransferConfig`), then
  `MANIFEST.json` (relative path -> size and SHA-256) written last, so a prefix with a manifest
  is a complete checkpoint.
- `pull s3://bucket/prefix LOCAL_DIR`: reads the manifest, downloads into a staging directory,
  skips files already there with the right hash (resume), verifies every hash, and only then
  renames the staging directory into `LOCAL_DIR.versions/<manifest hash>` and swaps the
  `LOCAL_DIR` symlink to it: a partial download is never visible as a model, and a loader
  reading the version it was given never sees the next one's files. Manifest keys that are
  absolute or climb out of the directory are refused, and a lock file next to the destination
  serialises concurrent pulls of one model. The versions layout is `cluster.model_versions`.

Errors (missing bucket, missing credentials, permission denied, checksum mismatch) are raised as
`StorageError` with one clear line.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from cluster.model_versions import (
    MANIFEST,
    StorageError,
    installed,
    link,
    linked_version,
    remove_versions,
    version_id,
    versions_dir,
)
from cluster.models import absolute_keeping_link, cache_dir, exclusive, replace_directory

_STAGING_SUFFIX = ".partial"
MiB = 1024 * 1024


@dataclass(frozen=True)
class S3Uri:
    bucket: str
    prefix: str

    @classmethod
    def parse(cls, uri: str) -> S3Uri:
        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        if not uri.startswith("s3://") or not bucket:
            raise StorageError(f"{uri!r} is not an s3://bucket/prefix URI")
        prefix = prefix.strip("/")
        # The prefix names the local copy too (`cached_path`): `..` would climb out of the cache.
        if prefix and _has_dot_parts(prefix):
            raise StorageError(f"the prefix of {uri!r} may not contain '.', '..' or '//'")
        return cls(bucket, prefix)

    def key(self, relative: str) -> str:
        return f"{self.prefix}/{relative}" if self.prefix else relative

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


def _has_dot_parts(path: str) -> bool:
    """Whether a `/`-separated path has a `.`, `..` or empty part (one that stays or climbs)."""
    return any(part in ("", ".", "..") for part in path.split("/"))


def check_s3_uri(location: str | None) -> str | None:
    """A config field's validator: an `s3://` location must parse (`S3Uri.parse`); anything
    else passes through."""
    if location is not None and location.startswith("s3://"):
        try:
            S3Uri.parse(location)
        except StorageError as error:
            raise ValueError(str(error)) from None
    return location


def transfer_config(workers: int = 16):
    """Multipart above 64 MiB in 64 MiB parts, `workers` parts in flight per file."""
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(
        multipart_threshold=64 * MiB,
        multipart_chunksize=64 * MiB,
        max_concurrency=workers,
        use_threads=True,
    )


def s3_client(endpoint_url: str | None = None, workers: int = 16):
    """A boto3 S3 client; `endpoint_url` (or `$AWS_ENDPOINT_URL_S3`) for S3-compatible stores."""
    import boto3
    from botocore.config import Config

    # A fresh session: credentials are resolved now, not cached from an earlier call.
    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3"),
        config=Config(max_pool_connections=max(workers * 2, 10), retries={"mode": "adaptive"}),
    )


def sha256_file(path: Path, block: int = 8 * MiB) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def build_manifest(local_dir: Path) -> dict[str, dict]:
    files = sorted(p for p in local_dir.rglob("*") if p.is_file() and p.name != MANIFEST)
    return {
        str(p.relative_to(local_dir)): {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in files
    }


def _explain(
    error: Exception,
    uri: S3Uri,
    missing: str = f"no {MANIFEST} (not a checkpoint pushed by cluster?)",
) -> StorageError:
    """One line for the failures users hit; anything else keeps boto's own words."""
    from botocore.exceptions import ClientError, NoCredentialsError

    # boto3's transfer manager wraps the ClientError (S3UploadFailedError); unwrap it.
    cause = error
    while cause is not None and not isinstance(cause, ClientError | NoCredentialsError):
        cause = cause.__cause__ or cause.__context__
    error = cause or error
    if isinstance(error, NoCredentialsError):
        return StorageError(
            f"{uri}: no AWS credentials (set AWS_PROFILE or AWS_ACCESS_KEY_ID/"
            "AWS_SECRET_ACCESS_KEY, or run on a node/pod with an IAM role)"
        )
    if isinstance(error, ClientError):
        code = error.response.get("Error", {}).get("Code", "")
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code == "NoSuchBucket":
            return StorageError(f"{uri}: bucket {uri.bucket!r} does not exist")
        if code in ("AccessDenied", "403", "Forbidden") or status == 403:
            return StorageError(f"{uri}: permission denied ({code or status})")
        if code in ("NoSuchKey", "404", "NotFound"):
            return StorageError(f"{uri}: {missing}")
        return StorageError(f"{uri}: {code}: {error}")
    return StorageError(f"{uri}: {error}")


def _progress(total: int, description: str):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=description)


def push(local_dir: str | Path, uri: str, *, client=None, workers: int = 16) -> dict[str, dict]:
    """Upload a checkpoint directory; returns the manifest written next to the files."""
    local_dir, target = Path(local_dir), S3Uri.parse(uri)
    if not local_dir.is_dir():
        raise StorageError(f"{local_dir}: not a directory")
    client = client or s3_client(workers=workers)
    manifest = build_manifest(local_dir)
    config = transfer_config(workers)
    total = sum(entry["size"] for entry in manifest.values())
    try:
        with _progress(total, f"push {local_dir.name}") as bar:
            for relative in manifest:
                client.upload_file(
                    str(local_dir / relative),
                    target.bucket,
                    target.key(relative),
                    Config=config,
                    Callback=bar.update,
                )
        body = json.dumps({"files": manifest}, indent=2, sort_keys=True).encode()
        client.put_object(Bucket=target.bucket, Key=target.key(MANIFEST), Body=body)
    except Exception as error:
        raise _explain(error, target) from error
    return manifest


def read_manifest(uri: str, *, client=None) -> dict[str, dict]:
    source = S3Uri.parse(uri)
    client = client or s3_client()
    try:
        body = client.get_object(Bucket=source.bucket, Key=source.key(MANIFEST))["Body"].read()
    except Exception as error:
        raise _explain(error, source) from error
    try:
        files = json.loads(body)["files"]
        if not isinstance(files, dict) or not all(
            isinstance(e, dict)
            and isinstance(e.get("size"), int)
            and isinstance(e.get("sha256"), str)
            for e in files.values()
        ):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise StorageError(f"{source}: {MANIFEST} is not a manifest pushed by cluster") from None
    for key in files:
        check_relative_key(key, source)
    return files


def check_relative_key(key: str, source: object) -> None:
    """A manifest key must name a file inside the checkpoint: relative, no `..`, no `\\`."""
    path = PurePosixPath(key)
    if (
        not key
        or path.is_absolute()
        or "\\" in key
        or _has_dot_parts(key)
        or key.split("/")[0].endswith(":")
    ):
        raise StorageError(f"{source}: manifest key {key!r} escapes the checkpoint directory")


def pull(
    uri: str,
    local_dir: str | Path,
    *,
    client=None,
    workers: int = 16,
    on_file_done: Callable[[str], None] | None = None,
) -> Path:
    """Download a pushed checkpoint and point `local_dir` at it, atomically and resumably;
    returns the version's own directory, which is what a loader should read.

    Each version is installed whole in `<local_dir>.versions/<version_id>/` and `local_dir` is
    a symlink to it, swapped in one rename. A replica that loads from the returned path keeps
    reading the version it started with when the prefix is pushed again and a neighbour on the
    node pulls the update (a directory replaced in place would hand it the new version's
    shards half-way through its load). The linked version and the one it replaced are kept,
    older ones removed. Files of an interrupted pull, or unchanged since the linked version
    (hard-linked, not copied), are not downloaded again. `on_file_done` is called after each
    file is verified (tests use it to interrupt a pull part-way).
    """
    source, final = S3Uri.parse(uri), absolute_keeping_link(local_dir)
    client = client or s3_client(workers=workers)
    # One pull of a destination at a time: a second process waits, then finds it installed.
    with exclusive(final.with_name(final.name + ".lock")):
        # Read under the lock: a pull that waited must not link back an older version.
        manifest = read_manifest(uri, client=client)
        wanted = versions_dir(final) / version_id(manifest)
        current = linked_version(final)
        if not installed(wanted, manifest):
            staging = wanted.with_name(wanted.name + _STAGING_SUFFIX)
            remove_versions(final, keep={current, wanted, staging})  # room first
            _download(source, staging, manifest, current, client, workers, on_file_done)
            replace_directory(staging, wanted)
        if current != wanted:
            link(final, wanted)
        remove_versions(final, keep={current, wanted})
    return wanted


def _download(source, staging, manifest, current, client, workers, on_file_done) -> None:
    """Fill `staging` with the manifest's files, each verified."""
    staging.mkdir(parents=True, exist_ok=True)
    _prune(staging, manifest)
    config = transfer_config(workers)

    def fetch(relative: str, bar) -> None:
        entry, path = manifest[relative], staging / relative
        previous = current / relative if current else None
        if _has(path, entry):  # staged by an interrupted pull
            bar.update(entry["size"])
        elif previous and _has(previous, entry):  # unchanged in the linked version
            path.parent.mkdir(parents=True, exist_ok=True)
            path.unlink(missing_ok=True)  # a damaged staged copy: never written through
            try:
                os.link(previous, path)  # versions are never written to: share the blocks
            except OSError:
                shutil.copy2(previous, path)
            bar.update(entry["size"])
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(path.name + ".part")
            try:
                client.download_file(
                    source.bucket,
                    source.key(relative),
                    str(partial),
                    Config=config,
                    Callback=bar.update,
                )
            except Exception as error:
                raise _explain(
                    error,
                    source,
                    f"{relative}: in {MANIFEST} but not in S3 (the "
                    "checkpoint changed while pulled? push it again)",
                ) from error
            actual = sha256_file(partial)
            if actual != entry["sha256"]:
                partial.unlink()
                raise StorageError(
                    f"{source}/{relative}: checksum mismatch (manifest {entry['sha256'][:12]}..., "
                    f"downloaded {actual[:12]}...); the object changed or is corrupt"
                )
            os.replace(partial, path)
        if on_file_done is not None:
            on_file_done(relative)

    total = sum(entry["size"] for entry in manifest.values())
    # Large files already parallelise over parts; small ones benefit from file-level threads.
    with _progress(total, f"pull {source}") as bar, ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(fetch, relative, bar) for relative in manifest]
        try:
            for future in futures:
                future.result()
        except BaseException:
            pool.shutdown(cancel_futures=True)  # the queued files are not started
            raise
    (staging / MANIFEST).write_text(json.dumps({"files": manifest}, indent=2, sort_keys=True))


def _prune(staging: Path, manifest: dict[str, dict]) -> None:
    """Remove from the staging directory what the manifest does not list, before downloading
    into it: files of an earlier version's interrupted pull (also where a file of this version
    needs their name) and the temporary files of a download that was killed. They would be
    installed with the checkpoint (a stale shard index makes vLLM load the wrong
    weights; an untrusted drafter with a stray file is refused)."""
    for path in sorted(staging.rglob("*"), reverse=True):  # files before their directories
        relative = path.relative_to(staging).as_posix()
        if path.is_dir() and not path.is_symlink():
            if not any(path.iterdir()):
                path.rmdir()
        elif relative not in manifest:
            path.unlink()


def _has(path: Path, entry: dict) -> bool:
    return (
        path.is_file()
        and path.stat().st_size == entry["size"]
        and sha256_file(path) == entry["sha256"]
    )


def cached_path(uri: str) -> Path:
    """Where `pull` installs an s3:// checkpoint on this node by default."""
    parsed = S3Uri.parse(uri)
    return cache_dir() / "s3" / parsed.bucket / parsed.prefix
