"""LoRA on the engine side and at admission: the vLLM launch flags, the adapter hot-load protocol, the API rules.

The hot-load protocol is checked against a stand-in server that records what the engine client sends
(the real vLLM CPU server serves the adapters in tests/integration/test_lora_vllm.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from aiohttp import web

from kuberl.api import RLExperiment
from kuberl.api.algorithm import LORA_DEFAULT_TARGETS, LORA_NEEDS_VLLM
from kuberl.api.validation import check_cel, crd_schema, prune_and_default, validate_manifest
from kuberl.runtime.inference import vllm
from kuberl.runtime.inference.base import EngineError, GenerateRequest
from kuberl.runtime.inference.main import engine_settings, server_command

REQ = GenerateRequest(input_ids=[1, 2, 3], max_new_tokens=2)


def manifest(**spec) -> dict:
    doc = {"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "lora"},
           "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "add-small"},
                    "algorithm": {"lora": {"rank": 8, "alpha": 16}}, "rollout": {"accelerator": {"type": "cpu"}}}}
    for key, value in spec.items():
        doc["spec"][key] = {**doc["spec"].get(key, {}), **value} if isinstance(value, dict) else value
    return doc


def messages(doc: dict) -> list[str]:
    return [e.message for e in validate_manifest(doc)]


def cel_messages(doc: dict) -> list[str]:
    """The CEL rules alone, as the API server evaluates them (validate_manifest stops at their first failures)."""
    schema = crd_schema()
    return [e.message for e in check_cel(schema, prune_and_default(schema, doc, "", []))]


# ---------------------------------------------------------------------------------------------
# API
# ---------------------------------------------------------------------------------------------

class TestAdmission:
    def test_a_lora_spec_takes_its_defaults(self):
        lora = RLExperiment.model_validate(manifest()).spec.algorithm.lora
        assert (lora.rank, lora.alpha, lora.dropout, lora.target_modules) == (8, 16.0, 0.0, LORA_DEFAULT_TARGETS)
        assert messages(manifest()) == []

    def test_no_lora_by_default(self):
        doc = manifest()
        del doc["spec"]["algorithm"]
        assert RLExperiment.model_validate(doc).spec.algorithm.lora is None

    @pytest.mark.parametrize("lora, field, words", [
        ({"rank": 0, "alpha": 16}, "spec.algorithm.lora.rank", "greater than or equal to 1"),
        ({"rank": 1024, "alpha": 16}, "spec.algorithm.lora.rank", "less than or equal to 512"),
        ({"rank": 8, "alpha": 0}, "spec.algorithm.lora.alpha", "greater than 0"),
        ({"rank": 8, "alpha": 16, "targetModules": []}, "spec.algorithm.lora.targetModules", "at least 1"),
        ({"rank": 8, "alpha": 16, "targetModules": ["q_proj", ""]}, "spec.algorithm.lora.targetModules[1]", "at least 1 chars"),
        ({"rank": 8, "alpha": 16, "dropout": 1.0}, "spec.algorithm.lora.dropout", "less than 1"),
        ({"alpha": 16}, "spec.algorithm.lora.rank", "Required value"),
        ({"rank": 8, "alpha": 16, "targetModules": ["q_proj", "lm_head"]}, "spec.algorithm.lora", "not on lm_head or embed_tokens"),
    ])
    def test_bad_lora_fields_are_refused_with_their_path(self, lora, field, words):
        errors = validate_manifest(manifest(algorithm={"lora": lora}))
        assert any(e.path == field and words in f"{e.kind}: {e.message}" for e in errors), errors

    @pytest.mark.parametrize("spec", [{"rollout": {"engine": "sglang"}}, {"allocation": "sglang:d2+fsdp:d2"}])
    def test_lora_with_sglang_is_refused_by_admission_and_the_model(self, spec):
        doc = manifest(**spec)
        assert LORA_NEEDS_VLLM in messages(doc)  # CEL, as the API server evaluates it
        with pytest.raises(ValueError, match="algorithm.lora needs rollout.engine vllm"):
            RLExperiment.model_validate(doc)

    @pytest.mark.parametrize("spec", [{"rollout": {"engine": "sglang"}}, {"allocation": "sglang:d2+fsdp:d2"}])
    def test_the_cel_rule_alone_refuses_lora_with_sglang(self, spec):
        assert LORA_NEEDS_VLLM in cel_messages(manifest(**spec))
        plain = manifest(**spec)
        del plain["spec"]["algorithm"]
        assert LORA_NEEDS_VLLM not in cel_messages(plain)

    @pytest.mark.parametrize("spec", [{"trainer": {"backend": "megatron"}}, {"allocation": "vllm:d2+megatron:d2"}])
    def test_lora_with_a_backend_other_than_fsdp_is_refused(self, spec):
        # only the fsdp trainer wraps the model with PEFT; the megatron trainer trains full weights (its own rule)
        from kuberl.api.v1alpha1 import MEGATRON_FULL_WEIGHTS

        assert MEGATRON_FULL_WEIGHTS in cel_messages(manifest(**spec))
        with pytest.raises(ValueError, match="algorithm.lora and weightSync.mode broadcast need trainer.backend fsdp"):
            RLExperiment.model_validate(manifest(**spec))

    def test_lora_with_vllm_and_fsdp_is_accepted_with_or_without_the_allocation(self):
        assert messages(manifest(allocation="vllm:d1+fsdp:d1")) == []
        assert cel_messages(manifest(allocation="vllm:d1+fsdp:d1")) == [] and cel_messages(manifest()) == []

    def test_the_rules_are_part_of_the_crd(self):
        from kuberl.api.crd import build_crd

        crd = json.dumps(build_crd())
        assert LORA_NEEDS_VLLM in crd


# ---------------------------------------------------------------------------------------------
# Launch
# ---------------------------------------------------------------------------------------------

class TestLaunch:
    def test_a_lora_manifest_starts_vllm_with_lora_enabled_at_a_rank_vllm_accepts(self):
        exp = RLExperiment.model_validate(manifest(algorithm={"lora": {"rank": 12, "alpha": 24}}))
        assert engine_settings(exp)["lora_rank"] == 12
        cmd, env = server_command(exp, "/m", 8000, "127.0.0.1")
        i = cmd.index("--enable-lora")
        assert cmd[i + 1:i + 5] == ["--max-lora-rank", "16", "--max-loras", "2"]  # 12 -> 16: vLLM takes 1, 8, 16, 32, ...
        assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"

    def test_no_lora_no_flags(self):
        doc = manifest()
        del doc["spec"]["algorithm"]
        cmd, _ = server_command(RLExperiment.model_validate(doc), "/m", 8000, "127.0.0.1")
        assert "--enable-lora" not in cmd

    @pytest.mark.parametrize("rank, flag", [(1, "1"), (8, "8"), (9, "16"), (320, "320"), (321, "512")])
    def test_the_rank_flag_is_the_smallest_accepted_value_that_holds_the_rank(self, rank, flag):
        assert vllm.lora_args(rank)[2] == flag

    def test_a_rank_vllm_cannot_serve_is_an_error(self):
        with pytest.raises(ValueError, match="1 to 512"):
            vllm.lora_args(513)


# ---------------------------------------------------------------------------------------------
# Hot-loading
# ---------------------------------------------------------------------------------------------

class FakeVLLM:
    """Records requests; keeps the set of loaded adapters as vLLM does (names, in-place reloads)."""

    def __init__(self, lora_enabled: bool = True) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.adapters: dict[str, str] = {}
        self.lora_enabled = lora_enabled

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        self.calls.append((request.path, body))
        if request.path == "/inference/v1/generate":
            return web.json_response({"choices": [{"index": 0, "token_ids": [7, 8], "finish_reason": "length",
                                                   "logprobs": {"content": [{"token_id": 7, "logprob": -0.1}, {"token_id": 8, "logprob": -0.2}]}}]})
        if request.path == "/v1/load_lora_adapter":
            if not self.lora_enabled:
                return web.json_response({"error": {"message": "LoRA is not enabled"}}, status=400)
            if body["lora_name"] in self.adapters and not body.get("load_inplace"):
                return web.json_response({"error": {"message": "already loaded"}}, status=400)
            self.adapters[body["lora_name"]] = body["lora_path"]
            return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' added successfully.")
        if request.path == "/v1/unload_lora_adapter":
            self.adapters.pop(body["lora_name"])
            return web.Response(text="unloaded")
        return web.json_response({})

    async def models(self, request: web.Request) -> web.Response:
        data = [{"id": "policy"}] + [{"id": n, "parent": "policy"} for n in self.adapters]
        return web.json_response({"object": "list", "data": data})

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


def adapter_dir(root: Path, version: int) -> Path:
    d = root / f"v{version}"
    d.mkdir(parents=True)
    (d / "adapter_config.json").write_text("{}")
    (d / "adapter_model.safetensors").write_bytes(b"")
    return d


async def test_each_update_serves_the_new_adapter_and_unloads_the_older_ones(tmp_path):
    server = FakeVLLM()
    engine = vllm.VLLMEngine(url=await server.start())
    try:
        await engine.generate(REQ)
        assert server.calls[-1][1]["model"] == "policy"  # no adapter yet: the base model (= zero adapters)
        server.adapters["kuberl-v1"] = "/left/by/an/earlier/agent"
        for version in (2, 3):
            await engine.pause()
            await engine.update_weights_from_disk(str(adapter_dir(tmp_path, version)), version)
            await engine.resume()
        assert server.adapters == {"kuberl-v3": str(tmp_path / "v3")}
        paths = [p for p, _ in server.calls]
        load = paths.index("/v1/load_lora_adapter")
        assert "/reset_prefix_cache" in paths[load:] and "/collective_rpc" not in paths  # an adapter, not a full reload
        result = await engine.generate(REQ)
        assert server.calls[-1][1]["model"] == "kuberl-v3" and result.version == 3 and engine.version == 3
        # a restarted trainer republishes v3: loaded again in place under the same name
        await engine.update_weights_from_disk(str(tmp_path / "v3"), 3)
        assert server.adapters == {"kuberl-v3": str(tmp_path / "v3")}
    finally:
        await engine.close()
        await server.runner.cleanup()


async def test_full_weights_after_adapters_serve_the_base_name_again(tmp_path):
    server = FakeVLLM()
    engine = vllm.VLLMEngine(url=await server.start())
    try:
        await engine.update_weights_from_disk(str(adapter_dir(tmp_path, 1)), 1)
        full = tmp_path / "full"
        full.mkdir()
        (full / "config.json").write_text("{}")
        await engine.update_weights_from_disk(str(full), 2)
        await engine.generate(REQ)
        assert server.calls[-1][1]["model"] == "policy"
    finally:
        await engine.close()
        await server.runner.cleanup()


async def test_a_server_without_lora_gets_an_error_that_says_how_to_start_it(tmp_path):
    server = FakeVLLM(lora_enabled=False)
    engine = vllm.VLLMEngine(url=await server.start())
    try:
        with pytest.raises(EngineError, match="cannot hot-load LoRA adapters.*--enable-lora"):
            await engine.update_weights_from_disk(str(adapter_dir(tmp_path, 1)), 1)
        assert engine.served_model == "policy" and engine.version == 0
    finally:
        await engine.close()
        await server.runner.cleanup()
