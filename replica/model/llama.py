"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over paged KV.

One forward pass runs every token of a step packed into one batch: tokens of all
sequences are concatenated (``[T]`` ids and positions) and attention finds each
sequence's rows through ``AttentionMetadata``. K/V of the new tokens are written
into the paged cache first, then attention reads the whole context from it.

The model holds no weight-loading logic beyond a name table: each parameter carries
its own ``weight_loader`` (see layers.py) and ``load_weights`` maps checkpoint names
onto fused parameters. No knowledge of requests, schedulers or tokenizers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from prefixserve.kernels.interface import KernelBackend, LayerOps
from prefixserve.replica.model.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    default_weight_loader,
)
from prefixserve.replica.model.rope import RopeConfig, RotaryEmbedding

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# vLLM's dynamic fp8 KV scales (calculate_kv_scales): amax / these constants.
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0
# Checkpoint names of fp8 KV scales (vLLM's spellings), by suffix after "layers.N.self_attn.":
# -> which scales the tensor sets.
KV_SCALE_NAMES = {
    "k_scale": ("k",),
    "v_scale": ("v",),
    "kv_scale": ("k", "v"),
    "attn.k_scale": ("k",),
    "attn.v_scale": ("v",),
    "k_proj.k_scale": ("k",),
    "v_proj.v_scale": ("v",),
    "qkv_proj.k_scale": ("k",),
    "qkv_proj.v_scale": ("v",),
    "k_proj.output_scale": ("k",),
    "v_proj.output_scale": ("v",),
}


