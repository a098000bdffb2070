"""Run megatron-core on the CPU with gloo: the dev/test path of the Megatron backend, never the production one.

megatron-core assumes CUDA in a few places that a CPU run reaches (measured on megatron-core 0.16.1, see
docs/design/megatron-cpu.md; RE-CHECK THIS LIST ON EVERY megatron-core UPGRADE):

* the RNG tracker (`tensor_parallel/random.py`, `CudaRNGStatesTracker.add`) forks `torch.cuda` RNG states:
  `CpuRNGStatesTracker` below forks the CPU generator instead;
* hard-coded CUDA allocations: `torch.empty(..., device=torch.cuda.current_device())` in
  `utils.py GlobalMemoryBuffer.get_tensor` (local attention), `device="cuda"` in every schedule
  (`pipeline_parallel/schedules.py`, `total_num_tokens`), the p2p shape/receive buffers
  (`pipeline_parallel/p2p_communication.py`), the grad-norm buffers (`optimizer/clip_grads.py`,
  `utils.py local_multi_tensor_l2_norm`); RoPE moves `inv_freq` to `torch.cuda.current_device()`
  (`models/common/embeddings/rotary_pos_embedding.py get_emb`); tied embeddings under pipeline parallelism
  call `weight.data.cuda()` (`models/common/language_module/language_module.py`).
  `cpu_compat()` maps them to the CPU: a `TorchFunctionMode` that rewrites a CUDA `device=` argument to
  "cpu" and makes `Tensor.cuda()` a no-op, plus `torch.cuda.current_device() -> torch.device("cpu")` and a
  no-op `torch.cuda.synchronize()` while it is active;
* backward passes run OUTSIDE the TorchFunctionMode (a mode is popped while its own `__torch_function__`
  runs, and `Tensor.backward`/`torch.autograd.backward` go through it), so an allocation in an autograd
  Function's backward sees only the `torch.cuda.current_device` patch: that is why it returns the CPU device
  itself rather than an index. Met in the MoE token dispatcher: `tensor_parallel/mappings.py:141`
  (`_gather_along_first_dim`, the backward of the reduce-scatter that combines the experts' outputs,
  `mappings.py:373`) allocates `torch.empty(..., device=torch.cuda.current_device())`;
* context parallel: RoPE's per-CP-rank slice builds its index with `torch.tensor(..., pin_memory=True).cuda()`
  (`models/common/embeddings/rope_utils.py:62-64`); a CPU-only torch has no pinned-memory allocator
  ("pin_memory=True requires a CUDA or other accelerator backend"): the mode turns pin_memory off;
* the router's gating linear (`transformer/moe/moe_utils.py:1192`, `:1225`) tests `te_general_gemm is not None`,
  a name that exists only when the Transformer Engine import (`moe_utils.py:25-34`) succeeded: without TE it is
  a NameError on any device. `no_te_shims()` defines it as None (megatron's torch.mm fallback).
* MoE expert parallelism: the alltoall token dispatcher allocates a `torch.cuda.Stream()` in its constructor
  (`transformer/moe/token_dispatcher.py:445`) and syncs on CUDA events (`:862-902`): not shimmed; the CPU
  path uses the allgather dispatcher (convert_moe.config_kwargs), which needs nothing beyond the above.

* the mixed-precision and distributed optimizers (`optimizer/optimizer.py:671-699`,
  `optimizer/distrib_optimizer.py:361-435`) and `clip_grads.py clip_grad_by_total_norm_fp32` tell a parameter's
  dtype by its type string (`param.type() == 'torch.cuda.FloatTensor'`) and refuse anything else: inside the
  mode a bare `Tensor.type()` answers the CUDA name of the same dtype ('torch.FloatTensor' -> 'torch.cuda.FloatTensor').
  Their DDP buffers and reduce-scatters are device-agnostic once the allocations above are mapped (gloo has
  reduce_scatter_tensor and all_gather_into_tensor in torch 2.13);
* activation recomputation (`tensor_parallel/random.py` CheckpointFunction, `_get_all_rng_states`) saves and
  restores the CUDA generator through `_get_cuda_rng_state`/`_set_cuda_rng_state`: `seed_cpu` makes them no-ops
  (the CPU generator, which dropout uses here, is saved and restored beside them already).

Everything here is global process state; it is installed only when the model runs on the CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_CPU = torch.device("cpu")


def no_te_shims() -> None:
    """What megatron-core 0.16.1 leaves undefined without Transformer Engine (any device): moe_utils.te_general_gemm."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class CudaToCpu(torch.overrides.TorchFunctionMode):
    """Rewrites megatron's hard-coded CUDA placements to the CPU while active.

    `device="cuda"`, `device="cuda:N"`, `device=torch.device("cuda")` and an integer device (what
    `torch.cuda.current_device()` returns) become "cpu"; `tensor.cuda()` returns the tensor itself;
    `pin_memory=True` becomes False.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:  # megatron's dtype test by type string
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        dev = kwargs.get("device")
        if dev is not None and (isinstance(dev, int) or str(dev).startswith("cuda")):
            kwargs = {**kwargs, "device": "cpu"}
        if kwargs.get("pin_memory"):  # no pinned-memory allocator without an accelerator
            kwargs = {**kwargs, "pin_memory": False}
        return func(*args, **kwargs)


def _install_cpu_rng_tracker_class():
    """A subclass of megatron's CudaRNGStatesTracker that forks the CPU generator (what dropout uses on CPU)."""
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Named RNG states of the CPU default generator; `fork(name)` runs a block on state `name`."""

        def add(self, name, seed):
            if seed in self.seeds_:
                raise ValueError(f"seed {seed} already exists")
            if name in self.states_:
                raise ValueError(f"rng state {name} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise ValueError(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    return CpuRNGStatesTracker


def seed_cpu(seed: int) -> None:
    """CPU twin of `tensor_parallel.model_parallel_cuda_manual_seed` (same seeds per tracker name).

    Call after `parallel_state.initialize_model_parallel`. Also makes recomputation's save/restore of the CUDA
    generator a no-op (module docstring).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    torch.manual_seed(seed)
    tracker = _install_cpu_rng_tracker_class()()
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mrandom._get_cuda_rng_state = lambda *a, **k: None
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    tp_rank = ps.get_tensor_model_parallel_rank()
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ps.get_expert_model_parallel_rank() + tp_rank)


_depth = 0
_saved: dict[str, object] = {}


@contextlib.contextmanager
def cpu_compat(enabled: bool = True) -> Iterator[None]:
    """Run the block with megatron's CUDA placements mapped to the CPU (re-entrant; a no-op when not enabled).

    The backend enters it around model construction, forward/backward schedules and the grad norm when its
    device is the CPU.
    """
    global _depth
    if not enabled:
        yield
        return
    if _depth == 0:
        _saved.update(current_device=torch.cuda.current_device, synchronize=torch.cuda.synchronize)
        torch.cuda.current_device = lambda: _CPU
        torch.cuda.synchronize = lambda *a, **k: None
    _depth += 1
    try:
        with CudaToCpu():
            yield
    finally:
        _depth -= 1
        if _depth == 0:
            torch.cuda.current_device = _saved.pop("current_device")
            torch.cuda.synchronize = _saved.pop("synchronize")
