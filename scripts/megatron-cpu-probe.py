"""Probe what megatron-core runs on CPU with gloo (issue #13, item 1, first step).

NOT a test: not collected by pytest, not run in CI. It needs megatron-core, which the project's
environment does not have; install it into a separate venv (megatron-core >= 0.17 needs Python >= 3.12,
so on this Python 3.11 machine the newest installable is 0.16.1):

    python3 -m venv /tmp/mcore-venv --system-site-packages
    /tmp/mcore-venv/bin/pip install megatron-core==0.16.1 torch==2.13.0
    flock /tmp/kuberl-heavy.lock timeout 600 /tmp/mcore-venv/bin/torchrun --nproc-per-node 2 \\
        scripts/megatron-cpu-probe.py [--cpu-rng-tracker] [--cpu-shims] [--pos rope] [--json OUT.json]

Steps (each one records "ok" with figures, or the exception's first line and the megatron frame it came from):
  a  parallel_state.initialize_model_parallel(tensor_model_parallel_size=2) on gloo
  b  ColumnParallelLinear -> RowParallelLinear forward + backward on CPU, checked against a dense reference
  c  tiny GPTModel (get_gpt_layer_local_spec, no Transformer Engine) at TP=2: forward + loss + backward,
     also through forward_backward_no_pipelining
  e  the TP=2 logits equal a TP=1 GPTModel's logits loaded with the gathered TP=2 weights
  d  pipeline parallel 2 (get_forward_backward_func with pp=2) on gloo
--cpu-rng-tracker replaces megatron's CUDA RNG tracker by a CPU one (the workaround a CPU test tier would need).
--cpu-shims also maps megatron's hard-coded device="cuda" / torch.cuda.current_device() to the CPU (a probe-only hack).
--pos rope|learned_absolute picks the GPTModel position embedding (rope moves inv_freq to CUDA in megatron).
"""

import argparse
import contextlib
import datetime
import json
import os
import time
import traceback

import torch
import torch.distributed as dist

SEQ, BATCH, VOCAB, HIDDEN, HEADS, LAYERS = 16, 2, 128, 64, 4, 2


def where(exc):
    """First line of the exception and the innermost megatron (else innermost) frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    mframes = [f for f in frames if "megatron" in f.filename]
    f = (mframes or frames)[-1] if frames else None
    loc = f"{f.filename.split('site-packages/')[-1]}:{f.lineno} ({f.name})" if f else "?"
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return f"{type(exc).__name__}: {first} @ {loc}"


def run_step(results, name, fn):
    t0 = time.perf_counter()
    try:
        figures = fn() or {}
        results[name] = {"ok": True, "seconds": round(time.perf_counter() - t0, 2), **figures}
    except Exception as exc:  # noqa: BLE001 - a probe records every failure
        results[name] = {"ok": False, "error": where(exc)}
        if os.environ.get("PROBE_TRACEBACK"):
            traceback.print_exc()
    print(f"[rank{dist.get_rank()}] {name}: {json.dumps(results[name])}", flush=True)


def install_cpu_rng_tracker():
    """Make megatron's RNG tracker fork the CPU generator instead of the CUDA one."""
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        def add(self, name, seed):
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)
            self.seeds_.add(seed)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    tracker = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, 1234 + 2718 + tp_rank)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, 1234)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, 1234 + 1024 + tp_rank)


