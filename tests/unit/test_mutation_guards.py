"""The trainer's sums across micro-batches and ranks, its KL reference and its dropout check, against numbers computed
here by hand (scripts/mutation-check.py plants a bug in each and needs a test here to fail).

The other trainer tests run one rank and one micro-batch, where a loss divided by each micro-batch's own token count,
or a gradient left averaged over the ranks, gives the same numbers as the right one. Here every response is longer than
half of trainer.microBatchTokens, so each row is a micro-batch of its own, and one test runs two gloo ranks under torchrun.
The expected gradient is that of the decoupled objective on an unsharded copy of the same weights, as in
test_trainer_compute.py's TestDecoupledWiring.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from kuberl.api import RLExperiment
from kuberl.runtime.trainer import dist as D
from kuberl.runtime.trainer.batch import build_batch
from kuberl.runtime.trainer.trainer import Trainer
from tests.unit.torchrun import torchrun

N = 2  # samples per group
MICRO_BATCH_TOKENS = 64  # the smallest the API allows; every row below is longer than half of it
LENGTHS = [36, 31, 40, 33]  # response tokens per row (4-token prompts): rows never share a micro-batch


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from kuberl.runtime.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", seed=0)


@pytest.fixture
def cleanup():
    yield
    D.shutdown()


def spec(tiny: Path, **algorithm) -> dict:
    """A manifest for the tiny model: GRPO, rewards (1, 0) per group unshaped, one row per micro-batch."""
    return {
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "guards"},
        "spec": {"model": {"path": str(tiny), "dtype": "float32"}, "dataset": {"builtin": "repeat-digit", "size": 8},
                 "algorithm": {"name": "grpo", "samplesPerPrompt": N, "batchSize": 2, "learningRate": 3e-3, "rewardBias": 0.0,
                               "rewardScaling": 1.0, "ppoMinibatches": 1, **algorithm},
                 "trainer": {"microBatchTokens": MICRO_BATCH_TOKENS, "packing": "off"}, "training": {"totalSteps": 10}},
    }


def make(tmp_path: Path, tiny: Path, **algorithm) -> Trainer:
    t = Trainer(RLExperiment.model_validate(spec(tiny, **algorithm)), bus_url="nats://unused:4222", workdir=tmp_path,
                handle_sigterm=False)
    t.setup()
    return t


def reference_copy(tiny: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()


def logprobs_by_hand(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log softmax(logits) at each response token, from the model's raw logits (temperature 1)."""
    logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def long_groups(model: torch.nn.Module) -> list[dict]:
    """Two groups of two long responses (random tokens), sample 0 rewarded; behaviour log-probs = the model's own."""
    g = torch.Generator().manual_seed(11)
    out, k = [], 0
    for grp in range(2):
        prompt = [5 + grp, 40, 41, 42]
        samples = []
        for i in range(N):
            resp = torch.randint(3, 200, (LENGTHS[k],), generator=g).tolist()
            k += 1
            with torch.no_grad():
                lp = logprobs_by_hand(model, prompt, resp).tolist()
            samples.append({"input_ids": prompt, "output_ids": resp, "logprobs": lp, "versions": [0] * len(resp),
                            "loss_mask": [1] * len(resp), "reward": 1.0 if i == 0 else 0.0})
        out.append({"group_id": f"long{grp}", "samples": samples})
    return out


def expected_update(model: torch.nn.Module, groups: list[dict]) -> tuple[float, float]:
    """(loss, gradient norm) of one on-policy GRPO step by hand: every ratio 1, w = pi_prox / pi_behave (~1), advantages
    +-0.5 / (0.5 + 1e-6), loss = sum_t w_t (-A_t) / tokens over the whole minibatch, whatever the micro-batches."""
    model.zero_grad()
    logp, w, adv = [], [], []
    for grp in groups:
        for i, s in enumerate(grp["samples"]):
            lp = logprobs_by_hand(model, s["input_ids"], s["output_ids"])
            logp.append(lp)
            w.append(torch.exp(lp.detach() - torch.tensor(s["logprobs"])))
            adv.append(torch.full((len(lp),), (0.5 if i == 0 else -0.5) / (0.5 + 1e-6)))
    logp, w, adv = torch.cat(logp), torch.cat(w), torch.cat(adv)
    (torch.sum(w * -adv * logp) / len(logp)).backward()
    norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters() if p.grad is not None))
    return float(torch.sum(w * -adv)) / len(logp), float(norm)


def one_step(t: Trainer, groups: list[dict]) -> tuple[dict, object]:
    batch = build_batch(groups, N)
    t.stage_prox_logp(batch)
    t.stage_advantages(batch)
    return t.stage_ppo_update(batch), batch


