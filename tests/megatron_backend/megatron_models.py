"""Tiny Hugging Face models for the Megatron backend's tests, built locally (random weights, nothing downloaded).

Weights are drawn with std 0.5 (norms around 1 +- 0.5) so that the logits are far from uniform and a wrong
weight layout (q/k/v grouping, gate/up order, TP shard order) changes the log-probs visibly.
"""

from __future__ import annotations

import torch

# name -> (config class name, config kwargs). GQA everywhere (4 query heads, 2 kv heads), SwiGLU, 2 layers.
TINY = {
    "qwen2": ("Qwen2Config", dict(vocab_size=128, tie_word_embeddings=False)),  # qkv bias
    "qwen2-tied": ("Qwen2Config", dict(vocab_size=128, tie_word_embeddings=True)),
    # qk norm, head_dim != hidden/heads, a RoPE base other than megatron's default 10000
    "qwen3": ("Qwen3Config", dict(vocab_size=128, head_dim=32, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # odd vocab: padded to 128 at TP=2
    "llama": ("LlamaConfig", dict(vocab_size=127, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 5e5})),
}
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, rms_norm_eps=1e-6)
# Qwen3-MoE: 4 experts of hidden 32, top-2. "qwen3-moe": every layer MoE, normalised top-k weights (Qwen3-30B-A3B's
# setting); "qwen3-moe-mixed": layer 0 a dense MLP (mlp_only_layers), softmax weights not normalised.
_MOE = dict(vocab_size=128, head_dim=32, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
TINY_MOE = {
    "qwen3-moe": ("Qwen3MoeConfig", dict(_MOE, norm_topk_prob=True)),
    "qwen3-moe-mixed": ("Qwen3MoeConfig", dict(_MOE, norm_topk_prob=False, mlp_only_layers=[0])),
}


def tiny_config(name: str):
    import transformers

    cls, kw = TINY[name] if name in TINY else TINY_MOE[name]
    return getattr(transformers, cls)(**COMMON, **kw)


def tiny_model(name: str, seed: int = 0) -> torch.nn.Module:
    """The tiny model `name` in fp32, eval mode, every weight ~ N(0, 0.5) and every norm ~ 1 + N(0, 0.5)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(name), attn_implementation="eager").float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.5
            p.copy_(1.0 + noise if "norm" in pname else noise)
    return model


def hf_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under the names save_pretrained writes (lm_head left out when tied; a MoE model's
    fused in-memory experts as the per-expert checkpoint tensors)."""
    from kuberl.runtime.trainer.megatron.convert_moe import checkpoint_names

    state = checkpoint_names({k: v.detach().clone() for k, v in model.state_dict().items()})
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return {k: v.contiguous() for k, v in state.items()}
