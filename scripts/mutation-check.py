#!/usr/bin/env python3
"""Mutation check: break the RL algorithm, the trainer, weight sync and the rollout side on purpose, one way at a time, and require a test to fail.

Each mutant in MUTANTS is an exact source substitution (old text -> new text in one file). For each one
the script copies kuberl/, tests/ and pyproject.toml into a temporary folder, applies the substitution
there (never in the working tree), runs the mutant's tests with pytest and calls it "killed" if a test
fails. It prints a table and exits 1 if any mutant survives, or if a mutant's old text is not found
(a refactor moved it: update the table, never let a mutant vanish silently). scripts/test.sh runs the same
table as tests/mutation (one pytest test per mutant) inside its pytest session; `python3 scripts/mutation-check.py
--list` shows the table, `--only ID` runs some.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOSSES = "runtime/kuberl/runtime/algorithms/losses.py"
ADVANTAGES = "runtime/kuberl/runtime/algorithms/advantages.py"
TRAINER_COMPUTE = "runtime/kuberl/runtime/trainer/compute.py"
TRAINER_COLLECT = "runtime/kuberl/runtime/trainer/collect.py"
TOKEN_LOGPROBS = "runtime/kuberl/runtime/trainer/token_logprobs.py"
STALENESS = "runtime/kuberl/runtime/staleness.py"
CONTEXT_PARALLEL = "runtime/kuberl/runtime/trainer/context_parallel.py"
PERSIST = "runtime/kuberl/runtime/trainer/persist.py"
DIST = "runtime/kuberl/runtime/trainer/dist.py"
WEIGHTS = "runtime/kuberl/runtime/trainer/weights.py"
PROXY = "runtime/kuberl/runtime/rollout/openai_proxy.py"
SENDER = "runtime/kuberl/runtime/weight_sync/sender.py"

# Tests named here are the smallest set that kills the mutant: keep them fast (no servers, no vLLM).
OFF_POLICY = "tests/unit/test_algorithms.py::TestOffPolicyLearning"
WIRING = "tests/unit/test_trainer_compute.py::TestDecoupledWiring"
ULYSSES = "tests/unit/test_context_parallel.py::test_ulysses_equals_one_process_on_two_gloo_ranks"  # 2 gloo ranks, ~25 s
ASYNC_CKPT = "tests/unit/test_async_checkpoint.py::test_a_background_checkpoint_holds_the_weights_of_its_step_and_acks_only_its_groups_once_committed"
GUARDS = "tests/unit/test_mutation_guards.py::"  # the trainer's sums over micro-batches and ranks, its KL reference, its dropout check
AGENTS = "tests/unit/test_agent_workflow.py::"
BROADCAST_RANKS = "tests/unit/test_weight_broadcast_protocol.py::test_an_engine_with_several_workers_gets_a_rank_for_each_and_the_engines_dtype"


@dataclass(frozen=True)
class Mutant:
    id: str
    what: str  # the bug it plants, in words
    file: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTANTS: tuple[Mutant, ...] = (
    Mutant("weight-dropped", "behaviour weight pi_prox/pi_behave ignored", LOSSES,
           "pg = pg * applied", "pg = pg * 1.0", (OFF_POLICY,)),
    Mutant("weight-inverted", "behaviour weight inverted (pi_behave/pi_prox)", LOSSES,
           "behave_log_w = torch.where(mask, prox - behave, zero)", "behave_log_w = torch.where(mask, behave - prox, zero)",
           (OFF_POLICY,)),
    Mutant("ratio-vs-behave", "PPO ratio taken against pi_behave instead of pi_prox", LOSSES,
           "log_ratio = torch.where(mask, lp - prox, zero)", "log_ratio = torch.where(mask, lp - behave, zero)",
           (OFF_POLICY,)),
    Mutant("clip-removed", "PPO clip removed", LOSSES,
           "pg = torch.maximum(pg_unclipped, pg_clipped)", "pg = pg_unclipped",
           ("tests/unit/test_algorithms.py::TestClipIsATrustRegion",)),
    Mutant("weight-cap-boundary", "behaviour weight exactly at the cap masked (>= instead of >)", LOSSES,
           "dropped = (weight > cap) & mask", "dropped = (weight >= cap) & mask",
           ("tests/unit/test_algorithms.py::TestBehaviourWeightCap",)),
    Mutant("baseline-removed", "GRPO group mean not subtracted", ADVANTAGES,
           "centred = r - r.mean(dim=1, keepdim=True)", "centred = r.clone()",
           ("tests/unit/test_algorithms.py::TestBaseline",)),
    Mutant("trainer-temperature-ignored", "trainer recomputes log-probs at temperature 1", TRAINER_COMPUTE,
           "return self.spec.algorithm.temperature", "return 1.0", (WIRING,)),
    Mutant("logprobs-temperature-ignored", "response_logprobs never divides by the temperature", TOKEN_LOGPROBS,
           "z.div_(temperature)", "z.mul_(1.0)", (WIRING,)),
    Mutant("logprob-gradient-target-term-dropped", "the log-prob backward drops the target's +g (gives -g softmax only)",
           TOKEN_LOGPROBS, "dz.scatter_add_(-1, tgt[s:s + rows], gs)", "dz.mul_(1.0)",
           ("tests/unit/test_token_logprobs.py::test_values_and_gradients_equal_plain_autograd",)),
    Mutant("loss-gets-behave-as-prox", "the PPO update passes pi_behave as pi_prox (plain PPO)", TRAINER_COMPUTE,
           "loss, st = ppo_actor_loss(logp, prox, behave,", "loss, st = ppo_actor_loss(logp, behave, behave,", (WIRING,)),
    Mutant("prox-is-behave", "stage_prox_logp copies pi_behave instead of recomputing pi_prox", TRAINER_COMPUTE,
           "batch.prox_logp = self._logprobs_all_rows(self.model, batch, rows, width)",
           "batch.prox_logp = batch.behave_logp.clone()", (WIRING,)),
    Mutant("fused-prox-is-behave", "with one minibatch, pi_prox taken from pi_behave instead of the update's forward", TRAINER_COMPUTE,
           "prox = logp.detach()", "prox = behave", (WIRING,)),
    Mutant("stale-drop-by-default", "groups older than v - eta dropped by default (biased toward short answers)",
           "kuberl/api/algorithm.py", "    drop_stale_groups: bool = Field(\n        False,", "    drop_stale_groups: bool = Field(\n        True,",
           ("tests/unit/test_length_bias.py::TestTrainingEveryAcceptedGroup",)),
    Mutant("stale-filter-removed", "with staleness.dropStaleGroups, the trainer still trains groups older than v - eta", TRAINER_COLLECT,
           "if self.book.bound.is_stale(group.head_version, self.version):", "if False:",
           ("tests/unit/test_trainer_stages.py::test_a_group_older_than_v_minus_eta_is_dropped_and_counted",)),
    Mutant("stale-boundary", "a group exactly eta versions old counted stale", STALENESS,
           "return head_version is not None and head_version < version - self.eta",
           "return head_version is not None and head_version <= version - self.eta",
           ("tests/unit/test_staleness.py::TestStaleGroups",)),
    Mutant("capacity-one-batch-more", "staleness capacity (eta + v + 2) * B: one batch too many", STALENESS,
           "cap = (self.eta + version + 1) * self.batch_size - self.started",
           "cap = (self.eta + version + 2) * self.batch_size - self.started",
           ("tests/unit/test_staleness.py::TestSynchronousWhenEtaIsZero",)),
    Mutant("capacity-one-batch-less", "staleness capacity (eta + v) * B: one batch too few", STALENESS,
           "cap = (self.eta + version + 1) * self.batch_size - self.started",
           "cap = (self.eta + version) * self.batch_size - self.started",
           ("tests/unit/test_staleness.py::TestSynchronousWhenEtaIsZero",)),
    Mutant("concurrency-freed-on-training", "a concurrency slot freed when trained, not when accepted", STALENESS,
           "cap = min(cap, self.max_concurrent - self.running)", "cap = min(cap, self.max_concurrent - self.in_flight)",
           ("tests/unit/test_staleness.py::TestConcurrencyCap",)),
    Mutant("cp-local-positions", "context parallel feeds each slice positions from 0 instead of its global ones (RoPE)", CONTEXT_PARALLEL,
           "scored_logits(model, ids[:, c0:c0 + s], pos[:, c0:c0 + s],", "scored_logits(model, ids[:, c0:c0 + s], torch.arange(s).expand(R, -1),",
           (ULYSSES,)),
    Mutant("cp-mask-from-slice", "context parallel's attention mask built from this rank's slice, not the full rows", CONTEXT_PARALLEL,
           "    set_positions(pos.to(device), cp)\n", "    set_positions(pos[:, c0:c0 + s].repeat(1, cp.size).to(device), cp)\n",
           (ULYSSES,)),
    Mutant("cp-all-to-all-back-swapped", "context parallel's all-to-all back puts heads where the sequence chunks go", CONTEXT_PARALLEL,
           "return y.transpose(0, 1).reshape(B, cp.size * h, S // cp.size, D)", "return y.permute(1, 2, 0, 3, 4).reshape(B, cp.size * h, S // cp.size, D)",
           (ULYSSES,)),
    Mutant("cp-gather-backward-summed", "context parallel's log-prob gather sums the gradients over the CP group too (2x)", CONTEXT_PARALLEL,
           "        return grad, None\n", "        grad = grad.clone()\n        dist.all_reduce(grad, group=None)\n        return grad, None\n",
           (ULYSSES,)),
    # Nothing lost when a pod dies: a checkpoint written behind training (checkpoint.asyncSave).
    Mutant("async-ckpt-live-tensors", "the background checkpoint writes the live tensors (no host copy): later steps leak into it", DIST,
           "storage_writer=writer, process_group=group)",
           "storage_writer=writer, process_group=group,\n                           async_stager=type('NoCopy', (dcp.staging.BlockingAsyncStager,), "
           "{'stage': lambda self, sd: sd})())", (ASYNC_CKPT,)),
    Mutant("async-ckpt-ack-at-save", "a background checkpoint's groups acked when it is taken, before it is written", PERSIST,
           "pending.state, pending.held, self.held = self._checkpoint_state(row), self.held, []",
           "await self.bus.ack(self.held)\n                pending.state, pending.held, self.held = self._checkpoint_state(row), [], []",
           (ASYNC_CKPT,)),
    Mutant("async-ckpt-commit-unwritten", "a background checkpoint committed at the next step whether or not its write is done", PERSIST,
           "if pending is None or not (wait or pending.future.done()):", "if pending is None:", (ASYNC_CKPT,)),
    # The engine samples the trained policy: a published version holds every weight (only a tied head is written once).
    Mutant("publish-drops-untied-head", "publishing leaves out lm_head.weight of an untied model too (no head for the engine)", WEIGHTS,
           '"tie_word_embeddings", False):\n        return entries',
           '"tie_word_embeddings", False):\n        return [(n, t) for n, t in entries if n != "lm_head.weight"]',
           ("tests/unit/test_weight_shards.py::test_the_trainer_path_writes_an_untied_models_lm_head_as_export_weights_does",)),
    # Advantage variants and the GSPO ratio.
    Mutant("rloo-mean-over-n", "RLOO's leave-one-out mean divides by n instead of n - 1", ADVANTAGES,
           "loo_mean = (r.sum(dim=1, keepdim=True) - r) / (n - 1)", "loo_mean = (r.sum(dim=1, keepdim=True) - r) / n",
           ("tests/unit/test_advantages.py::TestRLOO",)),
    Mutant("batch-std-per-group", "REINFORCE++ (and LitePPO) divide by each group's std instead of the batch's", ADVANTAGES,
           'keepdim=True, unbiased=False) + ADV_EPS)\n    elif cfg.std_norm == "batch":\n        centred = centred / (r.std(unbiased=False) + ADV_EPS)',
           'keepdim=True, unbiased=False) + ADV_EPS)\n    elif cfg.std_norm == "batch":\n'
           '        centred = centred / (r.std(dim=1, keepdim=True, unbiased=False) + ADV_EPS)',
           ("tests/unit/test_advantages.py::TestReinforcePlusPlus",)),
    Mutant("drgrpo-normaliser-longest-answer", "Dr.GRPO's constant normaliser taken as the batch's longest answer, not maxNewTokens", LOSSES,
           'd = seqs * cfg.max_new_tokens if cfg.aggregation == "seq-mean-token-sum-norm" else seqs',
           'd = seqs * float(_segment_sum(mask.to(torch.int64), ids, n).max()) if cfg.aggregation == "seq-mean-token-sum-norm" else seqs',
           ("tests/unit/test_losses.py::TestAggregation",)),
    Mutant("gspo-ratio-summed", "GSPO's sequence ratio exp(sum) of the token log-ratios, not exp(mean) (no length normalisation)", LOSSES,
           "log_ratio = (_segment_sum(log_ratio, f.ids, f.n_seq) / count)[f.ids]", "log_ratio = _segment_sum(log_ratio, f.ids, f.n_seq)[f.ids]",
           ("tests/unit/test_losses.py::TestGSPO",)),
    # The KL term: its gradient, and its reference.
    Mutant("kl-no-gradient", "the KL penalty in the loss has the right value but no gradient (log pi_theta detached in it)", LOSSES,
           "kl = kl_penalty(f.lp, ref_logp.reshape(-1), f.mask, cfg.kl_kind)", "kl = kl_penalty(f.lp.detach(), ref_logp.reshape(-1), f.mask, cfg.kl_kind)",
           ("tests/unit/test_losses.py::TestKL",)),
    Mutant("kl-against-prox", "the trainer's KL term measured against pi_prox instead of the frozen reference", TRAINER_COMPUTE,
           "ref_logp=ref, denominator=denom)", "ref_logp=prox, denominator=denom)",
           (GUARDS + "test_the_kl_term_is_taken_against_the_frozen_reference_not_pi_prox",)),
    # The loss denominator across micro-batches and ranks.
    Mutant("micro-batch-own-denominator", "each micro-batch's loss divided by its own token count, not the minibatch's", TRAINER_COMPUTE,
           "ref_logp=ref, denominator=denom)", "ref_logp=ref, denominator=None)",
           (GUARDS + "test_several_micro_batches_divide_by_the_minibatchs_tokens_not_their_own",)),
    Mutant("dp-gradient-left-averaged", "the loss not scaled by the world size: FSDP's average over ranks halves the gradient on 2", TRAINER_COMPUTE,
           "scale = float(self.info.world_size) if mb is not None else 0.0", "scale = 1.0 if mb is not None else 0.0",
           (GUARDS + "test_two_gloo_ranks_with_two_micro_batches_each_take_the_one_process_gradient",)),  # 2 gloo ranks, ~25 s
    # Dropout detection: PEFT's adapter dropout is a module deep in the model, not a config rate.
    Mutant("dropout-top-level-only", "dropout looked for among the model's direct children only (LoRA dropout missed)", TRAINER_COMPUTE,
           "and m.p > 0 for m in model.modules())", "and m.p > 0 for m in model.children())",
           (GUARDS + "test_lora_dropout_makes_the_trainer_take_pi_prox_from_an_eval_forward",)),
    # The agent proxy: sampling parameters, chat-template continuation, the episode token budget.
    Mutant("proxy-temperature-from-agent", "the proxy passes the agent's temperature to the engine, not the manifest's", PROXY,
           "max_new_tokens=max_new, temperature=sp.temperature,", 'max_new_tokens=max_new, temperature=body.get("temperature", sp.temperature),',
           (AGENTS + "test_the_engine_samples_with_the_manifests_temperature_and_top_p_whatever_the_agent_asks",)),
    Mutant("proxy-closing-duplicated", "a continued conversation repeats the <|im_end|> the model already generated", PROXY,
           "if ended_with_eos and eos and suffix.startswith(eos):", "if ended_with_eos and eos and suffix.endswith(eos):",
           (AGENTS + "test_a_continued_conversation_keeps_the_generated_tokens_and_renders_as_the_chat_template",)),
    Mutant("proxy-continuation-rerendered", "a continued conversation compares the wrong message, so it is re-tokenized from text", PROXY,
           "_same_turn(messages[k], c.reply)", "_same_turn(messages[k - 1], c.reply)",
           (AGENTS + "TestAToolCallingAgent::test_its_calls_become_one_sample_that_matches_the_engine_token_for_token",)),
    Mutant("proxy-budget-charged-on-return", "the episode budget charged when a call returns, not reserved when it starts", PROXY,
           "        s.spent += max_new  # reserved: calls of one episode may run at once\n        gen = None\n        try:\n"
           "            gen = await generate_continuing(self.engine, prompt_ids, req)\n",
           "        gen = None\n        try:\n            gen = await generate_continuing(self.engine, prompt_ids, req)\n"
           "            s.spent += max_new  # reserved: calls of one episode may run at once\n",
           (AGENTS + "TestTheEpisodeBudget::test_calls_of_one_episode_in_flight_at_once_share_the_budget_too",)),
    # The Responses API on the proxy: previous_response_id continues the stored conversation, answer included; a cut
    # answer must not fail an Agents SDK episode.
    Mutant("responses-history-without-answer", "previous_response_id continues a conversation that lacks the model's answer",
           "runtime/kuberl/runtime/rollout/responses_api.py", 's.responses[resp["id"]] = req.history + [reply_message(choices[0])]',
           's.responses[resp["id"]] = req.history',
           ("tests/unit/test_responses_api.py::test_one_conversation_through_chat_and_through_responses_gives_the_same_training_sample",)),
    Mutant("responses-cut-answer-incomplete", "an answer cut at max_output_tokens is an incomplete response (the Agents SDK raises)",
           "runtime/kuberl/runtime/rollout/responses_api.py", '"status": "completed", "error": None,',
           '"status": "incomplete" if incomplete else "completed", "error": None,',
           ("tests/unit/test_framework_agents.py::test_answers_cut_at_max_tokens_do_not_fail_the_sdks_episode",)),
    # Token versions: each token keeps the version that sampled it; tokens between an agent's calls get -1.
    Mutant("piece-version-for-every-token", "a piece's tokens all stamped with the version it started on (per-token versions lost)",
           "runtime/kuberl/runtime/rollout/workflows.py", "self.versions += res.token_versions()",
           "self.versions += [res.version] * len(res.output_ids)",
           ("tests/unit/test_workflows.py::TestPartialGeneration::test_the_engines_own_token_versions_are_kept_through_a_continuation",)),
    Mutant("tool-tokens-get-a-version", "tool output between an agent's calls stamped with the next call's version, not -1",
           "runtime/kuberl/runtime/rollout/agent_workflow.py", "vers += [-1] * len(gap) + c.versions",
           "vers += c.versions[:1] * len(gap) + c.versions",
           (AGENTS + "test_concat_sample_keeps_only_the_chain_that_ends_at_the_last_call",)),
    # Weight sync by broadcast: the version sent, the ranks of multi-worker engines, the engine's dtype.
    Mutant("broadcast-version-is-update-count", "the assignment names the sender's update count, not the policy version", SENDER,
           '"update": update, "rank": rank, "world": world, "version": version,', '"update": update, "rank": rank, "world": world, "version": self.updates,',
           ("tests/unit/test_weight_broadcast_protocol.py::test_sender_serves_every_requesting_engine_and_ties_once",)),
    Mutant("broadcast-one-rank-per-engine", "a tensor-parallel engine's workers get one rank between them (ranks collide)", SENDER,
           'rank += req["workers"]', "rank += 1", (BROADCAST_RANKS,)),
    Mutant("broadcast-dtype-ignored", "the broadcast sends the trainer's float32, not the engine's dtype", SENDER,
           "entries = B.entries_for(params, dtype)", "entries = B.entries_for(params, None)", (BROADCAST_RANKS,)),
)


@dataclass
class Result:
    mutant: Mutant
    outcome: str  # killed | SURVIVED | ERROR
    detail: str
    seconds: float


def check_mutants(root: Path, mutants: tuple[Mutant, ...]) -> list[str]:
    """Every mutant's old text occurs exactly once in its file (else the table is stale)."""
    problems = []
    for m in mutants:
        path = root / m.file
        text = path.read_text() if path.is_file() else ""
        count = text.count(m.old)
        if count != 1:
            problems.append(f"{m.id}: {m.file} contains the old text {count} times (need exactly 1): {m.old!r}")
        for t in m.tests:
            if not (root / t.split("::")[0]).is_file():
                problems.append(f"{m.id}: test file {t.split('::')[0]} does not exist")
    return problems


