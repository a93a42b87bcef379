"""Turning one parsed GGUF file into what a Hugging Face checkpoint holds: a config, a
tokenizer, and float32 tensors under HF names.

Everything is derived from one :class:`~prefixserve.replica.model.gguf_reader.GGUFFile`
(one parse), using transformers' own tables and functions so the result is what
``from_pretrained(..., gguf_file=...)`` gives, without building a transformers model
with real weights:

* config: the metadata renamed through ``GGUF_CONFIG_MAPPING`` the way
  ``load_gguf_checkpoint`` does it (the architecture fix-ups that apply to the
  architectures we serve: llama, mistral, qwen2);
* tokenizer: the metadata grouped as ``get_gguf_tokenizer`` groups it, converted by
  ``convert_gguf_tokenizer``;
* tensors: dequantized by ``gguf.quants.dequantize``, q/k un-permuted by transformers'
  ``TENSOR_PROCESSORS`` and renamed by ``get_gguf_hf_weights_map`` over a model built on
  the ``meta`` device (names only, no storage).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from prefixserve.replica.model.gguf_reader import GGUFFile

# GGUF metadata key -> tokenizer kwarg naming that token (as get_gguf_tokenizer does).
_SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def hf_architecture(g: GGUFFile) -> str:
    """transformers' model_type for this file (llama.cpp files mistral models as llama)."""
    arch = g.architecture
    # load_gguf_checkpoint tests ``"mistral" in read_field(reader, "general.name")``: a list, so equality.
    if "llama" in arch and g.metadata.get("general.name") == "mistral":
        return "mistral"
    return arch


def config_dict(g: GGUFFile) -> dict[str, Any]:
    """The HF config dict ``load_gguf_checkpoint(path)["config"]`` returns for this file."""
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    arch, hf_arch = g.architecture, hf_architecture(g)
    if hf_arch not in GGUF_CONFIG_MAPPING:
        raise ValueError(f"GGUF architecture {arch!r} is not supported by transformers' GGUF mapping")
    config: dict[str, Any] = {"tie_word_embeddings": all(t.name != "output.weight" for t in g.tensors)}
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(hf_arch, GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {}).items():
        config.setdefault(key, value)
    for key, value in g.metadata.items():
        prefix, _, rest = key.replace(arch, hf_arch).partition(".")
        renamed = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if renamed is None or renamed == -1:
            continue
        if isinstance(value, str) and arch in value:
            value = value.replace(arch, hf_arch)
        config[renamed] = value
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in g.metadata:
        config["vocab_size"] = len(g.metadata["tokenizer.ggml.tokens"])
    return config


def hf_config(g: GGUFFile) -> Any:
    """The config ``AutoConfig.from_pretrained(folder, gguf_file=...)`` gives."""
    from transformers import CONFIG_MAPPING

    cfg = config_dict(g)
    return CONFIG_MAPPING[cfg["model_type"]].from_dict(cfg)


def tokenizer(g: GGUFFile) -> Any:
    """The tokenizer ``AutoTokenizer.from_pretrained(folder, gguf_file=...)`` gives."""
    from transformers import TokenizersBackend
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    md = g.metadata
    # Mirrors transformers' get_gguf_tokenizer, which can only take a path (and would parse it again).
    grouped = {
        group: {name: md[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in md}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tok_dict, tok_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tok_dict.get("tokenizer_type") == "llama":
        tok_config.setdefault("add_bos_token", True)
    elif tok_dict.get("tokenizer_type") == "gemma4":
        tok_config["add_bos_token"] = False
    for name, key in _SPECIAL_TOKENS.items():
        token_id = md.get(f"tokenizer.ggml.{key}")
        tok_config[name] = tok_dict["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(g.architecture, tok_dict)
    return TokenizersBackend(tokenizer_object=backend, **tok_config, **extra)


def hf_tensors(g: GGUFFile, config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` for each tensor transformers would load from this file."""
    from gguf.quants import dequantize
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    processor = TENSOR_PROCESSORS.get(g.architecture, TensorProcessor)(config=config_dict(g))
    # Dequantize on every core (numpy releases the GIL in the heavy ops) while this thread
    # works out the names, which imports transformers' model code (~1-2 s).
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        pending = [pool.submit(dequantize, g.tensor_data(info), info.ggml_type) for info in g.tensors]
        name_map = gguf_to_hf_names(config, processor)
        for info, future in zip(g.tensors, pending):
            result = processor.process(
                weights=future.result(), name=info.name, tensor_key_mapping=name_map, parsed_parameters={}
            )
            if result.name not in name_map:
                continue
            weights = result.weights
            if not (weights.flags.owndata and weights.flags.writeable):
                weights = np.copy(weights)  # a view of the read-only mapped file (F32 tensors)
            yield name_map[result.name], torch.from_numpy(weights).to(torch.float32)


def gguf_to_hf_names(config: Any, processor: Any) -> dict[str, str]:
    """``{gguf_tensor_name: hf_parameter_name}`` for a model of ``config``.

    The top level of transformers' ``get_gguf_hf_weights_map``: it also recurses into every
    submodule, rebuilding gguf's name table each time (400 times, ~7 s for a 30-layer model)
    to catch models converted from a bare base model (Bloom); for the decoder-only
    architectures we serve the top level already names every tensor.
    """
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from transformers import AutoModelForCausalLM

    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == config.model_type), None)
    if arch is None:
        raise ValueError(
            f"this GGUF file's architecture {config.model_type!r} has no tensor-name table in gguf: "
            "convert it to a Hugging Face checkpoint directory instead"
        )
    table = get_tensor_name_map(arch, config.num_hidden_layers)
    with torch.device("meta"):  # parameter names only: no storage is allocated
        names = list(AutoModelForCausalLM.from_config(config).state_dict())
    mapping = {}
    for hf_name in names:
        hf_name = processor.preprocess_name(hf_name)
        base, dot, suffix = hf_name.rpartition(".")
        if suffix not in ("weight", "bias"):
            base, dot, suffix = hf_name, "", ""
        gguf_name = table.get_name(base)
        if gguf_name is not None:
            mapping[gguf_name + dot + suffix] = hf_name
    return mapping


def write_hf_checkpoint(g: GGUFFile, folder: Path) -> None:
    """Write ``g`` into ``folder`` as a Hugging Face checkpoint: config.json (complete), the tokenizer
    files (with the chat template) and one model.safetensors of float32 tensors."""
    from safetensors.torch import save_file

    config = hf_config(g)
    # Every field, defaults included: the loader reads it back without the model's config class.
    (folder / "config.json").write_text(config.to_json_string(use_diff=False))
    tokenizer(g).save_pretrained(folder)
    save_file(dict(hf_tensors(g, config)), folder / "model.safetensors", metadata={"format": "pt"})


def converter_version() -> str:
    """What the conversion depends on, for cache keys: a new transformers or gguf may convert differently."""
    from importlib.metadata import version

    return f"transformers={version('transformers')};gguf={version('gguf')}"
