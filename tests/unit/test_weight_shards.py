"""disk/bus weight versions in shards: planned from shapes, written one shard at a time, read back by load_weights and
transformers; one shard is today's plain model.safetensors byte for byte; two FSDP2 ranks write what one rank writes
while rank 0 never holds more than one shard (issue #14 item 2)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from kuberl.runtime.trainer.weights import (
    INDEX_FILE,
    WEIGHTS_FILE,
    export_model_weights,
    export_weights,
    list_versions,
    load_weights,
    plan_shards,
    shard_file_names,
    write_weights_streamed,
)
from tests.unit.torchrun import torchrun

SHARD = 600_000  # bytes: the tiny model (2.4 MB in float32) in 5 shards


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    from kuberl.runtime.models import build_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {"untied": build_tiny_model(root / "untied", seed=0), "tied": build_tiny_model(root / "tied", seed=0, variant="tiny-qwen2-instruct")}


def perturbed(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=gen))
    return model


ONE_RANK = SimpleNamespace(is_main=True)  # a one-rank trainer's rank info, as export_model_weights reads it


def folder_bytes(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir())}


class TestPlan:
    def test_consecutive_tensors_fill_a_shard_and_a_bigger_one_goes_alone(self):
        sizes = [("a", 40), ("b", 50), ("c", 20), ("big", 500), ("d", 10)]
        assert plan_shards(sizes, 100) == [["a", "b"], ["c"], ["big"], ["d"]]
        assert plan_shards(sizes, 110) == [["a", "b", "c"], ["big"], ["d"]]
        assert plan_shards(sizes, None) == [["a", "b", "c", "big", "d"]]

    def test_file_names_follow_transformers(self):
        assert shard_file_names(1) == ["model.safetensors"]
        assert shard_file_names(3) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]

    def test_a_shard_size_below_one_byte_is_refused(self):
        with pytest.raises(ValueError, match="bucketMB"):
            plan_shards([("a", 1)], 0)


@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_a_sharded_version_loads_back_equal_with_load_weights_and_transformers(kind, models, tmp_path):
    from transformers import AutoModelForCausalLM

    model = perturbed(models[kind])
    state = model.state_dict()
    stats: dict = {}
    path = export_weights(state, tmp_path, 4, source_dir=models[kind], shard_bytes=SHARD, stats=stats)
    index = json.loads((path / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert stats["shards"] == len(files) >= 3 and files == shard_file_names(len(files))
    assert not (path / WEIGHTS_FILE).exists()
    assert set(index["weight_map"]) == set(state)  # tied: lm_head.weight and model.embed_tokens.weight, as a one-file export
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in state.values()) == stats["total_bytes"]
    assert sum((path / f).stat().st_size for f in files) > stats["total_bytes"]  # headers on top of the tensors
    assert stats["peak_bytes"] <= SHARD
    got = load_weights(path)
    assert set(got) == set(state) and all(torch.equal(got[n], state[n]) for n in state)
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert loaded.config.tie_word_embeddings == (kind == "tied")
    for name, p in loaded.state_dict().items():
        assert torch.equal(p, state[name]), name
    ids = torch.tensor([[1, 5, 9, 3]])
    assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_a_version_that_fits_one_shard_is_the_plain_file_of_before_byte_for_byte(models, tmp_path):
    state = perturbed(models["tied"]).state_dict()
    before = tmp_path / "before.safetensors"  # what export_weights wrote before shards: every tensor cloned, one file
    save_file({n: t.detach().to(torch.bfloat16).contiguous().clone() for n, t in state.items()}, str(before), metadata={"format": "pt"})
    for shard_bytes in (None, 256 << 20):
        path = export_weights(state, tmp_path / str(shard_bytes), 1, source_dir=models["tied"], dtype=torch.bfloat16, shard_bytes=shard_bytes)
        assert (path / WEIGHTS_FILE).read_bytes() == before.read_bytes()
        assert not (path / INDEX_FILE).exists() and not list(path.glob("model-*"))


def test_the_trainer_path_on_one_rank_writes_what_export_weights_writes(models, tmp_path):
    model = perturbed(models["tied"])
    stats: dict = {}
    a = export_model_weights(model, ONE_RANK, tmp_path / "a", 2, shard_bytes=SHARD, source_dir=models["tied"], dtype=torch.float32, stats=stats)
    # A tied LM head is written once, under the embedding's name, as save_pretrained and the Hub's tied models have it.
    untied_names = without_tied_head(model.state_dict())
    b = export_weights(untied_names, tmp_path / "b", 2, source_dir=models["tied"], dtype=torch.float32, shard_bytes=SHARD)
    assert stats["shards"] >= 3 and folder_bytes(a) == folder_bytes(b)
    assert "lm_head.weight" not in load_weights(a) and "model.embed_tokens.weight" in load_weights(a)
    loaded = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32).eval()
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()  # tied again on load
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model.eval()(ids).logits)


def test_the_trainer_path_writes_an_untied_models_lm_head_as_export_weights_does(models, tmp_path):
    """Only a tied head is left out (written_entries): an untied model's lm_head is its own weight, published."""
    model = perturbed(models["untied"])
    a = export_model_weights(model, ONE_RANK, tmp_path / "a", 2, shard_bytes=SHARD, source_dir=models["untied"], dtype=torch.float32, stats={})
    b = export_weights(model.state_dict(), tmp_path / "b", 2, source_dir=models["untied"], dtype=torch.float32, shard_bytes=SHARD)
    assert folder_bytes(a) == folder_bytes(b)
    assert torch.equal(load_weights(a)["lm_head.weight"], model.lm_head.weight.detach())


