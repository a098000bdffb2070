"""spec.tracking: real TensorBoard, W&B (offline) and MLflow (file store) files written by kuberl.runtime.tracking
and read back with each library's own reader; a tracker that is down never holds training up; the trainer writes
every step to them from rank 0; the operator hands credentials over only as secretKeyRef."""

from __future__ import annotations

import json
import logging
import socket
import struct
import time
from pathlib import Path

import pytest
import torch
import yaml

from kuberl.api import RLExperiment
from kuberl.api.tracking import MLFLOW_TOKEN_ENV, WANDB_API_KEY_ENV, TrackingSpec
from kuberl.runtime import tracking as T
from kuberl.runtime.tracking import Tracking, flatten_metrics

STEPS = [1, 2, 3]


def row(step: int) -> dict:
    """A metrics.jsonl row as the trainer writes it (abridged), with values that differ per step."""
    return {"step": step, "time": 1_700_000_000.0 + step, "policy_version": step, "reward_mean": 0.1 * step, "loss": -0.01 * step,
            "entropy": 5.0 - step, "staleness_mean": 0.5 * step, "staleness_max": step, "samples_per_second": 10.0 + step,
            "timings": {"train.collect": 1.5 * step}, "group_ids": ["g1", "g2"], "grad_norm": float("nan"), "done": False}


def track(spec: dict, workdir: Path, steps=STEPS, **kw) -> Tracking:
    tr = Tracking.from_spec(TrackingSpec.model_validate(spec), workdir=workdir, name="exp", namespace="team",
                            config={"algorithm": {"name": "grpo", "batchSize": 4, "learningRate": 1e-3}}, **kw)
    for s in steps:
        tr.log(s, row(s))
    tr.close(timeout=120)
    return tr


def test_flatten_keeps_finite_numbers_and_joins_nested_names():
    flat = flatten_metrics(row(2) | {"eval": {"pass@1": 0.5}})
    assert flat["reward_mean"] == pytest.approx(0.2)
    assert flat["timings/train.collect"] == pytest.approx(3.0)
    assert flat["eval/pass_1"] == 0.5  # characters MLflow refuses become "_"
    for gone in ("step", "time", "group_ids", "grad_norm", "done"):  # the x axis, a list, NaN, a bool
        assert gone not in flat


# ----------------------------------------------------------------------------------------------
# Each library, read back with its own reader
# ----------------------------------------------------------------------------------------------


def test_tensorboard_event_files_hold_every_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tr = track({"tensorboard": {"logDir": "tb/run1"}}, tmp_path)
    assert [w.written for w in tr.workers] == [3]
    acc = EventAccumulator(str(tmp_path / "tb" / "run1"))
    acc.Reload()
    assert {"reward_mean", "entropy", "staleness_mean", "samples_per_second", "timings/train.collect"} <= set(acc.Tags()["scalars"])
    assert [(e.step, round(e.value, 5)) for e in acc.Scalars("reward_mean")] == [(s, round(0.1 * s, 5)) for s in STEPS]
    assert [(e.step, e.value) for e in acc.Scalars("entropy")] == [(s, 5.0 - s) for s in STEPS]
    assert [e.wall_time for e in acc.Scalars("loss")] == [1_700_000_000.0 + s for s in STEPS]


def test_a_restarted_trainer_replaces_the_steps_it_trains_again_in_tensorboard(tmp_path):
    """Killed after step 3 with its checkpoint at step 1, a trainer re-trains steps 2 and 3: TensorBoard shows each step
    once, the re-trained values (a new event file alone would leave both)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    track({"tensorboard": {}}, tmp_path)  # steps 1-3
    time.sleep(1.1)  # event files are named by the second they are opened in
    tr = Tracking.from_spec(TrackingSpec.model_validate({"tensorboard": {}}), workdir=tmp_path, name="exp", namespace="team")
    for s in (2, 3, 4):
        tr.log(s, row(s) | {"reward_mean": 1.0 + s})
    tr.close(timeout=120)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, round(e.value, 5)) for e in acc.Scalars("reward_mean")] == [(1, 0.1), (2, 3.0), (3, 4.0), (4, 5.0)]


def wandb_records(path: Path):
    """The protobuf records of a W&B transaction log (.wandb): W&B's LevelDB-style log, read by hand since the SDK
    no longer ships a Python reader. Header ':W&B' + magic 0xBEE1 + version 0; 32 KiB blocks of records
    (crc32 4, length 2, type 1: full 1, first 2, middle 3, last 4)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:7] == b":W&B\xe1\xbe\x00", data[:7]
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            yield rec
            buf = b""


