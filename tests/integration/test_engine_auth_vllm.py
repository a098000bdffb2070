"""A real vLLM CPU server started with an engine API key, as in a rollout pod: without the key every endpoint
but /health answers 401 (the development endpoints included, which vLLM's own --api-key leaves open);
the engine client, given the key by $KUBERL_ENGINE_API_KEY, generates and reloads weights as usual."""

from __future__ import annotations

import aiohttp
import pytest

from kuberl.api.v1alpha1 import ModelSpec
from kuberl.runtime.inference.base import GenerateRequest
from kuberl.runtime.inference.engine_auth import API_KEY_ENV
from kuberl.runtime.inference.vllm import VLLMEngine
from kuberl.runtime.models import resolve_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

KEY = "integration-Engine_key"


async def test_a_keyed_vllm_server_refuses_requests_without_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, KEY)  # what the pod's secretKeyRef sets for both containers
    model_dir = resolve_model(ModelSpec(builtin="tiny-qwen2"), tmp_path)
    engine = VLLMEngine(model_dir, max_model_len=256, max_num_seqs=4, log_path=tmp_path / "vllm.log", startup_timeout=300)
    try:
        await engine.start()
        assert KEY not in " ".join(engine.server_command())
        async with aiohttp.ClientSession() as anyone:
            async with anyone.get(engine.url + "/health") as resp:
                assert resp.status == 200  # kubelet probes carry no key
            for method, path in [("POST", "/collective_rpc"), ("POST", "/pause"), ("POST", "/resume"),
                                 ("POST", "/reset_prefix_cache"), ("POST", "/v1/completions"), ("POST", "/inference/v1/generate"),
                                 ("POST", "/update_weight_version"), ("GET", "/v1/models")]:
                async with anyone.request(method, engine.url + path, json={}) as resp:
                    assert resp.status == 401, path
        # The client sends the key: generation and a weight reload work.
        res = await engine.generate(GenerateRequest([1, 2, 3], max_new_tokens=4, temperature=1.0, seed=1))
        assert 1 <= len(res.output_ids) <= 4
        await engine.pause()
        await engine.update_weights_from_disk(str(model_dir), 1)
        await engine.resume()
        assert engine.version == 1
    finally:
        await engine.stop()
