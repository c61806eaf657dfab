"""Compile every kernel variant to an sm_90 cubin with Triton's bundled ptxas, no GPU needed.

The CPU interpreter runs kernels as Python and forgives what the real compiler rejects
(non-constexpr globals, starred constexpr tuples, dtype mismatches in ``tl.dot``); this
catches those. Run in a fresh process with ``TRITON_INTERPRET=0``; prints one line per kernel.
"""

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvgate.engine.attention.triton import kv_write, paged_decode, paged_prefill

HOPPER = GPUTarget("cuda", 90, 32)


def compile_kernel(kernel: triton.JITFunction, types: dict[str, str], constexprs: dict) -> None:
    def arg_type(name: str) -> str:
        if name in constexprs:
            return "constexpr"
        return types.get(name, "*fp32" if name.endswith("_ptr") else "i32")

    signature = {name: arg_type(name) for name in kernel.arg_names}
    triton.compile(ASTSource(kernel, signature, constexprs), target=HOPPER)
    print(kernel.fn.__name__, constexprs)


def main() -> None:
    int_ptrs = {"slot_ptr": "*i64", "seq_lens_ptr": "*i32", "block_tables_ptr": "*i32",
                "tile_seq_ptr": "*i32", "tile_first_ptr": "*i32", "query_start_ptr": "*i32"}  # fmt: skip
    for cache, fp8 in (("*fp8e4nv", True), ("*bf16", False), ("*fp16", False)):
        io = {"k_ptr": "*bf16", "v_ptr": "*bf16", "k_cache_ptr": cache, "v_cache_ptr": cache}
        write_flags = {"D_PAD": 128, "FP8": fp8, "FP8_MAX": 448.0, "MIN_SCALE": 1e-12}
        compile_kernel(kv_write._kv_write_kernel, {**int_ptrs, **io}, write_flags)
    variants = [
        ("*bf16", "*fp8e4nv", True, tl.bfloat16, "tf32"),
        ("*fp16", "*fp8e4nv", True, tl.float16, "tf32"),
        ("*bf16", "*bf16", False, tl.bfloat16, "tf32"),
        ("*fp32", "*fp32", False, tl.float32, "ieee"),
    ]
    for (q, cache, fp8, dot, precision), softcap in zip(variants, (1, 0, 1, 0), strict=True):
        io = {"q_ptr": q, "k_cache_ptr": cache, "v_cache_ptr": cache, "sm_scale_log2": "fp32",
              "softcap": "fp32"}  # fmt: skip
        flags = {"G_PAD": 16, "D_PAD": 128, "BLOCK_N": paged_decode.BLOCK_N, "FP8": fp8,
                 "SOFTCAP": bool(softcap), "DOT_DTYPE": dot, "PRECISION": precision}  # fmt: skip
        compile_kernel(paged_decode._decode_split_kernel, {**int_ptrs, **io}, flags)
        prefill_flags = {"BLOCK_Q": 16, "G_PAD": 4, "D_PAD": 128, "BLOCK_N": 64, "FP8": fp8,
                         "SOFTCAP": bool(softcap), "DOT_DTYPE": dot, "PRECISION": precision}  # fmt: skip
        prefill_io = {**io, "out_ptr": q}
        compile_kernel(paged_prefill._prefill_kernel, {**int_ptrs, **prefill_io}, prefill_flags)
    for splits in (1, 64):
        merge_flags = {"S_PAD": splits, "D_PAD": 128, "BLOCK_N": paged_decode.BLOCK_N}
        merge_io = {**int_ptrs, "out_ptr": "*bf16"}
        compile_kernel(paged_decode._merge_splits_kernel, merge_io, merge_flags)


if __name__ == "__main__":
    main()
