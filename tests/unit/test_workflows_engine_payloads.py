"""How the engines shape requests and read responses (SGLang cannot run here: it is checked against
payloads recorded from SGLang 0.5.x's /generate; vLLM's live behaviour is in tests/integration/test_vllm.py),
plus the `kuberl engine` launch settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from kuberl.api.v1alpha1 import RLExperiment
from kuberl.runtime.inference import sglang, vllm
from kuberl.runtime.inference.base import EngineError, GenerateRequest, engine_class
from kuberl.runtime.inference.main import engine_settings, server_command

REQ = GenerateRequest(input_ids=[1, 292, 201], max_new_tokens=16, temperature=0.7, top_p=0.9, stop_token_ids=[2], seed=5)

# SGLang 0.5.x /generate with input_ids and return_logprob=true (text of each logprob entry is null
# unless return_text_in_logprobs is set); finish_reason is a dict.
SGLANG_STOP = {
    "text": "77",
    "output_ids": [23, 23, 2],
    "meta_info": {
        "id": "5f0c", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 3, "weight_version": "3",
        "completion_tokens": 3, "cached_tokens": 0, "e2e_latency": 0.05,
        "input_token_logprobs": [[None, 1, None], [-5.7, 292, None], [-5.6, 201, None]],
        "output_token_logprobs": [[-0.51, 23, None], [-0.22, 23, None], [-1.9, 2, None]],
    },
}
SGLANG_ABORT = {
    "text": "7",
    "output_ids": [23],
    "meta_info": {"id": "6a1d", "finish_reason": {"type": "abort", "message": "Abort before prefill", "status_code": None, "err_type": None},
                  "prompt_tokens": 3, "completion_tokens": 1, "output_token_logprobs": [[-0.4, 23, None]]},
}


class TestSGLang:
    def test_generate_payload_asks_for_sampled_token_logprobs_from_token_ids(self):
        body = sglang.generate_payload(REQ)
        assert body["input_ids"] == [1, 292, 201] and body["return_logprob"] is True and body["stream"] is False
        sp = body["sampling_params"]
        assert (sp["max_new_tokens"], sp["temperature"], sp["top_p"], sp["stop_token_ids"]) == (16, 0.7, 0.9, [2])
        assert sp["no_stop_trim"] is True and sp["sampling_seed"] == 5
        # SGLang's ignore_eos would skip stop_token_ids too (every token-based stop): it must stay off.
        assert sp["ignore_eos"] is False and "stop" not in sp

    def test_a_finished_response_gives_ids_logprobs_and_reason(self):
        res = sglang.parse_generate(SGLANG_STOP, version=3)
        assert res.output_ids == [23, 23, 2] and res.logprobs == [-0.51, -0.22, -1.9]
        assert res.finish_reason == "stop" and res.version == 3

    def test_an_aborted_response_keeps_its_partial_tokens(self):
        res = sglang.parse_generate([SGLANG_ABORT], version=0)  # a batch of one also works
        assert res.finish_reason == "abort" and res.output_ids == [23]

    def test_inconsistent_or_unexpected_responses_are_errors_that_show_the_payload(self):
        bad = {**SGLANG_STOP, "output_ids": [23, 24, 2]}
        with pytest.raises(EngineError, match="disagree"):
            sglang.parse_generate(bad, 0)
        with pytest.raises(EngineError, match="unexpected response shape"):
            sglang.parse_generate({"text": "x"}, 0)
        odd = {"meta_info": {"finish_reason": {"type": "weird"}, "output_token_logprobs": []}}
        with pytest.raises(EngineError, match="unexpected finish_reason"):
            sglang.parse_generate(odd, 0)

    def test_every_sampling_field_is_explicit_and_neutral_so_the_models_defaults_cannot_apply(self):
        sp = sglang.generate_payload(REQ)["sampling_params"]
        # SGLang's SamplingParams: top_k -1 = whole vocabulary (0 is refused), min_p 0, penalties neutral.
        assert (sp["top_k"], sp["min_p"], sp["repetition_penalty"], sp["presence_penalty"], sp["frequency_penalty"]) == (-1, 0.0, 1.0, 0.0, 0.0)
        greedy = sglang.generate_payload(GenerateRequest(input_ids=[1], max_new_tokens=1, temperature=0.0))["sampling_params"]
        assert greedy["temperature"] == 0.0 and greedy["top_p"] == 1.0

    def test_the_server_takes_openai_sampling_defaults_not_the_models(self):
        cmd = sglang.build_server_command("/m", port=30000)
        assert cmd[cmd.index("--sampling-defaults") + 1] == "openai"

    def test_weight_update_payload_names_path_and_version(self):
        assert sglang.update_weights_payload("/w/v3", 3) == {"model_path": "/w/v3", "weight_version": "3", "abort_all_requests": True}

    def test_the_server_command_maps_parallelism_and_limits(self):
        cmd = sglang.build_server_command("/m", port=30000, tensor_parallel_size=2, max_model_len=4096, max_num_seqs=64,
                                          extra_args=["--mem-fraction-static", "0.8"])
        joined = " ".join(cmd)
        assert "-m sglang.launch_server --model-path /m" in joined and "--tp-size 2" in joined
        assert "--context-length 4096" in joined and "--max-running-requests 64" in joined
        assert cmd[-2:] == ["--mem-fraction-static", "0.8"]


class TestVLLM:
    def test_generate_payload_sends_token_ids_and_asks_for_tokens_back(self):
        body = vllm.VLLMEngine.generate_payload(REQ)
        sp = body["sampling_params"]
        assert body["token_ids"] == [1, 292, 201] and body["output_mode"] == "tokens" and body["model"] == "policy"
        assert sp["max_tokens"] == 16 and sp["seed"] == 5 and sp["detokenize"] is False
        assert sp["logprobs"] == 0 and sp["ignore_eos"] is True
        assert sp["stop_token_ids"] == [2] and sp["skip_special_tokens"] is False
        assert vllm.VLLMEngine.with_n(body, 8)["sampling_params"]["n"] == 8 and "n" not in sp
        # The prefix cache is salted with the weights' version: no request reuses KV that other weights computed.
        assert body["cache_salt"] != vllm.VLLMEngine.generate_payload(REQ, version=1)["cache_salt"]

    def test_every_sampling_field_of_the_installed_vllm_is_explicit_and_neutral(self):
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest as VGenerateRequest

        body = vllm.VLLMEngine.generate_payload(REQ)
        # Whatever vLLM would fill from the server's defaults (= the model's generation_config under
        # --generation-config auto) is named in the request.
        assert set(CompletionRequest.__private_attributes__["_DEFAULT_SAMPLING_PARAMS"].default) <= set(body["sampling_params"])
        # Through vLLM's own request model: the sampling parameters are the manifest's temperature and top_p and nothing else.
        parsed = VGenerateRequest(**body)
        sp = parsed.sampling_params
        assert all(parsed.is_sampling_param_provided(k) for k in ("temperature", "top_p", "top_k", "min_p", "max_tokens"))
        assert (sp.temperature, sp.top_p) == (0.7, 0.9)
        assert sp.top_k in (0, -1) and sp.min_p == 0.0
        assert (sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty) == (1.0, 0.0, 0.0)
        assert sp.logprobs == 0 and sp.detokenize is False and sp.ignore_eos is True and sp.stop_token_ids == [2]

    def test_an_unexpected_response_is_an_error(self):
        with pytest.raises(EngineError, match="unexpected response shape"):
            vllm.VLLMEngine.parse_generate({"choices": []}, 0)
        ok = {"choices": [{"index": 0, "token_ids": [5], "logprobs": {"content": [{"token_id": 5, "logprob": -1.0}]}, "finish_reason": "abort"}]}
        assert vllm.VLLMEngine.parse_generate(ok, 2).finish_reason == "abort"
        with pytest.raises(ValueError, match="1 tokens but 0 logprobs"):
            vllm.VLLMEngine.parse_generate({"choices": [{"index": 0, "token_ids": [5], "finish_reason": "length"}]}, 0)
        with pytest.raises(EngineError, match="unexpected finish_reason"):
            vllm.VLLMEngine.parse_generate({"choices": [{**ok["choices"][0], "finish_reason": "error"}]}, 0)

    def test_each_token_takes_the_version_of_its_weight_version_span(self):
        def choice(spans):
            return {"index": 0, "token_ids": [5, 6, 7, 8], "finish_reason": "length", "weight_versions": spans,
                    "logprobs": {"content": [{"token_id": t, "logprob": -0.5} for t in (5, 6, 7, 8)]}}

        # An in-flight update (weightSync.inFlight keep) after two tokens: the rest are v4's.
        res = vllm.VLLMEngine.parse_choice(choice([{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 4}]), 3)
        assert res.versions == [3, 3, 4, 4] and res.token_versions() == [3, 3, 4, 4] and res.version == 3
        # "default" (the weights the server started with, never labelled) and tokens no span covers: the request's version.
        res = vllm.VLLMEngine.parse_choice(choice([{"version": "default", "start": 0, "end": 1}, {"version": "7", "start": 1, "end": 3}]), 6)
        assert res.versions == [6, 7, 7, 6]
        # No spans (an older vLLM): every token is the request's.
        assert vllm.VLLMEngine.parse_choice(choice(None), 2).token_versions() == [2, 2, 2, 2]
        with pytest.raises(EngineError, match="unexpected response shape"):
            vllm.VLLMEngine.parse_choice(choice([{"version": "1"}]), 0)

    def test_the_server_runs_the_module_in_dev_mode_with_processed_logprobs(self):
        cmd = vllm.build_server_command("/m", port=8000, max_model_len=512, extra_args=["--max-model-len", "256"])
        # on CPU through vllm_server (its engine core forked), which runs vLLM's server module named next
        assert cmd[1:4] == ["-m", "kuberl.runtime.inference.vllm_server", "vllm.entrypoints.openai.api_server"] if vllm.on_cpu() else \
            cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
        assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs"
        assert cmd[cmd.index("--generation-config") + 1] == "vllm"  # the model's sampling defaults are off
        assert cmd[cmd.index("--worker-extension-cls") + 1] == vllm.WORKER_EXTENSION  # tied-head-safe reload
        assert "--enable-scale-out" in cmd  # /inference/v1/generate, the path generation takes
        assert cmd[-2:] == ["--max-model-len", "256"]  # the user's engineArgs come last and win
        assert vllm.server_env({})["VLLM_SERVER_DEV_MODE"] == "1"

    def test_a_one_worker_cpu_engine_runs_its_worker_in_the_engine_core_process(self, monkeypatch):
        monkeypatch.setattr(vllm, "on_cpu", lambda: True)
        one = vllm.build_server_command("/m", port=8000)
        assert one[one.index("--distributed-executor-backend") + 1] == "uni"
        assert vllm.server_env({})["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # else vLLM's CPU platform turns uni into mp
        assert "--disable-log-stats" in one  # per-step statistics nobody reads, on the engine's own CPU
        assert "--disable-log-stats" not in vllm.build_server_command("/m", port=8000, log_stats=True)  # asked for
        assert "--distributed-executor-backend" not in vllm.build_server_command("/m", port=8000, tensor_parallel_size=2)
        mine = vllm.build_server_command("/m", port=8000, extra_args=["--distributed-executor-backend", "mp"])
        assert mine[-2:] == ["--distributed-executor-backend", "mp"]  # engineArgs still win
        monkeypatch.setattr(vllm, "on_cpu", lambda: False)
        assert "--distributed-executor-backend" not in vllm.build_server_command("/m", port=8000)
        assert "--disable-log-stats" not in vllm.build_server_command("/m", port=8000)  # a GPU engine keeps its /metrics
        assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in vllm.server_env({})

    def test_an_n_sample_response_gives_every_choice_in_order(self):
        body = {"choices": [{"index": i, "token_ids": [i], "logprobs": {"content": [{"token_id": i, "logprob": -0.1 * i}]}, "finish_reason": "length"}
                            for i in (2, 0, 1)]}
        res = vllm.VLLMEngine.parse_choices(body, 3)
        assert [r.output_ids for r in res] == [[0], [1], [2]] and all(r.version == 3 for r in res)
        with pytest.raises(EngineError, match="unexpected response shape"):
            vllm.VLLMEngine.parse_choices({"choices": [{"token_ids": [1]}]}, 0)
        with pytest.raises(EngineError, match="unexpected response shape.*'x'"):
            vllm.VLLMEngine.parse_choices({"choices": [{"index": 0, "token_ids": ["x"]}]}, 0)

    def test_an_engine_needs_a_model_or_a_url(self):
        with pytest.raises(ValueError, match="exactly one of model_path"):
            vllm.VLLMEngine()


def exp(**rollout) -> RLExperiment:
    return RLExperiment.model_validate({
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "e"},
        "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"},
                 "algorithm": {"samplesPerPrompt": 8}, "rollout": {"engine": "vllm", "concurrency": 4, **rollout}},
    })


def test_engine_settings_on_cpu_use_float32_a_small_context_and_enough_sequences_for_the_agent():
    s = engine_settings(exp(accelerator={"type": "cpu"}, engineArgs=["--foo"]))
    assert s["dtype"] == "float32" and s["max_model_len"] == 512 and s["max_num_seqs"] == 32 and s["extra_args"] == ["--foo"]


def test_cpu_engines_compute_in_float32_and_the_trainer_exports_what_the_engine_computes_in():
    from kuberl.runtime.inference.main import engine_dtype

    cpu = exp(accelerator={"type": "cpu"})
    assert cpu.spec.model.dtype == "bfloat16" and engine_dtype(cpu.spec) == "float32"
    src = (Path(__file__).resolve().parents[2] / "runtime/kuberl/runtime/trainer/persist.py").read_text()
    assert "getattr(torch, engine_dtype(self.spec))" in src  # the export dtype follows the engine, not model.dtype


def test_a_stale_tied_head_is_found_and_repacked_with_vllms_own_cpu_gemm():
    """vLLM's CPU GEMM runs on a packed copy of the weight: an in-place update of a tied weight leaves it stale."""
    import torch
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    from kuberl.runtime.inference.vllm_worker import KubeRLWorkerExtension, gemm_is_current, refresh_tied_layers

    class Layer(torch.nn.Module):
        def __init__(self, weight: torch.nn.Parameter) -> None:
            super().__init__()
            self.weight, self.quant_method = weight, UnquantizedEmbeddingMethod()

    shared = torch.nn.Parameter(torch.randn(320, 128), requires_grad=False)
    model = torch.nn.ModuleDict({"embed_tokens": Layer(shared), "lm_head": Layer(shared),
                                 "o_proj": Layer(torch.nn.Parameter(torch.randn(64, 128), requires_grad=False))})
    for layer in model.values():
        layer.quant_method.process_weights_after_loading(layer)  # what vLLM does at load: the CPU prepack
    assert refresh_tied_layers(model) == {"tied_layers": 2, "refreshed": 0}
    shared.data.copy_(torch.randn(320, 128))  # a reload writes new values into the same tensor
    assert not gemm_is_current(model["lm_head"])  # the packed copy still holds the old head
    assert refresh_tied_layers(model) == {"tied_layers": 2, "refreshed": 2}
    assert gemm_is_current(model["lm_head"]) and gemm_is_current(model["o_proj"])
    assert callable(KubeRLWorkerExtension.kuberl_reload_weights) and vllm.VLLMEngine.reload_method == "kuberl_reload_weights"


