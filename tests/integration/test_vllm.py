"""The vLLM engine against a real vLLM CPU server: exact ids and logprobs, weight reload, pause/resume, partial rollouts."""

from __future__ import annotations

import asyncio
import time

import pytest
import pytest_asyncio
import torch

from kuberl.runtime.inference.base import EngineError, GenerateRequest
from kuberl.runtime.inference.vllm import VLLMEngine, cpu_block_size
from kuberl.runtime.rollout.workflows import generate_continuing, generate_group

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@pytest_asyncio.fixture(loop_scope="function")
async def engine(vllm_server):
    e = VLLMEngine(url=vllm_server.url)
    await e.start()
    yield e
    await e.close()


def _hf(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _prompt(tok, text="Repeat the digit 7."):
    return tok(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]


@torch.no_grad()
def _logprobs(model, prompt, output, temperature=1.0):
    ids = torch.tensor([prompt + output])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0].tolist()


@torch.no_grad()
def _greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


async def _load(engine, path, version):
    await engine.pause()
    await engine.update_weights_from_disk(str(path), version)
    await engine.resume()


def test_the_engine_core_process_was_forked_not_spawned(vllm_server):
    """kuberl.runtime.inference.vllm_server: a one-worker CPU engine's core is forked (healthy in about half the time).
    A spawned child is exec'd with the environment of the moment, which holds the VLLM_WORKER_MULTIPROC_METHOD=spawn
    that vLLM's CLI sets at start-up; a forked one keeps the server's exec-time environment, which does not."""
    from pathlib import Path

    children = [int(p) for p in Path(f"/proc/{vllm_server.pid}/task/{vllm_server.pid}/children").read_text().split()]
    cores = [pid for pid in children if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"VLLM::EngineCore")]
    assert len(cores) == 1, f"expected one engine-core child of the API server, got {children}"
    environ = Path(f"/proc/{cores[0]}/environ").read_bytes().split(b"\0")
    assert b"VLLM_WORKER_MULTIPROC_METHOD=spawn" not in environ


async def test_generate_returns_the_sampled_ids_and_their_logprobs_under_the_served_weights(engine, vllm_server):
    await _load(engine, vllm_server.model_dir, 0)
    tok, model = _hf(vllm_server.model_dir)
    prompt = _prompt(tok)
    for temperature in (1.0, 0.7):
        res = await engine.generate(GenerateRequest(prompt, max_new_tokens=12, temperature=temperature, stop_token_ids=[tok.eos_token_id], seed=3))
        assert res.finish_reason in ("stop", "length") and res.version == 0
        assert res.versions == [0] * len(res.output_ids)  # per-token versions from vLLM's weight-version spans
        assert 1 <= len(res.output_ids) == len(res.logprobs) <= 12
        assert all(0 <= t < len(tok) for t in res.output_ids)
        if res.finish_reason == "stop":
            assert res.output_ids[-1] == tok.eos_token_id  # the stop token is kept: the trainer learns to stop
        # The engine's logprobs are those of the temperature-scaled policy that sampled the tokens.
        assert res.logprobs == pytest.approx(_logprobs(model, prompt, res.output_ids, temperature), abs=2e-3)


async def test_the_same_seed_gives_the_same_tokens(engine, vllm_server):
    await _load(engine, vllm_server.model_dir, 0)
    tok, _ = _hf(vllm_server.model_dir)
    req = GenerateRequest(_prompt(tok), max_new_tokens=10, temperature=1.0, seed=11)
    a, b = await asyncio.gather(engine.generate(req), engine.generate(req))
    assert a.output_ids == b.output_ids


async def test_n_samples_in_one_request_are_n_independent_draws_with_their_own_logprobs(engine, vllm_server):
    await _load(engine, vllm_server.model_dir, 0)
    tok, model = _hf(vllm_server.model_dir)
    prompt = _prompt(tok)
    req = GenerateRequest(prompt, max_new_tokens=12, temperature=0.7)
    results = await engine.generate_n(req, 6)
    assert len(results) == 6 and all(r.version == 0 and r.finish_reason == "length" for r in results)
    assert len({tuple(r.output_ids) for r in results}) > 1  # six draws, not one sample six times
    for r in results:  # each choice's logprobs are its own tokens' under the temperature-scaled policy
        assert r.logprobs == pytest.approx(_logprobs(model, prompt, r.output_ids, 0.7), abs=2e-3)
    with pytest.raises(ValueError, match="unseeded"):
        await engine.generate_n(GenerateRequest(prompt, max_new_tokens=4, seed=1), 2)


