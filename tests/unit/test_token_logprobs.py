"""target_logprobs: the same log-probs, entropies and gradients as plain autograd ops, without their float32 copies."""

from __future__ import annotations

import pytest
import torch

from kuberl.runtime.trainer.token_logprobs import target_logprobs


def reference(logits: torch.Tensor, targets: torch.Tensor, T: float):
    z = logits.float() / T
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    with torch.no_grad():
        ent = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
    return logp, ent


def case(dtype=torch.float32, shape=(5, 7), V=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(*shape, V, generator=g)).to(dtype)
    targets = torch.randint(0, V, shape, generator=g)
    weights = torch.randn(*shape, generator=g)  # a loss that weights each token differently
    return logits, targets, weights


@pytest.mark.parametrize("T", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("chunk", [1 << 25, 50, 150, 1])  # one slice; a row per slice; three rows; rounds up to one row
def test_values_and_gradients_equal_plain_autograd(T, chunk):
    logits, targets, w = case()
    a = logits.clone().requires_grad_()
    lp, ent = target_logprobs(a, targets, T, entropy=True, chunk_elements=chunk)
    (lp * w).sum().backward()
    b = logits.clone().requires_grad_()
    ref_lp, ref_ent = reference(b, targets, T)
    (ref_lp * w).sum().backward()
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-5)
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-6)
    assert not ent.requires_grad


def test_gradcheck_in_float64_across_slices():
    logits, targets, _ = case(torch.float64, shape=(3, 4), V=9)
    x = logits.requires_grad_()
    assert torch.autograd.gradcheck(lambda z: target_logprobs(z, targets, 0.8, chunk_elements=20)[0], (x,))


def test_bf16_logits_are_scored_in_float32_and_get_a_bf16_gradient():
    logits, targets, w = case(torch.bfloat16, V=300)
    a = logits.clone().requires_grad_()
    lp, ent = target_logprobs(a, targets, 0.6)
    assert lp.dtype == torch.float32 and ent is None
    (lp * w).sum().backward()
    b = logits.clone().requires_grad_()
    ref_lp, _ = reference(b, targets, 0.6)
    (ref_lp * w).sum().backward()
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)  # the same float32 arithmetic on the same bf16 inputs
    assert a.grad.dtype == torch.bfloat16
    torch.testing.assert_close(a.grad.float(), b.grad.float(), rtol=0, atol=1e-2)


def saved_bytes(fn) -> int:
    """Bytes autograd keeps for the backward while fn() runs (distinct storages)."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_only_the_logits_themselves_are_kept_for_the_backward():
    logits, targets, _ = case(torch.bfloat16, shape=(64, 32), V=4096)
    x = logits.requires_grad_()
    kept = saved_bytes(lambda: target_logprobs(x, targets, 0.7, entropy=True, chunk_elements=1 << 16))
    per_token = 4 + 8  # the float32 logsumexp and the int64 target
    assert kept <= x.numel() * x.element_size() + targets.numel() * per_token
    plain = saved_bytes(lambda: reference(x, targets, 0.7))
    assert plain >= x.numel() * 4  # what it replaces keeps a float32 copy: this measure can tell them apart
    assert kept * 1.9 < plain


def test_mismatched_targets_are_refused():
    logits, targets, _ = case()
    with pytest.raises(ValueError, match="do not match"):
        target_logprobs(logits, targets[:, :-1])
