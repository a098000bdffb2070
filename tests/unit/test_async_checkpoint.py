"""Checkpoints written behind training (checkpoint.asyncSave): the choice, and the real Trainer's stages on one CPU rank.

The Trainer here is the real one (set-up, model, AdamW, DCP's async_save on its own gloo group), its bus a list that
records acks. The write is slowed down, as a GPU's multi-GB write is against its steps, so that training really goes
on while the shards are written. Two ranks under torchrun with FSDP2 and the real bus: tests/integration/test_trainer.py.
"""

from __future__ import annotations

import threading
import time
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _FileSystemWriter

from kuberl.api import RLExperiment
from kuberl.runtime.resources import host_memory_free
from kuberl.runtime.trainer import checkpoint as ck
from kuberl.runtime.trainer import dist as D
from kuberl.runtime.trainer.async_checkpoint import HEADROOM, choose_async_save, state_bytes
from kuberl.runtime.trainer.trainer import Trainer

GiB = 2**30


# ---- the choice ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("setting, backend, device, free, expected, why", [
    ("off", "fsdp", "cuda", None, False, "asyncSave off"),
    ("on", "fsdp", "cpu", None, True, "asyncSave on"),
    ("on", "fsdp", "cuda", 1 * GiB, True, "asyncSave on"),  # the user's choice stands, memory or not
    ("auto", "fsdp", "cuda", None, True, "copied to host memory"),
    ("auto", "fsdp", "cuda", 100 * GiB, True, "copied to host memory"),
    ("auto", "fsdp", "cuda", 11 * GiB, False, "would not fit in the 11.0 GiB"),  # 10 GiB of state needs 12.5 with headroom
    ("auto", "fsdp", "cpu", None, False, "synchronous on cpu"),
    ("auto", "fsdp", "npu", None, False, "synchronous on npu"),
    ("auto", "megatron", "cuda", None, False, "megatron writes its checkpoints synchronously"),
])
def test_async_save_is_chosen_by_setting_backend_device_and_host_memory(setting, backend, device, free, expected, why):
    chosen, reason = choose_async_save(setting, backend=backend, device_type=device, need=10 * GiB, free=free)
    assert chosen is expected and why in reason


def test_the_headroom_is_what_auto_asks_beyond_the_state():
    need = 8 * GiB
    assert choose_async_save("auto", backend="fsdp", device_type="cuda", need=need, free=int(need * HEADROOM))[0]
    assert not choose_async_save("auto", backend="fsdp", device_type="cuda", need=need, free=int(need * HEADROOM) - 1)[0]


def test_host_memory_free_is_the_smaller_of_the_cgroup_room_and_memavailable(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemAvailable:   20000000 kB\n")
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{16 * GiB}\n")
    (v2 / "memory.current").write_text(f"{4 * GiB}\n")
    assert host_memory_free(v2, meminfo) == 12 * GiB
    (v2 / "memory.max").write_text("max\n")
    assert host_memory_free(v2, meminfo) == 20000000 * 1024  # no container limit: the machine's
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{8 * GiB}\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{1 * GiB}\n")
    assert host_memory_free(v1, meminfo) == 7 * GiB
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert host_memory_free(v1, meminfo) == 20000000 * 1024
    assert host_memory_free(tmp_path / "none", tmp_path / "no-meminfo") is None


def test_state_bytes_counts_trained_parameters_and_their_adam_moments():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[1].requires_grad_(False)  # frozen: not in a checkpoint (LoRA's base)
    trained = 4 * 3 + 3
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    assert state_bytes(model, opt) == 3 * trained * 4  # before the first step: the moments to come
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    assert state_bytes(model, opt) == 3 * trained * 4 + 2 * 4  # and AdamW's step counters


# ---- the real Trainer, one CPU rank -----------------------------------------------------------------------------

class AckBus:
    """What the checkpoint stage uses of TrainerBusIO: acks and progress, recorded."""

    groups_buffered = 0

    def __init__(self) -> None:
        self.acked: list[str] = []
        self.progress: list[dict] = []

    async def ack(self, handles):
        self.acked += list(handles)

    async def put_progress(self, progress):
        self.progress.append(progress)


@pytest.fixture
def process_group():
    started = not dist.is_initialized()
    D.init_distributed()
    yield
    if started and dist.is_initialized():
        dist.destroy_process_group()


def set_up_trainer(tmp_path, async_save: str) -> Trainer:
    exp = RLExperiment.model_validate({
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "unit-async-ckpt"},
        "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit", "size": 20},
                 "algorithm": {"name": "grpo", "samplesPerPrompt": 2, "batchSize": 2}, "training": {"totalSteps": 5},
                 "checkpoint": {"everySteps": 1, "asyncSave": async_save}},
    })
    t = Trainer(exp, bus_url="nats://unused:4222", workdir=tmp_path)
    t.setup()
    t.bus = AckBus()
    return t


def train_a_step(t: Trainer) -> None:
    """A stand-in for a PPO step: AdamW moves every weight, in place, as the next steps do while the write goes on."""
    loss = sum((p.float() ** 2).sum() for p in t.model.parameters())
    loss.backward()
    t.optimizer.step()
    t.optimizer.zero_grad()
    t.step += 1
    t.version += 1


def slow_writes(seconds: float, fail: bool = False):
    """DCP's file writes (in the background thread) start `seconds` late, or fail: a large model's write on a GPU node."""
    real = _FileSystemWriter.write_data
    started = threading.Event()

    def write_data(self, plan, planner):
        started.set()
        time.sleep(seconds)
        if fail:
            raise OSError(28, "No space left on device")
        return real(self, plan, planner)

    return mock.patch.object(_FileSystemWriter, "write_data", write_data), started


