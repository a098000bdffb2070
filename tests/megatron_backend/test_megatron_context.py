"""Context parallel in the Megatron backend: what the trainer refuses (no process group needed).

The numbers (CP=2 against the single-process HF model, and CP with TP, PP and DP on 4 processes) are
test_megatron_tp.py's; end to end, tests/integration/test_megatron_run.py's cp2 run.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from agreement import MISSING
from megatron_models import tiny_config

from kuberl.runtime.errors import ConfigError

pytestmark = pytest.mark.megatron


def spec(context: int, expert: int = 1, tensor: int = 1, pipeline: int = 1):
    return SimpleNamespace(algorithm=SimpleNamespace(lora=None), weight_sync=SimpleNamespace(mode="disk"),
                           trainer=SimpleNamespace(gradient_checkpointing=False,
                                                   parallelism=SimpleNamespace(context=context, expert=expert, tensor=tensor, pipeline=pipeline)),
                           model=SimpleNamespace(id=None, builtin=None, path="/models/m"), seed=0)


def test_context_parallel_with_expert_parallel_is_refused_naming_both_fields():
    if MISSING:
        pytest.fail(MISSING)
    from kuberl.runtime.trainer.megatron.backend import check_megatron_spec

    check_megatron_spec(spec(2))  # context parallel alone: accepted
    with pytest.raises(ConfigError, match=r"^trainer.parallelism.context 2 with expert 2: context parallel of a mixture-of-experts model "):
        check_megatron_spec(spec(2, expert=2))


@pytest.mark.parametrize(("model", "world", "message"), [
    ("qwen3-moe", 2, r"^trainer.parallelism.context 2: context parallel of a mixture-of-experts model \(qwen3_moe, /models/m\) is not "),
    ("qwen2", 4, r"^trainer.parallelism tensor 1 x pipeline 1 x context 3 does not divide the trainer's 4 processes"),
    ("qwen2", 6, r"^trainer.parallelism.expert 4 does not divide the data-parallel size 3 \(6 processes / \(tensor 1 x pipeline 1 x context 2\)\)"),
])
def test_the_trainer_refuses_a_context_layout_it_cannot_build_before_any_process_group(tmp_path, model, world, message):
    """Refused from the spec and the model's config alone (a ConfigError: exit 2), before megatron's groups exist."""
    if MISSING:
        pytest.fail(MISSING)
    from kuberl.runtime.trainer.megatron.backend import MegatronMixin

    tiny_config(model).save_pretrained(tmp_path)
    t = MegatronMixin()
    t.spec = spec(2) if world == 2 else spec(3) if world == 4 else spec(2, expert=4)
    t.info, t.model_dir = SimpleNamespace(world_size=world, device="cpu"), tmp_path
    with pytest.raises(ConfigError, match=message):
        t.setup_megatron_model()
