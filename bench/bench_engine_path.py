"""Generated tokens/s of one vLLM engine, bare against through KubeRL's rollout agent, on the same prompts.

Issue #10 asks for this on a GPU: what the rollout path (the agent taking tickets from a real nats-server, rendering
the chat template, calling the engine's token-in/token-out endpoint with per-token logprobs, scoring, publishing the
groups) leaves of the engine's own throughput. One engine, started as `kuberl engine` starts it (the same flags), serves
both, in alternating rounds:

- bare: vLLM's OpenAI-compatible `/v1/completions`, the prompt as token ids, `n` samples per prompt, at most
  `concurrency` requests in flight (a plain asyncio + httpx client: what a user benchmarking vLLM would do);
- agent: `kuberl.runtime.rollout.agent.RolloutAgent` (the code of `kuberl rollout`) on the same prompts (the builtin
  repeat-digit data set through the model's chat template), `rollout.concurrency` groups in flight, every group
  published to JetStream and read back.

Both sample at temperature 1 with the same token budget; generated tokens are counted from what came back. The prefix
cache is on in both (prompts are ~30 tokens; decoding dominates). Runs anywhere vLLM runs: on CPU (the tiny model built
locally, float32) it checks the bench itself; on a GPU give a model, or `--shape` to build a random-init Qwen2.5 shape
here (bench_gpu_trainer's: Qwen2.5's config and 151,936-token vocabulary, the tiny tokenizer; nothing downloaded, for
machines without a network; random weights rarely sample EOS, so responses run to the token budget):

    python bench/bench_engine_path.py                                  # CPU, tiny model
    python bench/bench_engine_path.py --device gpu --shape qwen2.5-0.5b --dtype bfloat16 \
        --groups 256 --samples 8 --max-new-tokens 512 --concurrency 64
    python bench/bench_engine_path.py --device gpu --model Qwen/Qwen2.5-0.5B-Instruct --dtype bfloat16 ...
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def manifest(args: argparse.Namespace) -> dict:
    model = {"path": args.model} if args.model else {"builtin": "tiny-qwen2"}
    gpu = args.device == "gpu"
    return {
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "bench-engine-path"},
        "spec": {
            "model": {**model, "dtype": args.dtype},
            "dataset": {"builtin": "repeat-digit", "size": args.groups},
            "workflow": {"type": "rlvr", "reward": "repeat-digit"},
            "algorithm": {"samplesPerPrompt": args.samples, "maxNewTokens": args.max_new_tokens, "batchSize": args.groups,
                          "temperature": 1.0, "topP": 1.0},
            "rollout": {"engine": "vllm", "replicas": 1, "concurrency": args.concurrency,
                        "accelerator": {"type": "nvidia", "count": 1} if gpu else {"type": "cpu", "count": 0}},
            "trainer": {"accelerator": {"type": "nvidia", "count": 1} if gpu else {"type": "cpu", "count": 1}},
            "training": {"totalSteps": 1},
        },
    }


def start_engine(config: Path, workdir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    from kuberl.net import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "KUBERL_ENGINE_API_KEY"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kuberl.cli", "engine", "--config", str(config), "--port", str(port),
                                 "--host", "127.0.0.1", "--workdir", str(workdir)], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the engine exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the engine was not healthy within 900 s:\n{log.read_text()[-3000:]}")
        time.sleep(1)


def engine_log_excerpt(log: Path, lines: int = 60) -> str:
    """Where the engine's log first reports an error (its first ERROR line or traceback), else its last lines."""
    text = log.read_text(errors="replace").splitlines()
    first = next((i for i, line in enumerate(text) if "ERROR" in line or line.startswith("Traceback")), None)
    start = max(0, len(text) - lines) if first is None else first
    return f"the engine's log ({log}), lines {start + 1}-{min(len(text), start + lines)}:\n" + "\n".join(text[start: start + lines])


def rendered_prompts(exp, tokenizer) -> list[list[int]]:
    """The token ids the agent's workflow sends for each item (chat template, generation prompt)."""
    from kuberl.runtime.data import load_items

    out = []
    for item in load_items(exp.spec.dataset, seed=exp.spec.seed):
        text = tokenizer.apply_chat_template([{"role": "user", "content": item.prompt}], tokenize=False, add_generation_prompt=True)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


async def bare(url: str, prompts: list[list[int]], args: argparse.Namespace) -> tuple[int, float]:
    from kuberl.runtime.inference.vllm import SERVED_MODEL_NAME

    slots = asyncio.Semaphore(args.concurrency)
    tokens = 0

    async def one(client: httpx.AsyncClient, ids: list[int]) -> None:
        nonlocal tokens
        async with slots:
            r = await client.post(f"{url}/v1/completions", json={
                "model": SERVED_MODEL_NAME, "prompt": ids, "n": args.samples, "max_tokens": args.max_new_tokens,
                "temperature": 1.0, "top_p": 1.0})
            if r.status_code != 200:
                raise SystemExit(f"/v1/completions answered {r.status_code}: {r.text[:2000]}")
            tokens += r.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=args.concurrency)) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, ids) for ids in prompts))
        return tokens, time.perf_counter() - t0


