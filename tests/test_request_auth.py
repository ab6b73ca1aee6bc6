"""API keys: hashed, scoped, from config / env / file; 401 and 403 in OpenAI's shape."""

import json

import pytest

from cluster.config import ApiKey, AuthConfig, ConfigError, parse_config
from cluster.request.auth import ADMIN, INFERENCE, KeyStore, hash_key
from cluster.request.errors import ApiError
from tests.test_config import CONFIGS, embedded_data

USER, OPS = "sk-user-123", "sk-ops-456"
KEYS = [
    ApiKey(name="user", sha256=hash_key(USER), scopes=["inference"]),
    ApiKey(name="ops", sha256=hash_key(OPS), scopes=["inference", "admin"]),
]


def _denied(store: KeyStore, header, scope) -> ApiError:
    with pytest.raises(ApiError) as caught:
        store.authorize(header, scope)
    error = caught.value
    assert USER not in json.dumps(error.body()) and OPS not in json.dumps(error.body())
    return error


def test_missing_wrong_and_out_of_scope_keys():
    store = KeyStore(KEYS, required=True)
    assert _denied(store, None, INFERENCE).status == 401
    assert _denied(store, "Bearer sk-nope", INFERENCE).status == 401
    assert _denied(store, f"Basic {USER}", INFERENCE).status == 401
    error = _denied(store, f"Bearer {USER}", ADMIN)
    assert error.status == 403 and error.body()["error"]["type"] == "permission_error"
    assert store.authorize(f"Bearer {USER}", INFERENCE) == "user"
    assert store.authorize(f"bearer {OPS}", ADMIN) == "ops"


def test_open_store_lets_everyone_in():
    assert KeyStore([], required=False).authorize(None, ADMIN) is None


def test_keys_from_env_and_file(tmp_path, monkeypatch):
    entry = {"name": "env", "sha256": hash_key("sk-env"), "scopes": ["inference"]}
    monkeypatch.setenv("CLUSTER_API_KEYS", json.dumps([entry]))
    file = tmp_path / "keys.json"
    file.write_text(json.dumps([{**entry, "name": "file", "sha256": hash_key("sk-file")}]))
    store = KeyStore.load(AuthConfig(), str(file))
    assert store.authorize("Bearer sk-env", INFERENCE) == "env"
    assert store.authorize("Bearer sk-file", INFERENCE) == "file"


def test_required_auth_without_keys_refuses_to_start(monkeypatch):
    monkeypatch.delenv("CLUSTER_API_KEYS", raising=False)
    with pytest.raises(ValueError, match="no API keys"):
        KeyStore.load(AuthConfig(), None)


def test_malformed_key_list_does_not_echo_its_text(monkeypatch):
    monkeypatch.setenv("CLUSTER_API_KEYS", '[{"name": "x", "sha256": "sk-secret-plain"}]')
    with pytest.raises(ValueError) as caught:
        KeyStore.load(AuthConfig(), None)
    assert "sk-secret-plain" not in str(caught.value)


def test_open_auth_only_on_loopback():
    data = embedded_data()
    data["server"]["host"] = "0.0.0.0"
    with pytest.raises(ConfigError, match="auth.required"):
        parse_config(data, "bad.yaml")
    data["server"]["auth"] = {"required": True}
    assert parse_config(data, base_dir=CONFIGS).server.auth.required