@dataclass(frozen=True)
class ModelConfig:
    """The architecture numbers the forward pass needs, read from a HF config."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    # Window of the checkpoint's sliding-window attention, None if it attends to all.
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    # Each layer's window (None = full attention): the checkpoint's ``layer_types``
    # ("sliding_attention" / "full_attention", e.g. Gemma-2-style alternation, Qwen2's
    # max_window_layers) when it has them, else ``sliding_window`` on every layer.
    # Empty = ``sliding_window`` on every layer.
    layer_windows: tuple[int | None, ...] = ()

    def check_tensor_parallel(self, size: int) -> None:
        """Raise ValueError (naming the checkpoint number at fault) unless every layer
        splits over ``size`` ranks: query heads, MLP columns, KV heads split or replicated."""
        for rank in (0, size - 1):
            tp = TPGroup(rank, size)
            tp.shard(self.num_heads, "num_attention_heads")
            tp.shard(self.intermediate_size, "intermediate_size")
            tp.kv_heads(self.num_kv_heads)

    def window_of(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    @property
    def kv_window(self) -> int | None:
        """The window the KV cache may forget beyond: the widest layer window when every
        layer is windowed, else None (a full-attention layer needs every block)."""
        windows = [self.window_of(i) for i in range(self.num_layers)]
        if not windows or any(w is None for w in windows):
            return None
        return max(w for w in windows if w is not None)

    def with_sliding_window(self, window: int) -> ModelConfig:
        """The ``sliding_window`` knob: ``window`` on the checkpoint's windowed layers, or on
        every layer when the checkpoint has none."""
        current = [self.window_of(i) for i in range(self.num_layers)]
        if all(w is None for w in current):
            windows = [window] * self.num_layers
        else:
            windows = [None if w is None else window for w in current]
        return dataclasses.replace(self, sliding_window=window, layer_windows=tuple(windows))

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        archs = list(getattr(hf, "architectures", None) or [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            model_type = getattr(hf, "model_type", "")
            arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(
                model_type
            )
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or hf.model_type!r}; supported: {SUPPORTED_ARCHITECTURES}"
            )
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        max_pos = int(getattr(hf, "max_position_embeddings", 2048))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        window = getattr(hf, "sliding_window", None)
        if is_qwen2 and not getattr(hf, "use_sliding_window", False):
            window = None
        window = int(window) if window else None
        num_layers = hf.num_hidden_layers
        layer_types = getattr(hf, "layer_types", None)
        if window is None:
            layer_windows: tuple[int | None, ...] = (None,) * num_layers
        elif layer_types:
            if len(layer_types) != num_layers:
                raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
            unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
            if unknown:
                raise ValueError(f"unsupported layer_types {unknown}: only sliding_attention / full_attention")
            layer_windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
        else:
            layer_windows = (window,) * num_layers
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos]))
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            rope=_rope_config(hf, max_pos),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or bool(getattr(hf, "attention_bias", False)),
            o_bias=not is_qwen2 and bool(getattr(hf, "attention_bias", False)),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            max_position_embeddings=max_pos,
            sliding_window=window,
            eos_token_ids=tuple(int(e) for e in eos_ids),
            layer_windows=layer_windows,
        )


def _rope_config(hf: Any, max_pos: int) -> RopeConfig:
    # transformers 5 names it rope_parameters (theta inside); older configs rope_scaling + rope_theta.
    params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    theta = float(params.pop("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default")) or "default"
    return RopeConfig(theta=theta, rope_type=rope_type, params=params, max_position_embeddings=max_pos)


@dataclass
class AttentionMetadata:
    """Where the packed tokens of one step live in the paged cache (see kernels.reference)."""

    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32, context length incl. the new tokens
    query_start_loc: torch.Tensor  # [S + 1] int32
    # Rotary inputs of this step's positions (LayerOps.prepare_rotary); filled by the model's forward.
    rotary: Any = None


class Attention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, tp: TPGroup, backend: KernelBackend, dtype: torch.dtype, ops: LayerOps
    ) -> None:
        super().__init__()
        self.ops = ops
        self.tp = tp
        self.num_heads = tp.shard(cfg.num_heads, "num_attention_heads")
        self.num_kv_heads, _ = tp.kv_heads(cfg.num_kv_heads)
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias, tp, dtype
        )
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias, tp, dtype)
        self.backend = backend
        self.k_cache: torch.Tensor | None = None  # [NB, ...] in the backend's layout, bound by the runner
        self.v_cache: torch.Tensor | None = None
        # fp8 KV cache: the cache holds K / k_scale and V / v_scale (Python floats: no sync per step).
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.calculate_kv_scales = False  # set once: the next forward computes the scales
        self.sliding_window: int | None = None

    def _calculate_kv_scales(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """vLLM's dynamic scales: amax(K) / 200 and amax(V) / 100 (headroom below 448), once.

        Under tensor parallelism the amax is taken over every rank's heads, so all ranks
        (and a TP=1 engine) store the cache with the same scales."""
        self.calculate_kv_scales = False
        amax = self.tp.all_reduce(torch.stack([k.abs().max(), v.abs().max()]).float(), op="max")
        k_amax, v_amax = float(amax[0]), float(amax[1])
        self.k_scale = k_amax / K_SCALE_CONSTANT if k_amax > 0 else 1.0
        self.v_scale = v_amax / V_SCALE_CONSTANT if v_amax > 0 else 1.0

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        # q and k are adjacent columns: rotate them as one [T, H + KVH, D] tensor.
        heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, : self.q_size + self.kv_size].unflatten(1, (heads, self.head_dim))
        v = qkv[:, self.q_size + self.kv_size :].unflatten(1, (self.num_kv_heads, self.head_dim))
        if self.ops.rotary_and_write_kv is not None and not self.calculate_kv_scales:
            # One pass (Triton): rotate q and k in place and store the rotated k and v into the cache.
            q = self.ops.rotary_and_write_kv(
                qk,
                v,
                meta.rotary,
                self.k_cache,
                self.v_cache,
                meta.slot_mapping,
                k_scale=self.k_scale,
                v_scale=self.v_scale,
            )[:, : self.num_heads]
        else:
            q, k = self.ops.rotary(qk, meta.rotary).split([self.num_heads, self.num_kv_heads], dim=1)
            if self.calculate_kv_scales:  # needs the rotated k: the first forward stays unfused
                self._calculate_kv_scales(k, v)
            self.backend.write_kv_cache(
                k, v, self.k_cache, self.v_cache, meta.slot_mapping, k_scale=self.k_scale, v_scale=self.v_scale
            )
        # Token rows of q/k/v may be strided views into qkv; the CPU backend reads them as they are.
        if self.backend.name != "cpu":
            q = q.contiguous()
        o = self.backend.paged_attention(
            q,
            self.k_cache,
            self.v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            scale=self.scale,
            sliding_window=self.sliding_window,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, ops: LayerOps) -> None:
        super().__init__()
        self.ops = ops
        self.inter = tp.shard(cfg.intermediate_size, "intermediate_size")
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, cfg.mlp_bias, tp, dtype
        )
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, tp, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops.name == "c":  # the fused decode pass equals the C ops' silu_and_mul bit for bit
            fused = self.gate_up_proj.silu_and_mul_small(x)
            if fused is not None:
                return self.down_proj(fused)
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer. The residual stream is carried beside the hidden states
    so that each residual add is fused into the next norm (vLLM's layout)."""

    def __init__(
        self, cfg: ModelConfig, tp: TPGroup, backend: KernelBackend, dtype: torch.dtype, ops: LayerOps
    ) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, tp, backend, dtype, ops)
        self.mlp = MLP(cfg, tp, dtype, ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden, residual)`` in, ``(hidden, residual)`` out; the layer's output is their sum."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden, residual = self.post_attention_layernorm(self.self_attn(hidden, meta), residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    """Decoder stack + LM head; ``forward`` gives hidden states, ``compute_logits`` the logits
    of selected rows (only the rows that sample pay for the vocabulary projection)."""

    # checkpoint sub-name -> (our fused parameter sub-name, shard id)
    PACKED = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        max_model_len: int,
        backend: KernelBackend,
        dtype: torch.dtype,
        tp: TPGroup = TPGroup(),
        ops: LayerOps | None = None,
    ) -> None:
        """``ops``: the layer ops to run instead of ``backend``'s own (tests compare implementations)."""
        super().__init__()
        self.cfg = cfg
        ops = backend.layer_ops if ops is None else ops
        self.ops = ops
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_model_len, dtype)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp, backend, dtype, ops) for _ in range(cfg.num_layers))
        for i, layer in enumerate(self.layers):  # each layer's attention mask: causal, windowed or not
            layer.self_attn.sliding_window = cfg.window_of(i)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # fp8 KV scales found in the checkpoint: layer -> {"k": s, "v": s}
        self.checkpoint_kv_scales: dict[int, dict[str, float]] = {}

    def configure_kv_cache(self, *, fp8: bool, calculate_scales: bool = False) -> None:
        """Scales of an fp8 KV cache (vLLM's rule): computed from the first forward when
        ``calculate_scales``, else the checkpoint's, else 1.0. Not fp8: scales stay 1."""
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            found = self.checkpoint_kv_scales.get(i, {}) if fp8 else {}
            attn.k_scale, attn.v_scale = found.get("k", 1.0), found.get("v", 1.0)
            attn.calculate_kv_scales = fp8 and calculate_scales

    @property
    def kv_scales(self) -> list[tuple[float, float]]:
        return [(layer.self_attn.k_scale, layer.self_attn.v_scale) for layer in self.layers]

    def pack_weights_for_cpu(self) -> None:
        """Repack every linear's weight for MKL's packed GEMM (CPU float32; see layers.py)."""
        for module in self.modules():
            if hasattr(module, "pack_for_cpu"):
                module.pack_for_cpu()

    def bind_kv_cache(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> None:
        for layer, k, v in zip(self.layers, k_caches, v_caches, strict=True):
            layer.self_attn.k_cache, layer.self_attn.v_cache = k, v

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``[T]`` ids and positions -> ``[T, hidden]`` hidden states before the final norm."""
        meta.rotary = self.ops.prepare_rotary(positions, self.rotary.cos, self.rotary.sin)
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, meta)
        return hidden if residual is None else hidden + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``[N, hidden]`` (pre-norm) -> ``[N, vocab]`` float32 logits (None on TP ranks but 0)."""
        logits = self.lm_head(self.norm(hidden))
        return None if logits is None else logits.float()

    def _load_kv_scale(self, name: str, tensor: torch.Tensor) -> bool:
        """Record an fp8 KV scale tensor (``layers.N.self_attn.<KV_SCALE_NAMES>``); False if ``name`` is none."""
        parts = name.split(".", 3)
        if len(parts) < 4 or parts[0] != "layers" or parts[2] != "self_attn" or parts[3] not in KV_SCALE_NAMES:
            return False
        value = float(tensor.float().reshape(-1).max())
        if not value > 0:
            raise ValueError(f"checkpoint KV scale {name!r} must be positive, got {value}")
        scales = self.checkpoint_kv_scales.setdefault(int(parts[1]), {})
        for which in KV_SCALE_NAMES[parts[3]]:
            scales[which] = value
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint tensors (HF names); raise if a parameter is left unset."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            if self._load_kv_scale(name, tensor):
                continue
            shard_id = None
            for ckpt, (ours, sid) in self.PACKED.items():
                if f".{ckpt}." in name:
                    name, shard_id = name.replace(f".{ckpt}.", f".{ours}."), sid
                    break
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no parameter in {self.cfg.architecture}")
            loader = getattr(param, "weight_loader", default_weight_loader)
            # No dtype conversion here: each loader narrows to its slice first, and copy_
            # converts only that (a tensor-parallel rank's mapped weights are read lazily).
            loader(param, tensor, shard_id)
            loaded.add(name)
        expected = {n for n in params if not (self.cfg.tie_word_embeddings and n == "lm_head.weight")}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
