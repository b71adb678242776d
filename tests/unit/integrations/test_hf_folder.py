"""Host checks of an HF folder and of the Megatron-Bridge install, and the atomic HF-folder writer.

No Megatron-Bridge here (these run on every leg): the folder checks read files only, and the
writer is driven by a stand-in for Bridge's export (a list of tensors, or one that fails midway),
since what is tested is the file handling, not the conversion (tests/distributed/test_hf_bridge.py
runs the real one)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from megatron_pg_agg.data.output_folder import MARKER
from megatron_pg_agg.integrations.bridge import hf_folder
from megatron_pg_agg.integrations.bridge.hf_folder import BRIDGE_INSTALL, HFFolderError, open_hf_folder
from tests.support.optional import REQUIRE_BRIDGE, require

ROOT = Path(__file__).resolve().parents[3]


def _folder(tmp_path, architectures=("Qwen3ForCausalLM",), weights=("model.safetensors",), index=None,
            extra=()) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": list(architectures), "model_type": "qwen3"}))
    for name in (*weights, *extra):
        (tmp_path / name).write_bytes(b"")
    if index is not None:
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    return tmp_path


def test_a_causal_lm_folder_is_accepted_with_its_weights_and_tokenizer_files(tmp_path):
    folder = open_hf_folder(str(_folder(tmp_path, extra=("tokenizer.json", "merges.txt", "notes.txt"))))
    assert folder.architectures == ("Qwen3ForCausalLM",)
    assert [os.path.basename(p) for p in folder.weight_files] == ["model.safetensors"]
    assert folder.tokenizer_files == ("tokenizer.json", "merges.txt")  # notes.txt is not copied
    sharded = _folder(tmp_path / "sharded", weights=("a.safetensors", "b.safetensors"),
                      index={"x": "b.safetensors", "y": "a.safetensors", "z": "b.safetensors"})
    assert [os.path.basename(p) for p in open_hf_folder(str(sharded)).weight_files] == ["a.safetensors",
                                                                                       "b.safetensors"]


@pytest.mark.parametrize("make,words", [
    (lambda p: p / "absent", ["no such directory", "nothing is downloaded"]),
    (lambda p: (p.mkdir(), p)[1], ["no config.json"]),
    (lambda p: _folder(p, architectures=("BertModel",)), ["not a causal LM", "BertModel"]),
    (lambda p: _folder(p, architectures=()), ["not a causal LM"]),
    # Megatron-LM #7452 findings 6 (CrossAttention, encoder-decoder) and 7 (LLaVA): never built here
    (lambda p: _folder(p, architectures=("T5ForConditionalGeneration",)), ["not a causal LM"]),
    (lambda p: _folder(p, architectures=("LlavaForConditionalGeneration",)), ["not a causal LM"]),
    (lambda p: _folder(p, weights=("pytorch_model.bin",)), ["no safetensors weights", "pytorch_model.bin",
                                                            "convert them"]),
    (lambda p: _folder(p, weights=("a.safetensors",), index={"x": "a.safetensors", "y": "b.safetensors"}),
     ["missing", "b.safetensors"]),
    (lambda p: _folder(p, weights=(), index={}), ["empty weight_map"]),
])
def test_bad_folders_are_refused_naming_the_file(tmp_path, make, words):
    path = make(tmp_path / "model")
    with pytest.raises(HFFolderError) as err:
        open_hf_folder(str(path))
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_invalid_json_config_names_the_file(tmp_path):
    folder = _folder(tmp_path)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(HFFolderError, match="config.json: not valid JSON"):
        open_hf_folder(str(folder))


class _Version(tuple):
    """sys.version_info's shape: a tuple with major and minor."""

    def __new__(cls, *parts):
        return super().__new__(cls, parts)

    major = property(lambda self: self[0])
    minor = property(lambda self: self[1])


def test_the_install_problem_names_python_3_12_and_the_install_line(monkeypatch):
    monkeypatch.setattr(hf_folder, "sys", types.SimpleNamespace(version_info=_Version(3, 11, 7)))
    problem = hf_folder.bridge_install_problem()
    assert "Python 3.12" in problem and BRIDGE_INSTALL in problem and "3.11" in problem


def test_the_install_problem_names_a_missing_megatron_bridge(monkeypatch):
    monkeypatch.setattr(hf_folder, "sys", types.SimpleNamespace(version_info=_Version(3, 12, 1)))

    def version(name):
        raise hf_folder.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(hf_folder.importlib.metadata, "version", version)
    problem = hf_folder.bridge_install_problem()
    assert "megatron-bridge is not installed" in problem and BRIDGE_INSTALL in problem


