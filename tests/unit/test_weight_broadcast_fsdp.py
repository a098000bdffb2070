"""weightSync.mode broadcast from an FSDP2 trainer on two gloo ranks: the receiver gets the full parameters bit for bit,
while each rank only ever materialises one parameter's full tensor at a time (full_tensor per parameter, no state dict gather)."""

from __future__ import annotations

import subprocess
import sys
import time

import torch

from kuberl.runtime.weight_sync import broadcast as B

WORKER = r'''
import json, os, sys, time
import torch
from torch.distributed.tensor import DTensor
from transformers import Qwen2Config, Qwen2ForCausalLM
from kuberl.runtime.trainer import dist as D
from kuberl.runtime.weight_sync.sender import BroadcastSender

out = sys.argv[1]
info = D.init_distributed("cpu")
torch.manual_seed(0)
cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=True)
model = D.shard_model(Qwen2ForCausalLM(cfg).to(torch.float32), info)
assert all(isinstance(p, DTensor) for p in model.parameters()), "not sharded"
sender = BroadcastSender(rank=info.rank, world_size=info.world_size, bucket_mb=1, join_timeout_s=5, timeout_s=30, backend="gloo")
sender.bucket_bytes = 20_000  # several buckets
sender.start()
if info.is_main:
    with open(out + ".tmp", "w") as fh:
        json.dump(sender.record(), fh)
    os.rename(out + ".tmp", out)
    deadline = time.time() + 60
    while not sender.pending() and time.time() < deadline:
        time.sleep(0.05)
D.broadcast_object(None, info)
stats = sender.serve(model, 3, torch.float32, new_version=False, info=info)
if info.is_main:
    print("STATS " + json.dumps(stats), flush=True)
D.shutdown()
from kuberl.runtime.trainer.main import exit_now
exit_now(0)  # as the trainer leaves: torch's CPU teardown at exit can abort a 2-rank process (SIGABRT)
'''


def test_two_fsdp_ranks_send_the_full_parameters(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    script = tmp_path / "fsdp_broadcast_worker.py"
    script.write_text(WORKER)
    record_file = tmp_path / "record.json"
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script), str(record_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        deadline = time.time() + 120
        while not record_file.exists():
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.time() < deadline, "the trainer ranks never opened their store"
            time.sleep(0.1)
        import json

        record = json.loads(record_file.read_text())
        i = B.file_request(record, "fsdp-test", workers=1)
        assign = B.wait_assignment(record, i, 60)
        assert assign is not None and assign["world"] == 2 and assign["version"] == 3
        stats: dict = {}
        got = {n: t.clone() for n, t in B.receive_weights(assign, local_rank=0, device="cpu", stats=stats)}
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert stats["complete"] and stats["buckets"] > 1
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True)
    want = dict(Qwen2ForCausalLM(cfg).to(torch.float32).named_parameters())
    assert set(got) == set(want)  # tied head sent once, as model.embed_tokens.weight
    for name, p in want.items():
        assert torch.equal(got[name], p.detach()), name
    assert '"failed": null' in stdout and '"members": 1' in stdout, stdout
