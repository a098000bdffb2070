"""Agents in their own process, trained through the episode API: `python external_agent.py WORKDIR FUNCTIONS OUT`.

It is what a user runs next to `kuberl run` (or against a rollout pod): it reads where the episode API is and its key
from WORKDIR/episode-api.json (written by `kuberl run`), and with WORKERS episodes at a time opens an episode, runs
a framework agent of framework_agents.py (the OpenAI Agents SDK or LangChain, unchanged) on an openai client made
from the episode's base URL and key, and closes it empty, for workflow.reward to score the final answer. FUNCTIONS
names one agent function or several, comma-separated: the episodes are dealt to them in turn. Each episode it closed
is a JSON line in OUT (its group, index, pid, the function). It runs until terminated (SIGTERM).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import framework_agents
import openai

WORKERS = 16  # the run's concurrency (4 groups) times its group size (4)


async def open_episode(http: aiohttp.ClientSession, url: str, key: str) -> dict | None:
    """The next episode; None when none came within 5 s or the server is not listening (yet, or any more)."""
    try:
        async with http.post(url, json={"wait_seconds": 5}, headers={"Authorization": f"Bearer {key}"}) as r:
            if r.status == 204:
                return None
            r.raise_for_status()
            return await r.json()
    except aiohttp.ClientConnectionError:  # the rollout agent starts (or restarts): its port is held, not yet served
        await asyncio.sleep(0.5)
        return None


async def episode_loop(http: aiohttp.ClientSession, url: str, key: str, agents: Iterator[str], out: Path) -> None:
    """Open, run (the next agent function in turn), close, until terminated."""
    while True:
        ep = await open_episode(http, url, key)
        if ep is None:
            continue
        function = next(agents)
        agent = getattr(framework_agents, function)
        client = openai.AsyncOpenAI(base_url=ep["base_url"], api_key=ep["api_key"], max_retries=0)
        close: dict = {}
        try:
            await agent(client, SimpleNamespace(**ep["item"]))
        except Exception as exc:  # noqa: BLE001  the run counts it as a failed episode, with this reason
            close = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            await client.close()
        async with http.post(f"{url}/{ep['episode_id']}/close", json=close, headers={"Authorization": f"Bearer {ep['api_key']}"}) as r:
            closed = r.status
        with open(out, "a") as fh:
            fh.write(json.dumps({"group": ep["group"], "pid": os.getpid(), "function": function, "closed": closed, **close}) + "\n")


async def main(workdir: Path, functions: str, out: Path) -> None:
    where = workdir / "episode-api.json"
    while not where.is_file():  # `kuberl run` writes it once its roles are started
        await asyncio.sleep(0.2)
    info = json.loads(where.read_text())
    key = Path(info["key_file"]).read_text().strip()
    agents = itertools.cycle(functions.split(","))  # shared by the workers: episodes go to each function in turn
    async with aiohttp.ClientSession() as http:
        loops = [asyncio.create_task(episode_loop(http, info["urls"][0], key, agents, out)) for _ in range(WORKERS)]
        done, _ = await asyncio.wait(loops, return_when=asyncio.FIRST_EXCEPTION)
        for t in loops:
            t.cancel()
        print(f"external agent: stopping ({next(iter(done)).exception()!r}) at {time.strftime('%H:%M:%S')}", file=sys.stderr)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])))