class CudaToCpu(torch.overrides.TorchFunctionMode):
    """--cpu-shims: rewrite device="cuda"/int arguments (megatron hard-codes them) to "cpu"."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        dev = kwargs.get("device")
        if dev is not None and (isinstance(dev, int) or str(dev).startswith("cuda")):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def install_cpu_shims():
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda *a, **k: None
    CudaToCpu().__enter__()


def seed(args):
    from megatron.core import tensor_parallel

    torch.manual_seed(1234)
    if args.cpu_rng_tracker:
        install_cpu_rng_tracker()
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)


def gather_tp(p):
    """Full tensor of a (possibly) tensor-parallel parameter."""
    from megatron.core import parallel_state as ps

    if not getattr(p, "tensor_model_parallel", False) or ps.get_tensor_model_parallel_world_size() == 1:
        return p.detach().clone()
    parts = [torch.empty_like(p) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, p.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=p.partition_dim)


def config(tp, pp=1):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, use_cpu_initialization=True, gradient_accumulation_fusion=False,
        params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
        masked_softmax_fusion=False, bias_activation_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, pipeline_dtype=torch.float32,
        init_method_std=0.5,  # far from the uniform-logits init, so that a wrong weight layout shows in the loss
    )


def gpt(tp, pp=1, pos="learned_absolute"):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        config=config(tp, pp), transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
        max_sequence_length=SEQ, parallel_output=True, position_embedding_type=pos,
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
    )


def batch():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": pos, "attention_mask": mask}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-rng-tracker", action="store_true")
    ap.add_argument("--cpu-shims", action="store_true")
    ap.add_argument("--pos", choices=["rope", "learned_absolute"], default="learned_absolute")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    if args.cpu_shims:
        install_cpu_shims()
    torch.set_num_threads(1)
    import megatron.core
    from megatron.core import parallel_state as ps

    res = {"versions": {"torch": torch.__version__, "megatron-core": megatron.core.__version__},
           "world_size": dist.get_world_size(), "cpu_rng_tracker": args.cpu_rng_tracker,
           "cpu_shims": args.cpu_shims, "pos": args.pos}
    state = {}

    def step_a():
        ps.initialize_model_parallel(tensor_model_parallel_size=2)
        return {"tp_world": ps.get_tensor_model_parallel_world_size(), "dp_world": ps.get_data_parallel_world_size(),
                "tp_backend": dist.get_backend(ps.get_tensor_model_parallel_group())}

    def step_seed():
        seed(args)

    def step_b():
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.transformer_config import TransformerConfig

        cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, tensor_model_parallel_size=2,
                                use_cpu_initialization=True, gradient_accumulation_fusion=False, params_dtype=torch.float32)
        init = torch.nn.init.normal_
        col = ColumnParallelLinear(8, 16, config=cfg, init_method=init, bias=True, gather_output=False)
        row = RowParallelLinear(16, 8, config=cfg, init_method=init, bias=True, input_is_parallel=True, skip_bias_add=False)
        x = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(3), requires_grad=True)
        h, _ = col(x)
        y, _ = row(h)
        y.pow(2).sum().backward()
        w1, b1, w2, b2 = (gather_tp(t).requires_grad_() for t in (col.weight, col.bias, row.weight, row.bias))
        xr = x.detach().clone().requires_grad_()
        yr = torch.nn.functional.linear(torch.nn.functional.linear(xr, w1, b1), w2, b2)
        yr.pow(2).sum().backward()
        shard = w1.grad.chunk(2, dim=0)[ps.get_tensor_model_parallel_rank()]
        def rel(a, b):
            return (a - b).abs().max().item() / b.abs().max().item()

        diffs = {"out": rel(y, yr), "dx": rel(x.grad, xr.grad), "dw_col": rel(col.weight.grad, shard)}
        assert max(diffs.values()) < 1e-5, diffs
        return {"max_rel_diff": {k: float(f"{v:.1e}") for k, v in diffs.items()}, "local_col_weight": list(col.weight.shape)}

    def step_c():
        model = gpt(2, pos=args.pos)
        b = batch()
        loss = model(b["input_ids"], b["position_ids"], b["attention_mask"], labels=b["labels"])
        loss.mean().backward()
        grads = sum(1 for p in model.parameters() if p.grad is not None)
        with torch.no_grad():
            logits = model(b["input_ids"], b["position_ids"], b["attention_mask"], runtime_gather_output=True)
        state["logits"] = logits
        state["full"] = {k: gather_tp(p) for k, p in model.named_parameters()}
        state["loss_tp2"] = loss.mean().item()
        return {"loss": round(loss.mean().item(), 5), "params_with_grad": grads,
                "local_params": sum(p.numel() for p in model.parameters()), "logits_shape": list(logits.shape)}

    def fwd_step(data_iterator, model):
        b = next(data_iterator)
        out = model(b["input_ids"], b["position_ids"], b["attention_mask"], labels=b["labels"])

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            return loss, {"loss": loss.detach()}

        return out, loss_func

    def step_c_schedule():
        from megatron.core.pipeline_parallel import get_forward_backward_func

        model = gpt(2, pos=args.pos)
        fb = get_forward_backward_func()
        out = fb(forward_step_func=fwd_step, data_iterator=iter([batch(), batch()]), model=[model], num_microbatches=2,
                 seq_length=SEQ, micro_batch_size=BATCH, forward_only=False)
        return {"schedule": fb.__name__, "losses": [round(float(o["loss"]), 5) for o in out]}

    def step_e():
        logits2 = state["logits"]
        full = state["full"]
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=1)
        seed(args)
        model = gpt(1, pos=args.pos)
        missing = set(dict(model.named_parameters())) ^ set(full)
        assert not missing, f"parameter names differ between TP=1 and TP=2: {sorted(missing)[:5]}"
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.copy_(full[k])
        b = batch()
        with torch.no_grad():
            logits1 = model(b["input_ids"], b["position_ids"], b["attention_mask"], runtime_gather_output=True)
            loss1 = model(b["input_ids"], b["position_ids"], b["attention_mask"], labels=b["labels"]).mean().item()
        diff = (logits1 - logits2).abs().max().item()
        assert diff < 1e-4, f"TP=2 logits differ from TP=1 by {diff}"
        assert abs(loss1 - state["loss_tp2"]) < 1e-4, f"TP=2 loss {state['loss_tp2']} != TP=1 loss {loss1}"
        state["loss_tp1"] = loss1
        return {"max_abs_logit_diff": diff, "loss_tp1": round(loss1, 5), "loss_tp2": round(state["loss_tp2"], 5)}

    def step_d():
        from megatron.core.pipeline_parallel import get_forward_backward_func

        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
        seed(args)
        model = gpt(1, pp=2, pos=args.pos)
        stage = ps.get_pipeline_model_parallel_rank()
        if "full" in state:  # load the TP=1 weights of step e: stage r holds layer r (as its local layer 0)
            with torch.no_grad():
                for k, p in model.named_parameters():
                    p.copy_(state["full"][k.replace("decoder.layers.0.", f"decoder.layers.{stage}.")])
        fb = get_forward_backward_func()
        out = fb(forward_step_func=fwd_step, data_iterator=iter([batch(), batch()]), model=[model], num_microbatches=2,
                 seq_length=SEQ, micro_batch_size=BATCH, forward_only=False)
        grads = sum(1 for p in model.parameters() if p.grad is not None or getattr(p, "main_grad", None) is not None)
        losses = [float(o["loss"]) for o in out]
        if losses and "loss_tp1" in state:
            # the schedule divides the reported per-microbatch loss by num_microbatches (2 here)
            assert abs(2 * losses[0] - state["loss_tp1"]) < 1e-4, f"PP=2 loss 2 x {losses[0]} != TP=1 loss {state['loss_tp1']}"
        compared = bool(losses) and "loss_tp1" in state  # False on the first stage, or when step e failed
        return {"schedule": fb.__name__, "pp_rank": stage, "losses": [round(x, 5) for x in losses], "params_with_grad": grads,
                "loss_checked_against_tp1": compared,
                "local_params": sum(p.numel() for p in model.parameters())}

    run_step(res, "a_init_tp2", step_a)
    run_step(res, "seed", step_seed)
    run_step(res, "b_column_row_linear", step_b)
    run_step(res, "c_gpt_tp2_fwd_bwd", step_c)
    run_step(res, "c_gpt_tp2_no_pipelining_schedule", step_c_schedule)
    if "logits" in state:
        run_step(res, "e_tp2_equals_tp1", step_e)
    else:
        res["e_tp2_equals_tp1"] = {"ok": False, "error": "skipped: step c produced no logits"}
    run_step(res, "d_pp2_schedule", step_d)
    if args.json:  # each rank's own results, in case the ranks no longer meet for the gather below
        with open(f"{args.json}.rank{rank}", "w") as fh:
            json.dump(res, fh, indent=1)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, res)
    if rank == 0:
        text = json.dumps({f"rank{i}": r for i, r in enumerate(everyone)}, indent=1)
        print(text)
        if args.json:
            with open(args.json, "w") as fh:
                fh.write(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
