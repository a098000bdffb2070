"""The Megatron backend's optimizer at the sizes users run (megatron/optim.py, digest.py), on CPU ranks over gloo: megatron-core's
DDP and distributed optimizer, float32 main weights under a bf16 model, activation recomputation, a checkpoint resumed at another
data-parallel size, and the end-of-run digest one parameter at a time. One 2-rank and one 1-rank launch of
megatron_optim_worker.py (a tiny Qwen3: q/k norms, whose gradients finalize_model_grads sums; a tiny Qwen3-MoE at expert 2).

What runs on the CPU: megatron's DDP buffers, the reduce-scatter of gradients and all-gather of parameters (gloo has both),
the distributed optimizer's sharded Adam and clipping, Float16Module in bf16 and the mixed-precision main weights (cpu.py maps
megatron's CUDA placements and type-string checks). Not on the CPU: float16's loss scaling, Transformer Engine, NCCL."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.unit.torchrun import torchrun

pytestmark = pytest.mark.megatron
WORKER = Path(__file__).with_name("megatron_optim_worker.py")


def max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the 2-rank train record, the 1-rank resume record)."""
    out = tmp_path_factory.mktemp("megatron-optim")
    torchrun(WORKER, "train", out, ranks=2, timeout=400, cwd=out)
    torchrun(WORKER, "resume", out, ranks=1, timeout=400, cwd=out)
    return torch.load(out / "train.pt", weights_only=False), torch.load(out / "resume.pt", weights_only=False)


def test_distributed_optimizer_steps_as_the_plain_optimizer_with_half_the_state_per_rank(runs):
    rec, _ = runs
    assert rec["dist_norm"] == pytest.approx(rec["plain_norm"], rel=1e-6)
    assert max_diff(rec["dist_after"], rec["plain_after"]) < 1e-6
    # each of the 2 data-parallel ranks steps its slice of the flattened parameters (rank 0's here), not all of them
    assert 0 < rec["shard_sizes"][0] <= rec["model_size"] // 2 + 64


def test_expert_parallel_chained_optimizer_steps_as_the_plain_optimizer_and_streams_its_digest(runs):
    rec, _ = runs
    assert rec["moe_optimizers"] == 2  # dense and experts
    assert rec["moe_dist_norm"] == pytest.approx(rec["moe_plain_norm"], rel=1e-6)
    assert max_diff(rec["moe_dist_after"], rec["moe_plain_after"]) < 1e-6
    assert rec["moe_digest_streamed"] == rec["moe_digest_whole"]


def test_checkpoint_written_at_data_parallel_2_resumes_at_1(runs):
    rec, resumed = runs
    assert max_diff(resumed["loaded"], rec["second_after"]) == 0.0
    # the third step after resuming equals the third step of the run that wrote the checkpoint (Adam's moments and step)
    assert max_diff(resumed["third_after"], rec["third_after"]) < 1e-6


def test_final_digest_is_streamed_and_equals_the_whole_state_digest(runs):
    rec, _ = runs
    assert rec["digest_streamed"] == rec["digest_whole"]


def test_recomputation_runs_each_layer_again_with_the_same_gradients(runs):
    rec, _ = runs
    assert rec["calls"] == [1, 2]  # one micro-batch per rank: once without, forward + recompute with
    assert max_diff(rec["grads_recomputed"], rec["grads"]) < 1e-7


def test_bf16_model_keeps_float32_main_weights_in_the_optimizer(runs):
    rec, _ = runs
    assert rec["bf16_param_dtypes"] == ["torch.bfloat16"]
    assert rec["bf16_master_dtypes"] == ["torch.float32"]
    assert rec["bf16_master_numel"] == rec["shard_sizes"][0]  # rank 0's slice, as in float32
    assert rec["bf16_params_are_rounded_masters"] and rec["bf16_masters_finer"]
    assert rec["bf16_norm"] == rec["bf16_norm"]  # not nan: the step ran
    assert any(v.abs().max() > 0 for v in rec["bf16_update"].values())


def test_the_trainer_accepts_gradient_checkpointing_with_megatron():
    """trainer.gradientCheckpointing is megatron's recomputation now, no longer refused when the trainer starts."""
    from types import SimpleNamespace

    from kuberl.runtime.trainer.megatron.backend import check_megatron_spec

    check_megatron_spec(SimpleNamespace(algorithm=SimpleNamespace(lora=None), weight_sync=SimpleNamespace(mode="disk"),
                                        trainer=SimpleNamespace(gradient_checkpointing=True,
                                                                parallelism=SimpleNamespace(context=1, expert=1, tensor=1, pipeline=1))))


@pytest.mark.parametrize(("manifest", "total_gib", "want"), [(None, 0.001, True), (None, 1000.0, False), (False, 0.001, False), (True, 1000.0, True)])
def test_recomputation_unset_is_chosen_from_the_memory_estimate(tmp_path, monkeypatch, manifest, total_gib, want):
    """trainer.gradientCheckpointing unset: on when memory.step_memory_gib's estimate of the step exceeds 85% of the
    accelerator (here a pretend one), as the FSDP path chooses; set: the manifest's value."""
    import sys
    from types import SimpleNamespace

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron_backend"))
    from megatron_models import tiny_config

    from kuberl.runtime.trainer import memory
    from kuberl.runtime.trainer.megatron import convert
    from kuberl.runtime.trainer.megatron.backend import MegatronMixin

    tiny_config("qwen2").save_pretrained(tmp_path)
    monkeypatch.setattr(memory, "memory_gib", lambda device: (0.0, total_gib))
    t = MegatronMixin()
    t.spec = SimpleNamespace(trainer=SimpleNamespace(gradient_checkpointing=manifest, micro_batch_tokens=4096))
    t.info, t.model_dir = SimpleNamespace(device=torch.device("cpu"), world_size=2), tmp_path
    on, why = t._megatron_recompute(convert.model_shape(tiny_config("qwen2")))
    assert on is want, why
    assert ("set in the manifest" in why) == (manifest is not None)
