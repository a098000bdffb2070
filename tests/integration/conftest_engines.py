"""Engine fixtures of the integration tests: real vLLM CPU servers, each started once per session.

`vllm_server` serves the builtin tiny model (untied, no sampling defaults); `vllm_instruct_server`
the Instruct-shaped one (tied embeddings, Qwen2.5-Instruct's generation_config). Each is built as
`kuberl run` would (resolve_model into a session workdir), started with the command `kuberl engine`
uses (`python -m vllm.entrypoints.openai.api_server` ...) on a free loopback port and stopped by its
process group at the end. Tests attach with `VLLMEngine(url=...)` and load the weights they need
first (a reload takes ~30 ms), so no test depends on what an earlier one loaded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kuberl.api.v1alpha1 import ModelSpec
from kuberl.runtime.models import build_tiny_model, resolve_model


@dataclass
class VLLMServer:
    url: str
    workdir: Path  # resolve_model(builtin) put the served model under workdir/models/tiny-qwen2
    model_dir: Path  # the initial weights (v0)
    other_weights: Path  # the same architecture and tokenizer, other random weights (seed 1)
    log_path: Path
    pid: int  # the API server's process (vLLM's engine core is its child)


def _serve(tmp_path_factory: pytest.TempPathFactory, builtin: str) -> Iterator[VLLMServer]:
    from kuberl.runtime.inference.vllm import VLLMEngine

    workdir = tmp_path_factory.mktemp(f"engine-workdir-{builtin}")
    model_dir = Path(resolve_model(ModelSpec(builtin=builtin), workdir))
    other = build_tiny_model(workdir / "weights" / "v1", seed=1, variant=builtin)
    log_path = workdir / "vllm.log"
    # log_stats: generated_tokens (below) reads vLLM's token counter, which a CPU engine leaves off by default.
    engine = VLLMEngine(str(model_dir), max_model_len=512, max_num_seqs=16, log_path=log_path, startup_timeout=300, log_stats=True)

    async def start() -> None:
        await engine.start()
        await engine.close()  # the session belongs to this event loop; tests open their own

    try:
        asyncio.run(start())
    except Exception:  # noqa: BLE001  show the server's log whatever went wrong
        asyncio.run(engine.stop())
        tail = log_path.read_text()[-3000:] if log_path.exists() else "(no log)"
        pytest.fail(f"vLLM server did not start; log tail:\n{tail}")
    try:
        yield VLLMServer(url=engine.url, workdir=workdir, model_dir=model_dir, other_weights=other, log_path=log_path, pid=engine.proc.pid)
    finally:
        asyncio.run(engine.stop())


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    yield from _serve(tmp_path_factory, "tiny-qwen2")


@pytest.fixture(scope="session")
def vllm_instruct_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """The Instruct-shaped model: tied embeddings, a chat template, Qwen2.5-Instruct's sampling defaults."""
    yield from _serve(tmp_path_factory, "tiny-qwen2-instruct")


async def generated_tokens(engine) -> float:
    """vLLM's count of tokens generated so far (its Prometheus counter `vllm:generation_tokens_total`).

    Tests that must land a weight update mid-generation wait for this to move instead of sleeping: the tiny
    model generates a few hundred tokens in about 0.1 s on a quiet machine, so fixed waits miss the window.
    """
    async with engine._http().get(engine.url + "/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:generation_tokens_total"))
