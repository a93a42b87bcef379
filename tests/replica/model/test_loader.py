"""Checkpoint loading: the one-parse GGUF reader, the GGUF -> HF conversion against
transformers' own ``gguf_file=`` loading, and the checkpoint cache (built once, read
after, corrupt or partial entries rebuilt, never loaded)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from model_helpers import SMOLLM2_GGUF, hf_greedy, hf_model, random_prompts, smollm2_folder, tiny_gguf

from prefixserve.kernels.cpu import library as cpu_library
from prefixserve.replica.entrypoints.llm import LLM
from prefixserve.replica.model import checkpoint_cache, loader
from prefixserve.replica.model.gguf_reader import read_gguf
from prefixserve.replica.model.llama import ModelConfig
from prefixserve.replica.sampling_params import SamplingParams

TEXTS = [
    "Hello, my name is",
    "  spaces   and\n\nnew lines\ttabs",
    "<|im_start|>user\nhi<|im_end|>",
    "émojis 🤖 and 中文",
    "<|endoftext|> numbers 1234567",
]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a hammer?"}]


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gguf")
    tiny_gguf(folder / "tiny.gguf")
    return folder


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty checkpoint cache for this test, and no conversions remembered from other tests.
    The compiled kernels are shared with the real cache (building them is not under test)."""
    kernels = cpu_library.kernel_cache_dir()
    (tmp_path / "cache").mkdir()
    if kernels.is_dir():
        (tmp_path / "cache" / "kernels").symlink_to(kernels)
    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "_conversions", {})
    return tmp_path / "cache" / "checkpoints"


def weights(src: loader.CheckpointSource) -> dict[str, torch.Tensor]:
    return dict(loader.iter_weights(src))


def test_reader_matches_gguf_reader(gguf_dir):
    from gguf import GGUFReader

    ours, theirs = read_gguf(gguf_dir / "tiny.gguf"), GGUFReader(gguf_dir / "tiny.gguf")
    assert ours.metadata["tokenizer.ggml.tokens"] == [
        str(bytes(theirs.fields["tokenizer.ggml.tokens"].parts[i]), "utf-8")
        for i in theirs.fields["tokenizer.ggml.tokens"].data
    ]
    assert ours.metadata["llama.attention.head_count_kv"] == 2
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.ggml_type == b.tensor_type
        np.testing.assert_array_equal(ours.tensor_data(a), b.data)


def test_reader_refuses_truncated_and_foreign_files(gguf_dir, tmp_path):
    data = (gguf_dir / "tiny.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match="truncated"):
        read_gguf(tmp_path / "cut.gguf")
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04" + data[4:100])
    with pytest.raises(ValueError, match="not a GGUF"):
        read_gguf(tmp_path / "not.gguf")


def test_converted_gguf_equals_transformers_load_and_greedy(gguf_dir, cache):
    """Config, tokenizer, every weight and greedy tokens of the cached conversion are
    those of transformers' ``from_pretrained(gguf_file=...)``, cold (built) and warm (read)."""
    from transformers import AutoTokenizer

    src = loader.resolve(str(gguf_dir / "tiny.gguf"))
    ref = hf_model(str(gguf_dir), "tiny.gguf")
    ref_state = ref.state_dict()
    got = weights(src)
    assert set(got) == set(ref_state)
    for name, tensor in got.items():
        assert torch.equal(tensor, ref_state[name]), name
    assert ModelConfig.from_hf(loader.load_hf_config(src)) == ModelConfig.from_hf(ref.config)
    ref_tok, tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file="tiny.gguf"), loader.load_tokenizer(src)
    for text in TEXTS:
        assert tok(text).input_ids == ref_tok(text).input_ids, text
        assert tok.decode(ref_tok(text).input_ids) == ref_tok.decode(ref_tok(text).input_ids)
    assert tok.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=False
    ) == ref_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id, len(tok)) == (
        ref_tok.eos_token_id,
        ref_tok.bos_token_id,
        ref_tok.pad_token_id,
        len(ref_tok),
    )

    prompts = random_prompts(np.random.default_rng(0), 3, 3, 20)
    expected = [hf_greedy(ref, p, 12) for p in prompts]
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    entries = list(cache.glob("tiny-*"))
    assert len(entries) == 1 and checkpoint_cache.verify(entries[0])
    loader._conversions.clear()  # a new process: reads the entry, converts nothing
    mtime = (entries[0] / "model.safetensors").stat().st_mtime_ns
    llm = LLM(str(gguf_dir / "tiny.gguf"), num_kv_blocks=64)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == expected
    assert (entries[0] / "model.safetensors").stat().st_mtime_ns == mtime