def without_tied_head(state: dict) -> dict:
    return {k: v for k, v in state.items() if k != "lm_head.weight"}


def test_a_write_that_fails_halfway_still_runs_every_gather_and_leaves_nothing(models, tmp_path):
    state = perturbed(models["untied"]).state_dict()
    sizes = [(n, t.nbytes) for n, t in state.items()]
    pulled = []

    def gathers():  # stands for the collective full_tensor() of each entry: the other ranks wait for every one
        for name, t in state.items():
            pulled.append(name)
            yield name, (t if len(pulled) != 10 else "not a tensor")

    with pytest.raises(TypeError, match="not a tensor"):
        write_weights_streamed(sizes, gathers(), tmp_path, 3, shard_bytes=SHARD, source_dir=models["untied"])
    assert pulled == list(state)
    assert list_versions(tmp_path) == [] and list(tmp_path.iterdir()) == []


def test_tensors_out_of_plan_order_are_refused(models, tmp_path):
    items = list(perturbed(models["untied"]).state_dict().items())
    sizes = [(n, t.nbytes) for n, t in items]
    with pytest.raises(ValueError, match="expected tensor 'model.embed_tokens.weight' next, got 'lm_head.weight'"):
        write_weights_streamed(sizes, reversed(items), tmp_path, 1, shard_bytes=SHARD, source_dir=models["untied"])


class TestReadingShards:
    @pytest.fixture
    def version(self, models, tmp_path) -> Path:
        return export_weights(perturbed(models["untied"]).state_dict(), tmp_path, 1, source_dir=models["untied"], shard_bytes=SHARD)

    def test_an_index_naming_a_missing_shard_says_which(self, version):
        last = sorted(version.glob("model-*"))[-1]
        last.unlink()
        with pytest.raises(FileNotFoundError, match=f"names shard.s. {last.name}"):
            load_weights(version)

    def test_tensors_the_index_maps_to_no_shard_are_an_error(self, version):
        index = json.loads((version / INDEX_FILE).read_text())
        index["weight_map"]["model.extra.weight"] = sorted(set(index["weight_map"].values()))[0]
        (version / INDEX_FILE).write_text(json.dumps(index))
        with pytest.raises(ValueError, match="1 tensor.s. not in their shard, e.g. 'model.extra.weight'"):
            load_weights(version)

    def test_shard_tensors_the_index_leaves_out_are_an_error(self, version):
        index = json.loads((version / INDEX_FILE).read_text())
        index["weight_map"].pop("lm_head.weight")
        (version / INDEX_FILE).write_text(json.dumps(index))
        with pytest.raises(ValueError, match="does not name, e.g. 'lm_head.weight'"):
            load_weights(version)

    def test_a_folder_without_weights_names_both_layouts(self, tmp_path):
        with pytest.raises(FileNotFoundError, match=f"neither {WEIGHTS_FILE} nor {INDEX_FILE}"):
            load_weights(tmp_path)


