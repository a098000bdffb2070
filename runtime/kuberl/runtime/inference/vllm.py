"""vLLM engine: launches (or attaches to) vLLM's OpenAI-compatible server and drives it over HTTP.

Used by the rollout agent (`kuberl rollout`) and by `kuberl engine` (which only launches the server).
Generation goes through vLLM's token-in/token-out endpoint /inference/v1/generate (--enable-scale-out): prompt
token ids in; exact output ids, the sampled tokens' logprobs and each token's weight version (the spans
label_weights names after every update) out. Weight updates through the dev-mode endpoints (VLLM_SERVER_DEV_MODE=1):
/pause?mode=abort, /abort_requests, /collective_rpc kuberl_reload_weights(weights_path) (vllm_worker.py:
reload, then refresh tied LM heads), /update_weight_version, /resume (no prefix-cache reset: each request's cache_salt
names its version); weightSync.mode broadcast: /collective_rpc kuberl_receive_weights(assign) (the worker joins
the trainer's torch.distributed group, reloads bucket by bucket). With algorithm.lora the server starts with
--enable-lora and each update hot-loads the published adapter under its own name (kuberl-v{N}, through
/v1/load_lora_adapter, VLLM_ALLOW_RUNTIME_LORA_UPDATING=1), which generation then names as its `model`; older
adapters are unloaded. Only the manifest decides sampling: the
server ignores the model's generation_config (`--generation-config vllm`) and every request names every
sampling field. Facts measured on CPU: `vllm serve` is broken here (use the module), float32 avoids bf16 SIGILL.
Launching, health waits, stopping and the generation gate are http_engine.HTTPServerEngine's.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from kuberl.runtime.inference.base import EngineError, EngineRestarted, GenerateRequest, GenerateResult
from kuberl.runtime.inference.engine_auth import API_KEY_ENV, engine_api_key
from kuberl.runtime.inference.engine_auth import MIDDLEWARE as AUTH_MIDDLEWARE
from kuberl.runtime.inference.http_engine import HTTPServerEngine

log = logging.getLogger(__name__)

SERVED_MODEL_NAME = "policy"
LORA_NAME_PREFIX = "kuberl-v"  # an adapter of policy version N is served as kuberl-vN
LORA_MAX_LORAS = 2  # adapters resident at once: the one being loaded and the one it replaces
ADAPTER_CONFIG = "adapter_config.json"  # what marks a published version as a PEFT adapter (trainer/weights.py)
WORKER_EXTENSION = "kuberl.runtime.inference.vllm_worker.KubeRLWorkerExtension"
# "1" (server_env's default on CPU): the worker extension makes float32 CPU GEMMs use live weights, reloaded in place
# (vllm_worker.use_live_weight_gemms); "0" keeps vLLM's prepacked oneDNN weights and its layerwise reload.
LIVE_WEIGHTS_ENV = "KUBERL_VLLM_CPU_LIVE_WEIGHTS"
CPU_BLOCK_SIZE = 32  # tokens per KV block on CPU: the smallest vLLM's CPU attention backend declares (build_server_command)
CPU_SMALL_BLOCK_SIZE = 16  # what vllm_server.allow_16_token_kv_blocks lets it take on x86
GENERATE_PATH = "/inference/v1/generate"  # vLLM's token-in/token-out endpoint, served with SCALE_OUT_FLAG
SCALE_OUT_FLAG = "--enable-scale-out"
# Every sampling field vLLM 0.32 would otherwise fill from server defaults, neutral: a field left out takes the server's
# default, which `--generation-config auto` (vLLM's default) reads from the model's generation_config.json.
# top_k 0 = off (vLLM 0.32 prefers 0, accepts -1); min_p 0 = off; penalties 1 / 0 = none.
NEUTRAL_SAMPLING = {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def _vllm_cpu_build() -> bool:
    """Whether the installed vLLM is the CPU build (the `vllm-cpu` distribution, scripts/install-vllm-cpu.sh)."""
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


def on_cpu() -> bool:
    """True where vLLM runs its CPU backend (the vllm-cpu build, or no CUDA device)."""
    if _vllm_cpu_build():  # without importing torch: the engine role asks before it execs vLLM (1.5 s saved per start)
        return True
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
    auth: bool | None = None,
    lora_rank: int | None = None,
    log_stats: bool | None = None,
) -> list[str]:
    """The vLLM server command line (the module form: `vllm serve` fails on this vllm-cpu build).

    `auth` (default: whether $KUBERL_ENGINE_API_KEY is set) adds engine_auth's middleware, which asks
    for the key on every endpoint but /health; the key itself travels in the environment only.
    `lora_rank` (algorithm.lora.rank): serve LoRA adapters up to that rank (see lora_args).
    `log_stats`: vLLM's per-step statistics (its Prometheus series, e.g. vllm:generation_tokens_total); default:
    on GPUs only."""
    one_cpu_worker = on_cpu() and tensor_parallel_size * pipeline_parallel_size == 1
    # A one-worker CPU engine through vllm_server: its engine-core process forked, not spawned (healthy in 17.5 s, not 32)
    launcher = ["kuberl.runtime.inference.vllm_server"] if one_cpu_worker else []
    cmd = [
        sys.executable, "-m", *launcher, "vllm.entrypoints.openai.api_server",
        "--model", model_path, "--served-model-name", SERVED_MODEL_NAME,
        "--host", host, "--port", str(port), "--dtype", dtype,
        "--tensor-parallel-size", str(tensor_parallel_size), "--pipeline-parallel-size", str(pipeline_parallel_size),
        "--seed", str(seed),
        # Logprobs after temperature/top-p: the behaviour policy pi_behave that actually sampled the token.
        "--logprobs-mode", "processed_logprobs",
        # Server sampling defaults are vLLM's neutral ones, not the model's generation_config.json (Qwen2.5-
        # Instruct's top_k 20 / repetition_penalty 1.05 would make pi_behave differ from the trained policy).
        "--generation-config", "vllm",
        # kuberl_reload_weights: reload_weights + the tied-LM-head refresh vLLM's CPU reload misses.
        "--worker-extension-cls", WORKER_EXTENSION,
        "--disable-uvicorn-access-log",
        SCALE_OUT_FLAG,  # /inference/v1/generate: tokens in, tokens out, per-token weight versions
    ]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    if max_num_seqs is not None:
        cmd += ["--max-num-seqs", str(max_num_seqs)]
    if on_cpu():
        cmd.append("--enforce-eager")  # no graph capture on CPU
        # vLLM's CPU platform defaults to 128-token KV blocks, and the prefix cache shares only full blocks: a group's n
        # samples of a prompt under 128 tokens each prefilled it again. Measured on bench/bench_trl.py's model, 8 groups
        # of 8 samples of a 99-token prompt: 583 -> 248 ms of engine-core CPU per 64 samples with 32-token blocks.
        # spec.rollout.engineArgs' --block-size, later on the line, wins.
        cmd += ["--block-size", str(cpu_block_size(one_cpu_worker))]
        if one_cpu_worker:
            # The one worker runs inside the engine-core process (server_env sets VLLM_ENABLE_V1_MULTIPROCESSING=0,
            # without which vLLM's CPU platform turns uni back into mp): no worker process spinning on a shared-memory
            # queue between steps. Measured on bench/bench_trl.py: the engine's CPU per training step 0.53 -> 0.20 core-s.
            cmd += ["--distributed-executor-backend", "uni"]
    if log_stats is None:
        # vLLM's per-step statistics (its Prometheus /metrics and the periodic throughput log line) cost CPU that
        # a CPU engine takes from its own forward passes: 29-32 -> 24-25 ms of API-server CPU per 64 samples on
        # bench/bench_trl.py's model. KubeRL reads none of them; GPU engines keep them for dashboards.
        log_stats = not on_cpu()
    if not log_stats:
        cmd.append("--disable-log-stats")
    if auth is None:
        auth = engine_api_key() is not None
    if auth:
        cmd += ["--middleware", AUTH_MIDDLEWARE]
    if lora_rank is not None:
        cmd += lora_args(lora_rank)
    # Last, so the user's spec.rollout.engineArgs win (argparse keeps the last occurrence).
    return cmd + list(extra_args or [])


def cpu_block_size(one_cpu_worker: bool) -> int:
    """KV block size of a CPU engine: 16 tokens where vllm_server patches vLLM to take them (one worker, its engine
    core forked, x86: its vec16 kernel path; other CPUs' kernels are not known to), else 32."""
    import platform

    from kuberl.runtime.inference.vllm_server import forking

    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return CPU_SMALL_BLOCK_SIZE if one_cpu_worker and forking() and x86 else CPU_BLOCK_SIZE


def lora_args(rank: int) -> list[str]:
    """--enable-lora with the smallest --max-lora-rank vLLM accepts that holds `rank` (it takes only VLLM_LORA_RANKS)."""
    from kuberl.api.algorithm import VLLM_LORA_RANKS

    fitting = [r for r in VLLM_LORA_RANKS if r >= rank]
    if rank < 1 or not fitting:
        raise ValueError(f"algorithm.lora.rank {rank}: vLLM serves LoRA ranks 1 to {max(VLLM_LORA_RANKS)}")
    return ["--enable-lora", "--max-lora-rank", str(fitting[0]), "--max-loras", str(LORA_MAX_LORAS)]


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # /pause, /resume, /collective_rpc, /reset_prefix_cache
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # /v1/load_lora_adapter, /v1/unload_lora_adapter (algorithm.lora)
    if env.get(API_KEY_ENV):
        # vLLM's own check (/v1 and the like); AUTH_MIDDLEWARE guards the development endpoints too.
        env["VLLM_API_KEY"] = env[API_KEY_ENV]
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default (4) is much more than tiny models need
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if on_cpu():
        # torch.compile on CPU builds C++ kernels through a shared /tmp cache; measured here: concurrent
        # servers corrupt each other's precompiled headers (at::vec errors, HTTP 500). Eager is fast
        # enough for CPU-sized models and starts sooner.
        env.setdefault("TORCHDYNAMO_DISABLE", "1")
        # Lets a one-worker engine keep --distributed-executor-backend uni (build_server_command); the API server
        # and the engine core stay two processes either way (AsyncLLM always starts the core in its own).
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env.setdefault(LIVE_WEIGHTS_ENV, "1")  # reloads in place, 4x cheaper (vllm_worker.py)
    return env


def token_versions(spans: list[dict] | None, count: int, version: int) -> list[int] | None:
    """Each of `count` tokens' weights version from vLLM's weight-version spans ([{version, start, end}], labels set
    by VLLMEngine.label_weights). A token no span names, or one labelled otherwise ("default": the weights the server
    started with, or an adapter's), gets `version`, the request's. None without spans."""
    if not spans:
        return None
    out = [version] * count
    for span in spans:
        label = str(span["version"])
        if label.isdigit():
            for i in range(max(int(span["start"]), 0), min(int(span["end"]), count)):
                out[i] = int(label)
    return out


def _unlabelled(body: dict | list) -> bool:
    """Whether a generate response has tokens labelled "default": sampled by weights no label_weights named."""
    choices = body.get("choices") if isinstance(body, dict) else None
    return any(str(span.get("version")) == "default" for c in choices or [] for span in (c.get("weight_versions") or []))


class VLLMEngine(HTTPServerEngine):
    """An InferenceEngine over a vLLM server: launched here (model_path) or attached to (url)."""

    name = "vLLM"
    health_path = "/health"
    health_timeout = 5
    health_poll_s = 0.5
    stop_grace_s = 30
    generate_path = GENERATE_PATH
    pause_path = "/pause"
    drain_polls = 20
    drain_poll_s = 0.025

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
        lora_rank: int | None = None,
        log_stats: bool | None = None,
        startup_timeout: float = 600.0,
        log_path: str | Path | None = None,
        version: int = 0,
        request_timeout: float = 600.0,
    ) -> None:
        super().__init__(
            model_path, url=url, host=host, port=port, startup_timeout=startup_timeout, log_path=log_path, version=version,
            request_timeout=request_timeout, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size, extra_args=extra_args,
            lora_rank=lora_rank, log_stats=log_stats,
        )
        # What generation requests name as `model`: the base model, or the adapter of the current version (LoRA).
        self.served_model = SERVED_MODEL_NAME
        # Whether the weights served now carry our label (label_weights): then a token labelled "default" comes from
        # an engine that restarted with its initial weights since.
        self._labelled = False

    def server_command(self) -> list[str]:
        return build_server_command(self.model_path, port=self.port, **self._launch)

    def server_env(self) -> dict[str, str]:
        return server_env()

    @staticmethod
    async def _read_body(resp: aiohttp.ClientResponse) -> dict:
        if resp.content_type == "application/json":
            return await resp.json()
        return {}

    # -- generation ----------------------------------------------------------------------------

    @staticmethod
    def generate_payload(req: GenerateRequest, model: str = SERVED_MODEL_NAME, version: int = 0) -> dict:
        """The /inference/v1/generate body for a token-ids request: every sampling field explicit; `model`: the base or an adapter.

        Tokens in, tokens out: no prompt rendering, no detokenising (`detokenize: false`), only the sampled tokens'
        logprobs. Measured against /v1/completions on this CPU: 43 vs 65 ms of API-server CPU per 64 samples.
        `version` (the weights being served) salts the prefix cache: a request reuses only KV that the same weights
        computed, with or without a pause at the update."""
        sampling = {
            "max_tokens": req.max_new_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            **NEUTRAL_SAMPLING,
            "logprobs": 0,  # the sampled token's logprob only
            "skip_special_tokens": False,
            # Stop only where the request says (the workflows pass the model's stop set, stop_tokens.py), not on the
            # tokenizer's eos alone: the same request means the same thing on every engine.
            "ignore_eos": True,
            "stop_token_ids": list(req.stop_token_ids),
            "detokenize": False,
        }
        if req.stop:
            # Stop strings are matched on the detokenised text, which vLLM refuses to do without detokenize. Their
            # tokens stay in token_ids either way (vLLM cuts only the tokens after the one that completes the string);
            # include_stop_str_in_output keeps the text consistent with them.
            sampling.update(stop=list(req.stop), detokenize=True, include_stop_str_in_output=True)
        if req.seed is not None:
            sampling["seed"] = req.seed
        return {"model": model, "token_ids": list(req.input_ids), "sampling_params": sampling, "output_mode": "tokens",
                "cache_salt": f"{LORA_NAME_PREFIX}{version}"}

    @staticmethod
    def with_n(payload: dict, n: int) -> dict:
        return {**payload, "sampling_params": {**payload["sampling_params"], "n": n}}

    @staticmethod
    def parse_generate(body: dict, version: int) -> GenerateResult:
        """A GenerateResult from an /inference/v1/generate response (one choice)."""
        try:
            choice = body["choices"][0]
        except (KeyError, IndexError, TypeError) as exc:
            raise EngineError(f"vLLM {GENERATE_PATH}: unexpected response shape ({exc!r}): {str(body)[:300]}") from exc
        return VLLMEngine.parse_choice(choice, version)

    supports_n = True

    @staticmethod
    def parse_choices(body: dict, version: int) -> list[GenerateResult]:
        """Every choice of an n-sample /inference/v1/generate response, by index."""
        try:
            choices = sorted(body["choices"], key=lambda c: int(c["index"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError(f"vLLM {GENERATE_PATH}: unexpected response shape ({exc!r}): {str(body)[:300]}") from exc
        return [VLLMEngine.parse_choice(c, version) for c in choices]

    @staticmethod
    def parse_choice(choice: dict, version: int) -> GenerateResult:
        """One choice; `version`: the engine's version when the request started, for tokens no weight-version span names."""
        try:
            ids = [int(t) for t in choice["token_ids"]]
            content = (choice.get("logprobs") or {}).get("content") or []
            logprobs = [float(x["logprob"]) for x in content]
            versions = token_versions(choice.get("weight_versions"), len(ids), version)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EngineError(f"vLLM {GENERATE_PATH}: unexpected response shape ({exc!r}): {str(choice)[:300]}") from exc
        reason = choice.get("finish_reason")
        if reason not in ("stop", "length", "abort"):
            raise EngineError(f"vLLM {GENERATE_PATH}: unexpected finish_reason {reason!r}")
        if not ids and reason == "abort":
            logprobs = []
        return GenerateResult(output_ids=ids, logprobs=logprobs, finish_reason=reason, version=version, versions=versions)

    def request_payload(self, req: GenerateRequest) -> dict:
        return self.generate_payload(req, self.served_model, self._version)

    parse_response = parse_generate

    async def _post(self, path: str, json: dict | None = None, params: dict | None = None) -> dict | list:
        try:
            body = await super()._post(path, json=json, params=params)
        except EngineError as exc:
            if path == GENERATE_PATH and exc.status in (403, 404):
                raise EngineError(f"vLLM at {self.url} does not serve {GENERATE_PATH}: start it with `kuberl engine` or pass "
                                  f"{SCALE_OUT_FLAG} (its token-in/token-out endpoint): {exc}", status=exc.status) from exc
            raise
        if path == GENERATE_PATH and self._labelled and _unlabelled(body):
            self._labelled = False
            raise EngineRestarted(f"vLLM at {self.url} restarted: it serves its initial weights, not v{self._version}")
        return body

    def set_version(self, version: int) -> None:
        """The engine serves `version` as it started (no weights loaded into it since)."""
        super().set_version(version)
        self._labelled = False

    async def label_weights(self, version: int) -> None:
        """Name the weights now served `version` in vLLM's per-token weight-version spans (parse_choice reads them back).

        Sent right after each update: tokens sampled between the update and this call still carry the previous
        label, so a token's version is never newer than the weights that sampled it (staleness is over-counted, never under)."""
        await self._post("/update_weight_version", json={"new_version": str(version)})
        self._labelled = True

    # -- weight updates ------------------------------------------------------------------------

    # The /collective_rpc method that reloads weights (vllm_worker.KubeRLWorkerExtension's).
    reload_method = "kuberl_reload_weights"

    async def _pause_server(self) -> None:
        await self._post(self.pause_path, params={"mode": "abort"})

    async def _abort_requests(self) -> None:
        await self._post("/abort_requests", json={})

    async def _resume_server(self) -> None:
        await self._post("/resume")

    async def _worker_rpc(self, method: str, kwargs: dict, why: str = "") -> Any:
        """Call `method` of KubeRL's worker extension on every worker (/collective_rpc); the body vLLM returns.

        A server started without the extension answers HTTP 500 "Method '<method>' is not implemented." (vLLM's
        run_method): that becomes an error saying how to start it; any other failure is passed on as it came.
        """
        try:
            return await self._post("/collective_rpc", json={"method": method, "kwargs": kwargs})
        except EngineError as exc:
            if f"Method '{method}' is not implemented" in str(exc):
                raise EngineError(f"vLLM at {self.url} has no {method} method: start it with `kuberl engine` or pass "
                                  f"--worker-extension-cls {WORKER_EXTENSION}{why}", status=exc.status) from exc
            raise

    async def _serving(self, version: int, body: Any) -> None:
        """After new full weights are in: label them `version` and ask for the base model again.

        No prefix-cache reset: requests name their version in cache_salt (generate_payload), so no later request reuses
        KV the earlier weights computed. (A reset cannot do it under weightSync.inFlight keep: vLLM refuses it while any
        request runs, which without a pause is always.)
        """
        await self.label_weights(version)
        self._version = version
        self.served_model = SERVED_MODEL_NAME
        # One entry per worker, e.g. {"tied_layers": n, "refreshed": k} (vllm_worker.refresh_tied_layers).
        self.last_reload = body.get("results") if isinstance(body, dict) else body

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        """Reload safetensors from `path` in place (or hot-load the LoRA adapter there); call between pause() and resume(),
        or without them for an in-flight update of full weights (weightSync.inFlight keep): vLLM runs the reload between
        two engine steps, and requests in flight go on with the new weights."""
        if (Path(path) / ADAPTER_CONFIG).is_file():
            await self.load_adapter(path, version)
            return
        if not (Path(path) / "config.json").is_file() and not any(Path(path).glob("*.safetensors")):
            raise EngineError(f"weights path {path!r} holds no safetensors")
        started = time.monotonic()
        body = await self._worker_rpc(self.reload_method, {"weights_path": str(path)},
                                      " (a plain reload leaves a tied LM head stale on CPU)")
        await self._serving(version, body)
        log.info("vLLM loaded weights v%d from %s in %.0f ms (%s)", version, path, 1000 * (time.monotonic() - started), self.last_reload)

    # The /collective_rpc method that joins a weight broadcast (weightSync.mode broadcast; vllm_worker.py).
    receive_method = "kuberl_receive_weights"

    @property
    def workers(self) -> int:
        """vLLM workers of this engine: each joins a weight broadcast as its own rank."""
        return int(self._launch.get("tensor_parallel_size", 1)) * int(self._launch.get("pipeline_parallel_size", 1))

    async def update_weights_broadcast(self, assign: dict) -> None:
        """Receive the trainer's broadcast `assign` (kuberl.runtime.weight_sync.broadcast) in place; call between pause() and resume()."""
        started = time.monotonic()
        body = await self._worker_rpc(self.receive_method, {"assign": assign})
        version = int(assign["version"])
        await self._serving(version, body)
        log.info("vLLM received weights v%d by broadcast (%s) in %.0f ms (%s)", version, assign.get("update"),
                 1000 * (time.monotonic() - started), self.last_reload)

    async def load_adapter(self, path: str, version: int) -> None:
        """Hot-load the PEFT adapter in `path` as kuberl-v{version}, serve it, unload every other kuberl adapter.

        In place when that name is loaded already (a restarted trainer republishes a version); the prefix cache
        is reset as after a full reload. Call between pause() and resume(), so no request runs on an old adapter.
        """
        name = f"{LORA_NAME_PREFIX}{version}"
        started = time.monotonic()
        try:
            await self._post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), "load_inplace": True})
        except EngineError as exc:
            if exc.status in (404, 405) or "LoRA is not enabled" in str(exc) or "enable_lora" in str(exc).lower():
                raise EngineError(
                    f"vLLM at {self.url} cannot hot-load LoRA adapters: start it with `kuberl engine` for a manifest with algorithm.lora "
                    f"(--enable-lora --max-lora-rank R, VLLM_ALLOW_RUNTIME_LORA_UPDATING=1): {exc}", status=exc.status) from exc
            raise
        await self._post("/reset_prefix_cache")
        self.served_model = name
        self._version = version
        for other in await self.loaded_adapters():
            if other != name:
                await self._post("/v1/unload_lora_adapter", json={"lora_name": other})
        log.info("vLLM serves adapter %s from %s, loaded in %.0f ms", name, path, 1000 * (time.monotonic() - started))

    async def loaded_adapters(self) -> list[str]:
        """The kuberl adapters the server holds (GET /v1/models: the base model and every loaded LoRA)."""
        try:
            async with self._http().get(self.url + "/v1/models") as resp:
                if resp.status != 200:
                    raise EngineError(f"vLLM /v1/models returned HTTP {resp.status}: {(await resp.text())[:300]}", status=resp.status)
                body = await resp.json()
        except aiohttp.ClientError as exc:
            raise EngineError(f"vLLM /v1/models at {self.url}: {exc}") from exc
        return [m["id"] for m in body.get("data", []) if str(m.get("id", "")).startswith(LORA_NAME_PREFIX)]