@pytest.mark.skipif(sys.version_info[:2] == (3, 12), reason="the Python 3.11 refusal; the 3.12 legs run the real path")
def test_hf_model_is_refused_on_python_3_11_with_exit_2(tmp_path):
    folder = _folder(tmp_path / "model")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    out = subprocess.run([sys.executable, str(ROOT / "launch" / "train_actor.py"), "--hf-model", str(folder)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "needs Python 3.12" in out.stderr and BRIDGE_INSTALL in out.stderr, out.stderr[-3000:]
    assert "world=" not in out.stderr + out.stdout


# ----------------------------------------------------------------------------- the atomic writer


def _fake_hf(source: Path, tensors: list, fail_after=None):
    from megatron_pg_agg.integrations.bridge.hf_folder import HFFolder

    def export(model, cpu, show_progress):
        for i, pair in enumerate(tensors):
            if fail_after is not None and i == fail_after:
                raise OSError("disk full (simulated)")
            yield pair

    folder = HFFolder(path=str(source), config={"architectures": ["Qwen3ForCausalLM"], "dtype": "bfloat16", "x": 1},
                      architectures=("Qwen3ForCausalLM",), weight_files=(), tokenizer_files=("tokenizer.json",))
    return types.SimpleNamespace(folder=folder, bridge=types.SimpleNamespace(export_hf_weights=export))


def _safetensors():
    """The bridge extra installs safetensors: skip without it, fail where CI installed it."""
    require(None if importlib.util.find_spec("safetensors") else "safetensors is not installed (the bridge extra)",
            REQUIRE_BRIDGE)


@pytest.mark.optional_stack
def test_save_hf_folder_writes_config_weights_and_tokenizer_and_replaces_atomically(tmp_path):
    _safetensors()
    from safetensors.torch import load_file

    from megatron_pg_agg.integrations.bridge.hf_model import save_hf_folder

    source = tmp_path / "source"
    source.mkdir()
    (source / "tokenizer.json").write_text('{"t": 1}')
    tensors = [("a.weight", torch.arange(6.0).reshape(2, 3)), ("b.weight", torch.ones(4)), ("c.bias", torch.zeros(2))]
    out = tmp_path / "out"
    save_hf_folder(_fake_hf(source, tensors), [], str(out), rank=0)
    assert sorted(os.listdir(out)) == [MARKER, "config.json", "model.safetensors", "tokenizer.json"]
    written = load_file(out / "model.safetensors")
    assert sorted(written) == ["a.weight", "b.weight", "c.bias"] and torch.equal(written["a.weight"], tensors[0][1])
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float32" and config["x"] == 1  # the weights' dtype, the rest as the source's
    # sharded: 24 + 16 + 8 bytes with a 30-byte limit -> two files and an index naming every tensor
    sharded = tmp_path / "sharded"
    save_hf_folder(_fake_hf(source, tensors), [], str(sharded), rank=0, max_shard_bytes=30)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    assert index == {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors",
                     "c.bias": "model-00002-of-00002.safetensors"}
    # a failure midway leaves the previous folder whole under the final name, and no temporary folder
    with pytest.raises(OSError, match="disk full"):
        save_hf_folder(_fake_hf(source, [(n, t * 2) for n, t in tensors], fail_after=2), [], str(out), rank=0)
    assert torch.equal(load_file(out / "model.safetensors")["a.weight"], tensors[0][1])
    assert sorted(os.listdir(tmp_path)) == ["out", "sharded", "source"]
    # a complete write replaces it, again leaving nothing else behind
    save_hf_folder(_fake_hf(source, [(n, t * 2) for n, t in tensors]), [], str(out), rank=0)
    assert torch.equal(load_file(out / "model.safetensors")["a.weight"], 2 * tensors[0][1])
    assert sorted(os.listdir(tmp_path)) == ["out", "sharded", "source"]


@pytest.mark.optional_stack
def test_a_rank_other_than_0_writes_nothing(tmp_path):
    _safetensors()
    from megatron_pg_agg.integrations.bridge.hf_model import save_hf_folder

    source = tmp_path / "source"
    source.mkdir()
    seen = []
    hf = _fake_hf(source, [("a", torch.ones(1)), ("b", torch.ones(1))])
    export = hf.bridge.export_hf_weights
    hf.bridge.export_hf_weights = lambda *a, **k: (seen.append(p) or p for p in export(*a, **k))
    save_hf_folder(hf, [], str(tmp_path / "out"), rank=1)
    assert len(seen) == 2  # it still takes part in the (collective) export
    assert sorted(os.listdir(tmp_path)) == ["source"]
