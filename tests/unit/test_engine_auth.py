"""The engine API key: the server asks for it on every endpoint but the probes', the client sends it.

vLLM's own --api-key guards /v1 only; engine_auth.EngineAuthMiddleware is loaded through vLLM's real
`--middleware` loader (init_entrypoints_middleware) here, without starting an engine.
"""

from __future__ import annotations

import contextlib
from argparse import Namespace
from pathlib import Path

import pytest
from aiohttp import web
from fastapi import FastAPI
from starlette.testclient import TestClient

from kuberl.runtime.inference.base import GenerateRequest
from kuberl.runtime.inference.engine_auth import API_KEY_ENV, MIDDLEWARE, EngineAuthMiddleware
from kuberl.runtime.inference.vllm import VLLMEngine, build_server_command, server_env

ROOT = Path(__file__).resolve().parents[2]
KEY = "k3y-for-tests"
DEV_ENDPOINTS = ["/pause", "/resume", "/collective_rpc", "/reset_prefix_cache", "/abort_requests", "/update_weight_version"]


def vllm_app(middleware: list[str], api_key: list[str] | None = None) -> FastAPI:
    """A FastAPI app with the engine's paths, given its middleware by vLLM's own loader."""
    from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware

    app = FastAPI()
    for path in ["/health", "/v1/completions", "/inference/v1/generate", *DEV_ENDPOINTS]:
        app.add_api_route(path, lambda: {"ok": True}, methods=["GET", "POST"])
    args = Namespace(allowed_origins=["*"], allow_credentials=False, allowed_methods=["*"], allowed_headers=["*"],
                     api_key=api_key, enable_request_id_headers=False, middleware=middleware)
    init_entrypoints_middleware(args, app, ())
    return app


def test_vllm_api_key_alone_leaves_the_dev_endpoints_open(monkeypatch) -> None:
    """Why the middleware exists: vLLM 0.32's --api-key guards /v1 but not /pause or /collective_rpc."""
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    client = TestClient(vllm_app([], api_key=[KEY]))
    assert client.post("/v1/completions").status_code == 401
    assert client.post("/collective_rpc").status_code == 200


def test_middleware_guards_every_engine_endpoint_but_health(monkeypatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, KEY)
    client = TestClient(vllm_app([MIDDLEWARE]))
    for path in ["/v1/completions", "/inference/v1/generate", *DEV_ENDPOINTS]:
        assert client.post(path).status_code == 401, path
        assert client.post(path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
        assert client.post(path, headers={"Authorization": f"Basic {KEY}"}).status_code == 401, path
        assert client.post(path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200, path
    assert client.get("/health").status_code == 200  # kubelet probes carry no key


def test_middleware_refuses_to_start_without_a_key(monkeypatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with pytest.raises(RuntimeError, match=API_KEY_ENV):
        EngineAuthMiddleware(app=None)


def test_server_gets_the_key_by_environment_never_on_its_command_line(monkeypatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, KEY)
    cmd = build_server_command("/m", port=8000)
    assert cmd[cmd.index("--middleware") + 1] == MIDDLEWARE
    assert not any(KEY in arg for arg in cmd)
    assert server_env()["VLLM_API_KEY"] == KEY
    monkeypatch.delenv(API_KEY_ENV)
    assert "--middleware" not in build_server_command("/m", port=8000)  # local runs on 127.0.0.1: no key
    assert "VLLM_API_KEY" not in server_env({})


@contextlib.asynccontextmanager
async def recording_engine():
    """A tiny HTTP server on loopback that answers like vLLM and records each request's Authorization."""
    seen: list[tuple[str, str | None]] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append((request.path, request.headers.get("Authorization")))
        if request.path == "/inference/v1/generate":
            return web.json_response({"choices": [{"index": 0, "token_ids": [5], "logprobs": {"content": [{"token_id": 5, "logprob": -0.5}]},
                                                   "finish_reason": "length"}]})
        if request.path == "/collective_rpc":
            return web.json_response({"results": [{}]})
        return web.json_response({})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


async def drive(engine: VLLMEngine, tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert await engine.health()
    await engine.generate(GenerateRequest(input_ids=[1, 2], max_new_tokens=1, temperature=1.0, top_p=1.0, stop_token_ids=[]))
    await engine.pause()
    await engine.update_weights_from_disk(str(tmp_path), 1)
    await engine.resume()
    await engine.close()


async def test_client_sends_the_key_on_every_request(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(API_KEY_ENV, KEY)
    async with recording_engine() as (url, seen):
        await drive(VLLMEngine(url=url), tmp_path)
    paths = {p for p, _ in seen}
    assert {"/health", "/inference/v1/generate", "/pause", "/collective_rpc", "/update_weight_version", "/resume"} <= paths
    assert {auth for _, auth in seen} == {f"Bearer {KEY}"}


async def test_client_without_a_key_sends_no_authorization(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    async with recording_engine() as (url, seen):
        await drive(VLLMEngine(url=url), tmp_path)
    assert seen and {auth for _, auth in seen} == {None}


def test_sglang_gets_the_key_as_its_api_key_and_logs_never_show_it(monkeypatch, caplog) -> None:
    """SGLang's own --api-key guards every endpoint but /health* and /metrics (weight updates and pause too)."""
    from kuberl.api import load_experiment
    from kuberl.runtime.inference import main as engine_main
    from kuberl.runtime.inference.engine_auth import redact_command
    from kuberl.runtime.inference.sglang import SGLangEngine

    monkeypatch.setenv(API_KEY_ENV, KEY)
    exp = load_experiment(ROOT / "examples" / "quickstart-cpu.yaml")
    exp.spec.rollout.engine = "sglang"
    cmd, _ = engine_main.server_command(exp, "/m", 8000, "0.0.0.0")
    assert cmd[cmd.index("--api-key") + 1] == KEY
    engine = SGLangEngine("/m", port=8000)
    assert engine.server_command()[engine.server_command().index("--api-key") + 1] == KEY
    assert KEY not in redact_command(cmd) and "--api-key ***" in redact_command(cmd)
    monkeypatch.delenv(API_KEY_ENV)
    assert "--api-key" not in engine_main.server_command(exp, "/m", 8000, "127.0.0.1")[0]  # local runs: no key
