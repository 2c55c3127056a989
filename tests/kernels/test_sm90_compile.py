"""The GEMM, router, expert-order and SwiGLU-backward kernels compile for Hopper (sm_90) on this CPU machine:
Triton's compiler and its bundled ptxas, no GPU. The interpreter runs the kernels' Python; only the compiler
sees what it rejects (a variable a constexpr branch leaves undefined, a descriptor of
the wrong rank, a shared-memory overflow), and without this test such an error shows
only on a GPU.

Each case is a specialization the Triton paths launch with the default tiles (bf16,
descriptor loads on, 128-row tiles), or in float32 with those tiles fitted for IEEE
dots; the float32 cases must also compile without spilling registers."""

import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from uniep.config import UniEPConfig  # noqa: E402
from uniep.kernels.grouped_gemm import H200_SMEM_PER_BLOCK, ExpertTiles  # noqa: E402


def _fp32_fitted(kind: str, b_tiles: int = 1) -> dict:
    """The default tiles of launch ``kind`` (an ``ExpertTiles`` field) fitted for float32
    IEEE dots, as kernel constants."""
    t = getattr(ExpertTiles.from_config(UniEPConfig()), kind).fitted(torch.float32, torch.device("cpu"), b_tiles=b_tiles)
    return dict(dtype="fp32", DOT_PRECISION="ieee", BLOCK_N=t.block_n, BLOCK_K=t.block_k, num_stages=t.num_stages)


