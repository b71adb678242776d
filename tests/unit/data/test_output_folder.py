"""Output folders (``--save-hf``, tiny_hf): what is refused at start-up, what is replaced, and that
no user file is ever deleted or left behind as a hidden copy. Each test checks the user's files
byte for byte afterwards and lists the parent folder: a replaced or deleted file, or a hidden
``.NAME.<hex>.tmp(.old)`` left over, fails it."""
import json
import os

import pytest

from megatron_pg_agg.data.output_folder import (
    HF_KIND,
    MARKER,
    TINY_HF_KIND,
    OutputFolderError,
    new_output_folder,
    output_folder_problem,
    replace_output_folder,
)


def _write(out, files: dict) -> None:
    """One output of the project: ``files`` written into a new folder that then replaces ``out``."""
    temp = new_output_folder(str(out))
    for name, text in files.items():
        with open(os.path.join(temp, name), "w") as f:
            f.write(text)
    replace_output_folder(temp, str(out), kind=HF_KIND, flag="--save-hf")


def _problems(out, **others):
    return output_folder_problem(str(out), "--save-hf", kind=HF_KIND, others=others)


def test_a_new_or_empty_folder_is_written_with_a_marker_listing_its_files(tmp_path):
    assert _problems(tmp_path / "new") == []
    (tmp_path / "empty").mkdir()
    assert _problems(tmp_path / "empty") == []
    _write(tmp_path / "empty", {"config.json": "{}", "model.safetensors": "w"})
    marker = json.loads((tmp_path / "empty" / MARKER).read_text())
    assert marker == {"written_by": "megatron_pg_agg", "kind": "hf", "files": ["config.json", "model.safetensors"]}
    assert sorted(os.listdir(tmp_path)) == ["empty"]


def test_a_users_non_empty_folder_is_refused_and_kept(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    (problem,) = _problems(out)
    assert "--save-hf" in problem and "not empty (notes.txt)" in problem
    assert "not an earlier --save-hf output" in problem
    # at the write itself too (the folder filled during the run): refused, the notes kept, no temporary left
    with pytest.raises(OutputFolderError, match="notes.txt"):
        _write(out, {"config.json": "{}"})
    assert (out / "notes.txt").read_text() == "my notes" and sorted(os.listdir(out)) == ["notes.txt"]
    assert [n for n in os.listdir(tmp_path) if n != "out"] == [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_a_regular_file_or_a_link_is_refused_and_kept(tmp_path):
    target = tmp_path / "model.bin"
    target.write_text("weights")
    (problem,) = _problems(target)
    assert "is a file, not a folder" in problem
    with pytest.raises(OutputFolderError, match="is a file"):
        _write(target, {"config.json": "{}"})
    assert target.read_text() == "weights"
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    assert "symbolic link" in _problems(tmp_path / "link")[0]
    assert sorted(os.listdir(tmp_path)) == ["link", "model.bin", "real"]  # no hidden .model.bin.<hex>.tmp.old


def test_an_earlier_output_is_replaced_whole_and_nothing_is_left_behind(tmp_path):
    out = tmp_path / "out"
    _write(out, {"config.json": "1", "model-00001-of-00002.safetensors": "a", "model-00002-of-00002.safetensors": "b"})
    assert _problems(out) == []
    _write(out, {"config.json": "2", "model.safetensors": "c"})  # fewer files: the old shards go too
    assert sorted(os.listdir(out)) == [MARKER, "config.json", "model.safetensors"]
    assert (out / "config.json").read_text() == "2"
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_a_file_the_user_added_to_an_earlier_output_is_refused_and_kept(tmp_path):
    out = tmp_path / "out"
    _write(out, {"config.json": "1"})
    (out / "eval.txt").write_text("mine")
    (problem,) = _problems(out)
    assert "eval.txt" in problem and "did not write" in problem
    with pytest.raises(OutputFolderError, match="eval.txt"):
        _write(out, {"config.json": "2"})
    assert (out / "eval.txt").read_text() == "mine" and (out / "config.json").read_text() == "1"


def test_a_marker_of_another_kind_or_a_forged_one_is_not_ours(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("theirs")
    (out / MARKER).write_text(json.dumps({"written_by": "megatron_pg_agg", "kind": TINY_HF_KIND,
                                          "files": ["config.json"]}))
    assert "not an earlier --save-hf output" in _problems(out)[0]
    (out / MARKER).write_text("not json")
    assert "not an earlier --save-hf output" in _problems(out)[0]
    assert (out / "config.json").read_text() == "theirs"


@pytest.mark.parametrize("where", ["equal", "inside", "containing"])
def test_the_inputs_and_checkpoints_are_never_the_output(tmp_path, where):
    model = tmp_path / "models" / "qwen"
    model.mkdir(parents=True)
    (model / "config.json").write_text("source")
    out = {"equal": model, "inside": model / "trained", "containing": tmp_path / "models"}[where]
    problems = _problems(out, **{"--hf-model": str(model), "--load": None})
    how = {"equal": "is", "inside": "is inside", "containing": "contains"}[where]
    assert any(p.startswith(f"--save-hf {out} {how} --hf-model {model}") for p in problems), problems
    # a sibling that merely shares a prefix is not inside
    assert _problems(tmp_path / "models" / "qwen-trained", **{"--hf-model": str(model)}) == []
    assert (model / "config.json").read_text() == "source"
