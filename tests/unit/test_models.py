"""The tiny models and model resolution (kuberl.runtime.models): builds (untied, and the tied Instruct-shaped variant), loads, resolves."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from kuberl.api.v1alpha1 import ModelSpec, VolumeRef
from kuberl.runtime import models
from kuberl.runtime.models import ModelResolutionError, build_tiny_model, resolve_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_tiny_model_is_a_qwen2_with_untied_embeddings_and_vocab_equal_to_the_tokenizer(tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["tie_word_embeddings"] is False
    tok = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny)
    assert cfg["vocab_size"] == len(tok)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert (tiny / "model.safetensors").is_file()
    assert cfg["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id
    assert tok.pad_token == "<|endoftext|>"


def test_the_tokenizer_round_trips_any_text_and_wraps_chats_like_qwen(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    for text in ["Repeat the digit 7.", "What is 3 + 4?", "héllo wörld ✓ \t\n 12,345.6", "#### 42"]:
        assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(chat)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 2  # specials are single tokens


def test_the_same_seed_builds_identical_files_and_another_seed_other_weights(tiny, tmp_path):
    again = build_tiny_model(tmp_path / "again", seed=0)
    other = build_tiny_model(tmp_path / "other", seed=1)
    assert _digest(again / "model.safetensors") == _digest(tiny / "model.safetensors")
    assert _digest(again / "tokenizer.json") == _digest(tiny / "tokenizer.json")
    assert _digest(other / "model.safetensors") != _digest(tiny / "model.safetensors")


def test_building_prints_no_progress_bar_and_leaves_transformers_bars_as_they_were(tmp_path, capfd):
    """`kuberl run` prints one line per event: transformers' "Writing model shards" bar (on stderr) is not one of them."""
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()
    build_tiny_model(tmp_path / "quiet", seed=0)
    out, err = capfd.readouterr()
    assert "Writing model shards" not in out + err and "it/s" not in err, err[-500:]
    assert hf_logging.is_progress_bar_enabled(), "the user's own transformers bars must stay on"


