"""Compile every kernel variant for an NVIDIA GPU target, with no GPU present.

The CPU interpreter accepts things the NVIDIA backend rejects (dot sizes under 16,
fp8 dots under 32, loop-carried type changes), so ``test_kernels_compile_for_gpu``
runs this file in a subprocess *without* TRITON_INTERPRET: Triton lowers each
variant through PTX to a cubin with its bundled ptxas. It also checks that the fp8
quantizing store divides with IEEE rounding (div.rn) and computes the e4m3 bits in
integer ops (no hardware e4m3 conversion), which is what makes it match the torch
reference bit for bit (tests/kernels/test_fp8_kv.py checks the same code under the interpreter).
The fused layer kernels (kernels/triton/layer_ops.py) are compiled for every dtype and
constexpr branch; the rotary kernel must contain no fused multiply-add (its fp32 path
rounds like the torch chain only without contraction) and its fp8 cache store the same
div.rn and integer e4m3 rounding as the cache write. The segmented LoRA matmul's shrink and
expand kernels (kernels/triton/lora.py) are compiled for each activation dtype.

Usage: ``python tests/kernels/kernel_compile_check.py [sm]`` (default 90); prints one line
per variant and exits non-zero on the first failure.
"""

from __future__ import annotations

import dataclasses
import os
import sys

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("kernel_compile_check must run without TRITON_INTERPRET")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from prefixserve.kernels.triton import cache_write, paged_attention  # noqa: E402
from prefixserve.kernels.triton import layer_ops as triton_layer_ops  # noqa: E402
from prefixserve.kernels.triton import lora as triton_lora  # noqa: E402

TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8e4nv"}


def _compile(fn, arg_types: dict[str, str], constants: dict, target: GPUTarget, **options):
    signature = {name: "constexpr" if name in constants else arg_types.get(name, "i32") for name in fn.arg_names}
    return triton.compile(ASTSource(fn, signature, constants), target=target, options=options)


def attention_variants():
    """(label, plan, group, head_dim, block_size, act dtype, kv dtype, window) covering every branch."""
    cpu = torch.device("cpu")
    f16, bf16, f32, fp8 = torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn
    for num_tokens, num_seqs, heads, kv_heads, dim, bs, act, kv, window, splits in [
        (64, 64, 32, 8, 128, 16, f16, f16, False, 1),  # decode
        (64, 64, 32, 8, 128, 16, bf16, bf16, False, 8),  # decode, flash-decoding splits
        (64, 64, 32, 8, 128, 16, bf16, fp8, True, 4),  # fp8 KV, window, splits
        (64, 64, 24, 1, 64, 32, f16, fp8, False, 1),  # MQA wider than 16 rows
        (900, 4, 32, 8, 128, 16, f16, f16, False, 1),  # prefill tiles
        (900, 4, 32, 8, 128, 16, bf16, bf16, True, 1),
        (900, 4, 12, 4, 64, 32, f16, fp8, False, 1),  # group 3, fp8
        (900, 4, 8, 8, 80, 16, f32, f32, False, 1),  # fp32, head_dim padded to 128
        (900, 4, 8, 1, 256, 16, bf16, bf16, False, 1),  # head_dim 256
    ]:
        plan = paged_attention.plan_launch(num_tokens, num_seqs, heads, kv_heads, dim, 4096, act, cpu)
        plan = dataclasses.replace(plan, num_kv_splits=splits)
        label = (
            f"attention {TRITON_TYPES[act]}/{TRITON_TYPES[kv]} group={heads // kv_heads} d={dim} "
            f"bs={bs} window={window} splits={splits} block_m={plan.block_m} tile_n={plan.tile_n}"
        )
        yield label, plan, heads // kv_heads, dim, bs, act, kv, window


