"""Weight export in Hugging Face layout: transformers loads it back, writes are atomic, old versions pruned."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kuberl.runtime.trainer.weights import TRASH_PREFIX, export_weights, list_versions, load_weights, wait_for_pruning


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from kuberl.runtime.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", seed=0)


def _perturbed_state(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    return model.state_dict()


def test_exported_weights_load_with_transformers_and_give_the_same_logits(tmp_path, tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    state = _perturbed_state(tiny)
    path = export_weights(state, tmp_path / "weights", 3, source_dir=tiny)
    assert path == tmp_path / "weights" / "v3"
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)  # tokenizer files travel with the weights
    ids = torch.tensor([tok("12 + 3 =")["input_ids"]])
    reference = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    reference.load_state_dict(state)
    assert torch.allclose(loaded(ids).logits, reference(ids).logits, atol=1e-6)


def test_a_dtype_cast_is_applied_to_tensors_and_config(tmp_path, tiny):
    import json

    path = export_weights(_perturbed_state(tiny), tmp_path, 1, source_dir=tiny, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in load_weights(path).values())
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_only_the_newest_versions_are_kept_and_a_republished_old_version_survives(tmp_path, tiny):
    state = _perturbed_state(tiny)
    for v in range(5):
        export_weights(state, tmp_path, v, source_dir=tiny, keep=2)
    assert list_versions(tmp_path) == [3, 4]
    export_weights(state, tmp_path, 1, source_dir=tiny, keep=2)  # a trainer restarted from an older checkpoint
    assert 1 in list_versions(tmp_path)
    wait_for_pruning()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no temporary folders left behind"


def test_a_pruned_version_leaves_the_listing_at_once_and_is_deleted_behind_the_publish(tmp_path, tiny):
    """The unlinking (0.4 s of a 0.5B-shape publish on CPU) runs in a thread; a crash's leftover trash goes with the next."""
    import threading
    from unittest import mock

    from kuberl.runtime.trainer import weights

    state = _perturbed_state(tiny)
    (tmp_path / f"{TRASH_PREFIX}0-1-2").mkdir(parents=True)  # left by a trainer killed while deleting
    (tmp_path / f"{TRASH_PREFIX}0-1-2" / "model.safetensors").write_bytes(b"x")
    release = threading.Event()
    real = weights._delete_all
    with mock.patch.object(weights, "_delete_all", lambda paths: (release.wait(10), real(paths))):
        for v in range(3):
            export_weights(state, tmp_path, v, source_dir=tiny, keep=1)  # returns while the deleting thread is held
        assert list_versions(tmp_path) == [2]
        trash = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(TRASH_PREFIX))
        assert len(trash) == 3 and f"{TRASH_PREFIX}0-1-2" in trash, trash  # v0 and v1 renamed away, not deleted yet
        release.set()
        wait_for_pruning()
    assert [p.name for p in tmp_path.iterdir()] == ["v2"]


def test_a_failed_export_leaves_no_version_behind(tmp_path, tiny):
    with pytest.raises(TypeError, match="'bad' is a str"):
        export_weights({"bad": "not a tensor"}, tmp_path, 7, source_dir=tiny)
    assert list_versions(tmp_path) == [] and list(tmp_path.iterdir()) == []


def test_export_without_a_config_says_what_is_missing(tmp_path):
    with pytest.raises(ValueError, match="weights v2: no config.json"):
        export_weights({"w": torch.ones(1)}, tmp_path / "w", 2)


def test_loading_a_folder_without_weights_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_weights(tmp_path)


def test_the_digest_sees_any_changed_value_and_ignores_dict_order():
    from kuberl.runtime.trainer.weights import digest_state

    a = {"x": torch.arange(4.0), "y": torch.ones(2, 2)}
    b = {"y": torch.ones(2, 2), "x": torch.arange(4.0)}
    assert digest_state(a) == digest_state(b)
    b["x"][3] += 1e-6
    assert digest_state(a) != digest_state(b)


def test_a_published_version_skips_fsync_until_it_is_made_durable(tmp_path, tiny, monkeypatch):
    """Each step's version is written without fsync (the rename makes it appear whole); the final one is synced."""
    import os

    from transformers import AutoModelForCausalLM

    from kuberl.runtime.trainer import dist as D
    from kuberl.runtime.trainer.weights import export_model_weights, sync_folder

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    info = D.DistInfo(0, 1, 0, torch.device("cpu"))
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    fast = export_model_weights(model, info, tmp_path, 1, shard_bytes=None, source_dir=tiny, durable=False)
    assert synced == [] and load_weights(fast).keys() == model.state_dict().keys()
    sync_folder(fast)
    assert len(synced) == len(list(fast.iterdir())) + 1  # every file, then the folder
    synced.clear()
    export_model_weights(model, info, tmp_path, 2, shard_bytes=None, source_dir=tiny)  # durable by default
    assert len(synced) == len(list((tmp_path / "v2").iterdir())) + 1


def test_cached_state_entries_follow_a_replaced_parameter(tiny):
    """The trainer reuses the entry list each step; a parameter swapped for a new tensor must show up in it."""
    from transformers import AutoModelForCausalLM

    from kuberl.runtime.trainer import dist as D

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    first = D.model_state_entries(model, cached=True)
    assert D.model_state_entries(model, cached=True) is first  # nothing changed: the same list
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)  # in place, as the optimizer does: still the same tensors
    assert D.model_state_entries(model, cached=True) is first
    model.model.norm.weight = torch.nn.Parameter(torch.full_like(model.model.norm.weight, 7.0))
    entries = dict(D.model_state_entries(model, cached=True))
    assert torch.equal(entries["model.norm.weight"], torch.full_like(model.model.norm.weight, 7.0))
    assert [n for n, _ in first] == list(entries)
