"""The agent's HTTP client to its engine caps nothing: every generation reaches the engine, and a weight
update's /pause is sent at once even while every generation is still running.

A loopback aiohttp server stands in for the engine's HTTP front (the behaviour under test is the client's
connection pool, not the engine): it holds each /inference/v1/generate request until released.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from kuberl.runtime.inference.base import GenerateRequest
from kuberl.runtime.inference.vllm import VLLMEngine

IN_FLIGHT = 150  # more than aiohttp's default pool of 100 connections


async def serve_holding():
    arrived, paused, release = [], asyncio.Event(), asyncio.Event()

    async def completions(request: web.Request) -> web.Response:
        arrived.append(await request.json())
        await release.wait()
        return web.json_response({"choices": [{"index": 0, "token_ids": [7], "logprobs": {"content": [{"token_id": 7, "logprob": -0.5}]},
                                               "finish_reason": "length"}]})

    async def pause(request: web.Request) -> web.Response:
        paused.set()
        return web.json_response({"status": "paused"})

    app = web.Application()
    app.router.add_post("/inference/v1/generate", completions)
    app.router.add_post("/pause", pause)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}", arrived, paused, release


def test_every_generation_reaches_the_engine_and_a_pause_is_not_queued_behind_them() -> None:
    async def scenario():
        runner, url, arrived, paused, release = await serve_holding()
        engine = VLLMEngine(url=url)
        try:
            req = GenerateRequest(input_ids=[1, 2, 3], max_new_tokens=1)
            gens = [asyncio.create_task(engine.generate(req)) for _ in range(IN_FLIGHT)]
            for _ in range(200):
                if len(arrived) == IN_FLIGHT:
                    break
                await asyncio.sleep(0.025)
            seen = len(arrived)
            try:
                await asyncio.wait_for(engine._pause_server(), timeout=5)  # every generation still held by the server
            except TimeoutError:
                pass  # queued behind the generations for a connection: asserted below
            release.set()
            results = await asyncio.gather(*gens)
            return seen, paused.is_set(), results
        finally:
            release.set()
            await engine.close()
            await runner.cleanup()

    seen, paused, results = asyncio.run(scenario())
    assert seen == IN_FLIGHT, f"only {seen} of {IN_FLIGHT} generations reached the engine: the client's connection pool capped them"
    assert paused
    assert all(r.output_ids == [7] for r in results)


async def serve(posts: dict) -> tuple[web.AppRunner, str]:
    """A loopback aiohttp server answering POSTs with the given handlers: (its runner, its URL)."""
    app = web.Application()
    for path, handler in posts.items():
        app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


def test_a_pause_that_fails_lets_generation_go_on_instead_of_holding_it_for_ever() -> None:
    """An engine killed as an update pauses it: /pause fails. Generation must not stay held at the client's gate (the
    agent's episodes would wait for ever and never see the engine is gone); it reaches the engine and fails or runs."""
    async def scenario():
        resumed = []

        async def generate(request: web.Request) -> web.Response:
            return web.json_response({"choices": [{"index": 0, "token_ids": [7], "logprobs": {"content": [{"token_id": 7, "logprob": -0.5}]},
                                                   "finish_reason": "length"}]})

        async def pause(request: web.Request) -> web.Response:
            return web.json_response({"error": "engine core died"}, status=500)

        async def resume(request: web.Request) -> web.Response:
            resumed.append(True)
            return web.json_response({})

        runner, url = await serve({"/inference/v1/generate": generate, "/pause": pause, "/resume": resume})
        engine = VLLMEngine(url=url)
        try:
            try:
                await engine.pause()
            except Exception as exc:  # noqa: BLE001
                error = exc
            else:
                error = None
            result = await asyncio.wait_for(engine.generate(GenerateRequest(input_ids=[1, 2], max_new_tokens=1)), 5)
            return error, result, resumed
        finally:
            await engine.close()
            await runner.cleanup()

    error, result, resumed = asyncio.run(scenario())
    assert error is not None and "/pause" in str(error)  # the failure is still reported to the caller
    assert result.output_ids == [7] and resumed  # and generation was let go (the server told to resume, just in case)