def main(sm: int) -> None:
    target = GPUTarget("cuda", sm, 32)
    for label, plan, group, dim, bs, act, kv, window in attention_variants():
        constants = paged_attention.kernel_constants(plan, group, dim, bs, act, window)
        types = {
            "out_ptr": "*" + TRITON_TYPES[act],
            "query_ptr": "*" + TRITON_TYPES[act],
            "key_cache_ptr": "*" + TRITON_TYPES[kv],
            "value_cache_ptr": "*" + TRITON_TYPES[kv],
            "block_tables_ptr": "*i32",
            "seq_lens_ptr": "*i32",
            "query_start_loc_ptr": "*i32",
            "part_out_ptr": "*fp32",
            "part_lse_ptr": "*fp32",
            "qk_scale": "fp32",
            "v_scale": "fp32",
        }
        _compile(
            paged_attention._paged_attention_kernel,
            types,
            constants,
            target,
            num_warps=plan.num_warps,
            num_stages=plan.num_stages,
        )
        print("ok", label, flush=True)
    for out in ("fp16", "bf16"):
        constants = dict(HEAD_DIM=128, HEAD_DIM_PAD=128, HEADS_PAD=32, SPLITS_PAD=8)
        types = {"out_ptr": "*" + out, "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "query_start_loc_ptr": "*i32"}
        _compile(paged_attention._reduce_splits_kernel, types, constants, target, num_warps=4)
        print("ok reduce", out, flush=True)
    for src, cache in (("fp16", "fp16"), ("fp32", "bf16"), ("bf16", "fp8e4nv"), ("fp32", "fp8e4nv")):
        fp8 = cache == "fp8e4nv"
        constants = dict(BLOCK_SIZE=16, HEADS_PAD=8, DIM_PAD=128, FP8=fp8, FP8_MAX=448.0 if fp8 else 0.0)
        # An fp8 cache is written as bytes: the kernel computes the e4m3 bit patterns itself.
        stored = "u8" if fp8 else cache
        types = {
            "key_ptr": "*" + src,
            "value_ptr": "*" + src,
            "key_cache_ptr": "*" + stored,
            "value_cache_ptr": "*" + stored,
            "slot_mapping_ptr": "*i64",
            "k_scale": "fp32",
            "v_scale": "fp32",
        }
        compiled = _compile(cache_write._write_kv_kernel, types, constants, target, num_warps=4)
        if fp8:
            ptx = compiled.asm["ptx"]
            if "div.rn.f32" not in ptx or "e4m3" in ptx:
                raise SystemExit(f"fp8 store {src}: expected div.rn.f32 and no hardware e4m3 conversion")
        print("ok cache write", src, "->", cache, flush=True)
    layer_ops_variants(target)
    lora_variants(target)


def lora_variants(target: GPUTarget) -> None:
    """The segmented LoRA matmul's shrink and expand kernels (kernels/triton/lora.py) per activation dtype."""
    for act in ("fp32", "fp16", "bf16"):
        ints = {name: "i32" for name in ("K", "R", "N", "stride_x", "stride_as", "stride_ar", "stride_y")}
        shrink = {"x_ptr": "*" + act, "a_ptr": "*" + act, "h_ptr": "*fp32", "slots_ptr": "*i64", **ints}
        constants = dict(BLOCK_R=triton_lora.BLOCK_R, BLOCK_K=triton_lora.BLOCK_K)
        _compile(triton_lora._shrink, shrink, constants, target, num_warps=4)
        expand = {"h_ptr": "*fp32", "b_ptr": "*" + act, "y_ptr": "*" + act, "slots_ptr": "*i64", **ints}
        expand.update(stride_bs="i32", stride_bn="i32")
        constants = dict(BLOCK_N=triton_lora.BLOCK_N, BLOCK_R=triton_lora.BLOCK_R)
        _compile(triton_lora._expand, expand, constants, target, num_warps=4)
        print("ok lora", act, flush=True)


def _check_fp8_store(ptx: str, label: str) -> None:
    if "div.rn.f32" not in ptx or "e4m3" in ptx:
        raise SystemExit(f"{label}: expected div.rn.f32 and no hardware e4m3 conversion")


def layer_ops_variants(target: GPUTarget) -> None:
    """Every kernel of kernels/triton/layer_ops.py with the constexpr branches the wrappers launch."""
    # RMSNorm: (activation, weight, output) types, residual or not, row block (warps as launched).
    for act, weight, out, residual, block in [
        ("fp16", "fp16", "fp16", True, 2048),
        ("bf16", "bf16", "bf16", True, 2048),
        ("bf16", "bf16", "bf16", False, 2048),
        ("fp32", "fp32", "fp32", True, 4096),
        ("bf16", "bf16", "bf16", True, 8192),
        ("fp16", "fp16", "fp16", False, 16384),
        ("bf16", "fp32", "fp32", False, 4096),  # an fp32 weight promotes the output
    ]:
        types = {
            "x_ptr": "*" + act,
            "residual_ptr": "*" + act,
            "weight_ptr": "*" + weight,
            "out_ptr": "*" + out,
            "eps": "fp32",
        }
        _compile(
            triton_layer_ops._rms_norm_kernel,
            types,
            dict(HAS_RESIDUAL=residual, BLOCK=block),
            target,
            num_warps=triton_layer_ops._norm_warps(block),
        )
        print("ok layer rms_norm", act, weight, "->", out, f"residual={residual} block={block}", flush=True)
    for act in ("fp16", "bf16", "fp32"):
        _compile(
            triton_layer_ops._silu_and_mul_kernel,
            {"gate_up_ptr": "*" + act, "out_ptr": "*" + act},
            dict(BLOCK=triton_layer_ops.SILU_BLOCK),
            target,
            num_warps=4,
        )
        print("ok layer silu_and_mul", act, flush=True)
    # Rotary alone (no cache) and fused with the cache write: (activation, cache, heads, head_dim).
    for act, cache, heads, dim in [
        ("fp16", None, 48, 64),
        ("bf16", None, 48, 128),
        ("fp32", None, 40, 80),
        ("fp16", "fp16", 32, 128),
        ("bf16", "bf16", 32, 64),
        ("bf16", "fp8e4nv", 32, 128),
        ("fp16", "fp8e4nv", 8, 96),
        ("fp32", "bf16", 8, 64),
        ("fp32", "fp8e4nv", 8, 64),
    ]:
        fp8 = cache == "fp8e4nv"
        half_pad, block_h = triton_layer_ops._rotary_launch_shape(heads, dim)
        stored = "u8" if fp8 else (cache or act)
        types = {
            "x_ptr": "*" + act,
            "positions_ptr": "*i64",
            "cos_ptr": "*" + act,
            "sin_ptr": "*" + act,
            "value_ptr": "*" + act,
            "key_cache_ptr": "*" + stored,
            "value_cache_ptr": "*" + stored,
            "slot_mapping_ptr": "*i64",
            "k_scale": "fp32",
            "v_scale": "fp32",
        }
        constants = dict(
            HALF=dim // 2,
            HALF_PAD=half_pad,
            BLOCK_H=block_h,
            WRITE_KV=cache is not None,
            CACHE_BLOCK_SIZE=16,
            FP8=fp8,
            FP8_MAX=448.0 if fp8 else 0.0,
        )
        compiled = _compile(
            triton_layer_ops._rotary_kernel, types, constants, target, **triton_layer_ops.ROTARY_LAUNCH_OPTIONS
        )
        label = f"rotary {act} d={dim}" + (f" + cache write -> {cache}" if cache else "")
        ptx = compiled.asm["ptx"]
        if "fma.rn" in ptx:
            raise SystemExit(f"{label}: fused multiply-add in the PTX; the rotation must round like torch")
        if fp8:
            _check_fp8_store(ptx, label)
        print("ok layer", label, flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 90)
