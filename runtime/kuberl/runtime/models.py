"""The policy model's files: build the tiny test model, and resolve any ModelSpec to a local folder.

Called by the trainer (initial weights), the engine launcher (what vLLM/SGLang serve), `kuberl run`
and `kuberl build-model OUT`. Two builtin variants, both random-init Qwen2 with a byte-level BPE tokenizer
trained here: `tiny-qwen2` (untied embeddings, no sampling defaults) and `tiny-qwen2-instruct`, shaped like
Qwen2.5-Instruct (tied embeddings, chat template, generation_config.json with its sampling defaults).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from kuberl.api.v1alpha1 import ModelSpec

# In a pod, a model PVC is mounted read-only here (the operator mounts claim `c` at /models/c).
MODEL_VOLUME_ROOT = os.environ.get("KUBERL_MODEL_VOLUME_ROOT", "/models")
# Builtin models built once per machine and copied into each new workdir (build_cache_dir); "off" builds every time.
MODEL_CACHE_ENV = "KUBERL_MODEL_CACHE"

IM_START, IM_END, PAD = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END]

# Qwen's chat template, trimmed to what the workflows use (system/user/assistant turns).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Small on purpose: 2 CPU cores train and serve it; vLLM's CPU attention needs head_dim >= 32.
# Measured on repeat-digit (GRPO, 16 prompts x 8 samples, lr 1e-3): hidden 128 reaches reward 0.6
# in ~70 steps, hidden 64 in ~100-150; both train at a few steps per second here.
TINY_CONFIG = {
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
# Qwen2.5-{0.5B,1.5B,3B,7B}-Instruct's generation_config.json sampling defaults: an engine that applies
# them samples from a top-k, nucleus, repetition-penalised policy the trainer never scores.
QWEN25_INSTRUCT_SAMPLING = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
# builtin name -> (config overrides, generation_config sampling keys)
BUILTIN_MODELS: dict[str, tuple[dict, dict]] = {
    "tiny-qwen2": ({}, {"do_sample": True}),
    "tiny-qwen2-instruct": ({"tie_word_embeddings": True}, QWEN25_INSTRUCT_SAMPLING),
}
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TINY_VOCAB_TARGET = 320  # 256 byte symbols + 3 specials + a few merges (digit runs, task words)


def _corpus() -> list[str]:
    from kuberl.runtime.data import builtin_corpus

    tasks = builtin_corpus()
    # The prompts as the workflows send them: role words become single tokens, so the chat wrapper
    # is short (the digit to repeat sits few positions before the answer: faster to learn).
    chat = [f"{IM_START}user\n{t}{IM_END}\n{IM_START}assistant\n" for t in tasks[::2]]
    math = ["The answer is 42.", "#### 17", "Natalia sold 48 clips in April and half as many in May.", "system"]
    return tasks + chat + math


def build_tokenizer(vocab_size: int = TINY_VOCAB_TARGET):
    """A byte-level BPE tokenizer (every byte string round-trips) with Qwen's special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Qwen2's pre-tokenization: its split pattern (one token per digit), then bytes -> symbols.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=PAD, unk_token=None, bos_token=None,
        additional_special_tokens=[IM_START], model_max_length=TINY_CONFIG["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(output_dir: str | Path, seed: int = 0, *, variant: str = "tiny-qwen2", **overrides: int) -> Path:
    """Write a tiny Qwen2ForCausalLM + tokenizer in Hugging Face layout (safetensors); deterministic per seed.

    variant: a BUILTIN_MODELS name (its config overrides and generation_config sampling defaults).
    `overrides` change TINY_CONFIG entries (e.g. hidden_size=128) for experiments.
    """
    if variant not in BUILTIN_MODELS:
        raise ValueError(f"unknown builtin model {variant!r}; known: {', '.join(BUILTIN_MODELS)}")
    config_overrides, sampling = BUILTIN_MODELS[variant]
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    eos, pad = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(PAD)
    cfg = Qwen2Config(
        **{**TINY_CONFIG, **config_overrides, **overrides},
        vocab_size=len(tokenizer), eos_token_id=eos, pad_token_id=pad, bos_token_id=None,
    )
    cfg.dtype = "float32"
    # Seed and init on CPU in float32 so the same seed gives the same bytes everywhere.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg).to(torch.float32)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    # Instruct models stop at <|im_end|> or <|endoftext|> (Qwen2.5-Instruct lists both).
    eos_ids = [eos, pad] if variant != "tiny-qwen2" else eos
    model.generation_config = GenerationConfig(eos_token_id=eos_ids, pad_token_id=pad, **sampling)
    from transformers.utils import logging as hf_logging

    # One small file: transformers' "Writing model shards" progress bar would be the only bar in `kuberl run`'s output.
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out, safe_serialization=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(out)
    if variant != "tiny-qwen2":
        # Qwen2.5-Instruct's layout: the chat template inside tokenizer_config.json, no chat_template.jinja.
        tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
        tok_cfg["chat_template"] = CHAT_TEMPLATE
        (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
        (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


# ---------------------------------------------------------------------------------------------
# Resolving a ModelSpec
# ---------------------------------------------------------------------------------------------


class ModelResolutionError(ValueError):
    """spec.model names something that cannot be turned into a local model folder."""


def _check_model_dir(path: Path, field: str) -> Path:
    if not path.is_dir():
        raise ModelResolutionError(f"{field}: {str(path)!r} is not a folder")
    if not (path / "config.json").is_file():
        raise ModelResolutionError(f"{field}: {str(path)!r} has no config.json (expected a Hugging Face model folder)")
    return path


def build_cache_dir() -> Path | None:
    """Where builtin models are kept between workdirs: $KUBERL_MODEL_CACHE, else ~/.cache/kuberl/models (XDG_CACHE_HOME
    honoured); None when KUBERL_MODEL_CACHE is "off"."""
    where = os.environ.get(MODEL_CACHE_ENV)
    if where == "off":
        return None
    if where:
        return Path(where)
    try:
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kuberl" / "models"
    except (RuntimeError, KeyError):  # no HOME and no passwd entry (an arbitrary uid in a container): no cache
        return None


def _build_key(seed: int, variant: str) -> str:
    """The cached build's name: what decides its bytes (this module and the corpus its tokenizer learns from, the
    versions of torch, transformers and tokenizers), read without importing any of them."""
    from importlib.metadata import PackageNotFoundError, version

    from kuberl.runtime import data

    h = hashlib.sha256(Path(__file__).read_bytes() + Path(data.__file__).read_bytes())
    for dist in ("torch", "transformers", "tokenizers"):
        try:
            h.update(f"{dist}={version(dist)};".encode())
        except PackageNotFoundError:
            h.update(f"{dist}=?;".encode())
    return f"{variant}-seed{seed}-{h.hexdigest()[:16]}"


def _build_into(folder: Path, seed: int, variant: str) -> None:
    """Build the builtin model into the new folder `folder`: copied from the build cache (built there first if missing),
    or built in place when there is no usable cache (KUBERL_MODEL_CACHE=off, or a cache that cannot be written)."""
    cache = build_cache_dir()
    if cache is not None:
        try:
            cached = _build_once(cache / _build_key(seed, variant), seed, variant, cache=False)
            shutil.copytree(cached, folder, dirs_exist_ok=True)
            return
        except OSError:  # a read-only home, a full disk: build here instead
            pass
    build_tiny_model(folder, seed=seed, variant=variant)


def _build_once(target: Path, seed: int, variant: str, *, cache: bool = True) -> Path:
    """Build the builtin model into `target` unless it is there; a lock keeps concurrent roles from racing. With
    `cache`, a build another workdir made before is copied (no torch import, no build: ~10 CPU-s of every new run)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").is_file():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            if cache:
                _build_into(tmp, seed, variant)
            else:
                build_tiny_model(tmp, seed=seed, variant=variant)
            try:
                os.replace(tmp, target)  # atomic: readers see all files or none
            except OSError:
                # Another pod won the race (flock does not reach across every shared file system);
                # the build is deterministic, so its copy is as good as ours.
                if not (target / "config.json").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(spec: ModelSpec, workdir: str | Path | None = None, *, seed: int = 0) -> str:
    """A local folder holding spec's model (config.json, safetensors, tokenizer).

    builtin -> built once into `workdir/models/<name>`; path (+volume) -> that folder, checked;
    id -> `huggingface_hub.snapshot_download` (token from $HF_TOKEN; honours HF_HUB_OFFLINE).
    """
    if spec.builtin is not None:
        if workdir is None:
            raise ModelResolutionError("model.builtin: a workdir is needed to build the model into")
        return str(_build_once(Path(workdir) / "models" / spec.builtin, seed, spec.builtin))
    if spec.path is not None:
        if spec.volume is not None:
            root = Path(MODEL_VOLUME_ROOT) / spec.volume.claim_name
            return str(_check_model_dir(root / spec.path.lstrip("/"), "model.path"))
        return str(_check_model_dir(Path(spec.path).expanduser(), "model.path"))
    assert spec.id is not None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        folder = snapshot_download(
            spec.id, revision=spec.revision, token=os.environ.get("HF_TOKEN") or None,
            allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"],
        )
    except LocalEntryNotFoundError as exc:
        raise ModelResolutionError(
            f"model.id: {spec.id!r} (revision {spec.revision!r}) is not in the local cache and the hub cannot be reached: {exc}") from exc
    except HfHubHTTPError as exc:
        raise ModelResolutionError(f"model.id: cannot download {spec.id!r} (revision {spec.revision!r}): {exc}") from exc
    return str(_check_model_dir(Path(folder), "model.id"))


def model_summary(path: str | Path) -> dict:
    """A few facts from a model folder's config.json (for logs)."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    keys = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "tie_word_embeddings")
    return {k: cfg.get(k) for k in keys}


def main(args: argparse.Namespace) -> int:
    """`kuberl build-model OUT [--seed N] [--variant NAME]`."""
    out = build_tiny_model(args.output, seed=args.seed, variant=getattr(args, "variant", None) or "tiny-qwen2")
    print(f"built tiny model in {out}: {model_summary(out)}")
    return 0