async def test_a_background_checkpoint_holds_the_weights_of_its_step_and_acks_only_its_groups_once_committed(tmp_path, process_group):
    t = set_up_trainer(tmp_path, "on")
    assert t.checkpoint_group is not None
    train_a_step(t)
    at_step_1 = {k: v.detach().clone() for k, v in t.model.state_dict().items()}
    t.held = ["lease-a", "lease-b"]  # the groups step 1 trained on
    patch, started = slow_writes(1.0)
    with patch:
        began = time.monotonic()
        await t.stage_checkpoint(background=True)
        assert time.monotonic() - began < 1.0, "the stage returned before the write: training goes on"
        assert started.wait(10)
        assert t.pending_checkpoint is not None and t.pending_checkpoint.step == 1
        # Training goes on meanwhile: step 2 changes every weight and collects other groups.
        train_a_step(t)
        t.held = ["lease-c"]
        assert not (tmp_path / "checkpoints" / ck.checkpoint_name(1)).exists() and t.bus.acked == [], "nothing committed or acked yet"
        await t.finish_checkpoint(wait=False)
        assert t.pending_checkpoint is not None, "the write is not done: nothing to commit yet"
        await t.finish_checkpoint()
    assert t.pending_checkpoint is None
    assert t.bus.acked == ["lease-a", "lease-b"] and t.held == ["lease-c"], "step 2's group waits for a checkpoint that covers it"
    latest = ck.latest_checkpoint(tmp_path / "checkpoints")
    assert latest.step == 1 and t.last_checkpoint["step"] == 1 and t.bus.progress[-1]["checkpoint"]["step"] == 1
    saved = ck.read_model_state(latest.path)
    for name, value in at_step_1.items():
        assert torch.equal(saved[name], value), f"{name}: the checkpoint holds later weights than its step's"
    assert ck.load_trainer_state(latest.path)["version"] == 1


async def test_the_last_checkpoint_waits_for_the_one_in_flight_and_a_failed_write_commits_and_acks_nothing(tmp_path, process_group):
    t = set_up_trainer(tmp_path, "on")
    train_a_step(t)
    t.held = ["lease-a"]
    patch, _ = slow_writes(0.5)
    with patch:
        await t.stage_checkpoint(background=True)
        await t.stage_checkpoint()  # the end of training at the same step: waits for it, commits it, writes nothing more
    assert t.bus.acked == ["lease-a"] and [c.step for c in ck.list_checkpoints(tmp_path / "checkpoints")] == [1]

    train_a_step(t)
    t.held = ["lease-b"]
    patch, _ = slow_writes(0.1, fail=True)
    with patch:
        await t.stage_checkpoint(background=True)
        with pytest.raises(CheckpointException, match="No space left"):  # DCP reports each rank's failure
            await t.finish_checkpoint()
    assert t.bus.acked == ["lease-a"], "the groups of a checkpoint that was never written stay unacknowledged (redelivered)"
    assert ck.latest_checkpoint(tmp_path / "checkpoints").step == 1


async def test_asyncsave_auto_on_cpu_writes_synchronously(tmp_path, process_group):
    t = set_up_trainer(tmp_path, "auto")
    assert t.checkpoint_group is None
    train_a_step(t)
    t.held = ["lease-a"]
    await t.stage_checkpoint(background=True)
    assert t.pending_checkpoint is None and t.bus.acked == ["lease-a"] and ck.latest_checkpoint(tmp_path / "checkpoints").step == 1


async def test_a_checkpoint_whose_write_ends_while_the_trainer_waits_for_groups_is_committed_then(tmp_path, process_group):
    """The engines may keep the trainer waiting for minutes: its groups are acknowledged (and progress shows it) as soon
    as the write is done, not only after the next step."""
    import asyncio

    from kuberl.runtime.bus import Sample, TrajectoryGroup

    t = set_up_trainer(tmp_path, "on")
    train_a_step(t)
    t.held = ["lease-a"]
    t.book.bound.consumed = t.book.bound.issued = 0
    # The groups come 0.5 s after the write (0.3 s, longer on a busy machine) is done: the trainer must commit it in
    # that wait, not after the groups arrive.
    written_at: list[float] = []

    class WaitingBus(AckBus):
        tickets: list = []

        async def publish_tickets(self, tickets):
            self.tickets += tickets
            return len(tickets)

        async def put_tickets(self, state):
            pass

        async def get_control(self):
            return {}

        async def fetch_groups(self, max_n, timeout):
            pending = t.pending_checkpoint
            if not written_at and (pending is None or pending.future.done()):
                written_at.append(time.monotonic())
            if not written_at or time.monotonic() < written_at[0] + 0.5:
                await asyncio.sleep(0.05)
                return []
            out, self.tickets = self.tickets[:max_n], self.tickets[max_n:]
            return [(TrajectoryGroup(group_id=tk.ticket_id, ticket=tk, samples=[
                Sample(input_ids=[1, 2], output_ids=[3, 4], logprobs=[-1.0, -1.0], versions=[1, 1], loss_mask=[1, 1], reward=r)
                for r in (1.0, 0.0)]), f"lease-{tk.ticket_id}") for tk in out]

    t.bus = WaitingBus()
    patch, _ = slow_writes(0.3)
    with patch:
        await t.stage_checkpoint(background=True)
        await t.stage_issue_tickets()
        plan = await t.stage_collect()
    assert len(plan["groups"]) == 2
    assert t.pending_checkpoint is None and t.bus.acked == ["lease-a"], "committed while the trainer waited"
    assert ck.latest_checkpoint(tmp_path / "checkpoints").step == 1