async def test_a_group_interrupted_by_a_weight_update_continues_each_sample_on_the_new_weights(engine, vllm_server):
    tok, old = _hf(vllm_server.model_dir)
    _, new = _hf(vllm_server.other_weights)
    prompt = _prompt(tok)
    n = 512 - len(prompt)
    for delay in (0.3, 0.1, 0.05, 0.02, 0.01):
        await _load(engine, vllm_server.model_dir, 0)
        task = asyncio.create_task(generate_group(engine, prompt, GenerateRequest(prompt, max_new_tokens=n, temperature=1.0), 3))
        for _ in range(3000):
            if engine._in_flight or task.done():
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(delay)
        if task.done():
            continue
        await _load(engine, vllm_server.other_weights, 1)
        gens = await asyncio.wait_for(task, 300)
        if all(g.pieces >= 2 and set(g.versions) == {0, 1} for g in gens):
            break
    else:
        pytest.fail("no attempt caught the group mid-way")
    assert len(gens) == 3 and len({tuple(g.output_ids) for g in gens}) == 3
    for g in gens:
        assert g.finish_reason == "length" and len(g.output_ids) == n
        switch = g.versions.index(1)
        assert all(v == 0 for v in g.versions[:switch]) and all(v == 1 for v in g.versions[switch:])
        assert g.logprobs[:switch] == pytest.approx(_logprobs(old, prompt, g.output_ids)[:switch], abs=2e-3)
        assert g.logprobs[switch:] == pytest.approx(_logprobs(new, prompt, g.output_ids)[switch:], abs=2e-3)
    await _load(engine, vllm_server.model_dir, 0)


async def test_an_in_flight_update_swaps_the_weights_under_a_running_generation_without_interrupting_it(engine, vllm_server):
    """weightSync.inFlight keep: no pause, no abort; one piece whose tokens carry the versions that sampled them."""
    tok, old = _hf(vllm_server.model_dir)
    _, new = _hf(vllm_server.other_weights)
    prompt = _prompt(tok)
    n = 512 - len(prompt)
    for delay in (0.3, 0.1, 0.05, 0.02, 0.01):
        await _load(engine, vllm_server.model_dir, 0)
        task = asyncio.create_task(engine.generate(GenerateRequest(prompt, max_new_tokens=n, temperature=1.0)))
        for _ in range(3000):
            if engine._in_flight or task.done():
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(delay)
        if task.done():
            continue
        await engine.update_weights_from_disk(str(vllm_server.other_weights), 1)  # no pause
        assert engine.version == 1
        if task.done():  # the load outlasted the generation's remaining tokens (a loaded machine): try earlier
            continue
        res = await asyncio.wait_for(task, 300)
        old_lp = _logprobs(old, prompt, res.output_ids)
        differs = [abs(a - b) > 2e-3 for a, b in zip(res.logprobs, old_lp)]
        switch = differs.index(True) if any(differs) else len(differs)  # the first token the old weights did not give
        if 0 < switch < n:
            break
    else:
        pytest.fail("no attempt caught the generation mid-way")
    assert res.finish_reason == "length" and len(res.output_ids) == n  # never aborted: one piece
    assert res.version == 0  # the version it started on
    # Each token carries the version that sampled it (vLLM's weight-version spans): v0 up to the switch, then v1. The
    # label follows the reload by an HTTP call, so it may switch a few tokens late (over-counted staleness), never early.
    assert res.versions is not None and res.versions == sorted(res.versions) and set(res.versions) == {0, 1}, res.versions
    labelled = res.versions.index(1)
    assert switch <= labelled <= switch + 16, (switch, labelled)
    # The old weights' tokens up to the switch, then the new weights': most later logprobs are far from the old ones'.
    far = sum(abs(a - b) > 0.05 for a, b in zip(res.logprobs[switch:], old_lp[switch:]))
    assert far > (n - switch) // 2, (switch, far)
    greedy = GenerateRequest(prompt, max_new_tokens=16, temperature=0.0)
    await engine.update_weights_from_disk(str(vllm_server.other_weights), 1)  # idle now: the prefix cache is reset too
    assert (await engine.generate(greedy)).output_ids == _greedy(new, prompt, 16)
    await _load(engine, vllm_server.model_dir, 0)


