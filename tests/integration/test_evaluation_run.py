"""Held-out evaluation (spec.evaluation) on the real bus and in a real `kuberl run`.

The bus: evaluation tickets and results ride subjects of their own, never seen by the training ticket
consumer nor counted as training tickets. The run: a short synchronous run (eta 0, so the trained groups
are the same every time) with evaluation every 3 steps writes eval/* metrics at the steps the rounds
finish, a last line for the final step, prints the evaluation, and trains exactly the groups a run
without evaluation trains.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kuberl.runtime.bus import Bus, Ticket
from kuberl.runtime.bus.messages import EvalResult, EvalTicket
from tests.integration.test_run import ROOT, quickstart_manifest, read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

STEPS = 6
EVERY = 3
EVAL_ITEMS = 8
EVAL_SAMPLES = 4


async def test_eval_tickets_and_results_stay_apart_from_training(nats_server):
    bus = await Bus.connect(nats_server.url, "eval-bus")
    try:
        await bus.reset_experiment()
        await bus.publish_tickets([Ticket(ticket_id="e0-i0-0", index=0, epoch=0, issued_version=0)])
        evals = [EvalTicket(eval_id=f"s3-i{i}", step=3, index=i, version=3, samples=2, greedy=True) for i in range(3)]
        assert await bus.publish_eval_tickets(evals) == 3
        assert await bus.publish_eval_tickets(evals) == 0, "re-issued evaluation tickets are deduplicated"
        info = await bus.stream_info()
        assert info["tickets_pending"] == 1, "evaluation tickets are not training tickets"
        got = await bus.pull_tickets(10, timeout=1.0)
        assert [x.value.ticket_id for x in got] == ["e0-i0-0"], "the training consumer never sees evaluation tickets"
        ev = await bus.pull_eval_ticket(timeout=1.0)
        assert ev is not None and ev.value.eval_id == "s3-i0"
        await bus.publish_eval_result(EvalResult(eval_id="s3-i0", step=3, index=0, version=3, rewards=[1.0, 0.0], greedy_reward=1.0))
        await ev.ack()
        results = await bus.pull_eval_results(timeout=1.0)
        assert [r.value.rewards for r in results] == [[1.0, 0.0]]
        await results[0].ack()
        await bus.purge_eval()
        assert await bus.pull_eval_ticket(timeout=0.5) is None, "purged: the two tickets left are gone"
    finally:
        await bus.close()


def run(tmp: Path, name: str, **overrides) -> tuple[subprocess.CompletedProcess, Path]:
    manifest = quickstart_manifest(tmp, name, **{"training.totalSteps": STEPS, "staleness.maxHeadOffpolicyness": 0,
                                                 "checkpoint.everySteps": 100, **overrides})
    workdir = tmp / f"work-{name}"
    proc = subprocess.run([sys.executable, "-m", "kuberl.cli", "run", str(manifest), "--workdir", str(workdir)],
                          cwd=ROOT, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, workdir


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("eval")
    evaluation = {"split": "heldout", "size": EVAL_ITEMS, "everySteps": EVERY, "samplesPerPrompt": EVAL_SAMPLES, "passAtK": [1, EVAL_SAMPLES]}
    with_eval = run(tmp, "with-eval", evaluation=evaluation)
    without = run(tmp, "without-eval")
    return with_eval, without


def test_eval_metrics_are_written_printed_and_complete(runs):
    (proc, workdir), _ = runs
    rows = read_metrics(workdir)
    evals = [r for r in rows if "eval/reward_mean" in r]
    assert evals, "no row carries evaluation metrics"
    assert sorted({r["evaluated_step"] for r in evals}) == [EVERY, STEPS], "rounds after step 3 and after the last step"
    last = rows[-1]
    assert last["step"] == STEPS and last["evaluated_step"] == STEPS, "the final round lands in a last line of the final step"
    for r in evals:
        assert r["evaluated_items"] == EVAL_ITEMS and r["evaluated_failed_items"] == 0
        assert r["evaluated_policy_version"] == r["evaluated_step"] and r["evaluated_version_min"] >= r["evaluated_step"]
        for key in ("eval/reward_mean", "eval/greedy_reward_mean", "eval/pass_at_1", f"eval/pass_at_{EVAL_SAMPLES}", "eval/pass_at_1_greedy"):
            assert 0.0 <= r[key] <= 1.0, (key, r)
        assert r["eval/pass_at_1"] <= r[f"eval/pass_at_{EVAL_SAMPLES}"] + 1e-9
    assert f"eval (step {STEPS}, v{STEPS}, {EVAL_ITEMS} items)" in proc.stdout, proc.stdout[-2000:]


def test_evaluation_does_not_change_what_is_trained(runs):
    (_, with_dir), (_, without_dir) = runs

    def trained(workdir: Path) -> dict[int, list[str]]:
        return {r["step"]: sorted(r["group_ids"]) for r in read_metrics(workdir) if "group_ids" in r}

    a, b = trained(with_dir), trained(without_dir)
    assert sorted(a) == list(range(1, STEPS + 1)) and a == b
    assert not any("eval/reward_mean" in json.loads(x) for x in (without_dir / "metrics.jsonl").read_text().splitlines() if x.strip())
