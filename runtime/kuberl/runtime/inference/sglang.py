"""SGLang engine: launches (or attaches to) `python -m sglang.launch_server` and drives its native HTTP API.

Used by the rollout agent and `kuberl engine` when spec.rollout.engine is sglang (GPU images; SGLang
has no CPU build here, so tests check the request/response shaping against recorded payloads).
Endpoints (read from SGLang 0.5.5 and 0.5.21; the image pins 0.5.23): /generate (input_ids, sampling_params, return_logprob), /pause_generation
(aborts in-flight requests), /update_weights_from_disk, /continue_generation, /flush_cache, /health_generate.
Only the manifest decides sampling: `--sampling-defaults openai` (not the model's generation_config.json)
and every sampling field named in each request (SGLang's SamplingParams: top_k -1 = off, min_p 0, penalties neutral).
Launching, health waits, stopping and the generation gate are http_engine.HTTPServerEngine's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import aiohttp

from kuberl.runtime.inference.base import EngineError, GenerateRequest, GenerateResult
from kuberl.runtime.inference.engine_auth import engine_api_key
from kuberl.runtime.inference.http_engine import HTTPServerEngine

# SGLang's SamplingParams fields, neutral (top_k -1 = the whole vocabulary; 0 is refused by SGLang).
NEUTRAL_SAMPLING = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def build_server_command(
    model_path: str,
    *,
    port: int,
    host: str = "127.0.0.1",
    dtype: str = "bfloat16",
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    seed: int = 0,
    extra_args: list[str] | None = None,
    api_key: str | None = None,
) -> list[str]:
    """SGLang's server command. `api_key` (the engine's, $KUBERL_ENGINE_API_KEY on a cluster): SGLang's
    --api-key guards every endpoint but /health* and /metrics, weight updates and pause included. SGLang
    reads it only from its command line, which only the engine container's own processes can see (a pod
    has its own PID namespace); logs show it as *** (engine_auth.redact_command)."""
    cmd = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
        "--host", host, "--port", str(port), "--dtype", dtype,
        "--tp-size", str(tensor_parallel_size), "--pp-size", str(pipeline_parallel_size),
        "--random-seed", str(seed), "--skip-server-warmup",
        # Unset request fields take SGLang/OpenAI defaults, not the model's generation_config.json.
        "--sampling-defaults", "openai",
    ]
    if max_model_len is not None:
        cmd += ["--context-length", str(max_model_len)]
    if max_num_seqs is not None:
        cmd += ["--max-running-requests", str(max_num_seqs)]
    if api_key:
        cmd += ["--api-key", api_key]
    return cmd + list(extra_args or [])


def generate_payload(req: GenerateRequest) -> dict:
    """The /generate body for a token-ids request (logprobs of the sampled tokens, no text)."""
    sampling = {
        "max_new_tokens": req.max_new_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        **NEUTRAL_SAMPLING,
        "stop_token_ids": list(req.stop_token_ids),
        "skip_special_tokens": False,
        # Not ignore_eos: SGLang's ignore_eos skips every token-based stop, stop_token_ids included (Req.check_finished),
        # so generation would always run to max_new_tokens. Without it SGLang also stops at the eos ids it reads from
        # the model (config.json, generation_config.json, the tokenizer's eos), which the workflows' set holds already
        # (SGLang adds <|eom_id|> where the vocabulary has one).
        "ignore_eos": False,
        "no_stop_trim": True,  # keep the stop token in output_ids: the trainer must see it
    }
    if req.stop:
        sampling["stop"] = list(req.stop)  # matched on the decoded tail; output_ids end with the token completing it
    if req.seed is not None:
        sampling["sampling_seed"] = req.seed
    return {"input_ids": list(req.input_ids), "sampling_params": sampling, "return_logprob": True, "logprob_start_len": -1, "stream": False}


def parse_generate(body: dict, version: int) -> GenerateResult:
    """A GenerateResult from a /generate response: output ids and logprobs from meta_info.output_token_logprobs."""
    if isinstance(body, list):  # a batch of one
        body = body[0]
    try:
        meta = body["meta_info"]
        triples = meta.get("output_token_logprobs") or []
        ids = [int(t[1]) for t in triples]
        logprobs = [float(t[0]) if t[0] is not None else 0.0 for t in triples]
        reason = (meta.get("finish_reason") or {}).get("type")
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise EngineError(f"SGLang /generate: unexpected response shape ({exc!r}): {str(body)[:300]}") from exc
    output_ids = body.get("output_ids")
    if output_ids is not None and list(output_ids) != ids:
        raise EngineError(f"SGLang /generate: output_ids {output_ids} disagree with the logprob token ids {ids}")
    if reason not in ("stop", "length", "abort"):
        raise EngineError(f"SGLang /generate: unexpected finish_reason {meta.get('finish_reason')!r}")
    return GenerateResult(output_ids=ids, logprobs=logprobs, finish_reason=reason, version=version)


def update_weights_payload(path: str, version: int) -> dict:
    return {"model_path": str(path), "weight_version": str(version), "abort_all_requests": True}


class SGLangEngine(HTTPServerEngine):
    """An InferenceEngine over an SGLang server: launched here (model_path) or attached to (url)."""

    name = "SGLang"
    # /health_generate runs a one-token generation: a live scheduler, not only a live HTTP server.
    health_path = "/health_generate"
    health_timeout = 30
    health_poll_s = 1.0
    stop_grace_s = 60
    generate_path = "/generate"
    pause_path = "/pause_generation"
    drain_polls = 1
    drain_poll_s = 0.05

    def __init__(
        self,
        model_path: str | None = None,
        *,
        url: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        dtype: str = "bfloat16",
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        extra_args: list[str] | None = None,
        startup_timeout: float = 900.0,
        log_path: str | Path | None = None,
        version: int = 0,
        request_timeout: float = 1800.0,
    ) -> None:
        super().__init__(
            model_path, url=url, host=host, port=port, startup_timeout=startup_timeout, log_path=log_path, version=version,
            request_timeout=request_timeout, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size, extra_args=extra_args,
        )

    def server_command(self) -> list[str]:
        return build_server_command(self.model_path, port=self.port, api_key=engine_api_key(), **self._launch)

    @staticmethod
    async def _read_body(resp: aiohttp.ClientResponse) -> dict | list:
        return await resp.json(content_type=None) if resp.content_length != 0 else {}

    request_payload = staticmethod(generate_payload)
    parse_response = staticmethod(parse_generate)

    async def _pause_server(self) -> None:
        """/pause_generation aborts every in-flight request (they return finish_reason abort)."""
        await self._post(self.pause_path, json={"mode": "abort"})

    async def _abort_requests(self) -> None:
        await self._post("/abort_request", json={"abort_all": True})

    async def _resume_server(self) -> None:
        await self._post("/continue_generation", json={})

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        body = await self._post("/update_weights_from_disk", json=update_weights_payload(path, version))
        if isinstance(body, dict) and body.get("success") is False:
            raise EngineError(f"SGLang /update_weights_from_disk failed: {body.get('message')}")
        await self._post("/flush_cache", json={})
        self._version = version