def selected_tests(mutants: tuple[Mutant, ...]) -> tuple[str, ...]:
    """Every test the mutants name, once each: the baseline runs them all unmutated."""
    return tuple(dict.fromkeys(t for m in mutants for t in m.tests))


def make_copy(dest: Path) -> Path:
    for part in ("kuberl", "operator", "runtime", "tests"):
        shutil.copytree(ROOT / part, dest / part, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def env_for(copy: Path) -> dict[str, str]:
    # The copy comes first on sys.path (PYTHONPATH precedes the editable installs' .pth entries), its
    # operator/ and runtime/ distribution roots too: kuberl's __path__ then lists the copy's portions first.
    path = os.pathsep.join(str(copy / part) for part in ("", "operator", "runtime"))
    return {**os.environ, "PYTHONPATH": path, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def assert_imports_from(copy: Path) -> None:
    probe = "import kuberl, kuberl.runtime; print(kuberl.__file__); print(kuberl.runtime.__file__)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=copy, env=env_for(copy), capture_output=True, text=True, check=True).stdout
    for where in out.split():
        if not Path(where).resolve().is_relative_to(copy.resolve()):
            raise SystemExit(f"mutation-check: the copy in {copy} imports kuberl from {where}; mutants would not be tested")


PYTEST_ARGS = ("-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--no-header")  # a mutant's run: stop at its first failure


def run_tests(copy: Path, tests: tuple[str, ...], timeout: float) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "pytest", *PYTEST_ARGS, *tests]
    try:
        p = subprocess.run(cmd, cwd=copy, env=env_for(copy), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {timeout:.0f} s"
    return p.returncode, p.stdout + p.stderr


class Zygote:
    """A fork server in `copy` (scripts/mutation_zygote.py): each `run_tests` forks a pytest from a process that
    imported torch, transformers and the rest once, instead of starting Python and importing them per mutant."""

    def __init__(self, copy: Path) -> None:
        self.copy = copy
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "mutation_zygote.py")], cwd=copy, env=env_for(copy),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self.proc.stdout.readline()
        if not ready.strip():
            raise RuntimeError(f"mutation_zygote did not start (exit {self.proc.wait()})")

    def run_tests(self, tests: tuple[str, ...], timeout: float) -> tuple[int, str]:
        out = self.copy / ".zygote-output.txt"
        self.proc.stdin.write(json.dumps({"args": [*PYTEST_ARGS, *tests], "out": str(out), "timeout": timeout}) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"mutation_zygote died (exit {self.proc.wait()})")
        code = json.loads(answer)["code"]
        text = out.read_text(errors="replace") if out.exists() else ""
        return code, (text if code != -1 else f"timed out after {timeout:.0f} s\n{text[-2000:]}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def first_failure(output: str) -> str:
    """The first failing test and how it failed (AssertionError = a check caught it; anything else = a crash)."""
    m = re.search(r"^FAILED (\S+)", output, re.M) or re.search(r"^(\S+::\S+) FAILED", output, re.M)
    error = re.search(r"^E\s+(\w+(?:Error|Exception|Exit))\b", output, re.M)
    kind = error.group(1) if error else ("AssertionError" if re.search(r"^E\s+assert ", output, re.M) else "?")
    return f"{m.group(1) if m else '?'} [{kind}]"


def run_one(copy: Path, m: Mutant, timeout: float, zygote: Zygote | None = None) -> Result:
    """The mutant's tests on the mutated copy: in a fresh Python, or forked from `zygote` (a fork server in `copy`)."""
    path = copy / m.file
    original = path.read_text()
    path.write_text(original.replace(m.old, m.new, 1))
    t0 = time.monotonic()
    try:
        code, out = zygote.run_tests(m.tests, timeout) if zygote else run_tests(copy, m.tests, timeout)
    finally:
        path.write_text(original)
    secs = time.monotonic() - t0
    if code == 1:
        return Result(m, "killed", first_failure(out), secs)
    if code == 0:
        return Result(m, "SURVIVED", "every test passed", secs)
    tail = "\n".join(out.strip().splitlines()[-15:])
    return Result(m, "ERROR", f"pytest exit {code} (not a test failure):\n{tail}", secs)


def print_table(results: list[Result]) -> None:
    rows = [("mutant", "file", "tests run", "result", "killed by", "s")]
    for r in results:
        # The failing test's own name (its file and class are in "tests run"), shortened.
        detail = r.detail.rsplit("::", 1)[-1] if r.outcome == "killed" else r.detail.splitlines()[0]
        if len(detail) > 80:
            name, _, kind = detail.rpartition(" ")
            detail = name[: 76 - len(kind)] + "... " + kind
        rows.append((r.mutant.id, r.mutant.file.removeprefix("runtime/kuberl/runtime/"), " ".join(t.removeprefix("tests/unit/") for t in r.mutant.tests),
                     r.outcome, detail, f"{r.seconds:.0f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for k, row in enumerate(rows):
        print(" | ".join(cell.ljust(w) for cell, w in zip(row, widths)))
        if k == 0:
            print("-+-".join("-" * w for w in widths))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="print the mutants and their tests, run nothing")
    ap.add_argument("--only", action="append", default=[], metavar="ID", help="run only these mutants (repeatable)")
    ap.add_argument("--jobs", type=int, default=1, help="mutants run in parallel, each in its own copy (default 1)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per mutant's test run (default 300)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the check that the selected tests pass unmutated")
    ap.add_argument("--tests", nargs="+", metavar="NODE", help="run these tests for every mutant instead of its own selection "
                    "(e.g. an integration test; wrap heavy ones in the shared lock)")
    ap.add_argument("--fresh", action="store_true", help="a fresh Python per mutant instead of forks of one that imported torch "
                    "and the rest once (scripts/mutation_zygote.py)")
    args = ap.parse_args(argv)

    unknown = set(args.only) - {m.id for m in MUTANTS}
    if unknown:
        ap.error(f"unknown mutant(s) {sorted(unknown)}; known: {[m.id for m in MUTANTS]}")
    mutants = tuple(m for m in MUTANTS if not args.only or m.id in args.only)
    if args.tests:
        mutants = tuple(dataclasses.replace(m, tests=tuple(args.tests)) for m in mutants)
    if args.list:
        for m in mutants:
            print(f"{m.id}: {m.what}\n    {m.file}: {m.old!r} -> {m.new!r}\n    tests: {' '.join(m.tests)}")
        return 0
    problems = check_mutants(ROOT, mutants)
    if problems:
        print("mutation-check: the mutant table no longer matches the code (update MUTANTS in scripts/mutation-check.py):", file=sys.stderr)
        for p in problems:
            print("  " + p, file=sys.stderr)
        return 2

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kuberl-mutants-") as tmp:
        copies = [make_copy(Path(tmp) / f"copy{i}") for i in range(max(1, min(args.jobs, len(mutants))))]
        assert_imports_from(copies[0])
        if not args.no_baseline:
            # A mutant "killed" by a test that fails anyway proves nothing: the unmutated code must pass.
            tests = selected_tests(mutants)
            code, out = run_tests(copies[0], tests, args.timeout * 2)
            if code != 0:
                print(f"mutation-check: the selected tests fail without any mutant (exit {code}):\n{out[-4000:]}", file=sys.stderr)
                return 2
            print(f"baseline: the {len(tests)} test selections pass unmutated ({time.monotonic() - t0:.0f} s)", flush=True)
        zygotes = {copy: None if args.fresh else Zygote(copy) for copy in copies}
        free = list(copies)

        def job(m: Mutant) -> Result:
            copy = free.pop()
            try:
                r = run_one(copy, m, args.timeout, zygotes[copy])
            finally:
                free.append(copy)
            print(f"  {m.id}: {r.outcome} ({r.seconds:.0f} s)", flush=True)
            return r

        try:
            with ThreadPoolExecutor(len(copies)) as pool:
                results = list(pool.map(job, mutants))
        finally:
            for z in zygotes.values():
                if z:
                    z.close()
    print()
    print_table(results)
    bad = [r for r in results if r.outcome != "killed"]
    print(f"\n{len(results) - len(bad)}/{len(results)} mutants killed in {time.monotonic() - t0:.0f} s")
    for r in bad:
        print(f"\n{r.mutant.id} {r.outcome}: {r.mutant.what}\n  {r.mutant.file}: {r.mutant.old!r} -> {r.mutant.new!r}\n  {r.detail}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