def wandb_history(workdir: Path) -> tuple[list[dict], list]:
    runs = sorted((workdir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert runs, list((workdir / "wandb").rglob("*"))
    history, run_records = [], []
    for path in runs:
        for rec in wandb_records(path):
            kind = rec.WhichOneof("record_type")
            if kind == "history":
                history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
            elif kind == "run":
                run_records.append(rec.run)
    return history, run_records


def test_wandb_offline_run_holds_every_step_and_a_restart_continues_the_same_run(tmp_path):
    track({"wandb": {"project": "kuberl-test", "mode": "offline", "tags": ["ci"]}}, tmp_path, steps=[1, 2])
    track({"wandb": {"project": "kuberl-test", "mode": "offline", "tags": ["ci"]}}, tmp_path, steps=[3])  # the trainer restarted
    # run.finish() returns before wandb-core has appended the last records to the run's .wandb file (seen
    # about once in 40 runs: step 3 missing when read at once, there a moment later): read until it holds them.
    deadline = time.monotonic() + 15
    while True:
        history, runs = wandb_history(tmp_path)
        steps = {int(h["trainer/step"]): h for h in history if "trainer/step" in h}
        if sorted(steps) == STEPS or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sorted(steps) == STEPS
    for s in STEPS:
        assert steps[s]["reward_mean"] == pytest.approx(0.1 * s)
        assert steps[s]["timings/train.collect"] == pytest.approx(1.5 * s)
    assert {r.project for r in runs} == {"kuberl-test"}
    assert len({r.run_id for r in runs}) == 1  # the same run id both times (tracking.json)
    assert {r.display_name for r in runs} == {"exp"}
    assert json.loads((tmp_path / "tracking.json").read_text())["wandb"] == runs[0].run_id


def test_mlflow_file_store_run_holds_every_step_and_a_restart_continues_the_same_run(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    track({"mlflow": {}}, tmp_path, steps=[1, 2])
    track({"mlflow": {}}, tmp_path, steps=[3])
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    exp = client.get_experiment_by_name("team/exp")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params == {"algorithm": "grpo", "batch_size": "4", "learning_rate": "0.001"}
    assert run.data.tags["kuberl.io/experiment"] == "team/exp"
    hist = client.get_metric_history(run.info.run_id, "reward_mean")
    assert sorted((m.step, round(m.value, 5)) for m in hist) == [(s, round(0.1 * s, 5)) for s in STEPS]
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "timings/train.collect")) == STEPS


def test_nothing_selected_writes_nothing(tmp_path):
    tr = Tracking.from_spec(None, workdir=tmp_path, name="exp", namespace="team")
    tr.log(1, row(1))
    tr.close()
    assert tr.workers == [] and list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------------------------
# A tracker that is down
# ----------------------------------------------------------------------------------------------


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_mlflow_server_never_holds_a_step_up_and_is_logged_once(tmp_path, caplog):
    spec = TrackingSpec.model_validate({"tensorboard": {}, "mlflow": {"trackingUri": f"http://127.0.0.1:{closed_port()}"}})
    tr = Tracking.from_spec(spec, workdir=tmp_path, name="exp", namespace="team", retry_seconds=0.0)
    with caplog.at_level(logging.WARNING, logger="kuberl.tracking"):
        t0 = time.monotonic()
        for s in range(1, 6):
            tr.log(s, row(s))
        assert time.monotonic() - t0 < 0.5  # log() only queues
        tr.close(timeout=120)
    tb, ml = tr.workers
    assert tb.written == 5 and ml.written == 0  # TensorBoard is unaffected
    failed = [r for r in caplog.records if "mlflow failed" in r.getMessage()]
    assert len(failed) == 1, [r.getMessage() for r in caplog.records]
    assert "5 steps were not written" in caplog.text


class Flaky:
    """A backend that fails to start twice, then works."""

    name = "flaky"

    def __init__(self):
        self.starts, self.seen, self.closed = 0, [], False

    def start(self):
        self.starts += 1
        if self.starts <= 2:
            raise ConnectionError("server down")

    def log(self, step, metrics, wall):
        self.seen.append((step, metrics["reward_mean"]))

    def close(self):
        self.closed = True


def test_steps_logged_while_a_tracker_is_down_arrive_in_order_when_it_comes_back(caplog):
    fl = Flaky()
    tr = Tracking([fl], retry_seconds=0.0)
    with caplog.at_level(logging.INFO, logger="kuberl.tracking"):
        for s in STEPS:
            tr.log(s, row(s))
        tr.close(timeout=10)
    assert fl.seen == [(s, pytest.approx(0.1 * s)) for s in STEPS] and fl.closed
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("flaky failed" in m for m in msgs) == 1 and sum("flaky works again" in m for m in msgs) == 1


def test_a_tracker_that_hangs_on_close_is_left_behind_after_the_timeout():
    class Hang(Flaky):
        def start(self):
            pass

        def close(self):
            time.sleep(30)

    tr = Tracking([Hang()])
    tr.log(1, row(1))
    t0 = time.monotonic()
    tr.close(timeout=0.5)
    assert time.monotonic() - t0 < 5


# ----------------------------------------------------------------------------------------------
# The trainer (rank 0) and the operator
# ----------------------------------------------------------------------------------------------


class ReportBus:
    groups_buffered = 0

    def __init__(self):
        self.progress = []

    async def refresh_buffered(self, n):
        pass

    async def put_tickets(self, state):
        pass

    async def put_progress(self, p):
        self.progress.append(p)


def experiment(tracking: dict | None) -> RLExperiment:
    spec = {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "add-small"}, "training": {"totalSteps": 3}}
    if tracking is not None:
        spec["tracking"] = tracking
    return RLExperiment.model_validate({"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment",
                                        "metadata": {"name": "unit", "namespace": "team"}, "spec": spec})


