"""A vLLM worker extension (`--worker-extension-cls`): weight reload that checks tied LM heads afterwards.

On CPU, vLLM's unquantized GEMMs run on a prepacked copy of the weight (`dispatch_cpu_unquantized_gemm`
keeps it in `layer.cpu_linear`; measured: oneDNN's handle does not see in-place weight updates). A tied
LM head shares embed_tokens' weight, so it is correct only if the reload re-packs the head as well.
vLLM 0.32's layerwise reload does (measured with Qwen2); older versions did not. After every reload each
layer that shares its weight with another is checked (its GEMM against the live weight) and re-packed
if stale; a head still stale after that fails the reload. `kuberl_receive_weights` joins a weight broadcast
(weightSync.mode broadcast, kuberl.runtime.weight_sync.broadcast) and feeds the received buckets to the same reload.
Imported in vLLM's worker: torch, vLLM and that torch-only module.

Live-weight GEMMs on CPU (float32; set by VLLMEngine's server environment, `KUBERL_VLLM_CPU_LIVE_WEIGHTS=0` keeps
vLLM's packing): importing this module in vLLM's worker (vLLM does it when the worker starts, before it loads the
model) makes unquantized linear and LM-head layers
compute with `F.linear` on their own weight instead of a prepacked oneDNN copy. Packing drops the weight, so every
reload had to go through vLLM's layerwise reload, which rebuilds each layer and re-packs it; with live weights a
reload is `model.load_weights` copying the new tensors in place. Measured on the bench_trl model (2-core AVX2 CPU):
reload 21-27 -> 5-7 ms, generation CPU -5% (docs/design/cpu-performance.md).
"""

from __future__ import annotations

import glob
import os

import torch
import torch.nn.functional as F

from kuberl.runtime.inference.vllm import LIVE_WEIGHTS_ENV


def use_live_weight_gemms() -> bool:
    """With $KUBERL_VLLM_CPU_LIVE_WEIGHTS=1 on a CPU platform: float32 unquantized linear/LM-head layers keep their
    weight and run F.linear on it (patches vLLM's two unquantized methods in this process). Idempotent."""
    if os.environ.get(LIVE_WEIGHTS_ENV) != "1":
        return False
    from vllm.model_executor.layers import linear, vocab_parallel_embedding
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    for cls in (linear.UnquantizedLinearMethod, vocab_parallel_embedding.UnquantizedEmbeddingMethod):
        original = cls.process_weights_after_loading
        if getattr(original, "_kuberl_live", False):
            continue

        def process_weights_after_loading(self, layer, _original=original):
            weight = getattr(layer, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.dtype == torch.float32:
                layer.cpu_linear = F.linear  # called as cpu_linear(x, layer.weight, bias): the live weight
                return
            _original(self, layer)

        process_weights_after_loading._kuberl_live = True
        cls.process_weights_after_loading = process_weights_after_loading
    return True


def live_weights(model: torch.nn.Module) -> bool:
    """Whether every layer with a quant method computes from its live weight (then a reload may copy in place)."""
    layers = [m for m in model.modules() if getattr(m, "quant_method", None) is not None]
    return bool(layers) and all(getattr(m, "cpu_linear", None) is F.linear for m in layers)


@torch.no_grad()
def load_in_place(model: torch.nn.Module, weights_path: str) -> None:
    """The safetensors of `weights_path` copied into the model's parameters by its own weight loaders."""
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    files = sorted(glob.glob(os.path.join(weights_path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{weights_path}: no *.safetensors to load")
    loaded = model.load_weights(safetensors_weights_iterator(files, use_tqdm_on_load=False))
    missing = {name for name, _ in model.named_parameters()} - set(loaded or ())
    if missing:
        raise RuntimeError(f"{weights_path}: no weights for {sorted(missing)[:5]} ({len(missing)} parameters): not reloaded whole")


use_live_weight_gemms()


def tied_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Layers with a GEMM method whose 2-D weight shares storage with another such layer (embedding + tied head)."""
    by_storage: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if getattr(module, "quant_method", None) is None or not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.numel() == 0:
            continue
        by_storage.setdefault(weight.untyped_storage().data_ptr(), []).append(module)
    return [m for group in by_storage.values() if len(group) > 1 for m in group]


@torch.no_grad()
def gemm_is_current(layer: torch.nn.Module) -> bool:
    """Does the layer's GEMM (what the sampler's logits come from) compute with its live weight?"""
    weight = layer.weight
    x = torch.randn(2, weight.shape[1], dtype=weight.dtype, device=weight.device)
    got = layer.quant_method.apply(layer, x).float()
    want = torch.nn.functional.linear(x.float(), weight.float())
    return bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()) + 1e-4))


def refresh_tied_layers(model: torch.nn.Module) -> dict:
    """Re-pack every stale tied layer; raise if one stays stale (never sample from an old head)."""
    tied = tied_layers(model)
    refreshed = 0
    for layer in tied:
        if gemm_is_current(layer):
            continue
        layer.quant_method.process_weights_after_loading(layer)
        refreshed += 1
        if not gemm_is_current(layer):
            raise RuntimeError(f"{type(layer).__name__}: its GEMM still uses old weights after a re-pack (tied LM head stale)")
    return {"tied_layers": len(tied), "refreshed": refreshed}


class KubeRLWorkerExtension:
    """Mixed into vLLM's worker class; its methods are callable through /collective_rpc."""

    def kuberl_reload_weights(self, weights_path: str) -> dict:
        """vLLM's reload_weights(weights_path), then check (and if need be re-pack) tied layers."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        if live_weights(model) and getattr(self.model_runner, "lora_config", None) is None:  # type: ignore[attr-defined]
            load_in_place(model, weights_path)
        else:
            self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]  (the worker's own method)
        return refresh_tied_layers(model)

    def kuberl_receive_weights(self, assign: dict) -> dict:
        """Join the trainer's broadcast `assign` (broadcast.py) and reload the weights bucket by bucket as they arrive."""
        from kuberl.runtime.weight_sync.broadcast import join_update, receive_weights

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        device = next(model.parameters()).device
        if device.type == "meta":  # a reload that failed mid-way left parameters unmaterialised: buffers go to the worker's device
            device = torch.device(getattr(self, "device", "cpu"))
        stats: dict = {}
        local_rank = int(getattr(self, "rank", 0) or 0)  # this worker among the engine's (tensor/pipeline parallel) workers
        joined = join_update(assign, local_rank=local_rank)  # a dead trainer fails here, before any weight changes
        self.reload_weights(weights_iterator=receive_weights(assign, local_rank=local_rank, device=device, stats=stats, joined=joined))  # type: ignore[attr-defined]
        if not stats.get("complete"):
            raise RuntimeError(f"weight broadcast {assign.get('update')}: the reload stopped after {stats.get('buckets', 0)} buckets")
        return {**stats, **refresh_tied_layers(model)}