def test_live_weight_gemms_compute_from_the_weight_a_reload_writes_in_place(monkeypatch):
    """KUBERL_VLLM_CPU_LIVE_WEIGHTS=1 (CPU engines' default): no packed copy, so an in-place copy is what the GEMM uses."""
    import torch
    import torch.nn.functional as F
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    from kuberl.runtime.inference.vllm_worker import gemm_is_current, live_weights, refresh_tied_layers, use_live_weight_gemms

    assert vllm.server_env({})[vllm.LIVE_WEIGHTS_ENV] == "1" or not vllm.on_cpu()
    for cls in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod):  # restored after the test
        monkeypatch.setattr(cls, "process_weights_after_loading", cls.process_weights_after_loading)
    monkeypatch.setenv(vllm.LIVE_WEIGHTS_ENV, "0")
    assert not use_live_weight_gemms()
    monkeypatch.setenv(vllm.LIVE_WEIGHTS_ENV, "1")
    assert use_live_weight_gemms() and use_live_weight_gemms()  # idempotent: one wrapper, not two

    class Layer(torch.nn.Module):
        def __init__(self, weight: torch.nn.Parameter, method) -> None:
            super().__init__()
            self.weight, self.quant_method = weight, method

    shared = torch.nn.Parameter(torch.randn(320, 128), requires_grad=False)
    model = torch.nn.ModuleDict({"embed_tokens": Layer(shared, UnquantizedEmbeddingMethod()),
                                 "lm_head": Layer(shared, UnquantizedEmbeddingMethod()),
                                 "o_proj": Layer(torch.nn.Parameter(torch.randn(64, 128), requires_grad=False), UnquantizedLinearMethod())})
    for layer in model.values():
        layer.quant_method.process_weights_after_loading(layer)
        assert layer.cpu_linear is F.linear and layer.weight.numel() > 0  # vLLM's packing would drop o_proj's weight
    assert live_weights(model)
    shared.data.copy_(torch.randn(320, 128))
    model["o_proj"].weight.data.copy_(torch.randn(64, 128))
    assert gemm_is_current(model["lm_head"]) and gemm_is_current(model["o_proj"])
    assert refresh_tied_layers(model) == {"tied_layers": 2, "refreshed": 0}
    half = Layer(torch.nn.Parameter(torch.randn(8, 8).half(), requires_grad=False), UnquantizedLinearMethod())
    half.quant_method.process_weights_after_loading(half)  # not float32: vLLM's own dispatch
    assert getattr(half, "cpu_linear", None) is not F.linear
    model["fp16_proj"] = half
    assert not live_weights(model)  # then a reload takes vLLM's layerwise path


def test_the_engine_command_is_the_registered_engines_server(tmp_path):
    cmd, env = server_command(exp(accelerator={"type": "cpu"}), "/models/m", 8000, "0.0.0.0")
    assert "vllm.entrypoints.openai.api_server" in cmd and "--port" in cmd and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert engine_class("sglang") is sglang.SGLangEngine
    with pytest.raises(ValueError, match="unknown engine 'tgi'"):
        engine_class("tgi")


def test_the_rollout_agent_attaches_to_its_pods_engine_or_launches_its_own(monkeypatch):
    from kuberl.runtime.rollout.main import make_engine, resolve_bus_url

    attached = make_engine(exp(accelerator={"type": "cpu"}), "/models/m", "http://127.0.0.1:8000")
    assert attached.url == "http://127.0.0.1:8000" and attached.model_path is None
    own = make_engine(exp(accelerator={"type": "cpu"}), "/models/m", None)
    assert own.model_path == "/models/m" and own._launch["max_num_seqs"] == 32
    monkeypatch.delenv("KUBERL_BUS_URL", raising=False)
    with pytest.raises(ValueError, match="bus URL: pass --bus-url"):
        resolve_bus_url(exp(), None)
