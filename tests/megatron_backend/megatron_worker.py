"""One rank of the Megatron backend's gloo runs (test_megatron_tp.py, test_megatron_moe.py and test_megatron_cp.py start two with torch.distributed.run).

    python -m torch.distributed.run --nproc-per-node 2 megatron_worker.py JOB.pt OUT.pt

For every model directory in the job and every layout in it ((tp, pp), (tp, pp, ep) or (tp, pp, ep, cp); data parallel over the rest):
build the GPTModel
from the HF directory, gather its weights back to HF names, compute response log-probs and entropies, run
one decoupled-PPO train step (recording the gathered gradients just before the optimizer step) and gather
the updated weights. Rank 0 writes everything to OUT.pt; the test compares it with the HF model.
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback

import torch
import torch.distributed as dist


class Recording(torch.optim.AdamW):
    """AdamW that first stores the gathered gradients (HF names) in record["grads"]: what train_step's clipping left."""

    def __init__(self, mm, record: dict, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mm, self.record = mm, record

    def step(self, closure=None):
        from kuberl.runtime.trainer.megatron.model import gather_hf_state

        self.record["grads"] = gather_hf_state(self.mm, grads=True)  # every rank joins the gathers
        return super().step(closure)


def run(job: dict) -> dict:
    from megatron.core import parallel_state as ps

    from kuberl.api.v1alpha1 import AlgorithmSpec
    from kuberl.runtime.algorithms import resolve_algorithm
    from kuberl.runtime.trainer.megatron.model import MicroBatch, build_model, gather_hf_state, init_parallel, response_logprobs, train_step

    cfg = resolve_algorithm(AlgorithmSpec(**job["algorithm"]))
    prompts, outputs, width, T, plans = job["prompts"], job["outputs"], job["width"], job["temperature"], job["micro_batches"]
    cuda_current_device = torch.cuda.current_device
    results: dict = {}
    for name, model_dir in job["models"].items():
        tr = job["train"][name]
        for layout in job["layouts"]:
            tp, pp, ep, cp = (*layout, 1, 1)[:4]
            init_parallel(tp, pp, ep, cp_size=cp, device="cpu")
            mm = build_model(model_dir, device="cpu")
            out = {"loaded": gather_hf_state(mm)}
            out["logp"], out["entropy"] = response_logprobs(mm, prompts, outputs, width, temperature=T, entropy=True, micro_batches=plans)
            mbs = [MicroBatch(prompts=[prompts[i] for i in p], outputs=[outputs[i] for i in p],
                              **{k: tr[k][p] for k in ("loss_mask", "behave_logp", "advantages", "prox_logp", "ref_logp")}) for p in plans]

            opt = Recording(mm, out, mm.module.parameters(), lr=tr["lr"], betas=tr["betas"], eps=tr["eps"], weight_decay=tr["weight_decay"])
            dp = dist.get_world_size() // (tp * pp * cp)
            if dp > 1:  # data parallel: each DP rank trains its own micro-batches; the denominator is the whole minibatch's
                mbs = mbs[ps.get_data_parallel_rank()::dp]
            out["stats"] = train_step(mm, opt, mbs, cfg, denominator=tr["denominator"], temperature=T, grad_clip=tr["grad_clip"])
            if dp > 1:
                loss = torch.tensor([out["stats"]["loss"]], dtype=torch.float64)
                dist.all_reduce(loss, group=ps.get_data_parallel_group())
                out["stats"]["loss"] = float(loss)
            out["after"] = gather_hf_state(mm)
            results[f"{name}/tp{tp}-pp{pp}-dp{dp}" + (f"-ep{ep}" if ep > 1 else "") + (f"-cp{cp}" if cp > 1 else "")] = out
    assert torch.cuda.current_device is cuda_current_device, "cpu_compat left its torch.cuda patch behind"
    return results


def main() -> None:
    job_path, out_path = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    try:
        results = run(torch.load(job_path, weights_only=False))
        if dist.get_rank() == 0:
            torch.save(results, out_path)
        dist.barrier()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    # As kuberl.runtime.trainer.main: torch 2.13's CPU teardown at interpreter exit sometimes aborts after the work is done.
    os._exit(0)


if __name__ == "__main__":
    main()
