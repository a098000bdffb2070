"""CPU resources per role (runtime/kuberl/runtime/resources.py): core split, cgroup quota, thread environment.

The pure functions first, then `kuberl run`'s plan (engine and trainer on disjoint cores), then a real
child process that applies $KUBERL_CPUS/$KUBERL_THREADS: its affinity and torch's thread count follow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kuberl.api import RLExperiment
from kuberl.runtime.launcher import LocalRun
from kuberl.runtime.resources import (
    ResourceError,
    RoleCPUs,
    cgroup_cpu_limit,
    cpu_quantity,
    format_cpu_list,
    parse_cpu_list,
    plan_local_cpus,
    process_settings,
    split_cores,
    thread_count,
)


def experiment(**spec) -> RLExperiment:
    base = {"model": {"builtin": "tiny-qwen2", "dtype": "float32"}, "dataset": {"builtin": "repeat-digit"},
            "rollout": {"engine": "vllm", "replicas": 1, "accelerator": {"type": "cpu", "count": 0}},
            "trainer": {"accelerator": {"type": "cpu", "count": 1}}}
    for k, v in spec.items():
        base[k] = {**base.get(k, {}), **v}
    return RLExperiment.model_validate({"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "res"}, "spec": base})


class TestCpuLists:
    def test_round_trip(self):
        assert parse_cpu_list("0-2,5, 7-8") == [0, 1, 2, 5, 7, 8]
        assert format_cpu_list([8, 0, 1, 2, 5, 7]) == "0-2,5,7-8"
        assert format_cpu_list([3]) == "3"

    @pytest.mark.parametrize("bad", ["", "a", "3-1", "-1", "1-x"])
    def test_bad_lists_are_errors_that_quote_the_text(self, bad):
        with pytest.raises(ResourceError, match="CPU list"):
            parse_cpu_list(bad)

    def test_cpu_quantities(self):
        assert cpu_quantity("500m") == 0.5 and cpu_quantity(2) == 2.0 and cpu_quantity("1.5") == 1.5 and cpu_quantity(None) is None
        with pytest.raises(ResourceError):
            cpu_quantity("two")


class TestCgroupLimit:
    def test_v2_quota_in_cores(self, tmp_path):
        (tmp_path / "cpu.max").write_text("150000 100000\n")
        assert cgroup_cpu_limit(tmp_path) == 1.5

    def test_v2_unlimited(self, tmp_path):
        (tmp_path / "cpu.max").write_text("max 100000\n")
        assert cgroup_cpu_limit(tmp_path) is None

    def test_v1_quota_and_unlimited(self, tmp_path):
        (tmp_path / "cpu").mkdir()
        (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
        (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
        assert cgroup_cpu_limit(tmp_path) == 2.0
        (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
        assert cgroup_cpu_limit(tmp_path) is None

    def test_no_cgroup_files_means_no_limit(self, tmp_path):
        assert cgroup_cpu_limit(tmp_path) is None


class TestThreads:
    def test_the_quota_not_the_node_sizes_the_pools(self):
        assert thread_count(64, 2.0) == 2  # a 64-core node, a 2-CPU container
        assert thread_count(64, 1.5) == 1  # whole cores only: a second thread would be throttled
        assert thread_count(64, 0.25) == 1
        assert thread_count(2, None) == 2
        assert thread_count(2, 8.0) == 2  # never more threads than cores to run them

    def test_a_pod_gets_its_limit_as_thread_counts_and_an_unbound_engine(self):
        cpus, env = process_settings("engine", {}, list(range(64)), 4.0)
        assert cpus == list(range(64))  # no cores named: the pod's own affinity, left alone
        assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "3"  # one of the 4 left to the server and scheduler
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"  # the node's cores are shared: bind none of them
        _, trainer = process_settings("trainer", {}, list(range(64)), 4.0)
        assert trainer["OMP_NUM_THREADS"] == "4"

    def test_torchrun_ranks_in_a_pod_share_its_limit(self):
        _, env = process_settings("trainer", {"LOCAL_WORLD_SIZE": "4"}, list(range(64)), 8.0)
        assert env["OMP_NUM_THREADS"] == "2"

    def test_a_user_setting_is_kept(self):
        _, env = process_settings("trainer", {"OMP_NUM_THREADS": "3"}, list(range(8)), None)
        assert "OMP_NUM_THREADS" not in env and env["MKL_NUM_THREADS"] == "8"

    def test_kuberl_run_names_the_cores_and_threads(self):
        cpus, env = process_settings("engine", {"KUBERL_CPUS": "2-4", "KUBERL_THREADS": "3"}, list(range(8)), None)
        assert cpus == [2, 3, 4] and env["OMP_NUM_THREADS"] == "2" and env["VLLM_CPU_OMP_THREADS_BIND"] == "2-3"
        _, one = process_settings("engine", {"KUBERL_CPUS": "0", "KUBERL_THREADS": "1"}, [0, 1], None)
        assert one["OMP_NUM_THREADS"] == "1" and one["VLLM_CPU_OMP_THREADS_BIND"] == "0"

    def test_an_engine_with_compute_cores_binds_every_one_of_them(self):
        cpus, env = process_settings("engine", {"KUBERL_CPUS": "0-7", "KUBERL_COMPUTE_CPUS": "0-3", "KUBERL_THREADS": "4"}, list(range(8)), None)
        assert cpus == list(range(8)) and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-3" and env["OMP_NUM_THREADS"] == "4"
        _, tp2 = process_settings("engine", {"KUBERL_CPUS": "0-7", "KUBERL_COMPUTE_CPUS": "2-5", "KUBERL_THREADS": "4"}, list(range(8)), None,
                                  tensor_parallel=2)
        assert tp2["VLLM_CPU_OMP_THREADS_BIND"] == "2-3|4-5" and tp2["OMP_NUM_THREADS"] == "2"

    def test_a_tensor_parallel_engine_binds_one_block_per_rank(self):
        _, env = process_settings("engine", {"KUBERL_CPUS": "0-5", "KUBERL_THREADS": "6"}, list(range(6)), None, tensor_parallel=2)
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1|2-3" and env["OMP_NUM_THREADS"] == "2"

    @pytest.mark.parametrize("bad", ["0", "x"])
    def test_bad_thread_counts_are_errors(self, bad):
        with pytest.raises(ResourceError, match="KUBERL_THREADS"):
            process_settings("trainer", {"KUBERL_THREADS": bad}, [0, 1], None)


class TestSplit:
    def test_two_cores_one_each(self):
        assert split_cores([0, 1], {"engine-0": 1, "trainer": 1}) == {"engine-0": RoleCPUs((0,), 1), "trainer": RoleCPUs((1,), 1)}

    def test_by_weight_each_at_least_one(self):
        plan = split_cores(list(range(8)), {"engine-0": 3, "engine-1": 3, "trainer": 1})
        sizes = {k: len(v.cpus) for k, v in plan.items()}
        assert sum(sizes.values()) == 8 and sizes["trainer"] >= 1 and sizes["engine-0"] == sizes["engine-1"] > sizes["trainer"]
        every = [c for v in plan.values() for c in v.cpus]
        assert sorted(every) == list(range(8))  # disjoint and complete

    def test_fewer_cores_than_roles_share_without_oversubscribing(self):
        plan = split_cores([0, 1], {"engine-0": 1, "engine-1": 1, "trainer": 1})
        assert all(v.cpus == (0, 1) and v.threads == 1 for v in plan.values())


class TestLocalPlan:
    def test_engine_workers_and_trainer_compute_on_disjoint_cores_servers_and_agents_run_anywhere(self):
        plan = plan_local_cpus(experiment(), [0, 1])
        assert plan["engine-0"].compute == (0,) and plan["trainer"].cpus == (1,)
        assert plan["engine-0"].cpus == plan["rollout-0"].cpus == (0, 1) and plan["rollout-0"].threads == 1

    @pytest.mark.parametrize("cores", [[0], [0, 1], list(range(8))])
    def test_engines_and_agents_run_under_sched_batch_the_trainer_does_not(self, cores):
        plan = plan_local_cpus(experiment(rollout={"replicas": 2}), cores)
        assert {name for name, role in plan.items() if role.batch} == {"engine-0", "engine-1", "rollout-0", "rollout-1"}

    def test_cpu_requests_weigh_the_split(self):
        exp = experiment(rollout={"resources": {"requests": {"cpu": "6"}}}, trainer={"resources": {"requests": {"cpu": "2"}}})
        plan = plan_local_cpus(exp, list(range(8)))
        assert len(plan["engine-0"].compute) == 6 and len(plan["trainer"].cpus) == 2

    def test_torchrun_ranks_share_the_trainer_block(self):
        plan = plan_local_cpus(experiment(trainer={"accelerator": {"type": "cpu", "count": 2}}), [0, 1, 2, 3, 4])
        assert plan["trainer"].threads == max(1, len(plan["trainer"].cpus) // 2)

    def test_the_launcher_passes_each_role_its_cores(self, tmp_path, monkeypatch):
        monkeypatch.setattr("kuberl.runtime.launcher.available_cpus", lambda: [0, 1])
        run = LocalRun(experiment(), tmp_path / "e.yaml", tmp_path, "nats://127.0.0.1:1")
        run.plan(gpus=0)
        env = {r.name: r.env for r in run.roles}
        assert env["engine-0"]["KUBERL_CPUS"] == env["rollout-0"]["KUBERL_CPUS"] == "0-1"
        assert env["engine-0"]["KUBERL_COMPUTE_CPUS"] == "0" and "KUBERL_COMPUTE_CPUS" not in env["rollout-0"]
        assert env["trainer"]["KUBERL_CPUS"] == "1" and env["trainer"]["KUBERL_THREADS"] == "1"
        # The rollout side shares the trainer's core and runs under SCHED_BATCH; the trainer does not.
        assert env["engine-0"]["KUBERL_SCHED_BATCH"] == env["rollout-0"]["KUBERL_SCHED_BATCH"] == "1"
        assert "KUBERL_SCHED_BATCH" not in env["trainer"]
        # The engine process may run anywhere; its one worker thread is bound to core 0, the trainer's is not there.
        cpus, eng = process_settings("engine", env["engine-0"], [0, 1], None)
        assert cpus == [0, 1] and eng["VLLM_CPU_OMP_THREADS_BIND"] == "0" and eng["OMP_NUM_THREADS"] == "1"


def test_a_role_process_runs_on_its_cores_with_as_many_torch_threads():
    code = ("from kuberl.runtime.resources import apply_process_resources; apply_process_resources('trainer'); "
            "import os, json, torch; print(json.dumps([sorted(os.sched_getaffinity(0)), torch.get_num_threads()]))")
    cpu = max(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(KUBERL_CPUS=str(cpu), KUBERL_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [[cpu], 1]


SCHED = ("import os, threading, json; from kuberl.runtime.resources import apply_process_resources; apply_process_resources({role!r}); "
         "seen = []; t = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0))); t.start(); t.join(); "
         "print(json.dumps([os.sched_getscheduler(0), seen[0]]))")  # 0: the calling thread (a joined one's id may be gone)


@pytest.mark.parametrize(("role", "value", "policy"), [("rollout", "1", os.SCHED_BATCH), ("engine", "1", os.SCHED_BATCH),
                                                        ("trainer", None, os.SCHED_OTHER), ("rollout", "0", os.SCHED_OTHER)])
def test_a_role_process_asked_for_sched_batch_runs_under_it_and_so_do_its_later_threads(role, value, policy):
    env = {k: v for k, v in os.environ.items() if k != "KUBERL_SCHED_BATCH"}
    if value is not None:
        env["KUBERL_SCHED_BATCH"] = value
    out = subprocess.run([sys.executable, "-c", SCHED.format(role=role)], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [policy, policy]


def test_a_bad_sched_batch_setting_is_an_error_that_names_it():
    env = {**os.environ, "KUBERL_SCHED_BATCH": "yes"}
    out = subprocess.run([sys.executable, "-c", SCHED.format(role="rollout")], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "$KUBERL_SCHED_BATCH='yes': 1 (run under SCHED_BATCH) or 0" in out.stderr