async def test_no_request_reuses_prefix_kv_that_earlier_weights_computed(engine, vllm_server):
    """Each request's cache_salt names the weights' version: a prompt cached under v0 is computed afresh under v1, with
    no prefix-cache reset (which vLLM refuses while a request runs, i.e. always under weightSync.inFlight keep)."""
    tok, _ = _hf(vllm_server.model_dir)
    _, new = _hf(vllm_server.other_weights)
    long_prompt = _prompt(tok, "Repeat the digit 7, and nothing else. " * 12)
    assert 130 < len(long_prompt) < 480, len(long_prompt)  # full KV blocks to cache (32 tokens on CPU, 16 on GPUs)
    await _load(engine, vllm_server.model_dir, 0)
    await engine.generate(GenerateRequest(long_prompt, max_new_tokens=2, temperature=1.0, seed=1))  # its blocks cached under v0
    await engine.update_weights_from_disk(str(vllm_server.other_weights), 1)  # as keep does it: no pause
    res = await engine.generate(GenerateRequest(long_prompt, max_new_tokens=8, temperature=1.0, seed=2))
    assert res.logprobs == pytest.approx(_logprobs(new, long_prompt, res.output_ids), abs=2e-3)
    await _load(engine, vllm_server.model_dir, 0)


async def _prefix_cache_hits(engine) -> float:
    async with engine._http().get(engine.url + "/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits"))


@pytest.mark.parametrize("repeats", [0, 2])
async def test_a_groups_samples_share_the_kv_of_a_prompt_shorter_than_vllms_cpu_default_block(engine, vllm_server, repeats):
    """A prompt of 17-31 tokens (the bench's) or of 64-127 (many reasoning data sets'): under vLLM's CPU default of
    128-token blocks a group's n samples each prefilled it again; under the 16-token blocks KubeRL's one-worker CPU
    engines run (vllm.cpu_block_size) they share every full block of it."""
    await _load(engine, vllm_server.model_dir, 0)
    tok, _ = _hf(vllm_server.model_dir)
    digit = time.time_ns() % 10
    text = f"Repeat the digit {digit}: {str(digit) * 4}" + f". And nothing else; {time.time_ns()}." * repeats
    prompt = _prompt(tok, text)  # the bench's prompts; the longer ones unique (nothing an earlier test cached)
    assert (17 <= len(prompt) < 32) if repeats == 0 else (64 <= len(prompt) < 128), len(prompt)
    block = cpu_block_size(True)
    full_blocks = (len(prompt) - 1) // block * block  # vLLM computes at least a prompt's last token
    before = await _prefix_cache_hits(engine)
    await engine.generate(GenerateRequest(prompt, max_new_tokens=2, temperature=1.0))  # computes and caches its blocks
    await engine.generate_n(GenerateRequest(prompt, max_new_tokens=2, temperature=1.0), 4)
    assert await _prefix_cache_hits(engine) - before >= 4 * full_blocks > 0, (len(prompt), block)


async def test_a_weight_reload_changes_the_outputs_without_a_restart(engine, vllm_server):
    tok, old = _hf(vllm_server.model_dir)
    _, new = _hf(vllm_server.other_weights)
    prompt = _prompt(tok)
    greedy = GenerateRequest(prompt, max_new_tokens=16, temperature=0.0)
    await _load(engine, vllm_server.model_dir, 0)
    before = await engine.generate(greedy)
    await _load(engine, vllm_server.other_weights, 1)
    after = await engine.generate(greedy)
    assert engine.version == 1 and after.version == 1
    assert before.output_ids == _greedy(old, prompt, 16)
    assert after.output_ids == _greedy(new, prompt, 16)  # exactly what the new weights produce
    assert after.output_ids != before.output_ids
    await _load(engine, vllm_server.model_dir, 0)
    assert (await engine.generate(greedy)).output_ids == before.output_ids


async def test_a_paused_engine_holds_new_generations_until_resumed(engine, vllm_server):
    tok, _ = _hf(vllm_server.model_dir)
    await engine.pause()
    task = asyncio.create_task(engine.generate(GenerateRequest(_prompt(tok), max_new_tokens=4, temperature=1.0)))
    await asyncio.sleep(1.0)
    assert not task.done()
    await engine.resume()
    res = await asyncio.wait_for(task, 60)
    assert len(res.output_ids) >= 1


