"""The one-rank Triton path's rows and their row-tile schedule in one launch: each token's
row copied to its K pairs' plan rows (``combine.replicate_rows``' programs) and the
schedule the grouped GEMMs walk (``row_tiles.row_tiles``' programs), side by side.

Shape legend: T tokens, K experts per token, P = T*K plan rows, D model dim, E experts.

Both depend only on the expert order, which the launch before computes, and the gate/up
GEMM needs both. As one launch they cost the host one launch fewer before that GEMM,
whose issue a synchronized call waits for at a few thousand tokens
(``benchmarks/RESULTS.md``). Each program does the work of one program of the two
launches, with the same code, so the rows and the schedule have the same bits.

Grid: (schedule programs + T, column blocks of D); in column block 0 the first programs
write the schedule, in the other column blocks they have nothing to do. The PyTorch
reference is ``plan_rows_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from uniep.kernels.combine import NUM_WARPS, block_d, check_replicate_args, copy_token_row
from uniep.kernels.launch import cdiv, launcher
from uniep.kernels.row_tiles import RowTiles, empty_schedule, row_tiles_reference, write_row_tiles
from uniep.plan import inverse_permutation


@triton.jit
def _plan_rows_kernel(
    x_ptr, row_of_pair_ptr, scale_ptr, out_ptr, D,  # the row copy (``copy_token_row``)
    rows_per_expert_ptr, expert_offsets_ptr, tile_offsets_ptr, table_ptr, num_experts, table_rows,  # the schedule
    schedule_programs,
    K: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < schedule_programs:
        if tl.program_id(1) == 0:
            write_row_tiles(pid, rows_per_expert_ptr, expert_offsets_ptr, tile_offsets_ptr, table_ptr, num_experts,
                            table_rows, BLOCK_M, BLOCK_E, BLOCK_T)
    else:
        copy_token_row(pid - schedule_programs, tl.program_id(1), x_ptr, row_of_pair_ptr, scale_ptr, out_ptr, D, K,
                       HAS_SCALE, BLOCK_D)


def plan_rows(x_TD: torch.Tensor, top_k: int, row_of_pair: torch.Tensor, rows_per_expert_E: torch.Tensor,
              block_m: int, scale_TK: torch.Tensor | None = None) -> tuple[torch.Tensor, RowTiles]:
    """``(rows (P, D), schedule)``: ``replicate_rows(x_TD, top_k, row_of_pair, scale_TK)``
    and ``row_tiles(rows_per_expert_E, block_m, P)`` from one launch."""
    check_replicate_args(x_TD, top_k, row_of_pair, scale_TK, "plan_rows")
    x_TD = x_TD.contiguous()
    T, D = x_TD.shape
    P = T * top_k
    out = x_TD.new_empty(P, D)
    launch = empty_schedule(rows_per_expert_E.numel(), block_m, P, x_TD.device)
    columns = block_d(D)
    launcher(_plan_rows_kernel)[(launch.programs + T, cdiv(D, columns))](
        x_TD, row_of_pair, None if scale_TK is None else scale_TK.contiguous(), out, D,
        *launch.args(rows_per_expert_E), launch.programs,
        K=top_k, HAS_SCALE=scale_TK is not None, BLOCK_D=columns,
        BLOCK_M=block_m, BLOCK_E=launch.block_e, BLOCK_T=launch.block_t, num_warps=NUM_WARPS,
    )
    return out, launch.schedule


def plan_rows_reference(x_TD: torch.Tensor, top_k: int, row_of_pair: torch.Tensor, rows_per_expert: list[int],
                        block_m: int, scale_TK: torch.Tensor | None = None):
    """``(rows, (expert offsets, tile offsets, table rows))`` in PyTorch and plain Python."""
    order = inverse_permutation(row_of_pair)  # each plan row's pair
    rows = x_TD.index_select(0, order // top_k)
    if scale_TK is not None:
        rows = (rows.float() * scale_TK.reshape(-1)[order, None]).to(x_TD.dtype)
    return rows, row_tiles_reference(rows_per_expert, block_m)