async def report(t, stats: dict) -> None:
    """One step's report as Trainer.train_one_step makes it: the row (rank 0 only), then train.report."""
    await t.stage_report(await t.step_row(stats) if t.info.is_main else None)


def stats(step: int) -> dict:
    return {"samples": 8, "step_seconds": 1.0, "wait_seconds": 0.5, "reward_mean": 0.1 * step, "loss": 0.0, "entropy": 2.0,
            "staleness_mean": 0.0, "staleness_max": 0, "timings": {"train.collect": 0.5}, "group_ids": ["a"]}


@pytest.mark.parametrize("rank", [0, 1])
async def test_the_trainer_writes_each_reported_step_to_the_trackers_on_rank_0_only(tmp_path, rank):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from kuberl.runtime.trainer.dist import DistInfo
    from kuberl.runtime.trainer.tickets import TicketBook
    from kuberl.runtime.trainer.trainer import Trainer

    t = Trainer(experiment({"tensorboard": {}}), bus_url="nats://unused:4222", workdir=tmp_path)
    t.info = DistInfo(rank, 2, rank, torch.device("cpu"))
    t.book, t.bus, t.total_steps = TicketBook(20, 2, 0, total_groups=6), ReportBus(), 3
    for s in STEPS:
        t.step = t.version = s
        await report(t, stats(s))
    if rank:
        assert t.tracking is None and not (tmp_path / "tensorboard").exists() and not (tmp_path / "metrics.jsonl").exists()
        return
    t.tracking.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == STEPS  # metrics.jsonl as before
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, round(e.value, 5)) for e in acc.Scalars("reward_mean")] == [(s, round(0.1 * s, 5)) for s in STEPS]
    assert [e.step for e in acc.Scalars("timings/train.collect")] == STEPS


