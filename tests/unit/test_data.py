"""Data set loading (kuberl.runtime.data): builtin tasks, local files, clear errors on bad rows."""

from __future__ import annotations

import json

import pytest

from kuberl.api.v1alpha1 import DatasetSpec, VolumeRef
from kuberl.runtime import data
from kuberl.runtime.data import REPEAT_LEN, DatasetError, epoch_order, load_items


def test_builtin_repeat_digit_is_deterministic_per_seed_and_sized():
    a = load_items(DatasetSpec(builtin="repeat-digit", size=50), seed=7)
    b = load_items(DatasetSpec(builtin="repeat-digit", size=50), seed=7)
    c = load_items(DatasetSpec(builtin="repeat-digit", size=50), seed=8)
    assert a == b and a != c and len(a) == 50
    assert [it.index for it in a] == list(range(50))
    for it in a:
        digit, shown = it.prompt.removeprefix("Repeat the digit ").split(": ")
        assert len(digit) == 1 and digit.isdigit() and it.answer == digit * REPEAT_LEN
        assert set(shown) == {digit}
    assert len({it.answer for it in a}) > 5  # covers many digits


def test_builtin_add_small_answers_are_the_sums():
    for it in load_items(DatasetSpec(builtin="add-small", size=30), seed=1):
        a, b = it.prompt.removeprefix("What is ").removesuffix("?").split(" + ")
        assert int(it.answer) == int(a) + int(b)


def test_a_jsonl_file_is_read_with_the_configured_fields(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"q": f"question {i}", "a": i}) for i in range(5)) + "\n\n")
    items = load_items(DatasetSpec(path=str(f), prompt_field="q", answer_field="a", size=3))
    assert [(it.prompt, it.answer) for it in items] == [("question 0", "0"), ("question 1", "1"), ("question 2", "2")]


def test_a_json_list_and_a_json_object_with_one_list_are_both_read(tmp_path):
    rows = [{"question": "x", "answer": "1"}, {"question": "y", "answer": "2"}]
    (tmp_path / "l.json").write_text(json.dumps(rows))
    (tmp_path / "o.json").write_text(json.dumps({"data": rows}))
    assert load_items(DatasetSpec(path=str(tmp_path / "l.json"))) == load_items(DatasetSpec(path=str(tmp_path / "o.json")))


def test_a_parquet_file_is_read(tmp_path):
    import pyarrow as pa  # comes with datasets (kuberl[runtime]): a missing install fails, it is not skipped
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["a", "b"], "answer": ["1", "2"]}), tmp_path / "d.parquet")
    items = load_items(DatasetSpec(path=str(tmp_path / "d.parquet")))
    assert [(it.prompt, it.answer) for it in items] == [("a", "1"), ("b", "2")]


def test_a_missing_field_names_the_field_the_row_and_what_the_row_has(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n" + json.dumps({"question": "q2", "solution": "b"}) + "\n")
    with pytest.raises(DatasetError, match=r"row 1 has no field 'answer' \(dataset.answerField\); its fields are \['question', 'solution'\]"):
        load_items(DatasetSpec(path=str(f)))


def test_bad_files_give_errors_that_name_the_file(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        load_items(DatasetSpec(path=str(tmp_path / "absent.jsonl")))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "a"}\n{oops\n')
    with pytest.raises(DatasetError, match=r"bad.jsonl:2 is not valid JSON"):
        load_items(DatasetSpec(path=str(bad)))
    csv = tmp_path / "d.csv"
    csv.write_text("a,b\n")
    with pytest.raises(DatasetError, match="unsupported type .csv"):
        load_items(DatasetSpec(path=str(csv)))


def test_a_path_on_a_volume_is_read_under_the_claims_mount(tmp_path, monkeypatch):
    (tmp_path / "claim").mkdir()
    (tmp_path / "claim" / "d.jsonl").write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    monkeypatch.setattr(data, "DATA_VOLUME_ROOT", str(tmp_path))
    items = load_items(DatasetSpec(path="d.jsonl", volume=VolumeRef(claim_name="claim")))
    assert items[0].prompt == "q"


def test_epoch_order_is_a_seeded_permutation_that_changes_per_epoch():
    e0, e1 = epoch_order(20, 0, seed=1, shuffle=True), epoch_order(20, 1, seed=1, shuffle=True)
    assert sorted(e0) == list(range(20)) and e0 != e1
    assert e0 == epoch_order(20, 0, seed=1, shuffle=True)
    assert epoch_order(5, 3, seed=1, shuffle=False) == [0, 1, 2, 3, 4]


def test_a_hub_style_data_set_loads_through_datasets_from_a_local_folder(tmp_path):
    import datasets  # noqa: F401  kuberl[runtime]: a missing install fails, it is not skipped
    # `datasets.load_dataset` takes a folder of data files as an id: the hub path without a download.
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps({"question": f"q{i}", "answer": str(i)}) for i in range(4)) + "\n")
    items = load_items(DatasetSpec(id=str(tmp_path), split="train", size=3))
    assert [(it.prompt, it.answer) for it in items] == [("q0", "0"), ("q1", "1"), ("q2", "2")]
    with pytest.raises(DatasetError, match=r"split 'test'"):
        load_items(DatasetSpec(id=str(tmp_path), split="test"))


def test_a_saved_data_set_folder_is_read_with_its_split(tmp_path):
    import datasets

    ds = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"question": "a", "answer": "1"}])})
    ds.save_to_disk(str(tmp_path / "saved"))
    items = load_items(DatasetSpec(path=str(tmp_path / "saved")))
    assert [(it.prompt, it.answer) for it in items] == [("a", "1")]
