"""Engine fixtures of the integration tests (engineer C): one real vLLM CPU server for the whole session.

`vllm_server` builds the tiny model (as `kuberl run` would, into a session workdir), starts
`python -m vllm.entrypoints.openai.api_server` once on a free loopback port and stops it by its
process group at the end. Tests attach to it with `VLLMEngine(url=...)` and load the weights they
need first (a reload takes ~30 ms), so no test depends on what an earlier one loaded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kuberl.runtime.models import build_tiny_model, resolve_model

from kuberl.api.v1alpha1 import ModelSpec


@dataclass
class VLLMServer:
    url: str
    workdir: Path  # resolve_model(builtin) put the served model under workdir/models/tiny-qwen2
    model_dir: Path  # the initial weights (v0)
    other_weights: Path  # the same architecture and tokenizer, other random weights (seed 1)
    log_path: Path


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    from kuberl.runtime.inference.vllm import VLLMEngine

    workdir = tmp_path_factory.mktemp("engine-workdir")
    model_dir = Path(resolve_model(ModelSpec(builtin="tiny-qwen2"), workdir))
    other = build_tiny_model(workdir / "weights" / "v1", seed=1)
    log_path = workdir / "vllm.log"
    engine = VLLMEngine(str(model_dir), max_model_len=512, max_num_seqs=16, log_path=log_path, startup_timeout=300)

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
        yield VLLMServer(url=engine.url, workdir=workdir, model_dir=model_dir, other_weights=other, log_path=log_path)
    finally:
        asyncio.run(engine.stop())