def test_a_builtin_model_is_built_once_into_the_workdir(tmp_path):
    spec = ModelSpec(builtin="tiny-qwen2")
    first = resolve_model(spec, tmp_path)
    assert Path(first) == tmp_path / "models" / "tiny-qwen2"
    stamp = (Path(first) / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(spec, tmp_path) == first
    assert (Path(first) / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_new_workdir_gets_a_copy_of_the_machines_cached_build_without_building_again(tmp_path, monkeypatch):
    """The first builtin build goes to the build cache too; another workdir copies it (the same bytes) without
    importing torch or building, which `kuberl run` otherwise did in every new workdir."""
    monkeypatch.setenv(models.MODEL_CACHE_ENV, str(tmp_path / "cache"))
    spec = ModelSpec(builtin="tiny-qwen2")
    first = Path(resolve_model(spec, tmp_path / "one"))
    cached = list((tmp_path / "cache").glob("tiny-qwen2-seed0-*"))
    assert len(cached) == 1 and _digest(cached[0] / "model.safetensors") == _digest(first / "model.safetensors")

    def no_build(*args, **kwargs):
        raise AssertionError("built again although the cache holds the build")
    monkeypatch.setattr(models, "build_tiny_model", no_build)
    second = Path(resolve_model(spec, tmp_path / "two"))
    assert second == tmp_path / "two" / "models" / "tiny-qwen2"
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _digest(second / name) == _digest(first / name), name
    # Another seed or variant is another build.
    assert models._build_key(0, "tiny-qwen2") != models._build_key(1, "tiny-qwen2") != models._build_key(1, "tiny-qwen2-instruct")


def test_a_process_without_a_home_has_no_build_cache(monkeypatch):
    """An arbitrary uid in a container: no HOME, no passwd entry. Path.home() raises; the model is then built in place."""
    monkeypatch.delenv(models.MODEL_CACHE_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def homeless(cls):
        raise RuntimeError("Could not determine home directory.")
    monkeypatch.setattr(Path, "home", classmethod(homeless))
    assert models.build_cache_dir() is None


@pytest.mark.parametrize("cache", ["off", "/proc/kuberl-no-such-cache"])
def test_without_a_usable_build_cache_the_model_is_built_in_the_workdir(tmp_path, monkeypatch, cache):
    """KUBERL_MODEL_CACHE=off, or a cache that cannot be written (a read-only home in a pod): built in place."""
    monkeypatch.setenv(models.MODEL_CACHE_ENV, cache)
    built = []
    real = models.build_tiny_model
    monkeypatch.setattr(models, "build_tiny_model", lambda out, **kw: built.append(out) or real(out, **kw))
    path = Path(resolve_model(ModelSpec(builtin="tiny-qwen2"), tmp_path))
    assert (path / "config.json").is_file() and len(built) == 1 and Path(built[0]).parent == path.parent


def test_a_local_path_resolves_to_itself_and_a_folder_without_config_is_refused(tiny, tmp_path):
    assert resolve_model(ModelSpec(path=str(tiny))) == str(tiny)
    with pytest.raises(ModelResolutionError, match=r"model.path: .*has no config.json"):
        resolve_model(ModelSpec(path=str(tmp_path)))
    with pytest.raises(ModelResolutionError, match=r"model.path: .*is not a folder"):
        resolve_model(ModelSpec(path=str(tmp_path / "missing")))


def test_a_path_on_a_volume_is_looked_up_under_the_claims_mount(tiny, tmp_path, monkeypatch):
    (tmp_path / "my-claim").mkdir()
    (tmp_path / "my-claim" / "qwen").symlink_to(tiny)
    monkeypatch.setattr(models, "MODEL_VOLUME_ROOT", str(tmp_path))
    spec = ModelSpec(path="qwen", volume=VolumeRef(claim_name="my-claim"))
    assert resolve_model(spec) == str(tmp_path / "my-claim" / "qwen")


def test_a_hub_id_resolves_from_the_local_cache_without_network(tiny, tmp_path, monkeypatch):
    # Lay out a hub cache by hand (what snapshot_download leaves behind), then resolve offline.
    repo = tmp_path / "hub" / "models--acme--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in tiny.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub._snapshot_download as sd

    monkeypatch.setattr(sd.constants, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(sd.constants, "HF_HUB_CACHE", str(tmp_path / "hub"), raising=False)
    assert Path(resolve_model(ModelSpec(id="acme/tiny"))) == snap
    with pytest.raises(ModelResolutionError, match=r"model.id: 'acme/absent'"):
        resolve_model(ModelSpec(id="acme/absent"))


def test_build_model_command_writes_a_loadable_model(tmp_path, capsys):
    from kuberl.cli import main

    assert main(["build-model", str(tmp_path / "m"), "--seed", "3"]) == 0
    assert (tmp_path / "m" / "config.json").is_file()
    assert "tiny model" in capsys.readouterr().out


@pytest.fixture(scope="module")
def instruct(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("instruct"), seed=0, variant="tiny-qwen2-instruct")


def test_the_instruct_variant_is_shaped_like_qwen25_instruct_tied_with_its_sampling_defaults_and_chat_template(instruct):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = json.loads((instruct / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["tie_word_embeddings"] is True
    model = AutoModelForCausalLM.from_pretrained(instruct)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    gen = json.loads((instruct / "generation_config.json").read_text())
    assert {k: gen[k] for k in ("do_sample", "temperature", "top_p", "top_k", "repetition_penalty")} == {
        "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    tok_cfg = json.loads((instruct / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_cfg["chat_template"] and not (instruct / "chat_template.jinja").exists()
    tok = AutoTokenizer.from_pretrained(instruct)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_the_instruct_builtin_resolves_to_its_own_folder_and_unknown_variants_are_refused(tmp_path):
    path = Path(resolve_model(ModelSpec(builtin="tiny-qwen2-instruct"), tmp_path))
    assert path == tmp_path / "models" / "tiny-qwen2-instruct"
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is True
    with pytest.raises(ValueError, match="unknown builtin model 'tiny-llama'"):
        build_tiny_model(tmp_path / "x", variant="tiny-llama")
