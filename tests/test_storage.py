"""S3 weights storage against a real S3-compatible HTTP server (moto's, on 127.0.0.1).

AWS itself cannot be reached from here; moto's server speaks the S3 REST protocol over HTTP,
so boto3 does real multipart uploads, ranged GETs and errors against it.
"""

from __future__ import annotations

import json
import os

import boto3
import pytest
from moto.server import ThreadedMotoServer

from cluster import storage
from cluster.cli import main

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def s3_endpoint():
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1"
    )
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture()
def client(s3_endpoint):
    s3 = storage.s3_client(s3_endpoint)
    s3.create_bucket(Bucket="weights")
    yield s3
    bucket = boto3.resource("s3", endpoint_url=s3_endpoint).Bucket("weights")
    bucket.object_versions.delete()
    bucket.delete()


@pytest.fixture()
def checkpoint(tmp_path):
    """A multi-file checkpoint with a file above the 64 MiB multipart threshold."""
    src = tmp_path / "ckpt"
    (src / "sub").mkdir(parents=True)
    (src / "model-00001.safetensors").write_bytes(os.urandom(70 * MiB))
    (src / "model-00002.safetensors").write_bytes(os.urandom(3 * MiB))
    (src / "config.json").write_text(json.dumps({"hidden_size": 576}))
    (src / "sub" / "tokenizer.json").write_text("{}")
    return src


def _same_tree(a, b) -> bool:
    files = sorted(
        p.relative_to(a) for p in a.rglob("*") if p.is_file() and p.name != storage.MANIFEST
    )
    return files == sorted(
        p.relative_to(b) for p in b.rglob("*") if p.is_file() and p.name != storage.MANIFEST
    ) and all((a / f).read_bytes() == (b / f).read_bytes() for f in files)


def test_round_trip_with_multipart(client, checkpoint, tmp_path):
    manifest = storage.push(checkpoint, "s3://weights/models/m1", client=client)
    assert set(manifest) == {
        "model-00001.safetensors",
        "model-00002.safetensors",
        "config.json",
        "sub/tokenizer.json",
    }
    head = client.head_object(Bucket="weights", Key="models/m1/model-00001.safetensors")
    assert "-" in head["ETag"]  # multipart upload ETags are "<md5>-<parts>"
    remote = json.loads(
        client.get_object(Bucket="weights", Key="models/m1/MANIFEST.json")["Body"].read()
    )["files"]
    assert remote == manifest

    dest = tmp_path / "pulled"
    assert storage.pull("s3://weights/models/m1", dest, client=client) == dest
    assert _same_tree(checkpoint, dest)
    assert not (tmp_path / "pulled.partial").exists()


def test_interrupted_pull_resumes_and_is_never_visible(client, checkpoint, tmp_path):
    storage.push(checkpoint, "s3://weights/models/m2", client=client)
    dest = tmp_path / "pulled"
    done: list[str] = []

    def interrupt_after_first(relative: str) -> None:
        done.append(relative)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        storage.pull(
            "s3://weights/models/m2", dest, client=client, on_file_done=interrupt_after_first
        )
    assert not dest.exists()  # the partial download is not visible as a model
    staged = tmp_path / "pulled.partial" / done[0]
    assert staged.is_file()
    staged_mtime = staged.stat().st_mtime_ns

    fetched: list[str] = []
    storage.pull("s3://weights/models/m2", dest, client=client, on_file_done=fetched.append)
    assert _same_tree(checkpoint, dest)
    assert (dest / done[0]).stat().st_mtime_ns == staged_mtime  # resumed, not downloaded again

    # A second pull of an installed checkpoint transfers nothing.
    again: list[str] = []
    storage.pull("s3://weights/models/m2", dest, client=client, on_file_done=again.append)
    assert again == []


def test_corruption_is_detected(client, checkpoint, tmp_path):
    storage.push(checkpoint, "s3://weights/models/m3", client=client)
    client.put_object(Bucket="weights", Key="models/m3/config.json", Body=b'{"hidden_size": 1}')
    with pytest.raises(storage.StorageError, match="config.json: checksum mismatch"):
        storage.pull("s3://weights/models/m3", tmp_path / "pulled", client=client)
    assert not (tmp_path / "pulled").exists()


def test_missing_bucket_and_missing_checkpoint_errors(client, tmp_path, checkpoint):
    with pytest.raises(storage.StorageError, match="bucket 'nope' does not exist"):
        storage.pull("s3://nope/models/x", tmp_path / "x", client=client)
    with pytest.raises(storage.StorageError, match="bucket 'nope' does not exist"):
        storage.push(checkpoint, "s3://nope/models/x", client=client)
    with pytest.raises(storage.StorageError, match="no MANIFEST.json"):
        storage.pull("s3://weights/never-pushed", tmp_path / "y", client=client)


def test_missing_credentials_error(s3_endpoint, tmp_path, monkeypatch):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(storage.StorageError, match="no AWS credentials"):
        storage.pull("s3://weights/models/x", tmp_path / "x", client=storage.s3_client(s3_endpoint))


