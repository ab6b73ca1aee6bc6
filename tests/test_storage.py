"""S3 weights storage against a real S3-compatible HTTP server (moto's, on 127.0.0.1).

AWS itself cannot be reached from here; moto's server speaks the S3 REST protocol over HTTP,
so boto3 does real multipart uploads, ranged GETs and errors against it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

from cluster import storage
from cluster.cli import main

MiB = 1024 * 1024
ROOT = Path(__file__).resolve().parent.parent


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
    version = storage.pull("s3://weights/models/m1", dest, client=client)
    assert version == tmp_path / "pulled.versions" / storage.version_id(manifest)
    assert dest.resolve() == version and _same_tree(checkpoint, dest)
    assert [p.name for p in version.parent.iterdir()] == [version.name]  # no staging left


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
    version = storage.version_id(storage.read_manifest("s3://weights/models/m2", client=client))
    staged = tmp_path / "pulled.versions" / f"{version}.partial" / done[0]
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
    manifest = storage.push(checkpoint, "s3://weights/models/m6", client=client)
    staging = tmp_path / "m6.versions" / f"{storage.version_id(manifest)}.partial"
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


def test_an_update_never_changes_the_version_a_loader_was_given(client, checkpoint, tmp_path):
    """A replica loading the first version while a neighbour on the node pulls a re-push of
    the prefix keeps reading the first version's files (an in-place replacement handed it the
    new shards half-way through its load); the link moves to the new version in one rename."""
    uri, dest = "s3://weights/models/m8", tmp_path / "m8"
    storage.push(checkpoint, uri, client=client)
    loading = storage.pull(uri, dest, client=client)
    first_config = (loading / "config.json").read_text()
    (checkpoint / "config.json").write_text(json.dumps({"hidden_size": 1152}))
    (checkpoint / "model-00002.safetensors").unlink()
    storage.push(checkpoint, uri, client=client)
    fetched: list[str] = []
    updated = storage.pull(uri, dest, client=client, on_file_done=fetched.append)
    assert updated != loading and dest.resolve() == updated and _same_tree(checkpoint, dest)
    assert (loading / "config.json").read_text() == first_config
    assert (loading / "model-00002.safetensors").is_file()
    # The unchanged shard is shared with the first version, not copied.
    shard = "model-00001.safetensors"
    assert (updated / shard).stat().st_ino == (loading / shard).stat().st_ino
    # A third version removes the first; the one it replaces stays for its loaders.
    (checkpoint / "config.json").write_text(json.dumps({"hidden_size": 2048}))
    storage.push(checkpoint, uri, client=client)
    latest = storage.pull(uri, dest, client=client)
    assert sorted(p.name for p in latest.parent.iterdir()) == sorted([updated.name, latest.name])


def test_a_pull_that_waited_for_the_lock_installs_what_is_pushed_meanwhile(
    client, checkpoint, tmp_path
):
    """A pull waiting behind another reads the manifest once it holds the lock: one that read
    it before would link an older version back over a newer one (or fail its checksums)."""
    from concurrent.futures import ThreadPoolExecutor

    from cluster.models import exclusive

    uri, dest = "s3://weights/models/m10", tmp_path / "m10"
    storage.push(checkpoint, uri, client=client)
    with ThreadPoolExecutor(1) as pool:
        with exclusive(tmp_path / "m10.lock"):  # another pull of this destination
            waiting = pool.submit(storage.pull, uri, dest, client=client)
            time.sleep(0.5)  # it is waiting for the lock now
            (checkpoint / "config.json").write_text(json.dumps({"hidden_size": 1152}))
            newer = storage.push(checkpoint, uri, client=client)
        assert waiting.result().name == storage.version_id(newer)
    assert _same_tree(checkpoint, dest)


def test_a_directory_installed_by_an_earlier_release_becomes_a_version(
    client, checkpoint, tmp_path
):
    """Caches filled before versions existed hold the checkpoint in place: it is kept (a
    loader may be reading it) and the link takes its name."""
    uri, dest = "s3://weights/models/m9", tmp_path / "m9"
    manifest = storage.push(checkpoint, uri, client=client)
    shutil.copytree(storage.pull(uri, tmp_path / "scratch", client=client), dest)
    fetched: list[str] = []
    version = storage.pull(uri, dest, client=client, on_file_done=fetched.append)
    assert fetched == [] and dest.is_symlink() and _same_tree(checkpoint, dest)
    assert version.name == storage.version_id(manifest)


def test_a_replica_loads_the_pulled_versions_and_refuses_an_untrusted_drafter(
    s3_endpoint, client, tmp_path, monkeypatch
):
    """What a pool replica does before its engine starts (`stage_s3_sources`): the target and
    the drafter are pulled into the node's cache and vLLM is pointed at the versions' own
    directories; a drafter with a file that is not weights, config or tokenizer is refused."""
    from ray.serve.llm import LLMConfig

    from cluster.deployments.pool_server import stage_s3_sources

    monkeypatch.setenv("CLUSTER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_endpoint)
    drafter = tmp_path / "drafter"
    shutil.copytree(ROOT / "drafters" / "smollm2-135m-instruct-eagle3.1", drafter)
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(
        json.dumps({"hidden_size": 576, "vocab_size": 49152, "num_hidden_layers": 30})
    )
    storage.push(target, "s3://weights/stage/target", client=client)
    storage.push(drafter, "s3://weights/stage/drafter", client=client)

    def staged() -> LLMConfig:
        config = LLMConfig(
            model_loading_config={"model_id": "m", "model_source": "s3://weights/stage/target"},
            engine_kwargs={"speculative_config": {"model": "s3://weights/stage/drafter"}},
        )
        stage_s3_sources(config)
        return config

    config = staged()
    source = config.model_loading_config.model_source
    assert source == str(storage.cached_path("s3://weights/stage/target").resolve())
    assert ".versions" in source and _same_tree(target, Path(source))
    spec_model = Path(config.engine_kwargs["speculative_config"]["model"])
    assert spec_model == storage.cached_path("s3://weights/stage/drafter").resolve()
    (drafter / "loader.py").write_text("import os")
    storage.push(drafter, "s3://weights/stage/drafter", client=client)
    with pytest.raises(ValueError, match="loader.py: not a safetensors"):
        staged()
