"""Data set items (prompt, reference answer) for the rollout agents and the trainer's ticket issuer.

`load_items(spec.dataset, seed=spec.seed)` returns the same list in every role, so a Ticket only names
an index. Sources: the builtin synthetic tasks (no download), local .jsonl/.json/.parquet files or a
saved `datasets` folder, or a Hugging Face data set id (via the `datasets` package). dataset.prompt's
instruction or template is applied here (`format_prompt`), to training and held-out items alike; its
system message and the chat template are applied where the workflows tokenize (rollout/workflows.py).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kuberl.api.v1alpha1 import DatasetSpec, PromptSpec

# In a pod, a data set PVC is mounted read-only here (the operator mounts claim `c` at /data/c).
DATA_VOLUME_ROOT = os.environ.get("KUBERL_DATA_VOLUME_ROOT", "/data")

# repeat-digit: the answer is the digit repeated this many times; the reward is the fraction of the
# first REPEAT_LEN characters of the completion that equal it (dense partial credit, see rewards.py).
REPEAT_LEN = 8
REPEAT_SHOWN = 4  # extra copies of the digit in the prompt
DEFAULT_BUILTIN_SIZE = 1000


@dataclass(frozen=True)
class Item:
    """One data set item: `index` is its position in the loaded list (what a Ticket names)."""

    index: int
    prompt: str
    answer: str


class DatasetError(ValueError):
    """A data set cannot be loaded; the message names the field, file or row."""


PROMPT_PLACEHOLDER = "{prompt}"


def format_prompt(text: str, prompt: PromptSpec | None) -> str:
    """The user message for an item's prompt text: `text`, text + newline + instruction, or the template with
    {prompt} replaced. A plain replace, not str.format: LaTeX braces (\\boxed{}) in a template stay as written."""
    if prompt is None:
        return text
    if prompt.template is not None:
        return prompt.template.replace(PROMPT_PLACEHOLDER, text)
    if prompt.instruction is not None:
        return f"{text}\n{prompt.instruction}"
    return text


def formatted(items: list[Item], prompt: PromptSpec | None) -> list[Item]:
    """Items whose prompt is the formatted user message (unchanged without dataset.prompt)."""
    if prompt is None or (prompt.template is None and prompt.instruction is None):
        return items
    return [replace(it, prompt=format_prompt(it.prompt, prompt)) for it in items]


# ---------------------------------------------------------------------------------------------
# Builtin synthetic tasks
# ---------------------------------------------------------------------------------------------


def repeat_digit_item(rng: random.Random) -> tuple[str, str]:
    d = str(rng.randrange(10))
    # The prompt shows the digit several times: a random-init model's attention spreads over the prompt,
    # so more copies of the digit make the copying signal stronger. Measured with a tiny Qwen2 on 2 cores
    # (GRPO, 16 prompts x 8 samples per step): one copy reaches reward 0.6 after ~130-160 steps, five
    # copies after ~70-90.
    return f"Repeat the digit {d}: {d * REPEAT_SHOWN}", d * REPEAT_LEN


def add_small_item(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randrange(10), rng.randrange(10)
    return f"What is {a} + {b}?", str(a + b)


BUILTIN_TASKS = {"repeat-digit": repeat_digit_item, "add-small": add_small_item}


def builtin_items(name: str, size: int, seed: int | str) -> list[Item]:
    """`size` items of a builtin task, the same for the same (name, size, seed)."""
    if name not in BUILTIN_TASKS:
        raise DatasetError(f"dataset.builtin: unknown task {name!r} (known: {', '.join(sorted(BUILTIN_TASKS))})")
    rng = random.Random(f"{name}:{seed}")
    make = BUILTIN_TASKS[name]
    return [Item(i, *make(rng)) for i in range(size)]


def builtin_corpus() -> list[str]:
    """Texts that cover every builtin task's prompts and answers (the tiny tokenizer trains on them)."""
    rng = random.Random(0)
    texts: list[str] = []
    for make in BUILTIN_TASKS.values():
        for _ in range(300):
            prompt, answer = make(rng)
            texts += [prompt, answer]
    for d in range(10):
        texts += [str(d) * n for n in range(1, REPEAT_LEN + 1)]
    return texts


# ---------------------------------------------------------------------------------------------
# Files and hub data sets
# ---------------------------------------------------------------------------------------------


def resolve_data_path(spec: DatasetSpec) -> Path:
    """The local file or folder of a `path` data set (inside its volume's mount when `volume` is set)."""
    assert spec.path is not None
    if spec.volume is not None:
        return Path(DATA_VOLUME_ROOT) / spec.volume.claim_name / spec.path.lstrip("/")
    return Path(spec.path).expanduser()


