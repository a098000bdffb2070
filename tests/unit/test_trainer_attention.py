"""trainer.attention (runtime/kuberl/runtime/trainer/attention.py): which attention kernel the fsdp trainer loads.

The choice function on every device / flash_attn / dtype case (no GPU here: the device and the import check are played);
a trainer on CPU loads what it was asked for, sdpa and eager train alike, flash_attention_2 asked for on CPU is a
ConfigError before any model is loaded, and packing.varlen_attention sees the choice through a LoRA wrapper."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kuberl.api import RLExperiment
from kuberl.runtime.errors import ConfigError
from kuberl.runtime.trainer import attention as A
from kuberl.runtime.trainer.packing import varlen_attention
from tests.unit.test_packing import two_ragged_groups

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")
NPU = SimpleNamespace(type="npu")  # torch without torch_npu has no npu device type; only .type is read


@pytest.mark.parametrize("requested, device, dtype, flash, want", [
    ("auto", CUDA, "bfloat16", True, "flash_attention_2"),
    ("auto", CUDA, "float16", True, "flash_attention_2"),
    ("auto", CUDA, "bfloat16", False, "sdpa"),  # flash_attn missing or built for another torch
    ("auto", CUDA, "float32", True, "sdpa"),  # flash-attn has no float32 kernel
    ("auto", CPU, "bfloat16", True, "sdpa"),
    ("auto", NPU, "bfloat16", True, "sdpa"),
    ("sdpa", CUDA, "bfloat16", True, "sdpa"),
    ("eager", CUDA, "bfloat16", True, "eager"),
    ("eager", CPU, "float32", False, "eager"),
    ("flash_attention_2", CUDA, "bfloat16", True, "flash_attention_2"),
])
def test_the_choice(monkeypatch, requested, device, dtype, flash, want):
    monkeypatch.setattr(A, "flash_attn_imports", lambda: flash)
    impl, why = A.choose_attention(requested, device, dtype)
    assert impl == want and why


@pytest.mark.parametrize("device, dtype, flash, match", [
    (CPU, "bfloat16", True, "needs a GPU"),
    (CUDA, "bfloat16", False, "flash_attn package does not import"),
    (CUDA, "float32", True, "model.dtype bfloat16 or float16"),
])
def test_flash_attention_asked_for_where_it_cannot_run_is_refused_naming_the_field(monkeypatch, device, dtype, flash, match):
    monkeypatch.setattr(A, "flash_attn_imports", lambda: flash)
    with pytest.raises(ConfigError, match=match) as err:
        A.choose_attention("flash_attention_2", device, dtype)
    assert "trainer.attention" in str(err.value)


def test_context_parallel_takes_sdpa_and_refuses_other_kernels(monkeypatch):
    monkeypatch.setattr(A, "flash_attn_imports", lambda: True)
    assert A.choose_attention("auto", CUDA, "bfloat16", context_parallel=True)[0] == "sdpa"
    assert A.choose_attention("sdpa", CUDA, "bfloat16", context_parallel=True)[0] == "sdpa"
    for other in ("eager", "flash_attention_2"):
        with pytest.raises(ConfigError, match="trainer.attention"):
            A.choose_attention(other, CUDA, "bfloat16", context_parallel=True)


def test_the_import_check_reads_the_real_package(monkeypatch):
    """flash_attn_imports imports: a package that fails at import (a wheel for another CUDA) counts as missing."""
    import sys
    import types

    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    assert A.flash_attn_imports()
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import raises ImportError
    assert not A.flash_attn_imports()


def experiment(model_dir, name: str, attention: str, packing: str = "off") -> RLExperiment:
    return RLExperiment.model_validate({
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": name},
        "spec": {"model": {"path": str(model_dir), "dtype": "float32"}, "dataset": {"builtin": "repeat-digit", "size": 8},
                 "algorithm": {"name": "grpo", "samplesPerPrompt": 3, "batchSize": 2, "learningRate": 3e-3, "ppoMinibatches": 2},
                 "trainer": {"microBatchTokens": 64, "packing": packing, "attention": attention,
                             "accelerator": {"type": "cpu"}}, "training": {"totalSteps": 10}},
    })


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from kuberl.runtime.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


@pytest.mark.parametrize("packing", ["off", "on"])
def test_sdpa_and_eager_load_as_asked_and_train_alike(tmp_path, model_dir, packing, caplog):
    """A CPU trainer loads the kernel it was asked for (config._attn_implementation, what packing reads) and logs it; the
    two kernels give the same pi_prox, loss and updated weights, padded and packed (block-diagonal mask from position_ids)."""
    from kuberl.runtime.trainer import dist as D
    from kuberl.runtime.trainer.batch import build_batch
    from kuberl.runtime.trainer.trainer import Trainer

    results = {}
    try:
        for impl in ("sdpa", "eager"):
            with caplog.at_level("INFO", logger="kuberl.trainer"):
                t = Trainer(experiment(model_dir, f"attn-{impl}", impl, packing), bus_url="nats://unused:4222", workdir=tmp_path / impl,
                            handle_sigterm=False)
                t.setup()
            assert t.model.config._attn_implementation == impl
            assert f"trainer.attention {impl}: {impl}" in caplog.text
            batch = build_batch(two_ragged_groups(), 3)
            t.stage_prox_logp(batch)
            t.stage_advantages(batch)
            stats = t.stage_ppo_update(batch)
            results[impl] = (batch.prox_logp, stats, {n: p.detach().clone() for n, p in t.model.named_parameters()})
            D.shutdown()
    finally:
        D.shutdown()
    (prox_s, st_s, w_s), (prox_e, st_e, w_e) = results["sdpa"], results["eager"]
    assert st_s["tokens"] == st_e["tokens"] > 0
    assert torch.allclose(prox_s, prox_e, atol=1e-5, rtol=0)
    assert st_s["loss"] == pytest.approx(st_e["loss"], abs=1e-5) and st_s["loss"] != 0
    assert all(torch.allclose(w_s[n], w_e[n], atol=1e-4) for n in w_s)


def test_flash_attention_on_a_cpu_trainer_is_a_config_error_before_the_model_loads(tmp_path, model_dir, monkeypatch):
    """Past admission (a manifest that says nvidia, a trainer that finds no GPU): exit 2 naming the field, not sdpa."""
    from transformers import AutoModelForCausalLM

    from kuberl.runtime.trainer import dist as D
    from kuberl.runtime.trainer.trainer import Trainer

    exp = experiment(model_dir, "attn-flash", "auto")
    exp.spec.trainer.attention = "flash_attention_2"  # what the CPU-accelerator rule would refuse at admission
    loads = []
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **kw: loads.append(kw))
    t = Trainer(exp, bus_url="nats://unused:4222", workdir=tmp_path, handle_sigterm=False)
    try:
        with pytest.raises(ConfigError, match="trainer.attention flash_attention_2 needs a GPU"):
            t.setup()
    finally:
        D.shutdown()
    assert loads == []


def test_varlen_packing_sees_flash_attention_through_lora_and_fsdp_wrappers(model_dir):
    """packing.varlen_attention reads model.config._attn_implementation: what from_pretrained(attn_implementation=...)
    sets reaches it through the PEFT wrapper (FSDP2's fully_shard keeps the module and its config)."""
    from transformers import AutoModelForCausalLM

    from kuberl.runtime.trainer.setup_model import wrap_lora

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    lora = type("Lora", (), {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"], "dropout": 0.0})()
    wrapped = wrap_lora(model, lora)
    assert not varlen_attention(wrapped)
    model.config._attn_implementation = "flash_attention_2"  # as from_pretrained sets it where flash_attn runs
    assert varlen_attention(wrapped) and varlen_attention(model)


@pytest.mark.parametrize("trainer, ok", [
    ({"attention": "flash_attention_2"}, True),  # nvidia by default
    ({"attention": "flash_attention_2", "accelerator": {"type": "cpu"}}, False),
    ({"attention": "sdpa", "accelerator": {"type": "cpu"}}, True),
    ({"attention": "sdpa", "backend": "megatron"}, False),
    ({"attention": "auto", "backend": "megatron"}, True),
    ({"attention": "eager", "accelerator": {"type": "cpu", "count": 2}, "parallelism": {"context": 2}}, False),
    ({"attention": "sdpa", "accelerator": {"type": "cpu", "count": 2}, "parallelism": {"context": 2}}, True),
    ({"attention": "unknown"}, False),
])
def test_the_spec_field(trainer, ok):
    doc = {"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "x"},
           "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "add-small"}, "trainer": trainer}}
    if ok:
        assert RLExperiment.model_validate(doc).spec.trainer.attention == trainer["attention"]
    else:
        with pytest.raises(ValueError, match="attention"):
            RLExperiment.model_validate(doc)


def test_megatron_from_the_allocation_shorthand_refuses_an_attention_choice():
    doc = {"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "x"},
           "spec": {"allocation": "vllm:d1+megatron:d2", "model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "add-small"},
                    "trainer": {"attention": "sdpa"}}}
    with pytest.raises(ValueError, match="trainer.backend megatron runs megatron-core's own attention"):
        RLExperiment.model_validate(doc)
