"""The RLExperiment models: AReaL defaults, the allocation shorthand, and CEL rules that agree with pydantic."""

from __future__ import annotations

import copy

import pydantic
import pytest

from kuberl.api import RLExperiment, RLExperimentSpec
from kuberl.api.algorithm import LORA_NEEDS_VLLM, LORA_TARGET_UNSERVED
from kuberl.api.allocation import parse_allocation
from kuberl.api.evaluation import EVAL_K_TOO_BIG, EVAL_NOTHING, EVAL_ONE_SOURCE
from kuberl.api.infra import BROADCAST_NEEDS_VLLM, BROADCAST_NO_LORA, KEEP_NEEDS_VLLM_FILES
from kuberl.api.pods import CAPABILITY_MESSAGE, EXTENDED_RESOURCE_MESSAGE, HUGEPAGES_MESSAGE, SIDECAR_NAME_MESSAGE
from kuberl.api.roles import ATTENTION_CONTEXT, ATTENTION_FLASH_CPU, ATTENTION_MEGATRON
from kuberl.api.tracking import MLFLOW_TOKEN_NEEDS_SERVER, TRACKING_EMPTY, WANDB_OFFLINE_KEY, WANDB_ONLINE_NEEDS_KEY
from kuberl.api.v1alpha1 import (
    ALLOCATION_CONTEXT_EXPERT,
    ALLOCATION_DIM_TWICE,
    ALLOCATION_DIM_ZERO,
    ALLOCATION_EXPERT_DIVIDE,
    ALLOCATION_EXPERT_NEED_MEGATRON,
    ALLOCATION_EXPERT_TENSOR,
    ALLOCATION_FSDP_ONLY_D,
    ALLOCATION_NODE_SPLIT,
    ALLOCATION_REPLICAS_RANGE,
    ASCEND_IMAGE_MESSAGE,
    CONTEXT_DIVIDE,
    EXPERT_NEED_MEGATRON,
    MEGATRON_ASYNC_CHECKPOINT,
    MEGATRON_CONTEXT_EXPERT,
    MEGATRON_EXPERT_DIVIDE,
    MEGATRON_EXPERT_TENSOR,
    MEGATRON_FULL_WEIGHTS,
    MEGATRON_ON_ASCEND,
    MEGATRON_TP_PP_DIVIDE,
    OVERRIDE_ENV_MESSAGE,
    OVERRIDE_LABEL_MESSAGE,
    OVERRIDE_VOLUME_MESSAGE,
    PPO_UNSUPPORTED,
    TOP_P_UNSUPPORTED,
    TOPOLOGY_NEEDS_QUEUE,
    TOPOLOGY_ONE,
    TPE_NEED_MEGATRON,
    FieldError,
    allocation_disagrees,
)
from kuberl.api.validation import check_cel, crd_schema, iter_rules, prune_and_default
from kuberl.api.workflow import (
    AGENT_NEEDS_ENTRY,
    AGENT_ONE_ENTRY,
    PROMPT_ONE_FORM,
    PROMPT_PLACEHOLDER,
    PROMPT_SYSTEM_CHAT,
    SANDBOX_RUNTIME_CLASS,
)


def make_spec(**overrides) -> dict:
    spec = {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "add-small"}}
    spec.update(copy.deepcopy(overrides))
    return spec