def _read_rows(path: Path, split: str = "train") -> list[dict[str, Any]]:
    if not path.exists():
        raise DatasetError(f"dataset.path: {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if path.is_dir():
        return _rows_from_hf(_load_from_disk(path), split)
    if suffix == ".jsonl":
        rows = []
        with path.open() as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise DatasetError(f"dataset.path: {path}:{lineno} is not valid JSON: {exc.msg}") from exc
        return rows
    if suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise DatasetError(f"dataset.path: {path} is not valid JSON: {exc}") from exc
        if isinstance(data, dict):  # {"data": [...]} / {"train": [...]} style
            lists = [v for v in data.values() if isinstance(v, list)]
            if len(lists) != 1:
                raise DatasetError(f"dataset.path: {path} holds an object; expected a list of rows or an object with one list")
            data = lists[0]
        if not isinstance(data, list):
            raise DatasetError(f"dataset.path: {path} holds a {type(data).__name__}; expected a list of rows")
        return data
    if suffix == ".parquet":
        import pyarrow.parquet as pq  # installed with datasets/pandas

        return pq.read_table(path).to_pylist()
    raise DatasetError(f"dataset.path: {str(path)!r} has an unsupported type {suffix or '(none)'}; use .jsonl, .json, .parquet or a saved data set folder")


def _load_from_disk(path: Path) -> Any:
    try:
        import datasets
    except ModuleNotFoundError as exc:
        raise DatasetError(f"dataset.path: {path} is a folder; loading saved data sets needs the `datasets` package") from exc
    ds = datasets.load_from_disk(str(path))
    return ds


def _rows_from_hf(ds: Any, split: str | None = None) -> list[dict[str, Any]]:
    import datasets

    if isinstance(ds, datasets.DatasetDict):  # a saved DatasetDict: pick the split
        if split is None or split not in ds:
            raise DatasetError(f"dataset.split: {split!r} not found (available: {', '.join(ds.keys())})")
        ds = ds[split]
    return ds.to_list()


def _load_hub(spec: DatasetSpec) -> list[dict[str, Any]]:
    try:
        import datasets
    except ModuleNotFoundError as exc:
        raise DatasetError("dataset.id needs the `datasets` package: pip install datasets") from exc
    try:
        ds = datasets.load_dataset(spec.id, spec.config, split=spec.split, token=os.environ.get("HF_TOKEN") or None)
    except ValueError as exc:  # unknown split/config: datasets names the options
        raise DatasetError(f"dataset.id {spec.id!r} (config {spec.config!r}, split {spec.split!r}): {exc}") from exc
    return ds.to_list()


def rows_to_items(rows: list[Any], prompt_field: str, answer_field: str, source: str) -> list[Item]:
    """Turn raw rows into Items; a missing field names the field, the row and what the row has."""
    items = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DatasetError(f"{source}: row {i} is a {type(row).__name__}, not an object")
        for field, which in ((prompt_field, "promptField"), (answer_field, "answerField")):
            if field not in row:
                raise DatasetError(
                    f"{source}: row {i} has no field {field!r} (dataset.{which}); its fields are {sorted(row)}"
                )
        items.append(Item(i, str(row[prompt_field]), str(row[answer_field])))
    return items


def load_items(spec: DatasetSpec, seed: int = 1) -> list[Item]:
    """Every item of the data set (at most spec.size), in a fixed order; shuffling per epoch is the trainer's."""
    if spec.builtin is not None:
        return formatted(builtin_items(spec.builtin, spec.size or DEFAULT_BUILTIN_SIZE, seed), spec.prompt)
    if spec.path is not None:
        path = resolve_data_path(spec)
        rows = _read_rows(path, spec.split)
        source = f"dataset.path {path}"
    else:
        rows = _load_hub(spec)
        source = f"dataset.id {spec.id}"
    if spec.size is not None:
        rows = rows[: spec.size]
    items = rows_to_items(rows, spec.prompt_field, spec.answer_field, source)
    if not items:
        raise DatasetError(f"{source}: no rows")
    return formatted(items, spec.prompt)


def epoch_order(num_items: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """Item indices in the order of one epoch (a fresh seeded permutation per epoch when shuffling)."""
    order = list(range(num_items))
    if shuffle:
        random.Random(f"{seed}:{epoch}").shuffle(order)
    return order


DEFAULT_EVAL_BUILTIN_SIZE = 64


def load_eval_items(spec: Any) -> list[Item]:
    """The held-out items of `spec.evaluation` (an RLExperimentSpec's): a split of spec.dataset or a file.

    A builtin task's split is generated from a seed of its own (the split's name), so it shares no draw
    with the training items. Raises DatasetError naming the field when the split or file cannot be had.
    """
    ev, ds = spec.evaluation, spec.dataset
    if ev is None:
        raise DatasetError("spec.evaluation is not set")
    if ev.split is not None and ev.split == ds.split:
        raise DatasetError(f"evaluation.split {ev.split!r} is the split trained on (dataset.split): a held-out evaluation needs another split")
    if ev.path is not None:
        try:
            rows = _read_rows(resolve_data_path(ds.model_copy(update={"path": ev.path})))
        except DatasetError as exc:
            raise DatasetError(str(exc).replace("dataset.path", "evaluation.path", 1)) from None
        source = f"evaluation.path {ev.path}"
    elif ds.builtin is not None:
        return formatted(builtin_items(ds.builtin, ev.size or DEFAULT_EVAL_BUILTIN_SIZE, f"{spec.seed}:eval:{ev.split}"), ds.prompt)
    elif ds.path is not None:
        path = resolve_data_path(ds)
        if not path.is_dir():
            raise DatasetError(f"evaluation.split {ev.split!r}: dataset.path {str(path)!r} is a file, which has no splits; use evaluation.path")
        try:
            rows = _rows_from_hf(_load_from_disk(path), ev.split)
        except DatasetError as exc:
            raise DatasetError(f"evaluation.{str(exc).removeprefix('dataset.')}") from None
        source = f"evaluation.split {ev.split} of {path}"
    else:
        try:
            rows = _load_hub(ds.model_copy(update={"split": ev.split}))
        except DatasetError as exc:
            raise DatasetError(f"evaluation.split {ev.split!r}: {exc}") from None
        source = f"evaluation.split {ev.split} of {ds.id}"
    if ev.size is not None:
        rows = rows[: ev.size]
    items = rows_to_items(rows, ds.prompt_field, ds.answer_field, source)
    if not items:
        raise DatasetError(f"{source}: no rows")
    return formatted(items, ds.prompt)  # the training items' format: evaluation measures the prompt trained on