async def test_a_generation_interrupted_by_a_weight_update_continues_and_its_tokens_carry_both_versions(engine, vllm_server):
    tok, old = _hf(vllm_server.model_dir)
    _, new = _hf(vllm_server.other_weights)
    prompt = _prompt(tok)
    n = 512 - len(prompt)  # the whole context: the update lands mid-generation
    # How long ~500 tokens take depends on the machine's load: try shorter waits until the update lands
    # after v0 produced some tokens and before the generation ended.
    for delay in (0.2, 0.1, 0.05, 0.02, 0.01, 0.005):
        await _load(engine, vllm_server.model_dir, 0)
        gen_task = asyncio.create_task(generate_continuing(engine, prompt, GenerateRequest(prompt, max_new_tokens=n, temperature=1.0, seed=7)))
        for _ in range(3000):
            if engine._in_flight or gen_task.done():
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(delay)  # some tokens from v0 first
        if gen_task.done():
            continue  # finished before the update: too slow a trigger for this machine
        await _load(engine, vllm_server.other_weights, 1)
        gen = await asyncio.wait_for(gen_task, 300)
        if gen.pieces >= 2 and set(gen.versions) == {0, 1}:
            break
    else:
        pytest.fail("no attempt caught the generation mid-way (each finished before, or the update came before any token)")
    assert gen.finish_reason == "length" and len(gen.output_ids) == n and gen.pieces >= 2
    assert set(gen.versions) == {0, 1}
    switch = gen.versions.index(1)
    assert all(v == 0 for v in gen.versions[:switch]) and all(v == 1 for v in gen.versions[switch:])
    # Each token's logprob is its probability under the weights its version names: v0 before the
    # switch, v1 (continuing from prompt + v0's prefix) after it; under the other weights it is not.
    old_lp = _logprobs(old, prompt, gen.output_ids)
    new_lp = _logprobs(new, prompt, gen.output_ids)
    assert gen.logprobs[:switch] == pytest.approx(old_lp[:switch], abs=2e-3)
    assert gen.logprobs[switch:] == pytest.approx(new_lp[switch:], abs=2e-3)
    assert max(abs(a - b) for a, b in zip(gen.logprobs[switch:], old_lp[switch:])) > 0.05
    await _load(engine, vllm_server.model_dir, 0)


@pytest.mark.parametrize("update", ["disk", "broadcast"])
async def test_a_server_without_kuberls_worker_extension_gets_an_error_naming_the_flag(engine, vllm_server, update):
    """What the real server answers for a /collective_rpc method its workers lack (vLLM: HTTP 500 "Method '...' is not
    implemented.") becomes an error naming --worker-extension-cls, on both weight-update paths; nothing is relabelled and the
    server keeps serving."""
    missing = "kuberl_no_such_method"
    with pytest.raises(EngineError, match=f"has no {missing} method: start it with `kuberl engine` or pass --worker-extension-cls"):
        if update == "disk":
            engine.reload_method = missing
            await engine.update_weights_from_disk(str(vllm_server.model_dir), 7)
        else:
            engine.receive_method = missing
            await engine.update_weights_broadcast({"version": 7, "update": "missing"})
    assert engine.version != 7
    fresh = VLLMEngine(url=vllm_server.url)  # a connection of its own: vLLM may close the one that got the 500
    await fresh.start()
    try:
        assert await fresh.health()
    finally:
        await fresh.close()


async def test_generation_stops_at_a_stop_id_or_string_and_ends_with_the_token_that_stopped_it(engine, vllm_server):
    """algorithm.stopTokenIds and algorithm.stop through /inference/v1/generate: the output is the free (greedy) output up to
    and including the token that stopped it, a stop id or the token completing a stop string, with one logprob each."""
    await _load(engine, vllm_server.model_dir, 0)
    tok, _ = _hf(vllm_server.model_dir)
    prompt = _prompt(tok)

    async def greedy(**stops):
        return await engine.generate(GenerateRequest(prompt, max_new_tokens=16, temperature=0.0, **stops))

    free = (await greedy()).output_ids
    text = lambda ids: tok.decode(ids, skip_special_tokens=False)  # noqa: E731  as vLLM detokenises (skip_special_tokens false)
    # A stop string spanning two tokens of clean text (the random model also says lone bytes of multibyte characters,
    # which decode to U+FFFD).
    ks = [i for i in range(3, 14) if text(free[i:i + 2]).strip() and "\ufffd" not in text(free[i:i + 2])]
    assert ks, f"no clean two-token string in the greedy output {free} = {text(free)!r}"
    k = ks[0]
    by_id = await greedy(stop_token_ids=[free[k]])
    assert by_id.finish_reason == "stop" and by_id.output_ids == free[: free.index(free[k]) + 1]
    stop = text(free[k:k + 2])
    end = next(i for i in range(1, len(free) + 1) if stop in text(free[:i]))  # the first token that completes it
    by_str = await greedy(stop=[stop])
    assert by_str.finish_reason == "stop" and by_str.output_ids == free[:end] and len(by_str.logprobs) == end