async def test_without_spec_tracking_the_trainer_writes_metrics_jsonl_only(tmp_path):
    from kuberl.runtime.trainer.dist import DistInfo
    from kuberl.runtime.trainer.tickets import TicketBook
    from kuberl.runtime.trainer.trainer import Trainer

    t = Trainer(experiment(None), bus_url="nats://unused:4222", workdir=tmp_path)
    t.info = DistInfo(0, 1, 0, torch.device("cpu"))
    t.book, t.bus, t.total_steps, t.step = TicketBook(20, 2, 0, total_groups=6), ReportBus(), 3, 1
    await report(t, stats(1))
    t.tracking.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_the_operator_passes_tracking_credentials_only_as_secret_refs():
    from kuberl.operator.builders import build_children
    from kuberl.operator.builders.trainer import build_trainer_job

    exp = experiment({"wandb": {"project": "p", "apiKeySecret": {"name": "wandb-key", "key": "apiKey"}},
                      "mlflow": {"trackingUri": "https://mlflow.example", "tokenSecret": {"name": "mlflow"}}})
    env = {e["name"]: e for e in build_trainer_job(exp)["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env[WANDB_API_KEY_ENV] == {"name": WANDB_API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": "wandb-key", "key": "apiKey"}}}
    assert env[MLFLOW_TOKEN_ENV] == {"name": MLFLOW_TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": "mlflow", "key": "token"}}}
    # No other object names the variables, and the ConfigMap holds only the Secrets' names.
    children = build_children(exp)
    for obj in children:
        text = yaml.safe_dump(obj)
        if obj["kind"] != "Job":
            assert WANDB_API_KEY_ENV not in text and MLFLOW_TOKEN_ENV not in text, obj["kind"]
    plain = experiment({"tensorboard": {}})
    names = {e["name"] for e in build_trainer_job(plain)["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert not names & {WANDB_API_KEY_ENV, MLFLOW_TOKEN_ENV}


def test_tracking_module_imports_no_tracker_library_until_a_tracker_starts():
    import subprocess
    import sys

    code = ("import sys, kuberl.runtime.tracking; "
            "print(sorted(m for m in ('wandb', 'mlflow', 'tensorboard', 'torch.utils.tensorboard') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout
    assert out.strip() == "[]"
    assert T.MAX_PENDING >= 10_000


@pytest.mark.parametrize("log_dir, ok", [("tensorboard", True), ("tb/run-1", True), ("/abs", False), ("../up", False), ("a/../b", False)])
def test_the_tensorboard_folder_stays_inside_the_workdir(log_dir, ok):
    from kuberl.api.validation import validate_manifest

    doc = {"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "t"},
           "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "add-small"}, "tracking": {"tensorboard": {"logDir": log_dir}}}}
    errors = [str(e) for e in validate_manifest(doc)]
    assert (errors == []) is ok, errors
    if not ok:
        assert errors[0].startswith(f'spec.tracking.tensorboard.logDir: Invalid value: "{log_dir}"')
        with pytest.raises(ValueError, match="logDir"):
            RLExperiment.model_validate(doc)


def test_steps_still_waiting_at_the_end_get_a_few_more_tries(monkeypatch):
    """A tracker that is down when training ends (W&B's service slow to start on a loaded machine) is tried
    again a few times before close gives up, instead of once."""
    import kuberl.runtime.tracking as tracking

    monkeypatch.setattr(tracking, "CLOSE_RETRY_SECONDS", 0.01)
    fl = Flaky()  # fails to start twice: the close's own try and its first retry
    tr = Tracking([fl], retry_seconds=3600.0)  # no retry before the end: only the close's
    for s in range(1, 4):
        tr.log(s, row(s))
    tr.close(timeout=30)
    assert fl.starts == 3 and [s for s, _ in fl.seen] == [1, 2, 3] and fl.closed


def test_on_resume_the_checkpoints_row_is_written_once_if_missing_and_a_row_cut_short_is_removed(tmp_path):
    """A trainer killed between committing step 2's checkpoint and writing its row (Trainer.restore_row)."""
    from kuberl.runtime.trainer.dist import DistInfo
    from kuberl.runtime.trainer.trainer import Trainer

    t = Trainer(experiment(None), bus_url="nats://unused:4222", workdir=tmp_path)
    t.info = DistInfo(0, 1, 0, torch.device("cpu"))
    path = tmp_path / "metrics.jsonl"
    row1, row2 = {"step": 1, **stats(1)}, {"step": 2, **stats(2)}
    path.write_text(json.dumps(row1) + "\n" + '{"step": 2, "rew')  # the kill cut a row short
    t.restore_row(row2)
    t.restore_row(row2)  # a second resume from the same checkpoint: the row is there now
    t.tracking.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [row1, row2]
    path.write_text(json.dumps(row1) + "\n" + '{"st')
    t.restore_row(None)  # a checkpoint without a row (older, or the final one): only the cut row goes
    assert path.read_text() == json.dumps(row1) + "\n"


@pytest.mark.parametrize(("text", "kept"), [("", ""), ("a\n", "a\n"), ("a\nbb", "a\n"), ("cut", ""), ("a\n" + "x" * 20, "a\n"),
                                            ("a\n" + "y" * 9 + "\n", "a\n" + "y" * 9 + "\n")])
def test_a_row_cut_short_is_found_across_read_chunks(tmp_path, text, kept):
    from kuberl.runtime.trainer.report import _cut_short

    path = tmp_path / "metrics.jsonl"
    path.write_text(text)
    assert _cut_short(path, chunk=4) == len(text) - len(kept)
    assert path.read_text() == kept