# Cases: (kernel, constants that differ from the defaults below). Each is a
# specialization the Triton paths launch with the default tiles (bf16, descriptor loads).
GEMM = "grouped_gemm"
WGRAD = "wgrad"
ROUTER = "router_select"
ROUTER_BWD = "router_select_backward"
SWIGLU_BWD = "swiglu_backward"
EXPERT_ORDER = "expert_order"
ROUTER_GATE = "router_gate"
PLAN_ROWS = "plan_rows"
CASES = {
    "gate/up": (GEMM, dict(MODE=1, BLOCK_N=128)),
    "down, scattered to (token, k)": (GEMM, dict(MODE=0, HAS_C_ROW=True)),
    "down input gradient": (GEMM, dict(MODE=0, B_TRANSPOSED=False)),
    "up input gradient": (GEMM, dict(MODE=3, B_TRANSPOSED=False, HAS_C_ROW=True)),
    "megakernel down input gradient": (GEMM, dict(MODE=2, B_TRANSPOSED=False, BLOCK_N=128)),
    "pointer loads, rows gathered": (GEMM, dict(A_DESC=False, B_DESC=False, HAS_A_ROW=True)),
    "gate/up, half tiles": (GEMM, dict(MODE=1, BLOCK_N=128, HALF_TILES=True)),
    "down, half tiles": (GEMM, dict(MODE=0, HAS_C_ROW=True, HALF_TILES=True)),
    "up input gradient, half tiles": (GEMM, dict(MODE=3, B_TRANSPOSED=False, HAS_C_ROW=True, HALF_TILES=True)),
    "gate/up, descriptor stores": (GEMM, dict(MODE=1, BLOCK_N=128, C_DESC=True)),
    "down input gradient, descriptor stores": (GEMM, dict(MODE=0, B_TRANSPOSED=False, C_DESC=True)),
    "SwiGLU backward epilogue, descriptor stores": (GEMM, dict(MODE=2, B_TRANSPOSED=False, BLOCK_N=128, C_DESC=True)),
    "gate/up, half tiles and descriptor stores": (GEMM, dict(MODE=1, BLOCK_N=128, C_DESC=True, HALF_TILES=True)),
    # the weights asked of L2 ahead of the dots (``GemmTiles.prefetch_steps``): B stored
    # transposed (gate/up, down), as is (down input gradient), two of them (DUAL)
    "gate/up, L2 prefetch": (GEMM, dict(MODE=1, BLOCK_N=128, PREFETCH=4)),
    "down, scattered to (token, k), L2 prefetch": (GEMM, dict(MODE=0, HAS_C_ROW=True, PREFETCH=4)),
    "down input gradient, L2 prefetch": (GEMM, dict(MODE=0, B_TRANSPOSED=False, PREFETCH=4)),
    "up input gradient, L2 prefetch": (GEMM, dict(MODE=3, B_TRANSPOSED=False, HAS_C_ROW=True, PREFETCH=4)),
    "w2 gradient": (WGRAD, dict(HALVES=1)),
    "w1/w3 gradient": (WGRAD, dict(HALVES=2)),
    "w2 gradient, runs of one expert's tiles": (WGRAD, dict(HALVES=1, EXPERT_RUN=4)),
    "w1/w3 gradient, runs of one expert's tiles": (WGRAD, dict(HALVES=2, EXPERT_RUN=4)),
    "w2 gradient, descriptor stores": (WGRAD, dict(HALVES=1, EXPERT_RUN=4, C_DESC=True, BLOCK_N=128)),
    "w1/w3 gradient, descriptor stores": (WGRAD, dict(HALVES=2, EXPERT_RUN=4, C_DESC=True, BLOCK_N=128)),
    "router choice (Qwen3: E 128, K 8)": (ROUTER, dict()),
    "router choice replayed, sigmoid, biased (DeepSeek-V3-671B: E 256)": (
        ROUTER, dict(SELECT=False, SIGMOID=True, HAS_BIAS=True, BLOCK_E=256)),
    "router choice backward": (ROUTER_BWD, dict()),
    "router gate and choice (Qwen3: E 128, K 8)": (ROUTER_GATE, dict()),
    "router gate and choice, sigmoid, biased (DeepSeek-V3-671B slice: E 32)": (
        ROUTER_GATE, dict(SIGMOID=True, HAS_BIAS=True, BLOCK_E=32)),
    "router gate and choice, 256 experts (32 rows a program)": (ROUTER_GATE, dict(BLOCK_E=256)),
    "plan rows (the row copy and the row-tile schedule, Qwen3)": (PLAN_ROWS, dict()),
    "plan rows, copies scaled (scores before the experts), D 7168": (PLAN_ROWS, dict(HAS_SCALE=True, BLOCK_E=32,
                                                                                     BLOCK_T=128)),
    "expert order (the plan's counting sort)": (EXPERT_ORDER, dict()),
    "SwiGLU backward, in place (routed experts)": (SWIGLU_BWD, dict()),
    "SwiGLU backward, into a stacked buffer (shared experts)": (SWIGLU_BWD, dict(STRIDED_OUT=True)),
    # float32 (the debug configs) at the default tiles fitted for IEEE dots: the operands
    # sit in registers, and at the bf16 tiles the compiler spilled (control below)
    "float32 gate/up, fitted": (GEMM, dict(MODE=1, **_fp32_fitted("up", b_tiles=2))),
    "float32 down, scattered to (token, k), fitted": (GEMM, dict(MODE=0, HAS_C_ROW=True, **_fp32_fitted("gemm"))),
    "float32 up input gradient, fitted": (GEMM, dict(MODE=3, B_TRANSPOSED=False, HAS_C_ROW=True,
                                                     **_fp32_fitted("gemm"))),
    "float32 w1/w3 gradient, fitted": (WGRAD, dict(HALVES=2, **_fp32_fitted("wgrad_up"))),
    "float32 at the bf16 tiles (control)": (GEMM, dict(MODE=0, dtype="fp32", DOT_PRECISION="ieee", num_stages=2)),
    # the controls: a kernel the compiler rejects (tl.arange of 96), tiles too large
    # for shared memory (found in the compiled kernel's metadata)
    "not a power of 2 (control)": (GEMM, dict(BLOCK_N=96)),
    "too large (control)": (GEMM, dict(MODE=0, BLOCK_M=256, BLOCK_K=128, num_stages=4)),
}


