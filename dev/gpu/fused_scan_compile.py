"""Compile the fused observe scan's Triton kernels (dreamer_atari.py, `FusedObserve`) and the fused epilogues'
(`fused_imagine_step`, the heads' `norm_silu` backward) for an NVIDIA GPU on a machine without one, with the blocks a run would launch them with, and
report each kernel's registers and spills.

    python dev/gpu/fused_scan_compile.py                       # float32, an H100 (sm_90, 132 SMs), the default model
    python dev/gpu/fused_scan_compile.py --dtype fp64 --json /tmp/compiled.json

The tests run the kernels in Triton's interpreter, which runs Python: code the compiler refuses (or a tile that
spills registers to memory) shows only here, or on a GPU. Triton compiles to PTX and, with the `ptxas` its wheel
carries, to a cubin, whose resource use its `cuobjdump` reads (registers, and STACK: bytes of spilled registers and
local arrays per thread). TRITON_INTERPRET must be unset: in the interpreter's mode Triton's own library functions are
not compilable.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# the default model's RSSM (dreamer_atari.Args' dreamerv3 sizes) at the default batch
SIZES = {"B": 16, "H": 512, "D": 512, "latents": 32, "classes": 32}


def constexprs(sizes: dict, blocks) -> dict[str, dict[str, int]]:
    """Each kernel's compile-time arguments, as the operations around them (`scan_img_in` ...) compute them."""
    import dreamer_kernels as dk

    B, H, D, L, C = sizes["B"], sizes["H"], sizes["D"], sizes["latents"], sizes["classes"]
    S, rows, classes = L * C, dk.rows_block(B, blocks), dk.power_of_two_at_least(C)

    def k(columns: int, reduced: int) -> int:
        return dk.reduction_block(blocks, rows, columns, reduced)

    def parts(n: int, block: int) -> int:
        return dk.power_of_two_at_least(-(-n // block))

    return {
        "scan_img_in_kernel": dict(BLOCK_B=rows, BLOCK_K=k(blocks.img, S), BLOCK_N=blocks.img),
        "scan_gru_in_kernel": dict(
            BLOCK_B=rows, BLOCK_K=k(blocks.gru, max(H, D)), BLOCK_N=blocks.gru, BLOCK_P=parts(H, blocks.img)
        ),
        "scan_gru_out_kernel": dict(
            BLOCK_B=rows, BLOCK_K=k(blocks.post, D), BLOCK_N=blocks.post, BLOCK_P=parts(D, blocks.gru)
        ),
        "scan_posterior_kernel": dict(
            BLOCK_B=rows,
            BLOCK_K=k(blocks.latents * classes, H),
            BLOCK_L=blocks.latents,
            BLOCK_C=classes,
            BLOCK_P=parts(H, blocks.post),
        ),
        "scan_posterior_backward_kernel": dict(
            BLOCK_B=rows,
            BLOCK_L=dk.reduction_block(blocks, rows * classes, blocks.logits, L),
            BLOCK_C=classes,
            BLOCK_N=blocks.logits,
        ),
        "scan_posterior_input_backward_kernel": dict(
            BLOCK_B=rows, BLOCK_K=k(blocks.deter, H), BLOCK_N=blocks.deter, BLOCK_P=parts(H, blocks.logits)
        ),
        "scan_gru_backward_kernel": dict(
            BLOCK_B=rows, BLOCK_K=k(blocks.state, 3 * D), BLOCK_N=blocks.state, BLOCK_P=parts(D, blocks.deter)
        ),
        "scan_img_backward_kernel": dict(
            BLOCK_B=rows, BLOCK_K=k(blocks.stoch, H), BLOCK_N=blocks.stoch, BLOCK_P=parts(H + D, blocks.state)
        ),
        # the fused epilogues, as `norm_silu`, `gru_gates` and `logits_draw` launch them: img_in's LayerNorm (with
        # the action's row gathered), the GRU's gates, the prior's draw of each latent's class; `norm_silu_grads`
        "norm_silu_kernel": dict(GATHER=True, **dict(zip(("BLOCK_R", "BLOCK_W"), dk.epilogue_blocks(H)))),
        "gru_gates_kernel": dict(zip(("BLOCK_R", "BLOCK_D"), dk.epilogue_blocks(D, parts=3))),
        "logits_draw_kernel": dict(
            DOUBLE=False, OFFSETS=True, **dict(zip(("BLOCK_R", "BLOCK_C"), dk.epilogue_blocks(C)))
        ),
        # the heads' LayerNorms' backward (their hidden layers as wide as the RSSM's)
        "norm_silu_backward_kernel": dict(zip(("BLOCK_R", "BLOCK_W"), dk.epilogue_blocks(H))),
    }


# the arguments of other types than a pointer of the kernels' float type or a 32-bit integer
OTHER_TYPES = {
    "first_ptr": "*u8",
    "noise_ptr": "*fp32",
    "index_ptr": "*i64",
    "uniform_ptr": "*fp32",
    "eps": "fp32",
    "keep": "fp32",
    "share": "fp32",
}


def signature(kernel, compile_time: dict, dtype: str) -> dict[str, str]:
    """Triton's types of a kernel's arguments: pointers of `dtype` (the episode starts bytes, the uniforms float32,
    the actions' and the classes' indices int64), 32-bit integers, float32 scalars, and the compile-time ones."""
    code = kernel.__code__
    types = {}
    for name in code.co_varnames[: code.co_argcount]:
        if name in compile_time:
            types[name] = "constexpr"
        elif kernel.__name__ == "logits_draw_kernel" and name == "out_ptr":
            types[name] = "*i64"  # the classes drawn
        else:
            types[name] = OTHER_TYPES.get(name, f"*{dtype}" if name.endswith("_ptr") else "i32")
    return types


def resource_use(cubin: bytes) -> dict[str, int | None]:
    """Registers, stack (spilled registers and local arrays, bytes per thread) and shared memory of a cubin, read by
    the `cuobjdump` of Triton's wheel (None where it is missing)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return {"registers": None, "stack_bytes": None, "shared_bytes": None}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        out = subprocess.run([str(tool), "-res-usage", file.name], capture_output=True, text=True).stdout
    found = {key: re.search(rf"{key}:(\d+)", out) for key in ("REG", "STACK", "SHARED")}
    values = {key: int(match.group(1)) if match else None for key, match in found.items()}
    return {"registers": values["REG"], "stack_bytes": values["STACK"], "shared_bytes": values["SHARED"]}


def compile_kernels(
    dtype: str = "fp32", capability: int = 90, sms: int = 132, sizes: dict = SIZES
) -> list[dict]:
    """Each of the fused scan's and the fused epilogues' kernels compiled for compute capability `capability`: its name, compile-time
    arguments, seconds to compile, warps and resource use. Raises where Triton refuses a kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import dreamer_kernels as dk

    if dk.triton_interprets():
        raise SystemExit(
            "error: TRITON_INTERPRET is set; unset it to compile (the interpreter's Triton cannot)."
        )
    kernels = dk.scan_kernels()
    rows = []
    blocks = dk.scan_blocks(
        sizes["H"], sizes["D"], sizes["latents"] * sizes["classes"], sizes["latents"], sms
    )
    for name, compile_time in constexprs(sizes, blocks).items():
        if "DOUBLE" in compile_time:  # the draw's softmax in the kernels' float type
            compile_time = {**compile_time, "DOUBLE": dtype == "fp64"}
        kernel = getattr(kernels, name)
        start = time.perf_counter()
        source = ASTSource(
            fn=kernel, signature=signature(kernel.fn, compile_time, dtype), constexprs=compile_time
        )
        compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32))
        seconds = time.perf_counter() - start
        rows.append(
            dict(
                kernel=name,
                constexprs=compile_time,
                seconds=round(seconds, 2),
                warps=compiled.metadata.num_warps,
                **resource_use(compiled.asm["cubin"]),
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("fp32", "fp64"), default="fp32", help="the kernels' float type")
    parser.add_argument("--capability", type=int, default=90, help="compute capability (90: H100, H200)")
    parser.add_argument("--sms", type=int, default=132, help="SMs of the GPU the blocks are chosen for")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, said without a warning
    import triton

    rows = compile_kernels(args.dtype, args.capability, args.sms)
    print(
        f"triton {triton.__version__}, {args.dtype}, sm_{args.capability}, blocks for {args.sms} SMs, {SIZES}"
    )
    for row in rows:
        print(
            f"{row['kernel']:38s} registers {row['registers']}  stack {row['stack_bytes']} B  "
            f"{row['seconds']:5.1f} s  {row['constexprs']}"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"triton": triton.__version__, "dtype": args.dtype, "rows": rows})
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