def make_manifest(**overrides) -> dict:
    return {"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "t"}, "spec": make_spec(**overrides)}


def pydantic_messages(doc: dict) -> list[str]:
    try:
        RLExperiment.model_validate(doc)
    except pydantic.ValidationError as exc:
        out = []
        for err in exc.errors():
            cause = (err.get("ctx") or {}).get("error")
            out.append(str(cause) if isinstance(cause, ValueError) else err["msg"])
        return out
    return []


def cel_messages(doc: dict) -> list[str]:
    errors: list = []
    defaulted = prune_and_default(crd_schema(), doc, "", errors)
    assert errors == []
    return [e.message for e in check_cel(crd_schema(), defaulted)]


# ---------------------------------------------------------------------------------------------
# Defaults: AReaL's GSM8K GRPO
# ---------------------------------------------------------------------------------------------


class TestDefaults:
    def test_algorithm_defaults_follow_areal_gsm8k_grpo(self):
        a = RLExperimentSpec.model_validate(make_spec()).algorithm
        assert a.name == "grpo"
        assert a.samples_per_prompt == 4
        assert a.batch_size == 256
        assert a.max_new_tokens == 1024
        # epsClip unset = the algorithm's choice; for grpo that is AReaL's 0.4 (see also the preset tests)
        from kuberl.runtime.algorithms import resolve_algorithm

        assert a.eps_clip is None and resolve_algorithm(a).eps_low == 0.4 == resolve_algorithm(a).eps_high
        assert a.learning_rate == pytest.approx(1.7e-5)
        assert a.optimizer.weight_decay == pytest.approx(0.017)
        assert (a.reward_scaling, a.reward_bias) == (10.0, -0.5)
        assert a.decoupled_loss is True and a.behavior_weight_cap == 5.0
        assert a.kl_coef == 0.0

    def test_staleness_defaults_to_eta_two(self):
        assert RLExperimentSpec.model_validate(make_spec()).staleness.max_head_offpolicyness == 2

    def test_the_bus_is_embedded_unless_external_is_given(self):
        assert RLExperimentSpec.model_validate(make_spec()).bus.embedded is not None
        assert RLExperimentSpec.model_validate(make_spec(bus={"maxPayload": "4Mi"})).bus.embedded is not None
        ext = RLExperimentSpec.model_validate(make_spec(bus={"external": {"url": "nats://n:4222"}})).bus
        assert ext.embedded is None and ext.external.url == "nats://n:4222"

    def test_rollout_accelerators_default_to_the_engine_parallelism(self):
        r = RLExperimentSpec.model_validate(make_spec(rollout={"tensorParallelSize": 2, "pipelineParallelSize": 2})).rollout
        assert r.accelerator.count == 4

    def test_autoscaled_rollout_without_replicas_starts_at_min_replicas(self):
        r = RLExperimentSpec.model_validate(make_spec(rollout={"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 5}})).rollout
        assert r.replicas == 2

    def test_the_api_servers_defaults_load_into_the_same_spec(self):
        # What the operator reads (defaulted by the API server) equals what `kuberl run` reads.
        doc = make_manifest(allocation="sglang:d4+fsdp:d4")
        defaulted = prune_and_default(crd_schema(), doc, "", [])
        assert RLExperiment.model_validate(defaulted).spec == RLExperiment.model_validate(doc).spec


# ---------------------------------------------------------------------------------------------
# The allocation shorthand
# ---------------------------------------------------------------------------------------------


class TestAllocation:
    def test_sglang_d4_fsdp_d4_is_four_engines_and_a_four_gpu_trainer(self):
        s = RLExperimentSpec.model_validate(make_spec(allocation="sglang:d4+fsdp:d4"))
        assert (s.rollout.engine, s.rollout.replicas, s.rollout.tensor_parallel_size, s.rollout.accelerator.count) == ("sglang", 4, 1, 1)
        assert (s.trainer.backend, s.trainer.nodes, s.trainer.accelerator.count) == ("fsdp", 1, 4)
        assert (s.trainer.parallelism.data, s.trainer.parallelism.tensor) == (4, 1)

    def test_megatron_expands_into_the_trainer_layout(self):
        s = RLExperimentSpec.model_validate(make_spec(allocation="vllm:d2t2+megatron:d2p2t2"))
        p = s.trainer.parallelism
        assert (s.trainer.backend, s.trainer.world_size, p.data, p.tensor, p.pipeline) == ("megatron", 8, 2, 2, 2)

    def test_expert_parallel_folds_into_megatrons_data_parallel(self):
        # AReaL's e: not a factor of the world size; the experts are cut over the d data-parallel ranks.
        a = parse_allocation("vllm:d2t2+megatron:d2p2e2")
        assert (a.backend, a.trainer_world_size, a.rollout_accelerators) == ("megatron", 4, 2)
        s = RLExperimentSpec.model_validate(make_spec(allocation="vllm:d2+megatron:d4e2"))
        p = s.trainer.parallelism
        assert (s.trainer.world_size, p.data, p.expert, p.tensor) == (4, 4, 2, 1)

    def test_context_parallel_expands_into_the_fsdp_trainer_layout(self):
        # c is a factor of the world size with fsdp: d2c2 is 4 ranks, 2 data-parallel replicas of 2 context-parallel ranks.
        s = RLExperimentSpec.model_validate(make_spec(allocation="vllm:d1+fsdp:d2c2"))
        p = s.trainer.parallelism
        assert (s.trainer.backend, s.trainer.world_size, p.data, p.context) == ("fsdp", 4, 2, 2)

    def test_megatron_context_with_experts_fsdp_experts_and_e_not_dividing_d_are_refused_naming_the_allocation(self):
        # c > 1 not with e > 1 (megatron does not run a MoE model context parallel), e > 1 only by megatron, and e must divide d.
        for text, message in (("vllm:d2+fsdp:d2e2", ALLOCATION_EXPERT_NEED_MEGATRON), ("vllm:d2+megatron:d2c2e2", ALLOCATION_CONTEXT_EXPERT),
                              ("vllm:d2+megatron:d3e2", ALLOCATION_EXPERT_DIVIDE), ("vllm:d2t2+megatron:d2t2e2", ALLOCATION_EXPERT_TENSOR)):
            with pytest.raises(pydantic.ValidationError) as info:
                RLExperimentSpec.model_validate(make_spec(allocation=text))
            cause = info.value.errors()[0]["ctx"]["error"]
            assert isinstance(cause, FieldError) and cause.path == "spec.allocation" and str(cause) == message

    def test_a_trainer_larger_than_a_node_splits_into_nodes_of_eight(self):
        s = RLExperimentSpec.model_validate(make_spec(allocation="vllm:d4t2+fsdp:d16"))
        assert (s.trainer.nodes, s.trainer.accelerator.count, s.trainer.world_size) == (2, 8, 16)

    def test_an_explicit_node_size_decides_the_split(self):
        s = RLExperimentSpec.model_validate(make_spec(allocation="sglang:d2+fsdp:d8", trainer={"accelerator": {"count": 4}}))
        assert (s.trainer.nodes, s.trainer.accelerator.count) == (2, 4)

    def test_explicit_fields_that_agree_are_accepted(self):
        s = RLExperimentSpec.model_validate(make_spec(allocation="sglang:d4+fsdp:d4", rollout={"replicas": 4, "engine": "sglang"}))
        assert s.rollout.replicas == 4

    def test_an_explicit_replica_count_wins_over_the_shorthand_d(self):
        # kubectl scale / an HPA write spec.rollout.replicas through /scale: d is only the default.
        s = RLExperimentSpec.model_validate(make_spec(allocation="sglang:d4+fsdp:d4", rollout={"replicas": 2}))
        assert (s.rollout.replicas, s.rollout.engine) == (2, "sglang")
        assert RLExperimentSpec.model_validate(make_spec(allocation="sglang:d4+fsdp:d4")).rollout.replicas == 4

    def test_with_autoscaling_the_shorthand_only_sets_the_starting_replicas(self):
        # The autoscaler and `kubectl scale` write spec.rollout.replicas; that must not contradict d4.
        auto = {"enabled": True, "minReplicas": 1, "maxReplicas": 8}
        assert RLExperimentSpec.model_validate(make_spec(allocation="sglang:d4+fsdp:d4", rollout={"autoscaling": auto})).rollout.replicas == 4
        scaled = RLExperimentSpec.model_validate(make_spec(allocation="sglang:d4+fsdp:d4", rollout={"autoscaling": auto, "replicas": 6}))
        assert scaled.rollout.replicas == 6
        with pytest.raises(pydantic.ValidationError, match="must lie within"):
            RLExperimentSpec.model_validate(make_spec(allocation="sglang:d4+fsdp:d4", rollout={"autoscaling": auto, "replicas": 9}))

    @pytest.mark.parametrize("overrides, path, ours, theirs", [
        ({"rollout": {"engine": "vllm"}}, "rollout.engine", "sglang", "vllm"),
        ({"rollout": {"tensorParallelSize": 2}}, "rollout.tensorParallelSize", "1", "2"),
        ({"trainer": {"backend": "megatron"}}, "trainer.backend", "fsdp", "megatron"),  # refused for the contradiction first
        ({"trainer": {"nodes": 2}}, "trainer.nodes", "1", "2"),
        ({"trainer": {"parallelism": {"data": 2}}}, "trainer.parallelism.data", "4", "2"),
    ])
    def test_contradictions_are_rejected_naming_the_field_and_its_value(self, overrides, path, ours, theirs):
        with pytest.raises(pydantic.ValidationError) as info:
            RLExperimentSpec.model_validate(make_spec(allocation="sglang:d4+fsdp:d4", **overrides))
        cause = info.value.errors()[0]["ctx"]["error"]
        assert isinstance(cause, FieldError) and cause.path == f"spec.{path}"
        assert str(cause) == allocation_disagrees(path) and str(cause.value) == theirs  # the CRD's CEL rule says the same words

    @pytest.mark.parametrize("text, fragment", [
        ("sglang:d4", "is not of the form"),
        ("tgi:d4+fsdp:d4", "is not of the form"),
        ("sglang:d4+fsdp:d4p2", "fsdp takes only d"),
        ("vllm:d2x2+fsdp:d4", "'x' is not allowed"),
        ("vllm:d2t+fsdp:d4", "is not a list of dimensions"),
        ("vllm:d0+fsdp:d4", "must be at least 1"),
        ("vllm:t2t2+fsdp:d4", "appears twice"),
        ("vllm:d2c2+fsdp:d4", "'c' is not allowed"),
    ])
    def test_malformed_shorthand_says_what_is_wrong(self, text, fragment):
        with pytest.raises(ValueError, match=fragment):
            parse_allocation(text)

    def test_dims_left_out_are_one(self):
        a = parse_allocation("vllm:t2+megatron:p2")
        assert a.rollout == {"d": 1, "t": 2, "p": 1} and a.trainer_world_size == 2


# ---------------------------------------------------------------------------------------------
# CEL (admission) and pydantic (kuberl run, the operator) must agree
# ---------------------------------------------------------------------------------------------

MODEL_ONE = "set exactly one of model.id, model.path or model.builtin"
DATASET_ONE = "set exactly one of dataset.id, dataset.path or dataset.builtin"
AGREEMENT_CASES = [
    ("topology required and unconstrained", {"trainer": {"topologyRequest": {"required": "block", "unconstrained": True}}}, TOPOLOGY_ONE),
    ("topology unconstrained false alone", {"trainer": {"topologyRequest": {"unconstrained": False}}}, TOPOLOGY_ONE),
    ("topology request empty", {"trainer": {"topologyRequest": {}}}, TOPOLOGY_ONE),
    ("prompt instruction and system", {"dataset": {"builtin": "repeat-digit", "prompt": {"instruction": "Box it.", "system": "Be brief."}}}, None),
    ("prompt instruction and template", {"dataset": {"builtin": "repeat-digit", "prompt": {"instruction": "a", "template": "{prompt} b"}}},
     PROMPT_ONE_FORM),
    ("prompt template without its placeholder", {"dataset": {"builtin": "repeat-digit", "prompt": {"template": "Solve it."}}}, PROMPT_PLACEHOLDER),
    ("prompt system without the chat template", {"dataset": {"builtin": "repeat-digit", "prompt": {"system": "s"}},
                                                 "workflow": {"useChatTemplate": False}}, PROMPT_SYSTEM_CHAT),
    ("flash attention on a cpu trainer", {"trainer": {"attention": "flash_attention_2", "accelerator": {"type": "cpu", "count": 1}}},
     ATTENTION_FLASH_CPU),
    ("eager attention with megatron", {"trainer": {"backend": "megatron", "attention": "eager"}}, ATTENTION_MEGATRON),
    ("eager attention with context parallel", {"trainer": {"attention": "eager", "accelerator": {"type": "cpu", "count": 2},
                                                           "parallelism": {"context": 2}}}, ATTENTION_CONTEXT),
    ("eager attention with a megatron allocation", {"allocation": "vllm:d1+megatron:d1", "trainer": {"attention": "eager"}}, ATTENTION_MEGATRON),
    ("eager attention with context parallel from the allocation", {"allocation": "vllm:d1+fsdp:d1c2", "trainer": {"attention": "eager"}},
     ATTENTION_CONTEXT),
    ("sdpa attention with context parallel", {"trainer": {"attention": "sdpa", "accelerator": {"type": "cpu", "count": 2},
                                                          "parallelism": {"context": 2}}}, None),
    ("model from the hub", {"model": {"id": "Qwen/Qwen2.5-0.5B"}}, None),
    ("model with two sources", {"model": {"id": "x", "builtin": "tiny-qwen2"}}, MODEL_ONE),
    ("model with no source", {"model": {"dtype": "float32"}}, MODEL_ONE),
    ("model volume and path", {"model": {"path": "m", "volume": {"claimName": "c"}}}, None),
    ("model volume without path", {"model": {"id": "x", "volume": {"claimName": "c"}}}, "model.volume needs model.path (the folder inside the claim)"),
    ("dataset with two sources", {"dataset": {"id": "a", "path": "b"}}, DATASET_ONE),
    ("dataset volume without path", {"dataset": {"id": "a", "volume": {"claimName": "c"}}}, "dataset.volume needs dataset.path"),
    ("multi-turn with turns", {"workflow": {"type": "multi-turn", "maxTurns": 3}}, None),
    ("rlvr with turns", {"workflow": {"type": "rlvr", "maxTurns": 3}}, "workflow.maxTurns > 1 needs workflow.type multi-turn"),
    ("clip-higher above clip", {"algorithm": {"epsClip": 0.2, "epsClipHigh": 0.28}}, None),
    ("clip-higher equal to clip", {"algorithm": {"epsClip": 0.2, "epsClipHigh": 0.2}}, None),
    ("clip-higher below clip", {"algorithm": {"epsClip": 0.3, "epsClipHigh": 0.2}}, "algorithm.epsClipHigh must be >= algorithm.epsClip"),
    ("grpo with one sample", {"algorithm": {"name": "grpo", "samplesPerPrompt": 1}}, "group-relative algorithms need algorithm.samplesPerPrompt >= 2"),
    ("rloo with one sample", {"algorithm": {"name": "rloo", "samplesPerPrompt": 1}}, "group-relative algorithms need algorithm.samplesPerPrompt >= 2"),
    ("ppo with a critic", {"algorithm": {"name": "ppo"}}, PPO_UNSUPPORTED),
    ("liteppo, critic-free", {"algorithm": {"name": "liteppo"}}, None),
    ("nucleus sampling", {"algorithm": {"topP": 0.8}}, TOP_P_UNSUPPORTED),
    ("lora on vllm", {"algorithm": {"lora": {"rank": 8, "alpha": 16}}}, None),
    ("lora on sglang", {"algorithm": {"lora": {"rank": 8, "alpha": 16}}, "rollout": {"engine": "sglang"}}, LORA_NEEDS_VLLM),
    ("broadcast on vllm", {"weightSync": {"mode": "broadcast"}}, None),
    ("broadcast on sglang", {"weightSync": {"mode": "broadcast"}, "rollout": {"engine": "sglang"}}, BROADCAST_NEEDS_VLLM),
    ("broadcast with lora", {"weightSync": {"mode": "broadcast"}, "algorithm": {"lora": {"rank": 8, "alpha": 16}}}, BROADCAST_NO_LORA),
    ("in-flight keep on vllm", {"weightSync": {"inFlight": "keep", "mode": "bus"}}, None),
    ("in-flight keep on sglang", {"weightSync": {"inFlight": "keep"}, "rollout": {"engine": "sglang"}}, KEEP_NEEDS_VLLM_FILES),
    ("in-flight keep on an sglang allocation", {"weightSync": {"inFlight": "keep"}, "allocation": "sglang:d1+fsdp:d1"}, KEEP_NEEDS_VLLM_FILES),
    ("in-flight keep with broadcast", {"weightSync": {"inFlight": "keep", "mode": "broadcast"}}, KEEP_NEEDS_VLLM_FILES),
    ("in-flight keep with lora", {"weightSync": {"inFlight": "keep"}, "algorithm": {"lora": {"rank": 8, "alpha": 16}}}, KEEP_NEEDS_VLLM_FILES),
    ("in-flight abort with lora", {"weightSync": {"inFlight": "abort"}, "algorithm": {"lora": {"rank": 8, "alpha": 16}}}, None),
    ("lora on the lm_head", {"algorithm": {"lora": {"rank": 8, "alpha": 16, "targetModules": ["q_proj", "lm_head"]}}}, LORA_TARGET_UNSERVED),
    ("lora on the embeddings", {"algorithm": {"lora": {"rank": 8, "alpha": 16, "targetModules": ["model.embed_tokens"]}}}, LORA_TARGET_UNSERVED),
    ("topP 1", {"algorithm": {"topP": 1.0}}, None),
    ("reinforce++ with one sample", {"algorithm": {"name": "reinforce++", "samplesPerPrompt": 1}}, None),
    ("autoscaling min above max", {"rollout": {"autoscaling": {"minReplicas": 4, "maxReplicas": 2}}}, "rollout.autoscaling.minReplicas must be <= maxReplicas"),
    ("replicas within autoscaling", {"rollout": {"replicas": 3, "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4}}}, None),
    ("replicas outside autoscaling", {"rollout": {"replicas": 6, "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4}}},
     "rollout.replicas must lie within rollout.autoscaling.minReplicas..maxReplicas"),
    ("replicas unset with autoscaling", {"rollout": {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 4}}}, None),
    ("replicas outside a disabled autoscaling", {"rollout": {"replicas": 6, "autoscaling": {"maxReplicas": 4}}}, None),
    ("tensor parallel on too few GPUs", {"rollout": {"tensorParallelSize": 2, "accelerator": {"count": 1}}},
     "rollout.accelerator.count must equal tensorParallelSize * pipelineParallelSize"),
    ("tensor parallel with matching GPUs", {"rollout": {"tensorParallelSize": 2, "accelerator": {"count": 2}}}, None),
    ("tensor parallel with GPUs left to default", {"rollout": {"tensorParallelSize": 2}}, None),
    ("cpu rollout ignores the GPU count", {"rollout": {"accelerator": {"type": "cpu", "count": 0}}}, None),
    ("data parallel that fills the nodes", {"trainer": {"nodes": 2, "accelerator": {"count": 4}, "parallelism": {"data": 8}}}, None),
    ("data parallel that does not", {"trainer": {"nodes": 2, "accelerator": {"count": 4}, "parallelism": {"data": 4}}},
     "trainer.parallelism data*tensor*pipeline*context must equal nodes * accelerator.count"),
    ("cpu trainer process counts", {"trainer": {"accelerator": {"type": "cpu", "count": 0}, "parallelism": {"data": 1}}}, None),
    ("megatron tensor parallel", {"trainer": {"backend": "megatron", "accelerator": {"count": 2}, "parallelism": {"tensor": 2}}}, None),
    ("megatron tensor x pipeline x data", {"trainer": {"backend": "megatron", "nodes": 2, "accelerator": {"count": 4},
                                                      "parallelism": {"tensor": 2, "pipeline": 2, "data": 2}}}, None),
    ("megatron backend", {"trainer": {"backend": "megatron"}}, None),
    ("megatron with gradient checkpointing (recomputation)", {"trainer": {"backend": "megatron", "gradientCheckpointing": True}}, None),
    ("megatron tensor x pipeline not dividing the processes", {"trainer": {"backend": "megatron", "accelerator": {"count": 4},
                                                                           "parallelism": {"tensor": 3}}}, MEGATRON_TP_PP_DIVIDE),
    ("megatron expert parallel", {"trainer": {"backend": "megatron", "accelerator": {"count": 2}, "parallelism": {"expert": 2}}}, None),
    ("megatron expert x pipeline x data", {"trainer": {"backend": "megatron", "nodes": 2, "accelerator": {"count": 4},
                                                      "parallelism": {"pipeline": 2, "expert": 4}}}, None),
    ("megatron expert not dividing the data parallel size", {"trainer": {"backend": "megatron", "accelerator": {"count": 4},
                                                                         "parallelism": {"pipeline": 2, "expert": 4}}}, MEGATRON_EXPERT_DIVIDE),
    ("megatron expert with tensor parallel", {"trainer": {"backend": "megatron", "accelerator": {"count": 4},
                                                          "parallelism": {"tensor": 2, "expert": 2}}}, MEGATRON_EXPERT_TENSOR),
    ("megatron expert 1 with tensor parallel", {"trainer": {"backend": "megatron", "accelerator": {"count": 4},
                                                            "parallelism": {"tensor": 2, "expert": 1}}}, None),
    ("megatron expert on one process", {"trainer": {"backend": "megatron", "parallelism": {"expert": 2}}}, MEGATRON_EXPERT_DIVIDE),
    ("megatron expert with a tensor size not dividing", {"trainer": {"backend": "megatron", "accelerator": {"count": 4},
                                                                     "parallelism": {"tensor": 3, "expert": 2}}}, MEGATRON_TP_PP_DIVIDE),
    ("fsdp expert parallel", {"trainer": {"accelerator": {"count": 2}, "parallelism": {"expert": 2}}}, EXPERT_NEED_MEGATRON),
    ("megatron with lora", {"trainer": {"backend": "megatron"}, "algorithm": {"lora": {"rank": 8, "alpha": 16}}}, MEGATRON_FULL_WEIGHTS),
    ("megatron with broadcast weights", {"trainer": {"backend": "megatron"}, "weightSync": {"mode": "broadcast"}}, MEGATRON_FULL_WEIGHTS),
    ("megatron on ascend", {"trainer": {"backend": "megatron", "accelerator": {"type": "ascend", "count": 2}}}, MEGATRON_ON_ASCEND),
    ("allocation megatron on ascend", {"allocation": "vllm:d2+megatron:d2t2", "trainer": {"accelerator": {"type": "ascend"}}}, MEGATRON_ON_ASCEND),
    ("fsdp on ascend", {"trainer": {"accelerator": {"type": "ascend", "count": 2}}}, None),
    ("megatron with asyncSave on", {"trainer": {"backend": "megatron"}, "checkpoint": {"asyncSave": "on"}}, MEGATRON_ASYNC_CHECKPOINT),
    ("allocation megatron with asyncSave on", {"allocation": "vllm:d2+megatron:d2t2", "checkpoint": {"asyncSave": "on"}}, MEGATRON_ASYNC_CHECKPOINT),
    ("megatron with asyncSave auto", {"trainer": {"backend": "megatron"}, "checkpoint": {"asyncSave": "auto"}}, None),
    ("fsdp with asyncSave on", {"checkpoint": {"asyncSave": "on"}}, None),
    ("allocation megatron with lora", {"allocation": "vllm:d2+megatron:d2t2", "algorithm": {"lora": {"rank": 8, "alpha": 16}}}, MEGATRON_FULL_WEIGHTS),
    ("fsdp tensor parallel", {"trainer": {"backend": "fsdp", "parallelism": {"tensor": 2}}}, TPE_NEED_MEGATRON),
    ("default backend with pipeline parallel", {"trainer": {"parallelism": {"pipeline": 2}}}, TPE_NEED_MEGATRON),
    ("context parallel", {"trainer": {"accelerator": {"count": 2}, "parallelism": {"context": 2}}}, None),
    ("context x data parallel", {"trainer": {"nodes": 2, "accelerator": {"count": 2}, "parallelism": {"data": 2, "context": 2}}}, None),
    ("context parallel with megatron", {"trainer": {"backend": "megatron", "accelerator": {"count": 2}, "parallelism": {"context": 2}}}, None),
    ("megatron context x tensor x pipeline x data", {"trainer": {"backend": "megatron", "nodes": 2, "accelerator": {"count": 8},
                                                                "parallelism": {"tensor": 2, "pipeline": 2, "context": 2, "data": 2}}}, None),
    ("megatron context with expert parallel", {"trainer": {"backend": "megatron", "accelerator": {"count": 4},
                                                           "parallelism": {"context": 2, "expert": 2}}}, MEGATRON_CONTEXT_EXPERT),
    ("megatron tensor x context not dividing the processes", {"trainer": {"backend": "megatron", "accelerator": {"count": 6},
                                                                          "parallelism": {"tensor": 2, "context": 2}}}, MEGATRON_TP_PP_DIVIDE),
    ("megatron context on one process", {"trainer": {"backend": "megatron", "parallelism": {"context": 2}}}, MEGATRON_TP_PP_DIVIDE),
    ("context not dividing the processes", {"trainer": {"accelerator": {"count": 3}, "parallelism": {"context": 2}}}, CONTEXT_DIVIDE),
    ("context on one process", {"trainer": {"parallelism": {"context": 2}}}, CONTEXT_DIVIDE),
    ("context x data not filling the processes", {"trainer": {"accelerator": {"count": 6}, "parallelism": {"data": 2, "context": 2}}},
     "trainer.parallelism data*tensor*pipeline*context must equal nodes * accelerator.count"),
    ("context 1", {"trainer": {"parallelism": {"context": 1}}}, None),
    ("allocation with megatron", {"allocation": "vllm:d2+megatron:d2t2"}, None),
    ("allocation with expert parallel", {"allocation": "vllm:d2t2+megatron:d2p2e2"}, None),
    ("allocation with expert and tensor parallel", {"allocation": "vllm:d2+megatron:d2t2e2"}, ALLOCATION_EXPERT_TENSOR),
    ("allocation with rollout tensor parallel and experts", {"allocation": "vllm:d1t2+megatron:d2e2"}, None),
    ("allocation fsdp with expert parallel", {"allocation": "vllm:d2+fsdp:d2e2"}, ALLOCATION_EXPERT_NEED_MEGATRON),
    ("allocation fsdp with e10", {"allocation": "vllm:d1+fsdp:d40e10"}, ALLOCATION_EXPERT_NEED_MEGATRON),
    ("allocation with e1", {"allocation": "vllm:d2+megatron:d2t2e1"}, None),
    ("allocation with context parallel", {"allocation": "vllm:d2+fsdp:d2c2"}, None),
    ("allocation with context 8", {"allocation": "vllm:d1+fsdp:d1c8"}, None),
    ("allocation megatron with context parallel", {"allocation": "vllm:d2+megatron:d2c2"}, None),
    ("allocation megatron with context 12 and tensor 2", {"allocation": "vllm:d1+megatron:d1t2c12"}, None),
    ("allocation megatron with context and expert parallel", {"allocation": "vllm:d2+megatron:d2c2e2"}, ALLOCATION_CONTEXT_EXPERT),
    ("allocation megatron with c12 and e10", {"allocation": "vllm:d1+megatron:d10c12e10"}, ALLOCATION_CONTEXT_EXPERT),
    ("allocation with c1 and d16", {"allocation": "vllm:d1+fsdp:d16c1"}, None),
    ("allocation with c01", {"allocation": "vllm:d1+fsdp:d2c01"}, None),
    # the shorthand read at admission (issue #36): every field it fills must agree with it
    ("allocation engine agrees", {"allocation": "sglang:d4+fsdp:d4", "rollout": {"engine": "sglang"}}, None),
    ("allocation engine disagrees", {"allocation": "sglang:d4+fsdp:d4", "rollout": {"engine": "vllm"}}, allocation_disagrees("rollout.engine")),
    ("allocation backend agrees", {"allocation": "vllm:d2+megatron:d2t2", "trainer": {"backend": "megatron"}}, None),
    ("allocation backend disagrees", {"allocation": "sglang:d4+fsdp:d4", "trainer": {"backend": "megatron"}}, allocation_disagrees("trainer.backend")),
    ("allocation rollout tensor agrees", {"allocation": "vllm:d2t2+fsdp:d4", "rollout": {"tensorParallelSize": 2}}, None),
    ("allocation rollout tensor disagrees", {"allocation": "vllm:d2t2+fsdp:d4", "rollout": {"tensorParallelSize": 4}},
     allocation_disagrees("rollout.tensorParallelSize")),
    ("allocation rollout pipeline disagrees", {"allocation": "vllm:d2p12+fsdp:d4", "rollout": {"pipelineParallelSize": 1}},
     allocation_disagrees("rollout.pipelineParallelSize")),
    ("allocation rollout accelerators agree", {"allocation": "vllm:d2t2p2+fsdp:d4", "rollout": {"accelerator": {"count": 4}}}, None),
    ("allocation rollout accelerators disagree", {"allocation": "vllm:d2t2+fsdp:d4", "rollout": {"accelerator": {"count": 4}}},
     allocation_disagrees("rollout.accelerator.count")),
    ("allocation trainer data agrees", {"allocation": "vllm:d1+megatron:t2d4", "trainer": {"parallelism": {"data": 4, "tensor": 2}}}, None),
    ("allocation trainer data disagrees", {"allocation": "vllm:d1+fsdp:d04", "trainer": {"parallelism": {"data": 2}}},
     allocation_disagrees("trainer.parallelism.data")),
    ("allocation trainer tensor disagrees", {"allocation": "vllm:d1+megatron:d2t2", "trainer": {"parallelism": {"tensor": 1}}},
     allocation_disagrees("trainer.parallelism.tensor")),
    ("allocation trainer pipeline disagrees", {"allocation": "vllm:d1+megatron:d2p2", "trainer": {"parallelism": {"pipeline": 4}}},
     allocation_disagrees("trainer.parallelism.pipeline")),
    ("allocation trainer context disagrees", {"allocation": "vllm:d1+fsdp:d2c2", "trainer": {"parallelism": {"context": 1}}},
     allocation_disagrees("trainer.parallelism.context")),
    ("allocation trainer expert disagrees", {"allocation": "vllm:d1+megatron:d4e2", "trainer": {"parallelism": {"expert": 4}}},
     allocation_disagrees("trainer.parallelism.expert")),
    ("allocation trainer of 16 in two nodes", {"allocation": "vllm:d1+fsdp:d16", "trainer": {"nodes": 2}}, None),
    ("allocation trainer of 16 in four nodes of 4", {"allocation": "vllm:d1+fsdp:d16", "trainer": {"nodes": 4, "accelerator": {"count": 4}}}, None),
    ("allocation trainer of 4 in two nodes", {"allocation": "vllm:d1+fsdp:d4", "trainer": {"nodes": 2}}, allocation_disagrees("trainer.nodes")),
    ("allocation trainer of 16 in three nodes of 4", {"allocation": "vllm:d1+fsdp:d16", "trainer": {"nodes": 3, "accelerator": {"count": 4}}},
     allocation_disagrees("trainer.nodes")),
    ("allocation trainer of 12, nodes of 8", {"allocation": "vllm:d1+fsdp:d12"}, ALLOCATION_NODE_SPLIT),
    ("allocation trainer of 8, nodes of 3", {"allocation": "vllm:d1+megatron:d4t2", "trainer": {"accelerator": {"count": 3}}}, ALLOCATION_NODE_SPLIT),
    ("allocation trainer, nodes of 0", {"allocation": "vllm:d1+fsdp:d4", "trainer": {"accelerator": {"count": 0}}}, ALLOCATION_NODE_SPLIT),
    ("allocation rollout d twice", {"allocation": "vllm:d2d2+fsdp:d4"}, ALLOCATION_DIM_TWICE),
    ("allocation trainer e twice", {"allocation": "vllm:d2+megatron:e2d4e2"}, ALLOCATION_DIM_TWICE),
    ("allocation rollout d and trainer d", {"allocation": "vllm:t2d2+fsdp:d2"}, None),
    ("allocation d0", {"allocation": "vllm:d0+fsdp:d1"}, ALLOCATION_DIM_ZERO),
    ("allocation e00", {"allocation": "vllm:d1+megatron:d2e00"}, ALLOCATION_DIM_ZERO),
    ("allocation d10 is not d0", {"allocation": "vllm:d10+fsdp:d1"}, None),
    ("allocation fsdp with t", {"allocation": "vllm:d2+fsdp:d2t2"}, ALLOCATION_FSDP_ONLY_D),
    ("allocation fsdp with p", {"allocation": "vllm:d2+fsdp:p2d2"}, ALLOCATION_FSDP_ONLY_D),
    ("allocation fsdp with t1", {"allocation": "vllm:d2t2+fsdp:d2t1"}, None),
    ("allocation e not dividing d", {"allocation": "vllm:d2+megatron:d3e2"}, ALLOCATION_EXPERT_DIVIDE),
    ("allocation replicas within autoscaling", {"allocation": "sglang:d2+fsdp:d4", "rollout": {"autoscaling": {"enabled": True, "maxReplicas": 2}}},
     None),
    ("allocation replicas above autoscaling", {"allocation": "sglang:d4+fsdp:d4", "rollout": {"autoscaling": {"enabled": True, "maxReplicas": 2}}},
     ALLOCATION_REPLICAS_RANGE),
    ("allocation replicas below autoscaling",
     {"allocation": "sglang:d1+fsdp:d4", "rollout": {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 4}}}, ALLOCATION_REPLICAS_RANGE),
    ("both buses", {"bus": {"embedded": {}, "external": {"url": "nats://n:4222"}}}, "set bus.embedded or bus.external, not both"),
    ("external bus", {"bus": {"external": {"url": "nats://n:4222"}}}, None),
    ("external bus, minted users", {"bus": {"external": {"url": "nats://n:4222", "accountSigningKeySecret": {"name": "nats-sk", "key": "seed"},
                                                         "account": "A" + "B" * 55}}}, None),
    ("external bus, token and minted users", {"bus": {"external": {"url": "nats://n:4222", "credentialsSecret": {"name": "t"},
                                                                   "accountSigningKeySecret": {"name": "nats-sk"}}}},
     "set bus.external.credentialsSecret (one token for every role) or bus.external.accountSigningKeySecret (a user per role), not both"),
    ("external bus, account without its key", {"bus": {"external": {"url": "nats://n:4222", "account": "A" + "B" * 55}}},
     "bus.external.account names the account of bus.external.accountSigningKeySecret: set that too"),
    ("existing claim with a class", {"checkpoint": {"existingClaim": "c", "storageClassName": "s"}},
     "checkpoint.storageClassName has no effect with checkpoint.existingClaim"),
    ("no training length", {"training": {}}, "set training.totalSteps or training.epochs"),
    ("steps only", {"training": {"totalSteps": 10}}, None),
    ("custom workflow without a class", {"workflow": {"type": "custom"}}, "workflow.type custom needs workflow.class (package.module:Class)"),
    ("a class without the custom workflow", {"workflow": {"class": "my.wf:W"}}, "workflow.class needs workflow.type custom"),
    ("custom workflow with its class", {"workflow": {"type": "custom", "class": "my.wf:W"}}, None),
    ("agent workflow without an agent", {"workflow": {"type": "agent"}}, AGENT_NEEDS_ENTRY),
    ("agent workflow with external agents", {"workflow": {"type": "agent", "external": {"namespaces": ["agents"]}}}, None),
    ("agent workflow with both an agent and external agents", {"workflow": {"type": "agent", "agent": "my.agent:run", "external": {}}},
     AGENT_ONE_ENTRY),
    ("external agents without the agent workflow", {"workflow": {"type": "rlvr", "external": {}}}, "workflow.external needs workflow.type agent"),
    ("an agent without the agent workflow", {"workflow": {"type": "rlvr", "agent": "my.agent:run"}}, "workflow.agent needs workflow.type agent"),
    ("agent workflow with concat samples", {"workflow": {"type": "agent", "agent": "my.agent:run", "exportStyle": "concat"}}, None),
    ("agent workflow with individual samples", {"workflow": {"type": "agent", "agent": "my.agent:run", "exportStyle": "individual"}}, None),
    ("an export style without the agent workflow", {"workflow": {"type": "rlvr", "exportStyle": "individual"}},
     "workflow.exportStyle needs workflow.type agent"),
    ("a sandbox in pods of its own", {"workflow": {"sandbox": {"placement": "pod", "replicas": 2}}}, None),
    ("a sandbox pod under gVisor", {"workflow": {"sandbox": {"placement": "pod", "runtimeClassName": "gvisor"}}}, None),
    ("a runtime class for the sandbox process", {"workflow": {"sandbox": {"runtimeClassName": "gvisor"}}}, SANDBOX_RUNTIME_CLASS),
    ("a runtime class with placement process", {"workflow": {"sandbox": {"placement": "process", "runtimeClassName": "gvisor"}}},
     SANDBOX_RUNTIME_CLASS),
    ("ascend rollout without an image", {"rollout": {"accelerator": {"type": "ascend"}}}, ASCEND_IMAGE_MESSAGE),
    ("ascend rollout with an image", {"rollout": {"image": "r/vllm-ascend:1", "accelerator": {"type": "ascend"}}}, None),
    ("pod template overrides", {"trainer": {"podTemplate": {"labels": {"team": "a"}, "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
                                                            "volumes": [{"name": "nvme", "emptyDir": {}}]}}}, None),
    ("pod template with a reserved label", {"rollout": {"podTemplate": {"labels": {"kuberl.io/role": "x"}}}}, OVERRIDE_LABEL_MESSAGE),
    ("pod template with a reserved env", {"trainer": {"podTemplate": {"env": [{"name": "KUBERL_BUS_URL", "value": "x"}]}}}, OVERRIDE_ENV_MESSAGE),
    ("pod template with a reserved volume", {"trainer": {"podTemplate": {"volumes": [{"name": "config", "emptyDir": {}}]}}}, OVERRIDE_VOLUME_MESSAGE),
    ("fabric: EFA on the trainer", {"trainer": {"resources": {"requests": {"memory": "32Gi"}}, "podTemplate": {
        "capabilities": ["IPC_LOCK"], "extendedResources": {"vpc.amazonaws.com/efa": 32, "hugepages-2Mi": "5120Mi"}, "shmSizeLimit": "64Gi"}}}, None),
    ("fabric: a TCPXO daemon sidecar", {"trainer": {"podTemplate": {"sidecars": [
        {"name": "tcpxo-daemon", "image": "us-docker.pkg.dev/x/tcpgpudmarxd:v1", "capabilities": ["NET_ADMIN", "NET_BIND_SERVICE"], "runAsUser": 0}]}}}, None),
    ("fabric: SYS_ADMIN on the main container", {"trainer": {"podTemplate": {"capabilities": ["SYS_ADMIN"]}}}, CAPABILITY_MESSAGE),
    ("fabric: CAP_ prefix", {"rollout": {"podTemplate": {"capabilities": ["CAP_IPC_LOCK"]}}}, CAPABILITY_MESSAGE),
    ("fabric: SYS_ADMIN on a sidecar", {"trainer": {"podTemplate": {"sidecars": [{"name": "d", "image": "i", "capabilities": ["SYS_ADMIN"]}]}}},
     CAPABILITY_MESSAGE),
    ("fabric: a sidecar named trainer", {"trainer": {"podTemplate": {"sidecars": [{"name": "trainer", "image": "i"}]}}}, SIDECAR_NAME_MESSAGE),
    ("fabric: two sidecars of one name", {"rollout": {"podTemplate": {"sidecars": [{"name": "d", "image": "i"}, {"name": "d", "image": "j"}]}}},
     SIDECAR_NAME_MESSAGE),
    ("fabric: memory as an extended resource", {"trainer": {"podTemplate": {"extendedResources": {"memory": "1Gi"}}}}, EXTENDED_RESOURCE_MESSAGE),
    ("fabric: GPUs as an extended resource", {"trainer": {"podTemplate": {"extendedResources": {"nvidia.com/gpu": 8}}}}, EXTENDED_RESOURCE_MESSAGE),
    ("fabric: hugepages without memory", {"rollout": {"podTemplate": {"extendedResources": {"hugepages-2Mi": "1Gi"}}}}, HUGEPAGES_MESSAGE),
    # spec.tracking (kuberl/api/tracking.py)
    ("tracking with every tracker", {"tracking": {"tensorboard": {}, "wandb": {"project": "p", "apiKeySecret": {"name": "wandb"}},
                                                  "mlflow": {"trackingUri": "https://mlflow.example:5000", "tokenSecret": {"name": "ml"}}}}, None),
    ("tracking with no tracker", {"tracking": {}}, TRACKING_EMPTY),
    ("wandb online without a key", {"tracking": {"wandb": {"project": "p"}}}, WANDB_ONLINE_NEEDS_KEY),
    ("wandb offline", {"tracking": {"wandb": {"project": "p", "mode": "offline"}}}, None),
    ("wandb offline with a key", {"tracking": {"wandb": {"project": "p", "mode": "offline", "apiKeySecret": {"name": "w"}}}}, WANDB_OFFLINE_KEY),
    ("wandb offline with a host", {"tracking": {"wandb": {"project": "p", "mode": "offline", "host": "https://wandb.example"}}}, WANDB_OFFLINE_KEY),
    ("mlflow file store", {"tracking": {"mlflow": {}}}, None),
    ("mlflow token with a file store", {"tracking": {"mlflow": {"trackingUri": "file:///data/mlruns", "tokenSecret": {"name": "m"}}}},
     MLFLOW_TOKEN_NEEDS_SERVER),
    ("mlflow token without a server", {"tracking": {"mlflow": {"tokenSecret": {"name": "m"}}}}, MLFLOW_TOKEN_NEEDS_SERVER),
    # spec.evaluation (kuberl/api/evaluation.py)
    ("evaluation on a split", {"evaluation": {"split": "test", "everySteps": 5, "samplesPerPrompt": 8, "passAtK": [1, 8]}}, None),
    ("evaluation greedy only", {"evaluation": {"path": "eval.jsonl", "samplesPerPrompt": 0, "passAtK": []}}, None),
    ("evaluation with no source", {"evaluation": {"everySteps": 5}}, EVAL_ONE_SOURCE),
    ("evaluation with split and path", {"evaluation": {"split": "test", "path": "eval.jsonl"}}, EVAL_ONE_SOURCE),
    ("evaluation pass@k above the samples", {"evaluation": {"split": "test", "samplesPerPrompt": 4, "passAtK": [8]}}, EVAL_K_TOO_BIG),
    ("evaluation default pass@1 with no samples", {"evaluation": {"split": "test", "samplesPerPrompt": 0}}, EVAL_K_TOO_BIG),
    ("evaluation measuring nothing", {"evaluation": {"split": "test", "samplesPerPrompt": 0, "passAtK": [], "greedy": False}}, EVAL_NOTHING),
]


@pytest.mark.parametrize("overrides, expected", [c[1:] for c in AGREEMENT_CASES], ids=[c[0] for c in AGREEMENT_CASES])
def test_cel_rules_agree_with_the_pydantic_validators(overrides, expected):
    doc = make_manifest(**overrides)
    want = [expected] if expected else []
    assert cel_messages(doc) == want, "CEL (admission)"
    assert pydantic_messages(doc) == want, "pydantic (kuberl run)"
    assert pydantic_messages(prune_and_default(crd_schema(), doc, "", [])) == want, "pydantic after API-server defaulting (operator)"


def test_every_cel_rule_has_a_failing_agreement_case():
    messages = {rule["message"] for _, rule in iter_rules(crd_schema())}
    covered = {c[2] for c in AGREEMENT_CASES if c[2]}
    assert messages - covered == set(), "add an AGREEMENT_CASES row for each new rule"


def test_with_allocation_set_admission_reads_the_shorthands_numbers():
    # CEL reads the shorthand (find() and int()): what the model refuses after expansion, admission refuses too (issue #36).
    doc = make_manifest(allocation="vllm:d2t2+fsdp:d4", rollout={"accelerator": {"count": 2}})
    assert cel_messages(doc) == []
    assert pydantic_messages(doc) == []
    doc = make_manifest(allocation="vllm:d2+megatron:d3e2")
    assert cel_messages(doc) == pydantic_messages(doc) == [ALLOCATION_EXPERT_DIVIDE]


def test_a_topology_request_needs_the_experiment_queued_in_kueue():
    """CEL cannot read labels: admission takes trainer.topologyRequest without the queue label, and kuberl validate and the
    operator (a ValidationFailed condition and event) refuse it, since nothing but Kueue would honour it."""
    doc = make_manifest(trainer={"topologyRequest": {"preferred": "cloud.google.com/gce-topology-block"}})
    assert cel_messages(doc) == []
    assert pydantic_messages(doc) == [TOPOLOGY_NEEDS_QUEUE]
    doc["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "gpus"}
    assert pydantic_messages(doc) == []
    assert RLExperiment.model_validate(doc).spec.trainer.topology_request.kueue() == {
        "preferred": "cloud.google.com/gce-topology-block", "podIndexLabel": "batch.kubernetes.io/job-completion-index"}