def compile_sm90(name: str) -> dict:
    """Compile case ``name`` for sm_90 (run without ``TRITON_INTERPRET``)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from uniep.kernels import expert_order, grouped_gemm, plan_rows, router_select, swiglu, wgrad

    kind, changes = CASES[name]
    changes = dict(changes)
    num_stages = changes.pop("num_stages", 3)
    num_warps = changes.pop("num_warps", 8)
    dtype = changes.pop("dtype", "bf16")
    if kind == GEMM:
        kernel = grouped_gemm._grouped_gemm_kernel
        types = dict.fromkeys(("a_ptr", "a2_ptr", "b_ptr", "b2_ptr", "c_ptr", "c2_ptr", "aux1_ptr", "aux3_ptr"),
                              f"*{dtype}")
        types |= dict.fromkeys(("N", "Kd", "num_experts", "rows_a", "rows_c", "rows_aux", "stride_am", "stride_be", "stride_bk",
                                "stride_bn", "stride_cm", "stride_auxm"), "i32")
        types |= dict(a_row_ptr="*i64", a_scale_ptr="*fp32", c_row_ptr="*i64", tile_offsets_ptr="*i32",
                      table_ptr="*i32")
        constants = dict(MODE=0, HAS_A_ROW=False, HAS_A_SCALE=False, HAS_C_ROW=False, A_DESC=True, B_DESC=True,
                         B_TRANSPOSED=True, C_DESC=False, HALF_TILES=False, NUM_PROGRAMS=132,
                         BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, DOT_PRECISION="tf32", PREFETCH=0)
    elif kind == EXPERT_ORDER:
        kernel = expert_order._expert_order_kernel
        types = dict(ids_ptr="*i64", counts_ptr="*i64", order_ptr="*i64", num_pairs="i32", num_experts="i32")
        constants = dict(BLOCK=expert_order.BLOCK)
    elif kind == ROUTER_GATE:
        kernel = router_select._router_gate_kernel
        types = dict.fromkeys(("x_ptr", "w_ptr", "gate_bias_ptr", "logits_ptr"), "*bf16")
        types |= dict(bias_ptr="*fp32", idx_ptr="*i64", top_ptr="*fp32", T="i32", E="i32", D="i32", stride_x="i32",
                      route_scale="fp32")
        # the launch's rows, warps and stages (fitted to shared memory as the launch fits them)
        tiles, block_e = router_select.GATE_TILES, changes.get("BLOCK_E", 128)
        constants = dict(K=8, KP=8, BLOCK_E=128, ROWS=router_select.gate_rows(tiles, block_e), BLOCK_K=tiles.block_k,
                         SIGMOID=False, HAS_GATE_BIAS=False, HAS_BIAS=False, SELECT=True, ROUTE_NORM=True,
                         DOT_PRECISION="tf32", ACC_DTYPE=tl.float32)
        num_warps = tiles.num_warps
        num_stages = router_select.gate_stages(tiles, block_e, 2, H200_SMEM_PER_BLOCK)
    elif kind == PLAN_ROWS:
        kernel = plan_rows._plan_rows_kernel
        types = dict(x_ptr="*bf16", row_of_pair_ptr="*i64", scale_ptr="*fp32", out_ptr="*bf16", D="i32",
                     rows_per_expert_ptr="*i64", expert_offsets_ptr="*i32", tile_offsets_ptr="*i32", table_ptr="*i32",
                     num_experts="i32", table_rows="i32", schedule_programs="i32")
        constants = dict(K=8, HAS_SCALE=False, BLOCK_D=2048, BLOCK_M=128, BLOCK_E=128, BLOCK_T=32)
    elif kind == SWIGLU_BWD:
        kernel = swiglu._swiglu_backward_kernel
        types = dict.fromkeys(("g_ptr", "a1_ptr", "a3_ptr", "d_a1_ptr", "d_a3_ptr"), "*bf16")
        types |= dict.fromkeys(("n", "R", "H", "out_row_stride"), "i32")
        constants = dict(STRIDED_OUT=False, BLOCK=2048, BLOCK_H=128)
    elif kind in (ROUTER, ROUTER_BWD):
        kernel = (router_select._router_select_kernel if kind == ROUTER
                  else router_select._router_select_backward_kernel)
        types = dict(logits_ptr="*bf16", bias_ptr="*fp32", idx_ptr="*i64", top_ptr="*fp32", grad_top_ptr="*fp32",
                     grad_logits_ptr="*bf16", T="i32", E="i32", stride="i32", route_scale="fp32")
        constants = dict(K=8, KP=8, BLOCK_E=128, ROWS=16, SIGMOID=False, ROUTE_NORM=True)
        if kind == ROUTER:
            constants |= dict(HAS_BIAS=False, SELECT=True)
    else:
        kernel = wgrad._grouped_wgrad_kernel
        types = dict.fromkeys(("a_ptr", "b_ptr", "c_ptr", "c2_ptr"), f"*{dtype}")
        types |= dict.fromkeys(("M", "N", "num_experts", "rows_a", "rows_b", "stride_am", "stride_bm",
                                "stride_ce", "stride_cm"), "i32")
        types |= dict(a_row_ptr="*i32", a_scale_ptr="*fp32", b_row_ptr="*i32", b_scale_ptr="*fp32",
                      expert_offsets_ptr="*i32")
        constants = dict(HAS_A_ROW=False, HAS_A_SCALE=False, HAS_B_ROW=False, HAS_B_SCALE=False, HALVES=1,
                         A_DESC=True, B_DESC=True, C_DESC=False, EXPERT_RUN=0, NUM_PROGRAMS=132,
                         NUM_STAGES=3, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, DOT_PRECISION="tf32")
    constants |= changes
    params = list(inspect.signature(kernel.fn).parameters)
    signature = {p: "constexpr" if p in constants else types[p] for p in params}
    divisible = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if types.get(p, "").startswith("*")}
    source = ASTSource(kernel, signature, {(params.index(k),): v for k, v in constants.items()}, divisible)
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": num_warps, "num_stages": num_stages})
    except Exception as e:  # reported to the test, which decides
        cause = e.__cause__ or e
        return {"error": f"{type(e).__name__}: {type(cause).__name__}: {cause}"[-2000:]}
    ptx = compiled.asm["ptx"]
    return {"scratch": compiled.metadata.global_scratch_size, "shared": compiled.metadata.shared,
            "stack": _stack_bytes(compiled.asm["cubin"]), "l2_prefetches": ptx.count("prefetch.global.L2")}


def _stack_bytes(cubin: bytes) -> int | None:
    """Per-thread stack of the compiled kernel (registers spilled to local memory), read
    with the cuobjdump that comes with Triton; None where there is none."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"STACK:(\d+)", out)
    return int(found.group(1)) if found else None


