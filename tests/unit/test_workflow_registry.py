"""The workflow registry (kuberl.runtime.rollout.registry): every workflow.type is built through it, and
`workflow.type: custom` loads a user class in one file with a clear error for each way it can be wrong."""

from __future__ import annotations

import asyncio
import sys
import textwrap

import pytest

from kuberl.api.v1alpha1 import RLExperimentSpec, WorkflowType
from kuberl.runtime.data import Item
from kuberl.runtime.rollout.agent_workflow import AgentWorkflow
from kuberl.runtime.rollout.registry import WORKFLOWS, EpisodeTimeout, RolloutWorkflow, WorkflowError
from kuberl.runtime.rollout.workflows import MultiTurnWorkflow, RLVRWorkflow, make_workflow

MODULE = "kuberl_test_user_workflows"
SOURCE = '''
from kuberl.runtime.bus.messages import Sample
from kuberl.runtime.inference.base import GenerateRequest


class EchoWorkflow:
    """A whole custom workflow: one async method per episode."""

    def __init__(self, setup):
        self.setup = setup

    async def arun_episode(self, engine, item, ctx):
        res = await engine.generate(GenerateRequest(input_ids=[1, 2], max_new_tokens=2))
        return [Sample(input_ids=[1, 2], output_ids=res.output_ids, logprobs=res.logprobs, versions=[res.version] * 2,
                       loss_mask=[1, 1], reward=float(item.answer == "yes"))] * self.setup.sampling.n


class NoArgs:
    async def arun_episode(self, engine, item, ctx):
        return None


class Sleeper:
    async def arun_episode(self, engine, item, ctx):
        import asyncio
        await asyncio.sleep(3600)


class SyncMethod:
    def arun_episode(self, engine, item, ctx):
        return None


class Exploding:
    def __init__(self, setup):
        raise RuntimeError("needs a GPU")
        async def arun_episode(self, engine, item, ctx):
            return None

    async def arun_episode(self, engine, item, ctx):
        return None


def not_a_class():
    pass
'''


@pytest.fixture(scope="module", autouse=True)
def user_module(tmp_path_factory):
    d = tmp_path_factory.mktemp("user")
    (d / f"{MODULE}.py").write_text(textwrap.dedent(SOURCE))
    sys.path.insert(0, str(d))
    yield
    sys.path.remove(str(d))
    sys.modules.pop(MODULE, None)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from kuberl.runtime.models import build_tiny_model

    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny")))


def spec(**workflow):
    return RLExperimentSpec.model_validate({"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "add-small"},
                                            "workflow": workflow, "algorithm": {"samplesPerPrompt": 3}})


def test_every_workflow_type_has_a_registry_entry():
    assert set(WORKFLOWS) == {str(t) for t in WorkflowType}


def test_the_builtin_workflows_come_through_the_registry(tokenizer):
    assert type(make_workflow(spec(type="rlvr", reward="exact-match"), tokenizer)) is RLVRWorkflow
    mt = make_workflow(spec(type="multi-turn", maxTurns=3, turnDiscount=0.5), tokenizer)
    assert isinstance(mt, MultiTurnWorkflow) and (mt.max_turns, mt.turn_discount) == (3, 0.5)
    agent = make_workflow(spec(type="agent", agent="kuberl.runtime.agents.repeat:two_call_agent"), tokenizer)
    assert isinstance(agent, AgentWorkflow) and agent.sampling.n == 3


def test_a_custom_class_gets_the_setup_and_runs_its_episode(tokenizer):
    from kuberl.runtime.inference.base import GenerateResult

    wf = make_workflow(spec(type="custom", **{"class": f"{MODULE}:EchoWorkflow"}), tokenizer)
    assert isinstance(wf, RolloutWorkflow) and wf.inner.setup.tokenizer is tokenizer and wf.inner.setup.sampling.n == 3

    class Engine:
        version = 4

        async def generate(self, req):
            return GenerateResult([5, 6], [-0.5, -0.6], "stop", version=4)

    out = asyncio.run(wf.arun_episode(Engine(), Item(0, "q", "yes"), None))
    assert len(out) == 3 and out[0].reward == 1.0 and out[0].versions == [4, 4]


def test_a_custom_class_without_arguments_is_constructed_plainly(tokenizer):
    assert make_workflow(spec(type="custom", **{"class": f"{MODULE}:NoArgs"}), tokenizer).inner.__class__.__name__ == "NoArgs"


def test_a_custom_episode_past_the_timeout_is_cancelled_with_a_clear_reason(tokenizer):
    wf = make_workflow(spec(type="custom", episodeTimeoutSeconds=0.2, **{"class": f"{MODULE}:Sleeper"}), tokenizer)
    with pytest.raises(EpisodeTimeout, match=r"ran past workflow.episodeTimeoutSeconds \(0.2 s\)"):
        asyncio.run(wf.arun_episode(None, Item(0, "q", "a"), None))


@pytest.mark.parametrize("path, message", [
    (f"{MODULE}:Missing", f"module {MODULE!r} has no attribute 'Missing'"),
    ("no_such_module_xyz:Workflow", "cannot import module 'no_such_module_xyz'"),
    (f"{MODULE}:not_a_class", "is a function, not a class"),
    (f"{MODULE}:SyncMethod", "has no `async def arun_episode(self, engine, item, ctx)`"),
    (f"{MODULE}:Exploding", "constructing kuberl_test_user_workflows:Exploding failed: RuntimeError: needs a GPU"),
])
def test_a_custom_class_that_cannot_be_used_is_a_configuration_error_naming_the_field(tokenizer, path, message):
    with pytest.raises(WorkflowError, match="workflow.class") as err:
        make_workflow(spec(type="custom", **{"class": path}), tokenizer)
    assert message in str(err.value)


def test_an_agent_entry_point_that_is_not_a_two_argument_function_is_refused(tokenizer):
    with pytest.raises(WorkflowError, match=r"workflow.agent: .* must take \(client, item\)"):
        make_workflow(spec(type="agent", agent=f"{MODULE}:not_a_class"), tokenizer)


def test_an_agent_that_cannot_be_imported_stops_the_rollout_as_a_configuration_error(tokenizer):
    """The rollout agent builds its workflow inside spec_errors(): exit 2 with the reason, no restart."""
    from kuberl.runtime.errors import ConfigError, spec_errors

    with pytest.raises(ConfigError, match=r"workflow.agent: cannot import module 'my_agents\.search'.*rollout\.image"):
        with spec_errors():
            make_workflow(spec(type="agent", agent="my_agents.search:run"), tokenizer)