def test_an_engine_back_with_its_initial_weights_is_told_apart_by_its_weight_label(tmp_path) -> None:
    """A restarted vLLM (a container restart the agent did not see fail) answers, but labels its tokens "default":
    after the agent has loaded and labelled weights, that is an EngineRestarted, so the agent reloads before going on."""
    from kuberl.runtime.inference.base import EngineRestarted

    async def scenario():
        label = {"now": "default"}

        async def generate(request: web.Request) -> web.Response:
            return web.json_response({"choices": [{"index": 0, "token_ids": [7], "logprobs": {"content": [{"token_id": 7, "logprob": -0.5}]},
                                                   "finish_reason": "length", "weight_versions": [{"version": label["now"], "start": 0, "end": 1}]}]})

        async def relabel(request: web.Request) -> web.Response:
            label["now"] = (await request.json())["new_version"]
            return web.json_response({"success": True})

        async def ok(request: web.Request) -> web.Response:
            return web.json_response({"results": [{}]})

        runner, url = await serve({"/inference/v1/generate": generate, "/update_weight_version": relabel, "/collective_rpc": ok})
        engine = VLLMEngine(url=url)
        req = GenerateRequest(input_ids=[1, 2], max_new_tokens=1)
        (tmp_path / "config.json").write_text("{}")
        try:
            first = await engine.generate(req)  # nothing loaded yet: "default" is the weights it started with, v0
            await engine.update_weights_from_disk(str(tmp_path), 4)
            loaded = await engine.generate(req)
            label["now"] = "default"  # the engine restarts
            try:
                await engine.generate(req)
                restarted = None
            except EngineRestarted as exc:
                restarted = exc
            engine.set_version(0)  # the agent found no weights to load: the initial ones are v0 again
            after = await engine.generate(req)
            return first, loaded, restarted, after
        finally:
            await engine.close()
            await runner.cleanup()

    first, loaded, restarted, after = asyncio.run(scenario())
    assert first.versions == [0] and loaded.versions == [4]
    assert restarted is not None and "restarted" in str(restarted) and not restarted.permanent
    assert after.versions == [0]


def test_an_idle_connection_is_closed_by_the_client_before_the_servers_keep_alive_would_close_it() -> None:
    """vLLM's server (uvicorn) closes a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s): a request the client
    sends on it at that moment fails with "Server disconnected" (a weight update's /pause, in the suite of 2026-12-03).
    The client closes idle connections first, so a request after a pause longer than its idle time opens a new one."""
    import importlib.util
    import re
    from pathlib import Path

    from kuberl.runtime.inference.http_engine import IDLE_CONNECTION_SECONDS

    envs = Path(importlib.util.find_spec("vllm").submodule_search_locations[0]) / "envs.py"
    server_keep_alive = int(re.search(r'"VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "(\d+)"', envs.read_text()).group(1))
    assert IDLE_CONNECTION_SECONDS < server_keep_alive

    async def scenario() -> list:
        peers: list = []

        async def pause(request: web.Request) -> web.Response:
            peers.append(request.transport.get_extra_info("peername")[1])  # the client's port: one per connection
            return web.json_response({"status": "paused"})

        app = web.Application()
        app.router.add_post("/pause", pause)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        engine = VLLMEngine(url=f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
        try:
            await engine._post("/pause")
            await engine._post("/pause")  # at once: the same connection
            await asyncio.sleep(IDLE_CONNECTION_SECONDS + 1.0)
            await engine._post("/pause")  # after the idle time: a new one
        finally:
            await engine.close()
            await runner.cleanup()
        return peers

    first, again, later = asyncio.run(scenario())
    assert first == again and later != first