def test_several_micro_batches_divide_by_the_minibatchs_tokens_not_their_own(tmp_path, tiny, cleanup):
    """Each micro-batch's loss is its tokens' sum over the whole minibatch's token count, so the gradients accumulated over
    the micro-batches are the minibatch loss's gradient (a micro-batch mean each would give about 4x here, and weigh a
    short row's tokens more)."""
    model = reference_copy(tiny)
    groups = long_groups(model)
    want_loss, want_norm = expected_update(model, groups)
    t = make(tmp_path, tiny)
    batch = build_batch(groups, N)
    rows = list(range(batch.num_samples))
    assert len(t._micro_batches(batch, rows, t._packed(batch, t.model))) == len(LENGTHS)  # the premise: one row each
    stats, _ = one_step(t, groups)
    assert stats["tokens"] == sum(LENGTHS)
    assert stats["loss"] == pytest.approx(want_loss, rel=1e-4, abs=1e-6)
    assert stats["grad_norm"] == pytest.approx(want_norm, rel=1e-3), "the summed micro-batch gradients are not the minibatch's"


def test_the_kl_term_is_taken_against_the_frozen_reference_not_pi_prox(tmp_path, tiny, cleanup):
    """With klCoef in the loss, KL(pi_theta || pi_ref) is measured against the initial weights. At the second step the policy
    has moved from them, so the KL is k3(log pi_ref - log pi_theta) > 0 per token; measured against pi_prox (the same
    weights as pi_theta when there is one minibatch) it would be exactly 0 and pull nothing back."""
    model = reference_copy(tiny)
    groups = long_groups(model)
    t = make(tmp_path, tiny, klCoef=0.5)
    assert t.ref_model is not None and t.prox_in_update()
    one_step(t, groups)
    stats, batch = one_step(t, groups)
    d = (batch.ref_logp - batch.prox_logp)[batch.loss_mask.bool()]  # pi_prox = the weights this step's loss saw
    want = float((torch.exp(d) - d - 1.0).mean())
    assert want > 1e-7, "the policy did not move from the reference in one step; the test proves nothing"
    assert stats["kl"] == pytest.approx(want, rel=1e-3)


@pytest.mark.parametrize("dropout, has", [(0.1, True), (0.0, False)])
def test_lora_dropout_makes_the_trainer_take_pi_prox_from_an_eval_forward(tmp_path, tiny, cleanup, dropout, has):
    """PEFT puts the adapters' dropout in nn.Dropout modules deep inside the model (not in its config): the trainer must see
    them, else it takes pi_prox from the update's train-mode forward, with dropout on (noise in every behaviour weight)."""
    from kuberl.runtime.trainer.compute import _has_dropout

    t = make(tmp_path, tiny, lora={"rank": 4, "alpha": 8, "targetModules": ["q_proj", "v_proj"], "dropout": dropout})
    assert _has_dropout(t.model) is has
    assert t.prox_in_update() is not has


WORKER = '''
import json, os, sys
import torch
from kuberl.api import RLExperiment
from kuberl.runtime.trainer import dist as D
from kuberl.runtime.trainer.batch import build_batch
from kuberl.runtime.trainer.trainer import Trainer

job = json.load(open(sys.argv[1]))
t = Trainer(RLExperiment.model_validate(job["spec"]), bus_url="nats://unused:4222", workdir=sys.argv[2], handle_sigterm=False)
t.setup()
batch = build_batch(job["groups"], job["n"])
mbs = len(t._micro_batches(batch, list(range(batch.num_samples)), t._packed(batch, t.model)))
t.stage_prox_logp(batch)
t.stage_advantages(batch)
st = t.stage_ppo_update(batch)
print(f"RESULT rank {t.info.rank} of {t.info.world_size} micro {mbs} loss {st['loss']:.9e} norm {st['grad_norm']:.9e} "
      f"tokens {st['tokens']:.0f}", flush=True)
D.shutdown(synchronize=True)
sys.stdout.flush()
os._exit(0)  # as the trainer does (kuberl.runtime.trainer.main): torch's CPU teardown at interpreter exit can abort
'''


def test_two_gloo_ranks_with_two_micro_batches_each_take_the_one_process_gradient(tmp_path, tiny):
    """FSDP averages the ranks' gradients; each rank's loss is its rows' share of the minibatch loss, so the trainer scales it
    by the world size: the update's gradient is then the whole minibatch's on every rank (left averaged, it is half)."""
    model = reference_copy(tiny)
    groups = long_groups(model)
    want_loss, want_norm = expected_update(model, groups)
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"spec": spec(tiny), "groups": groups, "n": N}))
    script = tmp_path / "dp_worker.py"
    script.write_text(WORKER)
    proc = torchrun(str(script), str(job), str(tmp_path / "work"), timeout=240, cwd=tmp_path)
    num = r"(-?[0-9.]+e[+-]\d+)"
    found = re.findall(rf"RESULT rank (\d) of 2 micro (\d+) loss {num} norm {num} tokens (\d+)", proc.stdout)
    assert sorted(r[0] for r in found) == ["0", "1"], proc.stdout
    for _rank, micro, loss, norm, tokens in found:
        assert int(micro) == 2 and int(tokens) == sum(LENGTHS)  # two rows per rank, one micro-batch each
        assert float(loss) == pytest.approx(want_loss, rel=1e-4, abs=1e-6)
        assert math.isclose(float(norm), want_norm, rel_tol=1e-3), f"gradient norm {norm} on 2 ranks, {want_norm} by hand"
