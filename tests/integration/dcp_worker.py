"""One trainer rank for tests/integration/test_checkpoint_resharding.py: `python dcp_worker.py PLAN.json`.

Runs the trainer's own checkpoint code (persist.write_state / read_state, checkpoint.commit_checkpoint,
dist.init_distributed / shard_model) on a small Qwen2 with AdamW and a warm-up schedule, in a gloo group
of $WORLD_SIZE ranks (env set by the test). Each rank trains on its slice of a batch that depends only on
the step, so any world size computes the same averaged gradient. The plan's ops, in order:

  ["train", n]   n optimizer steps          ["save"]      sharded checkpoint of the current step, committed
  ["save_old"]   model.pt/optimizer.pt full dicts, as earlier versions wrote them, committed
  ["torn"]       every rank writes its shards of the current step, then the process dies (exit 3) before the commit
  ["resume"]     rank 0 picks `latest` (as Trainer._resume does), every rank loads it; writes resumed.json
  ["dump", NAME] rank 0 writes NAME.pt: full model and optimizer state (gathered) and whether lm_head is tied
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from kuberl.runtime.trainer import checkpoint as ck
from kuberl.runtime.trainer import dist as D
from kuberl.runtime.trainer.persist import read_state, write_state

ROWS, SEQ, VOCAB = 4, 16, 320


def build(info: D.DistInfo, tie: bool, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).to(torch.float32)
    if tie:
        model.tie_weights()
    model = D.shard_model(model, info)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    return model, optimizer, scheduler


def train_step(info: D.DistInfo, model, optimizer, scheduler, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    batch = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen)
    per_rank = ROWS // info.world_size
    mine = batch[info.rank * per_rank:(info.rank + 1) * per_rank]
    # Mean over this rank's tokens; FSDP2 averages gradients over ranks: the mean over the whole batch.
    model(input_ids=mine, labels=mine).loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def main(plan_file: str) -> int:
    plan = json.loads(Path(plan_file).read_text())
    out, root = Path(plan["out"]), Path(plan["root"])
    info = D.init_distributed("cpu")
    model, optimizer, scheduler = build(info, plan["tie"], plan["init_seed"])
    step = 0
    for op in plan["ops"]:
        if op[0] == "train":
            for _ in range(op[1]):
                step += 1
                train_step(info, model, optimizer, scheduler, step)
        elif op[0] == "save":
            write_state(info, root, step, model, optimizer, scheduler)
            if info.is_main:
                ck.commit_checkpoint(root, step, {"version": step, "world_size": info.world_size})
            D.barrier(info)
        elif op[0] == "save_old":  # the writer of earlier versions: full dicts gathered on rank 0
            model_sd, optim_sd = D.full_model_state(model), D.full_optimizer_state(model, optimizer)
            if info.is_main:
                tmp = ck.begin_checkpoint(root, step)
                for name, obj in (("model.pt", model_sd), ("optimizer.pt", optim_sd), ("scheduler.pt", scheduler.state_dict()),
                                  ("rng-rank0.pt", ck.capture_rng_state())):
                    ck.write_torch(tmp, name, obj)
                ck.commit_checkpoint(root, step, {"version": step, "world_size": info.world_size})
            D.barrier(info)
        elif op[0] == "torn":
            write_state(info, root, step, model, optimizer, scheduler)
            os._exit(3)  # killed after the shards, before rank 0 commits
        elif op[0] == "resume":
            found = None
            if info.is_main and (latest := ck.latest_checkpoint(root)) is not None:
                found = (str(latest.path), ck.load_trainer_state(latest.path), ck.read_torch(latest.path, "scheduler.pt"), ck.is_sharded(latest.path))
            found = D.broadcast_object(found, info)
            if found is None:
                raise SystemExit("no checkpoint to resume from")
            path, state, sched, sharded = found
            read_state(info, Path(path), sharded, model, optimizer)
            scheduler.load_state_dict(sched)
            step = int(state["step"])
            if info.is_main:
                (out / "resumed.json").write_text(json.dumps({"path": path, "step": step, "sharded": sharded}))
        elif op[0] == "dump":
            model_sd, optim_sd = D.full_model_state(model), D.full_optimizer_state(model, optimizer)
            inner = model.model.embed_tokens.weight
            tied = model.lm_head.weight is inner
            if info.is_main:
                torch.save({"model": model_sd, "optimizer": optim_sd, "tied": tied, "step": step, "lr": scheduler.get_last_lr()}, out / f"{op[1]}.pt")
        else:
            raise ValueError(f"unknown op {op!r}")
    D.barrier(info)
    D.shutdown()
    return 0


if __name__ == "__main__":
    from kuberl.runtime.trainer.main import exit_now

    exit_now(main(sys.argv[1]))  # as the trainer leaves: torch's CPU teardown at exit can abort a 2-rank process