def test_permission_denied_is_explained():
    from botocore.exceptions import ClientError

    # moto's server does not enforce IAM; the error mapping is checked on the real error shape.
    denied = ClientError(
        {
            "Error": {"Code": "AccessDenied", "Message": "Access Denied"},
            "ResponseMetadata": {"HTTPStatusCode": 403},
        },
        "GetObject",
    )
    error = storage._explain(denied, storage.S3Uri.parse("s3://weights/m"))
    assert str(error) == "s3://weights/m: permission denied (AccessDenied)"


def test_cli_push_and_pull(s3_endpoint, client, checkpoint, tmp_path, capsys):
    uri = "s3://weights/cli/m"
    assert main(["models", "push", str(checkpoint), uri, "--endpoint-url", s3_endpoint]) == 0
    dest = tmp_path / "cli-pulled"
    assert main(["models", "pull", uri, str(dest), "--endpoint-url", s3_endpoint]) == 0
    assert _same_tree(checkpoint, dest)
    assert main(["models", "pull", "s3://nope/x", str(dest), "--endpoint-url", s3_endpoint]) == 1
    assert "bucket 'nope' does not exist" in capsys.readouterr().err


ESCAPING_KEYS = ["../evil.json", "/etc/passwd", "a/../../b", "./x", "a//b", "c:\\x"]


@pytest.mark.parametrize("key", ESCAPING_KEYS)
def test_manifest_keys_that_escape_the_directory_are_refused(client, tmp_path, key):
    body = json.dumps({"files": {key: {"size": 1, "sha256": "0" * 64}}})
    client.put_object(Bucket="weights", Key="models/evil/MANIFEST.json", Body=body.encode())
    with pytest.raises(storage.StorageError, match="escapes"):
        storage.pull("s3://weights/models/evil", tmp_path / "out", client=client)
    assert not (tmp_path / "evil.json").exists() and not (tmp_path / "out").exists()


def test_concurrent_pulls_of_one_model_install_it_once(client, checkpoint, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    storage.push(checkpoint, "s3://weights/models/m5", client=client)
    downloaded = []
    with ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(
            lambda _: storage.pull("s3://weights/models/m5", tmp_path / "m5", client=client,
                                   on_file_done=downloaded.append),
            range(2),
        ))  # fmt: skip
    assert paths[0] == paths[1] and _same_tree(checkpoint, tmp_path / "m5")
    # the second pull waited for the lock, then found the model installed
    assert len(downloaded) == len(storage.build_manifest(checkpoint))


def test_leftovers_in_the_staging_directory_are_not_installed(client, checkpoint, tmp_path):
    """An older version's interrupted pull and a killed download's temporary file stay out of
    the installed checkpoint (a stray file makes an untrusted drafter fail validation)."""
    storage.push(checkpoint, "s3://weights/models/m6", client=client)
    staging = tmp_path / "m6.partial"
    (staging / "old").mkdir(parents=True)
    (staging / "old" / "model-00003.safetensors").write_bytes(b"stale shard")
    (staging / "model-00002.safetensors.part.1a2b3c4d").write_bytes(b"half a download")
    (staging / "sub").write_bytes(b"a file where this version has a directory")
    dest = storage.pull("s3://weights/models/m6", tmp_path / "m6", client=client)
    assert _same_tree(checkpoint, dest)
    assert not (dest / "old").exists()


def test_a_directory_that_is_not_a_pulled_checkpoint_is_never_replaced(
    client, checkpoint, tmp_path
):
    storage.push(checkpoint, "s3://weights/models/m7", client=client)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(storage.StorageError, match="holds no MANIFEST.json"):
        storage.pull("s3://weights/models/m7", tmp_path / "mine", client=client)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _same_tree(checkpoint, storage.pull("s3://weights/models/m7", empty, client=client))


@pytest.mark.parametrize("uri", ["s3://", "s3:///prefix", "s3://b/../../etc", "s3://b/m/./x"])
def test_uris_without_a_bucket_or_that_climb_are_refused(uri):
    with pytest.raises(storage.StorageError, match="s3://"):
        storage.S3Uri.parse(uri)


@pytest.mark.parametrize("body", [b"not json", b'{"files": {"a": "x"}}', b'{"files": []}'])
def test_a_malformed_manifest_is_a_storage_error(client, tmp_path, body):
    client.put_object(Bucket="weights", Key="models/bad/MANIFEST.json", Body=body)
    with pytest.raises(storage.StorageError, match="not a manifest pushed by cluster"):
        storage.pull("s3://weights/models/bad", tmp_path / "bad", client=client)


def test_an_update_replaces_the_installed_version_whole(client, checkpoint, tmp_path):
    storage.push(checkpoint, "s3://weights/models/m8", client=client)
    dest = storage.pull("s3://weights/models/m8", tmp_path / "m8", client=client)
    (checkpoint / "config.json").write_text(json.dumps({"hidden_size": 1152}))
    (checkpoint / "model-00002.safetensors").unlink()
    storage.push(checkpoint, "s3://weights/models/m8", client=client)
    fetched: list[str] = []
    storage.pull("s3://weights/models/m8", dest, client=client, on_file_done=fetched.append)
    assert _same_tree(checkpoint, dest)
    assert not (tmp_path / "m8.replaced").exists() and not (tmp_path / "m8.partial").exists()