@pytest.fixture(scope="module")
def compiled() -> dict:
    """Every case compiled in one process without the interpreter (under it,
    ``triton.jit`` gives functions the compiler cannot take)."""
    try:
        from triton.backends import backends
    except ImportError:
        pytest.skip("this Triton has no backend registry")
    if "nvidia" not in backends:
        pytest.skip("Triton without its NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json, sys; from tests.kernels.test_sm90_compile import CASES, compile_sm90; "
            "print(json.dumps({name: compile_sm90(name) for name in CASES}))")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", [n for n in CASES if "control" not in n])
def test_kernel_compiles_for_sm90(compiled, name):
    result = compiled[name]
    assert "error" not in result, result.get("error")
    assert result["shared"] <= H200_SMEM_PER_BLOCK
    # descriptors are built on the device, in scratch memory the launch allocates
    kind, changes = CASES[name]
    assert (result["scratch"] > 0) == (kind in (GEMM, WGRAD) and changes.get("A_DESC", True))


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("float32") and "control" not in n])
def test_float32_fitted_tiles_do_not_spill(compiled, name):
    """Spills are the stack of the compiled kernel: the bf16 tiles in float32 took 24 KB
    per thread (the control); the fitted ones none, or a few bytes."""
    stack = compiled[name]["stack"]
    if stack is None:
        pytest.skip("no cuobjdump with this Triton")
    assert stack <= 64, stack
    assert compiled["float32 at the bf16 tiles (control)"]["stack"] > 4096


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][0] == ROUTER_GATE])
def test_gate_launch_keeps_its_logits_in_registers(compiled, name):
    """The gate launch's default rows per program (``gate_rows``) leave its fp32 logits
    in registers: no stack (64 rows of 256 experts spilled 24 bytes per thread)."""
    stack = compiled[name]["stack"]
    if stack is None:
        pytest.skip("no cuobjdump with this Triton")
    assert stack == 0, stack


@pytest.mark.parametrize("name", [n for n in CASES if n.endswith(", L2 prefetch")])
def test_l2_prefetch_keeps_the_pipeline(compiled, name):
    """With the weights asked of L2 ahead, the launch compiles the requests into its
    loop and keeps what it had without them: the same pipeline stages in shared memory
    (a loop the pipeliner gave up on would hold fewer) and no stack blown up (this
    test's specialization, only the pointers marked 16-divisible, spills where real
    launches do not: Triton 3.6 gave 904-1416 bytes per thread with the requests and
    912-1264 without, at most 256 more). Without them, no request (the control)."""
    with_prefetch, without = compiled[name], compiled[name.removesuffix(", L2 prefetch")]
    assert "error" not in with_prefetch, with_prefetch.get("error")
    assert with_prefetch["l2_prefetches"] > 0 and without["l2_prefetches"] == 0
    assert with_prefetch["shared"] == without["shared"]
    if without["stack"] is not None:
        assert with_prefetch["stack"] <= without["stack"] + 512


def test_the_controls_fail_here(compiled):
    assert "power of 2" in compiled["not a power of 2 (control)"].get("error", "")
    assert compiled["too large (control)"]["shared"] > H200_SMEM_PER_BLOCK