WORKER = r'''
import json, sys, weakref
from pathlib import Path
import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM
from kuberl.runtime.trainer import dist as D
from kuberl.runtime.trainer import weights as W

out, shard_bytes = Path(sys.argv[1]), int(sys.argv[2])
info = D.init_distributed("cpu")
live = {"now": 0, "peak": 0}  # bytes of full tensors this rank holds beyond its shards, counted as they are made and freed


def _free(n):
    live["now"] -= n


def track(t):
    live["now"] += t.nbytes
    live["peak"] = max(live["peak"], live["now"])
    weakref.finalize(t, _free, t.nbytes)
    return t


plain, full_of = W._plain_tensor, D.iter_full_tensors
W._plain_tensor = lambda name, tensor, dtype: track(plain(name, tensor, dtype))  # the shard buffer's tensors


def gathered(entries):  # the all-gathered full tensors; `box` so that this frame keeps no reference once the caller has one
    box = []
    for name, t in full_of(entries):
        box.append((name, track(t) if isinstance(entries[0][1], DTensor) else t))
        del t
        yield box.pop()


D.iter_full_tensors = gathered
result = {}
for kind, dtype in (("untied", torch.bfloat16), ("tied", torch.float32)):
    src = Path(sys.argv[3 if kind == "untied" else 4])
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=gen))
    model = D.shard_model(model, info)
    assert all(isinstance(p, DTensor) for p in model.parameters()), "not sharded"
    live.update(now=0, peak=0)
    stats = {}
    path = W.export_model_weights(model, info, out / kind, 1, shard_bytes=shard_bytes, source_dir=src, dtype=dtype, stats=stats)
    result[kind] = {"path": str(path) if path else None, "stats": stats, "live_peak": live["peak"],
                    "largest": max(p.numel() * 4 for p in model.parameters())}
    D.barrier(info)
(out / f"rank{info.rank}.json").write_text(json.dumps(result))  # a file each: the ranks' stdout lines can run together
D.shutdown()
'''


def test_two_fsdp_ranks_write_what_one_rank_writes_and_rank_0_holds_one_shard_at_most(models, tmp_path):
    script = tmp_path / "shard_worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    torchrun(str(script), str(out), str(SHARD), str(models["untied"]), str(models["tied"]), timeout=300, cwd=tmp_path)
    rank0, rank1 = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    for kind, dtype in (("untied", torch.bfloat16), ("tied", torch.float32)):
        got = rank0[kind]
        assert rank1[kind]["path"] is None and rank1[kind]["live_peak"] <= rank1[kind]["largest"]  # one full tensor at a time
        state = perturbed(models[kind]).state_dict()
        state = without_tied_head(state) if kind == "tied" else state  # written once, under the embedding's name
        ref = export_weights(state, tmp_path / "one" / kind, 1, source_dir=models[kind], dtype=dtype, shard_bytes=SHARD)
        assert folder_bytes(Path(got["path"])) == folder_bytes(ref), kind
        assert got["stats"]["shards"] >= 3 and got["stats"]["total_bytes"] > 2 * SHARD
        # What rank 0 held at once: the shard being filled plus the full tensor being converted, never the whole model.
        assert got["stats"]["peak_bytes"] <= SHARD, got
        assert got["live_peak"] <= SHARD + got["largest"] < got["stats"]["total_bytes"], got


def test_a_tensor_is_cast_where_it_lives_before_it_is_copied_to_the_host():
    """On a GPU, publishing float32 master weights to a bf16 engine casts there first: half the bytes cross to the host
    and the host casts nothing. Torch's dispatch records the order here (no GPU on this machine)."""
    from kuberl.runtime.trainer.weights import _plain_tensor

    calls: list[tuple] = []

    class Recorded(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") == "to":
                calls.append(tuple(a for a in args[1:] if isinstance(a, (torch.dtype, str, torch.device))))
            return super().__torch_function__(func, types, args, kwargs or {})

    w = torch.randn(4, 3).as_subclass(Recorded)
    out = _plain_tensor("w", w, torch.bfloat16)
    assert calls[:2] == [(torch.bfloat16,), ("cpu",)], calls
    assert out.dtype == torch.bfloat16 and torch.equal(out.float(), w.as_subclass(torch.Tensor).to(torch.bfloat16).float())
