"""The private Ray Serve LLM API our one adapter (`pool_server.StatsVLLMEngine`) relies on.
A Ray upgrade that renames or reshapes it fails here instead of silently losing engine stats."""

import inspect

from ray.llm._internal.serve.engines.vllm.vllm_engine import VLLMEngine
from ray.serve.llm import LLMServer


def test_engine_start_hook_keeps_its_signature():
    parameters = list(inspect.signature(VLLMEngine._start_async_llm_engine).parameters)
    assert parameters == ["self", "vllm_engine_args", "vllm_engine_config", "placement_group"]


def test_llm_server_still_takes_its_engine_class_from_default_engine_cls():
    assert hasattr(LLMServer, "_default_engine_cls")
    source = inspect.getsource(LLMServer._get_default_engine_class)
    assert "self._default_engine_cls" in source


def test_pool_server_uses_only_public_handle_methods_of_llm_server():
    # The ingress calls these by name through DeploymentHandles (cluster/request/protocol.py).
    from cluster.request.protocol import ENDPOINTS

    for method in ENDPOINTS:
        assert inspect.iscoroutinefunction(getattr(LLMServer, method)), method
