"""The trainer out of accelerator memory: a configuration error (exit 2, not retried) naming the settings that lower it.

The real allocator's error is seen on a GPU by `bench/check_gpu_trainer_loop.py --memory-fraction` (docs/benchmarks.md); here
torch.OutOfMemoryError is raised where the step would raise it, and the trainer's run() must turn it into exit 2,
a termination message and progress.failed.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from kuberl.api.roles import TrainerSpec
from kuberl.runtime.errors import ConfigError
from kuberl.runtime.trainer import memory

CUDA = torch.device("cuda", 0)
TORCH_MESSAGE = ("CUDA out of memory. Tried to allocate 4.64 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.02 GiB is "
                 "free. Of the allocated memory 74.10 GiB is allocated by PyTorch, and 2.40 GiB is reserved by PyTorch but unallocated.")


def test_the_message_names_the_settings_and_how_much_was_in_use(monkeypatch):
    monkeypatch.setattr(memory, "memory_gib", lambda device: (77.93, 79.19))
    err = memory.out_of_memory_error(torch.OutOfMemoryError(TORCH_MESSAGE), TrainerSpec(gradientCheckpointing=False), CUDA, 2)
    assert isinstance(err, ConfigError)
    assert str(err) == (
        "trainer: cuda out of memory (tried to allocate 4.64 GiB): 77.9 GiB allocated at the peak, of 79.2 GiB at "
        "trainer.microBatchTokens 16384, trainer.gradientCheckpointing false, 2 trainer ranks; set "
        "trainer.gradientCheckpointing: true (a Qwen2.5-1.5B step on one GPU: 92 -> 33 GiB, ~19% slower) or lower trainer.microBatchTokens")


def test_with_checkpointing_on_it_points_at_the_micro_batch_and_more_ranks(monkeypatch):
    monkeypatch.setattr(memory, "memory_gib", lambda device: None)  # the counters could not be read: no figures, still the advice
    spec = TrainerSpec(microBatchTokens=8192, gradientCheckpointing=True)
    err = memory.out_of_memory_error(torch.OutOfMemoryError("CUDA out of memory."), spec, CUDA, 1)
    assert str(err) == ("trainer: cuda out of memory at trainer.microBatchTokens 8192, trainer.gradientCheckpointing true, 1 trainer "
                        "rank; lower trainer.microBatchTokens, or give the trainer more ranks (FSDP shards weights and optimizer state over them)")


def qwen_shaped(params: float, layers: int, hidden: int):
    """A stand-in with what the estimate reads: the HF config's shape and the parameters' sizes."""
    config = SimpleNamespace(num_hidden_layers=layers, hidden_size=hidden, vocab_size=151936)
    return SimpleNamespace(config=config, parameters=lambda: [SimpleNamespace(numel=lambda: int(params))])


QWEN_1_5B, QWEN_0_5B = qwen_shaped(1544e6, 28, 1536), qwen_shaped(494e6, 24, 896)


def test_the_estimate_matches_the_measured_gpu_peaks():
    """docs/design/gpu-trainer-2026-11-28-h200.log: 92.0 and 44.9 GiB at the defaults on one H200."""
    for model, measured in ((QWEN_1_5B, 92.0), (QWEN_0_5B, 44.9)):
        cfg = model.config
        params = sum(p.numel() for p in model.parameters())
        est = memory.step_memory_gib(params, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, 16384, 1)
        assert measured <= est <= measured * 1.05, (measured, est)


@pytest.mark.parametrize(("model", "total_gib", "ranks", "on"), [
    (QWEN_1_5B, 79.19, 1, True),    # an 80 GB card: the 92 GiB default step does not fit
    (QWEN_1_5B, 139.8, 1, False),   # an H200 holds it: no recomputation, ~19% faster
    (QWEN_0_5B, 79.19, 1, False),   # 45 GiB fits an 80 GB card
    (QWEN_1_5B, 79.19, 8, True),    # sharding the states over 8 ranks leaves the activations: still too big
    (QWEN_0_5B, 39.5, 1, True),     # a 40 GB card
])
def test_unset_gradient_checkpointing_is_chosen_from_the_model_and_the_accelerator(monkeypatch, model, total_gib, ranks, on):
    monkeypatch.setattr(memory, "memory_gib", lambda device: (0.0, total_gib))
    chosen, why = memory.choose_gradient_checkpointing(TrainerSpec(), model, CUDA, ranks)
    assert chosen is on, why
    assert why.startswith(f"unset: {'on' if on else 'off'}, a step without it estimated at ") and f"of the {total_gib:.1f} GiB cuda" in why


def test_a_set_gradient_checkpointing_is_kept_and_cpu_chooses_off(monkeypatch):
    monkeypatch.setattr(memory, "memory_gib", lambda device: (0.0, 79.19))
    assert memory.choose_gradient_checkpointing(TrainerSpec(gradientCheckpointing=False), QWEN_1_5B, CUDA, 1) == (False, "set in the manifest")
    assert memory.choose_gradient_checkpointing(TrainerSpec(gradientCheckpointing=True), QWEN_0_5B, CUDA, 1) == (True, "set in the manifest")
    monkeypatch.setattr(memory, "memory_gib", lambda device: None)  # CPU: no accelerator memory to budget
    assert memory.choose_gradient_checkpointing(TrainerSpec(), QWEN_1_5B, torch.device("cpu"), 1) == (False, "unset: off on cpu")


def test_the_out_of_memory_message_says_when_checkpointing_was_chosen(monkeypatch):
    monkeypatch.setattr(memory, "memory_gib", lambda device: None)
    err = memory.out_of_memory_error(torch.OutOfMemoryError("CUDA out of memory."), TrainerSpec(), CUDA, 1, checkpointing=True)
    assert "trainer.gradientCheckpointing true (chosen: the field is unset), 1 trainer rank; lower trainer.microBatchTokens" in str(err)


def test_only_the_accelerator_running_out_of_memory_counts():
    wrapped = RuntimeError("the PPO update failed")
    wrapped.__cause__ = torch.OutOfMemoryError(TORCH_MESSAGE)
    assert memory.is_out_of_memory(wrapped, CUDA)
    npu = SimpleNamespace(type="npu")  # torch.device("npu") needs torch_npu
    assert memory.is_out_of_memory(RuntimeError("NPU out of memory. Tried to allocate 2.00 GiB"), npu)
    assert not memory.is_out_of_memory(RuntimeError("CUDA error: an illegal memory access was encountered"), CUDA)
    assert not memory.is_out_of_memory(ValueError("out of memory"), CUDA)  # not an allocator's error
    assert not memory.is_out_of_memory(torch.OutOfMemoryError(TORCH_MESSAGE), torch.device("cpu"))
    assert memory.out_of_memory_error(KeyError("x"), TrainerSpec(), CUDA, 1) is None


def test_the_trainer_exits_2_with_the_reason_in_the_termination_message_and_progress(tmp_path, monkeypatch):
    from kuberl.api import load_experiment
    from kuberl.runtime.trainer import trainer as trainer_module
    from kuberl.runtime.trainer.dist import DistInfo
    from kuberl.runtime.trainer.trainer import Trainer

    path = tmp_path / "exp.yaml"
    path.write_text("apiVersion: kuberl.io/v1alpha1\nkind: RLExperiment\nmetadata: {name: m}\nspec:\n  model: {builtin: tiny-qwen2}\n"
                    "  dataset: {builtin: repeat-digit}\n  trainer: {microBatchTokens: 4096}\n  training: {totalSteps: 1}\n")
    progress: list[dict] = []

    class Bus:  # rank 0's bus I/O, as far as a failed set-up uses it
        groups_buffered = 0

        async def put_progress(self, doc):
            progress.append(doc)

        async def close(self):
            pass

    async def connect(*args, **kwargs):
        return Bus()

    def setup(self):  # loading the model onto the GPU is where a too-large model runs out
        raise torch.OutOfMemoryError(TORCH_MESSAGE)

    monkeypatch.setattr(trainer_module.D, "init_distributed", lambda: DistInfo(rank=0, world_size=1, local_rank=0, device=CUDA))
    monkeypatch.setattr(trainer_module.TrainerBusIO, "connect", connect)
    monkeypatch.setattr(Trainer, "setup", setup)
    monkeypatch.setattr(memory, "memory_gib", lambda device: (78.0, 79.2))
    log = tmp_path / "termination-log"
    monkeypatch.setenv("KUBERL_TERMINATION_LOG", str(log))
    trainer = Trainer(load_experiment(path), bus_url="nats://127.0.0.1:1", workdir=tmp_path / "work", handle_sigterm=False)
    assert asyncio.run(trainer.run()) == 2
    message = log.read_text()
    assert message.count("\n") == 1
    assert "cuda out of memory (tried to allocate 4.64 GiB): 78.0 GiB allocated at the peak, of 79.2 GiB" in message
    assert "trainer.microBatchTokens 4096, trainer.gradientCheckpointing unset, 1 trainer rank;" in message  # not chosen yet
    assert progress and progress[-1]["failed"].startswith("ConfigError: trainer: cuda out of memory")


@pytest.mark.parametrize(("exc", "device"), [(RuntimeError("boom"), CUDA), (torch.OutOfMemoryError(TORCH_MESSAGE), torch.device("cpu"))])
def test_other_failures_and_cpu_keep_exit_1(tmp_path, monkeypatch, exc, device):
    """A failure that is not the accelerator's memory stays retryable (exit 1); so does anything on CPU."""
    from kuberl.api import load_experiment
    from kuberl.runtime.trainer import trainer as trainer_module
    from kuberl.runtime.trainer.dist import DistInfo
    from kuberl.runtime.trainer.trainer import Trainer

    path = tmp_path / "exp.yaml"
    path.write_text("apiVersion: kuberl.io/v1alpha1\nkind: RLExperiment\nmetadata: {name: m}\nspec:\n  model: {builtin: tiny-qwen2}\n"
                    "  dataset: {builtin: repeat-digit}\n  training: {totalSteps: 1}\n")
    def setup(self):
        raise exc

    monkeypatch.setattr(trainer_module.D, "init_distributed", lambda: DistInfo(rank=1, world_size=2, local_rank=1, device=device))
    monkeypatch.setattr(Trainer, "setup", setup)
    monkeypatch.setenv("KUBERL_TERMINATION_LOG", str(tmp_path / "termination-log"))
    trainer = Trainer(load_experiment(path), bus_url="nats://127.0.0.1:1", workdir=tmp_path / "work", handle_sigterm=False)
    assert asyncio.run(trainer.run()) == 1
