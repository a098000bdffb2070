"""The pure parts of `kuberl run --ray`: resources per role, the bus URL per node, each role's environment."""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

import pytest
import yaml

from kuberl.api import load_experiment
from kuberl.cli import build_parser
from kuberl.runtime import ray_launcher as rl
from kuberl.runtime import ray_placement as rp

ROOT = Path(__file__).resolve().parents[2]


def experiment(tmp_path: Path, **spec_overrides):
    doc = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    for dotted, value in spec_overrides.items():
        node = doc["spec"]
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(doc))
    return load_experiment(path)


def test_the_quickstart_asks_one_cpu_per_engine_and_trainer_and_none_for_the_agent(tmp_path):
    p = rp.ray_placements(experiment(tmp_path, **{"rollout.replicas": 2}))
    assert set(p) == {"engine-0", "rollout-0", "engine-1", "rollout-1", "trainer"}
    assert p["engine-0"].bundle() == {"CPU": 1.0} and p["engine-0"].actor_options() == {"num_cpus": 1.0, "num_gpus": 0}
    assert p["rollout-1"].num_cpus == 0 and p["rollout-1"].threads == 1
    assert p["trainer"].bundle() == {"CPU": 1.0} and p["trainer"].threads == 1


def test_cpu_requests_and_gpus_map_to_ray_resources(tmp_path):
    exp = experiment(tmp_path, **{"rollout.accelerator": {"type": "nvidia", "count": 2}, "rollout.resources": {"requests": {"cpu": "4"}},
                                  "rollout.tensorParallelSize": 2,
                                  "trainer.accelerator": {"type": "nvidia", "count": 4}, "trainer.resources": {"limits": {"cpu": "8000m"}}})
    p = rp.ray_placements(exp)
    assert p["engine-0"].bundle() == {"CPU": 4.0, "GPU": 2.0}
    assert p["engine-0"].actor_options() == {"num_cpus": 4.0, "num_gpus": 2} and p["engine-0"].threads == 4
    assert p["trainer"].bundle() == {"CPU": 8.0, "GPU": 4.0}
    assert p["trainer"].threads == 2  # 8 cores shared by torchrun's 4 ranks


def test_ascend_npus_are_a_custom_ray_resource(tmp_path):
    exp = experiment(tmp_path, **{"trainer.accelerator": {"type": "ascend", "count": 2}})
    t = rp.ray_placements(exp)["trainer"]
    assert t.bundle() == {"CPU": 2.0, "NPU": 2.0}
    assert t.actor_options() == {"num_cpus": 2.0, "num_gpus": 0, "resources": {"NPU": 2}}


def test_a_multi_node_trainer_is_refused_with_what_to_do(tmp_path):
    exp = experiment(tmp_path, **{"trainer.nodes": 2, "trainer.accelerator": {"type": "nvidia", "count": 1}})
    with pytest.raises(rp.RayLaunchError, match="trainer.nodes is 2: --ray runs the trainer's ranks on one node"):
        rp.ray_placements(exp)


def test_the_bus_url_is_the_node_address_ray_reports():
    assert rp.bus_url("10.1.2.3", 4222) == "nats://10.1.2.3:4222"
    assert rp.bus_url("fd00::2", 4222) == "nats://[fd00::2]:4222"
    with pytest.raises(rp.RayLaunchError):
        rp.bus_url("", 4222)


def test_a_role_env_drops_the_drivers_cores_and_devices_and_carries_threads_and_token():
    base = {"KUBERL_BUS_URL": "nats://10.0.0.1:4222", "KUBERL_CPUS": "0-1", "CUDA_VISIBLE_DEVICES": "0", "KUBERL_THREADS": "2"}
    env = rp.ray_role_env(base, rp.Placement(3.0, threads=3), "tok")
    assert env == {"KUBERL_BUS_URL": "nats://10.0.0.1:4222", "KUBERL_THREADS": "3", "KUBERL_BUS_TOKEN": "tok"}
    assert "KUBERL_BUS_TOKEN" not in rp.ray_role_env(base, rp.Placement(1.0), None)


def test_ray_run_env_holds_only_the_runs_variables(tmp_path):
    exp = experiment(tmp_path)
    run = rl.RayRun(exp, tmp_path / "exp.yaml", tmp_path / "w", "nats://10.0.0.1:4222", token="t")
    run.plan(gpus=0)
    engine = next(r for r in run.roles if r.name == "engine-0")
    assert "PATH" not in engine.env and engine.env["KUBERL_BUS_URL"] == "nats://10.0.0.1:4222"
    assert engine.env["KUBERL_WORKDIR"] == str(tmp_path / "w")


def test_the_bus_goes_to_the_head_node():
    nodes = [{"NodeID": "a", "Alive": True, "Resources": {"CPU": 2}},
             {"NodeID": "h", "Alive": True, "Resources": {"CPU": 2, "node:__internal_head__": 1}}]
    assert rp.head_node_id(nodes) == "h"
    assert rp.head_node_id(nodes[:1]) == "a"
    with pytest.raises(rp.RayLaunchError, match="no live node"):
        rp.head_node_id([{"NodeID": "x", "Alive": False}])


def test_an_address_nobody_answers_is_refused_at_once():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(ConnectionError, match=f"nothing answers at 127.0.0.1:{port}"):
            rp.reachable(f"127.0.0.1:{port}")
    with pytest.raises(ValueError, match="is not HOST:PORT"):
        rp.reachable("just-a-host")
    rp.reachable("auto")  # Ray's own resolution


def test_the_run_command_takes_ray(tmp_path):
    args = build_parser().parse_args(["run", "x.yaml", "--ray", "auto"])
    assert args.ray == "auto"
    assert build_parser().parse_args(["run", "x.yaml"]).ray is None


def test_ray_missing_names_the_pip_command(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    code = rl.main(argparse.Namespace(file="x.yaml", ray="auto", workdir=None, bus_url=None, max_steps=None, resume=False))
    assert code == 2
    assert "pip install 'kuberl-runtime[ray]'" in capsys.readouterr().err