@pytest.mark.parametrize("damage", ["flip_weight_byte", "truncate_weights", "no_manifest", "edit_config"])
def test_damaged_cache_entry_is_rebuilt_not_loaded(gguf_dir, cache, damage, monkeypatch):
    # Every file counts as large: the weights' hash is checked in the background, as for a real model.
    monkeypatch.setattr(checkpoint_cache, "LARGE_FILE", 1)
    src = loader.resolve(str(gguf_dir / "tiny.gguf"))
    good = weights(src)
    (entry,) = cache.glob("tiny-*")
    target = entry / "model.safetensors"
    if damage == "flip_weight_byte":  # same size: only the hash can tell
        with open(target, "r+b") as f:
            f.seek(target.stat().st_size - 5)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x40]))
    elif damage == "truncate_weights":
        os.truncate(target, target.stat().st_size // 2)
    elif damage == "no_manifest":  # as if a build had died before finishing
        (entry / checkpoint_cache.MANIFEST).unlink()
    else:
        cfg = json.loads((entry / "config.json").read_text())
        (entry / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
    assert not checkpoint_cache.verify(entry)
    loader._conversions.clear()
    again = weights(src)
    assert checkpoint_cache.verify(entry)
    assert set(again) == set(good) and all(torch.equal(again[k], good[k]) for k in good)
    assert loader.load_hf_config(src).num_hidden_layers == 2


def test_cache_key_follows_the_source_file(gguf_dir, cache, tmp_path):
    copy = tmp_path / "copy" / "tiny.gguf"
    copy.parent.mkdir()
    shutil.copy(gguf_dir / "tiny.gguf", copy)
    first = loader.prepare(loader.resolve(str(copy))).folder
    assert loader.prepare(loader.resolve(str(copy))).folder == first
    os.utime(copy, ns=(copy.stat().st_atime_ns, copy.stat().st_mtime_ns + 10**9))  # touched
    loader._conversions.clear()
    touched = loader.prepare(loader.resolve(str(copy))).folder
    assert touched != first
    manifest = json.loads((touched / checkpoint_cache.MANIFEST).read_text())
    assert manifest["source"]["sha256"] == checkpoint_cache.file_sha256(copy)
    assert manifest["source"]["size"] == copy.stat().st_size
    assert not list(cache.glob(".tiny-*"))  # no temporary build folders left behind


def test_unwritable_cache_still_loads(gguf_dir, tmp_path, monkeypatch):
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("")
    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(blocker))
    monkeypatch.setattr(loader, "_conversions", {})
    src = loader.resolve(str(gguf_dir / "tiny.gguf"))
    assert loader.load_hf_config(src).num_hidden_layers == 2
    assert "model.embed_tokens.weight" in weights(src)


@pytest.mark.slow
def test_smollm2_cached_weights_equal_transformers_gguf_load(cache):
    ref = hf_model(str(smollm2_folder()), SMOLLM2_GGUF).state_dict()
    got = weights(loader.resolve("smollm2"))
    assert set(got) == set(ref) - {"lm_head.weight"}  # tied to the embedding
    for name, tensor in got.items():
        assert torch.equal(tensor, ref[name]), name


def test_mapped_weights_are_the_same_tensors_read_lazily(tmp_path):
    """A tensor-parallel rank's mapped views hold exactly what the positioned reads return,
    including a bf16 tensor and an empty one; narrowing a view reads only its slice."""
    from safetensors.torch import save_file

    tensors = {
        "a": torch.randn(6, 5),
        "b": torch.randn(3, 4).to(torch.bfloat16),
        "empty": torch.empty(0, 4),
        "c": torch.arange(12, dtype=torch.int64).view(3, 4),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    src = loader.CheckpointSource(tmp_path)
    read = dict(loader.iter_weights(src))
    mapped = dict(loader.iter_weights(src, mapped=True))
    assert read.keys() == mapped.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert mapped[name].dtype == tensor.dtype and torch.equal(mapped[name], tensor), name
        assert torch.equal(read[name], tensor), name
    assert torch.equal(mapped["a"].narrow(1, 2, 2).clone(), tensors["a"][:, 2:4])
