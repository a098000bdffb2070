"""Weight-sync update time per mode (disk, bus, broadcast) against model size, with the real vLLM CPU engine.

    python3 bench/bench_weight_sync.py                      # tiny and ~300 MB Qwen2, every mode, 3 updates each
    python3 bench/bench_weight_sync.py --sizes tiny --modes broadcast --reps 5

For each size it builds a random-init Qwen2 (the builtin tokenizer; float32), starts one vLLM CPU engine as `kuberl
engine` does and a nats-server, then times `--reps` updates per mode with the code the roles run: the trainer side
(weights.export_weights + TrainerBusIO.publish_weights for disk and bus; weight_sync.sender.publish_broadcast for
broadcast) and the agent side (RolloutAgent.apply_weights: download for bus, pause, load, resume). An update is timed
from the trainer starting to publish to the agent's engine serving the new version; the best and the median are
printed, with what the trainer spends in its own publish stage (for broadcast: its join window and the send).
One engine, one agent, one trainer process, all on this machine: disk reads what it just wrote (page cache), the
bus is a local nats-server, broadcast runs over loopback gloo. The first update of each mode is excluded (warm-up; for
broadcast the engine is not a usual member yet, later updates wait for it).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

SIZES = {  # build_tiny_model overrides: the trainer's tiny model, and one of a few hundred MB (float32)
    "tiny": {},
    "300MB": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 5, "num_attention_heads": 16, "num_key_value_heads": 4},
}
MODES = ("disk", "bus", "broadcast")


def experiment(model_dir: Path, mode: str):
    from kuberl.api.v1alpha1 import RLExperiment

    return RLExperiment.model_validate({
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": f"bench-{mode}"},
        "spec": {"model": {"path": str(model_dir), "dtype": "float32"}, "dataset": {"builtin": "repeat-digit", "size": 8},
                 "rollout": {"engine": "vllm", "accelerator": {"type": "cpu"}}, "weightSync": {"mode": mode, "bucketMB": 64},
                 "training": {"totalSteps": 1}},
    })


async def bench_size(size: str, modes: list[str], reps: int, tmp: Path, nats_url: str) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    from kuberl.runtime.bus import Bus
    from kuberl.runtime.bus.names import KEY_WEIGHTS
    from kuberl.runtime.inference.vllm import VLLMEngine
    from kuberl.runtime.models import build_tiny_model
    from kuberl.runtime.rollout.agent import RolloutAgent
    from kuberl.runtime.trainer.bus_io import TrainerBusIO
    from kuberl.runtime.trainer.weights import export_weights
    from kuberl.runtime.weight_sync.sender import publish_broadcast

    model_dir = build_tiny_model(tmp / size / "model", seed=0, **SIZES[size])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    engine = VLLMEngine(str(model_dir), max_model_len=512, max_num_seqs=4, log_path=tmp / size / "vllm.log", startup_timeout=600)
    await engine.start()
    rows = []
    try:
        for mode in modes:
            exp = experiment(model_dir, mode)
            bus = await Bus.connect(nats_url, f"bench-{size.lower()}-{mode}")
            await bus.reset_experiment()
            trainer_bus = TrainerBusIO(bus)
            agent = RolloutAgent(exp, bus, engine, None, [], workdir=tmp / size / mode, agent_id=f"bench-{mode}")
            trainer = SimpleNamespace(info=SimpleNamespace(rank=0, world_size=1, is_main=True, device=torch.device("cpu")),
                                      spec=exp.spec, bus=trainer_bus, model=model, version=0)
            totals, publishes = [], []
            for v in range(1, reps + 2):
                with torch.no_grad():
                    next(model.parameters()).add_(1e-3)  # new weights each version
                trainer.version = v
                t0 = time.monotonic()
                if mode == "broadcast":
                    publishing = asyncio.create_task(publish_broadcast(trainer, new_version=True))
                    while (w := await bus.get_state(KEY_WEIGHTS)) is None or w["version"] != v:
                        await asyncio.sleep(0.005)
                    applying = asyncio.create_task(agent.apply_weights(w))
                    if (await publishing)["members"] == 0:  # v1: the request came after the join grace: the collect loop's resync serves it
                        while not trainer.weight_sender.pending():
                            await asyncio.sleep(0.01)
                        await publish_broadcast(trainer, new_version=False)
                    t_pub = time.monotonic() - t0
                    await applying
                else:
                    state = {k: t.detach() for k, t in model.state_dict().items()}
                    path = export_weights(state, tmp / size / mode / "weights", v, source_dir=model_dir, dtype=torch.float32, keep=2)
                    await trainer_bus.publish_weights(v, path, mode=mode)
                    t_pub = time.monotonic() - t0
                    await agent.apply_weights(await bus.get_state(KEY_WEIGHTS))
                total = time.monotonic() - t0
                assert engine.version == v, f"{mode}: engine serves v{engine.version}, not v{v}"
                if v > 1:  # v1 warms caches (and for broadcast takes the late-joiner path)
                    totals.append(total)
                    publishes.append(t_pub)
            if getattr(trainer, "weight_sender", None) is not None:
                trainer.weight_sender.store = None
            await bus.close()
            rows.append({"size": size, "MB": round(mb), "mode": mode, "best_s": min(totals), "median_s": statistics.median(totals),
                         "trainer_publish_s": statistics.median(publishes)})
            print(f"{size:>6} {mb:7.0f} MB  {mode:<9}  update best {min(totals):6.3f}s  median {statistics.median(totals):6.3f}s  "
                  f"(trainer publish stage {statistics.median(publishes):6.3f}s)", flush=True)
    finally:
        await engine.stop()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, from {', '.join(SIZES)}")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    sizes, modes = args.sizes.split(","), args.modes.split(",")
    bad = [s for s in sizes if s not in SIZES] + [m for m in modes if m not in MODES]
    if bad or args.reps < 1:
        ap.error(f"unknown size/mode {bad} or --reps < 1")
    from kuberl.runtime.bus.server import start_nats_server

    with tempfile.TemporaryDirectory(prefix="bench-weight-sync-") as d:
        tmp = Path(d)
        server = start_nats_server(store_dir=str(tmp / "jetstream"), max_payload="8MB")
        try:
            for size in sizes:
                asyncio.run(bench_size(size, modes, args.reps, tmp, server.url))
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
