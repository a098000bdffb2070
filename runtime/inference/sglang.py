"""SGLang engine: launches (or attaches to) `python -m sglang.launch_server` and drives its native HTTP API.

Used by the rollout agent and `kuberl engine` when spec.rollout.engine is sglang (GPU images; SGLang
has no CPU build here, so tests check the request/response shaping against recorded payloads).
Endpoints (checked against SGLang 0.5.5 and 0.5.21, the pinned one): /generate (input_ids, sampling_params, return_logprob), /pause_generation
(aborts in-flight requests), /update_weights_from_disk, /continue_generation, /flush_cache, /health_generate.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from kuberl.runtime.inference.base import EngineError, GenerateRequest, GenerateResult
from kuberl.runtime.inference.vllm import free_port

log = logging.getLogger(__name__)


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
) -> list[str]:
    cmd = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
        "--host", host, "--port", str(port), "--dtype", dtype,
        "--tp-size", str(tensor_parallel_size), "--pp-size", str(pipeline_parallel_size),
        "--random-seed", str(seed), "--skip-server-warmup",
    ]
    if max_model_len is not None:
        cmd += ["--context-length", str(max_model_len)]
    if max_num_seqs is not None:
        cmd += ["--max-running-requests", str(max_num_seqs)]
    return cmd + list(extra_args or [])


def generate_payload(req: GenerateRequest) -> dict:
    """The /generate body for a token-ids request (logprobs of the sampled tokens, no text)."""
    sampling = {
        "max_new_tokens": req.max_new_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stop_token_ids": list(req.stop_token_ids),
        "skip_special_tokens": False,
        "ignore_eos": True,  # stop only on stop_token_ids (the workflows pass eos), as with vLLM
        "no_stop_trim": True,  # keep the stop token in output_ids: the trainer must see it
    }
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


class SGLangEngine:
    """An InferenceEngine over an SGLang server: launched here (model_path) or attached to (url)."""

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
        if (model_path is None) == (url is None):
            raise ValueError("SGLangEngine needs exactly one of model_path (launch a server) or url (attach to one)")
        self.model_path = model_path
        self.port = port or (free_port(host) if url is None else None)
        self.url = (url or f"http://{host}:{self.port}").rstrip("/")
        self._launch = {
            "host": host, "dtype": dtype, "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
            "tensor_parallel_size": tensor_parallel_size, "pipeline_parallel_size": pipeline_parallel_size, "extra_args": extra_args,
        }
        self.startup_timeout = startup_timeout
        self.log_path = Path(log_path) if log_path else None
        self.request_timeout = request_timeout
        self.proc: subprocess.Popen | None = None
        self._session: aiohttp.ClientSession | None = None
        self._version = version
        self._gate = asyncio.Event()
        self._gate.set()
        self._in_flight = 0

    @property
    def version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        self._version = version

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.request_timeout))
        return self._session

    async def _post(self, path: str, json: dict | None = None) -> dict | list:
        try:
            async with self._http().post(self.url + path, json=json or {}) as resp:
                if resp.status != 200:
                    raise EngineError(f"SGLang {path} returned HTTP {resp.status}: {(await resp.text())[:500]}", status=resp.status)
                return await resp.json(content_type=None) if resp.content_length != 0 else {}
        except aiohttp.ClientError as exc:
            raise EngineError(f"SGLang {path} at {self.url}: {exc}") from exc

    def launch(self) -> None:
        cmd = build_server_command(self.model_path, port=self.port, **self._launch)
        log.info("starting SGLang: %s", " ".join(cmd))
        if self.log_path is None:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
            return
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    async def start(self) -> None:
        if self.model_path is not None and self.proc is None:
            self.launch()
        start = time.monotonic()
        while time.monotonic() - start < self.startup_timeout:
            if self.proc is not None and self.proc.poll() is not None:
                raise EngineError(f"SGLang server exited with code {self.proc.returncode} during start-up")
            if await self.health():
                return
            await asyncio.sleep(1.0)
        raise EngineError(f"SGLang at {self.url} not healthy after {self.startup_timeout:.0f} s")

    async def close(self) -> None:
        """Close the HTTP session only (the server keeps running)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def stop(self) -> None:
        await self.close()
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                await asyncio.to_thread(self.proc.wait, 60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc = None

    async def health(self) -> bool:
        # /health_generate runs a one-token generation: a live scheduler, not only a live HTTP server.
        try:
            async with self._http().get(self.url + "/health_generate", timeout=aiohttp.ClientTimeout(total=30)) as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        await self._gate.wait()
        version = self._version
        self._in_flight += 1
        try:
            body = await self._post("/generate", json=generate_payload(req))
        finally:
            self._in_flight -= 1
        return parse_generate(body, version)

    async def pause(self) -> None:
        """/pause_generation aborts every in-flight request (they return finish_reason abort)."""
        self._gate.clear()
        await self._post("/pause_generation", json={"mode": "abort"})
        deadline = time.monotonic() + 60
        while self._in_flight:
            await self._post("/abort_request", json={"abort_all": True})
            await asyncio.sleep(0.05)
            if time.monotonic() > deadline:
                raise EngineError(f"SGLang: {self._in_flight} generations still running 60 s after /pause_generation")

    async def resume(self) -> None:
        await self._post("/continue_generation")
        self._gate.set()

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        body = await self._post("/update_weights_from_disk", json=update_weights_payload(path, version))
        if isinstance(body, dict) and body.get("success") is False:
            raise EngineError(f"SGLang /update_weights_from_disk failed: {body.get('message')}")
        await self._post("/flush_cache")
        self._version = version
