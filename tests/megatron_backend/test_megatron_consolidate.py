"""checkpoint.read_model_state of a trainer.backend megatron checkpoint (megatron/consolidate.py), without processes.

The checkpoint files are laid out as megatron_write_state writes them (one `megatron-tp{t}-pp{p}[-ep{e}].pt` per rank
with the GPTModel state_dict under "model", `megatron.json` with the sizes and the HF config), their tensors cut by
convert.hf_to_megatron; the integration tests (tests/integration/test_megatron_run.py) read the real trainer's.
"""

from __future__ import annotations

import json

import pytest
import torch
from megatron_models import hf_state, tiny_config, tiny_model

from kuberl.runtime.trainer import checkpoint as ck
from kuberl.runtime.trainer.megatron import convert
from kuberl.runtime.trainer.megatron.consolidate import shard_file

pytestmark = pytest.mark.megatron


def write_checkpoint(folder, name, tp, pp, ep, *, with_config=True):
    model = tiny_model(name)
    hf, shape = hf_state(model), convert.model_shape(model.config)
    for p in range(pp):
        for t in range(tp):
            for e in range(ep):
                mine = convert.hf_to_megatron(hf, shape, tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp, ep_rank=e, ep_size=ep)
                mine["decoder.layers.0.self_attention.core_attention._extra_state"] = None  # what TE modules add
                torch.save({"model": mine, "optimizer": {}}, folder / shard_file(t, p, e, ep))
    layout = {"tensor": tp, "pipeline": pp, "expert": ep}
    if with_config:
        layout["model"] = json.loads(model.config.to_json_string())
    (folder / "megatron.json").write_text(json.dumps(layout))
    return hf


@pytest.mark.parametrize(("name", "tp", "pp", "ep"), [("qwen2-tied", 2, 2, 1), ("llama", 2, 1, 1), ("qwen3-moe", 1, 2, 2),
                                                      ("qwen3-moe-mixed", 1, 1, 4)])
def test_read_model_state_merges_a_megatron_checkpoint_into_hf_names(tmp_path, name, tp, pp, ep):
    hf = write_checkpoint(tmp_path, name, tp, pp, ep)
    got = ck.read_model_state(tmp_path)
    if tiny_config(name).tie_word_embeddings:  # as the FSDP path's state dict: lm_head too
        assert torch.equal(got.pop("lm_head.weight"), hf["model.embed_tokens.weight"])
    assert sorted(got) == sorted(hf)
    for k, v in hf.items():
        assert torch.equal(got[k], v), k


def test_a_megatron_checkpoint_without_its_config_needs_one(tmp_path):
    hf = write_checkpoint(tmp_path, "qwen3-moe", 1, 1, 2, with_config=False)
    with pytest.raises(ValueError, match="holds no model config"):
        ck.read_model_state(tmp_path)
    got = ck.read_model_state(tmp_path, hf_config=tiny_config("qwen3-moe"))
    assert all(torch.equal(got[k], v) for k, v in hf.items())
    (tmp_path / shard_file(0, 0, 1, 2)).unlink()
    with pytest.raises(FileNotFoundError, match="megatron-tp0-pp0-ep1.pt: missing"):
        ck.read_model_state(tmp_path, hf_config=tiny_config("qwen3-moe"))
