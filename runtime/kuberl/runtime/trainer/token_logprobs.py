"""log softmax(logits / T) at the sampled tokens, without a float32 copy of the logits.

The trainer scores every response token: log pi(token) = z[token] - logsumexp(z), z = logits / T. Written as
plain autograd ops (`logits.float() / T`, `logsumexp`, `gather`), that keeps a float32 [tokens, vocab] copy of
the logits for the backward and builds two more float32 [tokens, vocab] tensors in it (softmax, and the
gather's scattered gradient): ~12 bytes per logit next to the model's own 2 (bf16). For a real model that is
the trainer's largest tensor by far: Qwen's 151,936-token vocabulary at 32k response tokens is 10 GB of bf16
logits and ~60 GB of float32 around them.

`target_logprobs` computes the same numbers in float32, a slice of rows at a time, and keeps only the logits
themselves (in their own dtype) and one float per token for the backward, which recomputes softmax per slice:
dlogp/dz = onehot(token) - softmax(z), dz/dlogits = 1/T. Peak extra memory is one slice's float32 work,
`chunk_elements` logits (default 2**25: 128 MB), whatever the number of tokens. `bench/bench_logprob_memory.py`
measures both.
"""

from __future__ import annotations

import torch

CHUNK_ELEMENTS = 1 << 25


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # bf16/fp16 -> fp32, fp64 stays (gradcheck)


class _TargetLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool, rows: int):
        V = logits.shape[-1]
        flat, tgt = logits.reshape(-1, V), targets.reshape(-1, 1)
        dtype = _compute_dtype(logits.dtype)
        n = flat.shape[0]
        logp = torch.empty(n, dtype=dtype, device=logits.device)
        lse = torch.empty(n, dtype=dtype, device=logits.device)
        ent = torch.empty(n, dtype=dtype, device=logits.device) if entropy else None
        for s in range(0, n, rows):
            z = flat[s:s + rows].to(dtype, copy=True)  # this slice's only float copy: the rest works in place
            if temperature != 1.0:
                z.div_(temperature)
            lse[s:s + rows] = torch.logsumexp(z, dim=-1)
            logp[s:s + rows] = z.gather(-1, tgt[s:s + rows]).squeeze(-1) - lse[s:s + rows]
            if ent is not None:  # H = logsumexp(z) - sum softmax(z) * z
                ent[s:s + rows] = lse[s:s + rows] - torch.softmax(z, dim=-1).mul_(z).sum(-1)
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature, ctx.rows = temperature, rows
        shape = targets.shape
        if ent is None:
            return logp.view(shape), None
        ent = ent.view(shape)
        ctx.mark_non_differentiable(ent)  # a statistic, never a loss term
        return logp.view(shape), ent

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, _grad_ent):
        logits, targets, lse = ctx.saved_tensors
        T, rows = ctx.temperature, ctx.rows
        V = logits.shape[-1]
        flat, tgt = logits.reshape(-1, V), targets.reshape(-1, 1)
        g = grad_logp.reshape(-1).to(lse.dtype)
        grad = torch.empty_like(flat)
        for s in range(0, flat.shape[0], rows):
            dz = flat[s:s + rows].to(lse.dtype, copy=True)
            if T != 1.0:
                dz.div_(T)
            gs = g[s:s + rows, None]
            dz.sub_(lse[s:s + rows, None]).exp_().mul_(-gs)  # -g * softmax(z)
            dz.scatter_add_(-1, tgt[s:s + rows], gs)  # + g at the target
            if T != 1.0:
                dz.div_(T)
            grad[s:s + rows] = dz
        return grad.view(logits.shape), None, None, None, None


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *, entropy: bool = False,
                    chunk_elements: int = CHUNK_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log softmax(logits / T)[targets], entropy of softmax(logits / T) or None), both shaped like `targets`, in
    float32 (float64 for float64 logits). logits: [..., V] of any float dtype; targets: the matching [...] indices.
    The entropy carries no gradient."""
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets {tuple(targets.shape)} do not match logits {tuple(logits.shape)} without the vocabulary")
    rows = max(1, chunk_elements // max(1, logits.shape[-1]))
    return _TargetLogprob.apply(logits, targets, float(temperature), bool(entropy), rows)