async def through_agent(url: str, bus_url: str, exp, tokenizer, workdir: Path, round_no: int) -> tuple[int, float]:
    from kuberl.runtime.bus import Bus, Ticket
    from kuberl.runtime.data import load_items
    from kuberl.runtime.inference.vllm import VLLMEngine
    from kuberl.runtime.rollout.agent import RolloutAgent
    from kuberl.runtime.rollout.workflows import make_workflow

    items = load_items(exp.spec.dataset, seed=exp.spec.seed)
    bus = await Bus.connect(bus_url, exp.metadata.name)
    engine = VLLMEngine(url=url)
    await engine.start()
    try:
        await bus.publish_tickets([Ticket(ticket_id=f"r{round_no}-i{i}", index=i, epoch=round_no, issued_version=0) for i in range(len(items))])
        agent = RolloutAgent(exp, bus, engine, make_workflow(exp.spec, tokenizer), items, workdir=workdir, agent_id="bench", log_every=1e9)
        t0 = time.perf_counter()
        stats = await agent.run(max_tickets=len(items))
        seconds = time.perf_counter() - t0
        tokens, got = 0, 0
        while got < stats.published:
            for lease in await bus.pull_groups(stats.published - got, timeout=10.0):
                tokens += sum(len(s.output_ids) for s in lease.value.samples)
                got += 1
                await lease.ack()
        if stats.failed:
            raise SystemExit(f"the agent failed {stats.failed} tickets")
        return tokens, seconds
    finally:
        await engine.close()
        await bus.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--model", help="a local folder or a Hugging Face id (default: the builtin tiny Qwen2, built locally)")
    # bench_gpu_trainer's `tiny` smoke shape is left out: its head_dim 16 has no vLLM CPU attention kernel (the engine dies).
    ap.add_argument("--shape", choices=["qwen2.5-0.5b", "qwen2.5-1.5b"],
                    help="build a random-init model of this shape here (bench_gpu_trainer's SHAPES) instead of --model")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--groups", type=int, default=64, help="prompts per round")
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt (n)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=16, help="prompts (groups) in flight")
    ap.add_argument("--repeats", type=int, default=2, help="alternating rounds of (bare, agent)")
    args = ap.parse_args()
    if args.shape and args.model:
        ap.error("--shape builds the model: give --shape or --model, not both")

    import yaml
    from transformers import AutoTokenizer

    from kuberl.api import load_experiment
    from kuberl.runtime.bus.server import start_nats_server
    from kuberl.runtime.models import resolve_model

    with tempfile.TemporaryDirectory(prefix="kuberl-bench-engine-") as tmp:
        root = Path(tmp)
        if args.shape:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from bench_gpu_trainer import build_model

            args.model = str(build_model(root, args.shape))
            import torch

            if torch.cuda.is_available():  # built on the GPU: leave its memory to the engine
                torch.cuda.empty_cache()
        config = root / "experiment.yaml"
        config.write_text(yaml.safe_dump(manifest(args), sort_keys=False))
        exp = load_experiment(str(config))
        tokenizer = AutoTokenizer.from_pretrained(resolve_model(exp.spec.model, str(root)))
        prompts = rendered_prompts(exp, tokenizer)
        server = start_nats_server()
        proc, url = start_engine(config, root, root / "engine.log")
        rows: dict[str, list[float]] = {"bare": [], "agent": []}
        try:
            asyncio.run(bare(url, prompts[: args.concurrency], args))  # warm-up: first requests, allocator, prefix cache
            for k in range(args.repeats):
                tokens, s = asyncio.run(bare(url, prompts, args))
                rows["bare"].append(tokens / s)
                print(f"round {k + 1}: bare  {tokens:8d} tokens in {s:7.2f} s = {tokens / s:10.1f} tokens/s", flush=True)
                tokens, s = asyncio.run(through_agent(url, server.url, exp, tokenizer, root, k))
                rows["agent"].append(tokens / s)
                print(f"round {k + 1}: agent {tokens:8d} tokens in {s:7.2f} s = {tokens / s:10.1f} tokens/s", flush=True)
        except BaseException:
            print(engine_log_excerpt(root / "engine.log"), file=sys.stderr)
            raise
        finally:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=60)
            server.stop()
    b, a = statistics.median(rows["bare"]), statistics.median(rows["agent"])
    model = f"random-init {args.shape} shape" if args.shape else args.model or "builtin tiny-qwen2"
    print(f"\n{time.strftime('%Y-%m-%d')}, {args.device}, {model} ({args.dtype}); {args.groups} prompts x {args.samples} samples, "
          f"at most {args.max_new_tokens} new tokens, {args.concurrency} prompts in flight")
    print(f"median tokens/s: bare engine {b:.1f}, through the rollout agent {a:.1f}: agent / bare = {a / b:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
