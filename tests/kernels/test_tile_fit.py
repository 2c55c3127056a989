"""Every tile setting the layer can launch fits an H200's shared memory in every dtype a
TorchTitan config trains in (float32 tiles of the bf16 defaults needed 384 KiB: the
first GPU run of the float32 debug configs died with OutOfResources), and float32 tiles
of IEEE dots fit the registers (the bf16 defaults spilled in float32)."""

import itertools

import pytest
import torch

from uniep.config import UniEPConfig
from uniep.kernels import grouped_gemm
from uniep.kernels.grouped_gemm import (
    FMA_VALUES_PER_THREAD,
    H200_SMEM_PER_BLOCK,
    GemmTiles,
    fma_values_per_thread,
    shared_memory_bytes,
)
from uniep.tune.space import CHOICES

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (A tiles, B tiles) of each launch kind: plain/DUAL GEMM, gate/up GEMM (two B tiles),
# w2 gradient, w1/w3 gradient (two A tiles)
OPERANDS = ((1, 1), (1, 2), (2, 1))
CPU = torch.device("cpu")  # fitted to the H200's limit where the device cannot be asked


def _smem(t: GemmTiles, dtype, a_tiles, b_tiles) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return shared_memory_bytes(t.block_m, t.block_n, t.block_k, t.num_stages, elem, a_tiles, b_tiles)


def _candidate_tiles():
    """The defaults, the tuner's whole per-launch grid, and the config's extremes."""
    d = UniEPConfig()
    yield GemmTiles(d.gemm_block_m, d.gemm_up_block_n, d.gemm_block_k, d.gemm_num_warps, d.gemm_num_stages)
    yield GemmTiles(d.wgrad_block_m, d.wgrad_block_n, d.wgrad_block_k, d.wgrad_num_warps, d.wgrad_num_stages)
    for bm, bn, bk, stages in itertools.product(
        CHOICES["gemm_block_m"], CHOICES["gemm_block_n"], CHOICES["gemm_block_k"], CHOICES["gemm_num_stages"]
    ):
        yield GemmTiles(bm, bn, bk, 8, stages)
    for bm, bn, bk in itertools.product((16, 256), (16, 256), (16, 256)):
        yield GemmTiles(bm, bn, bk, 8, 8)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_fitted_tile_fits_the_h200(dtype):
    checked = 0
    for tiles, (a_tiles, b_tiles) in itertools.product(_candidate_tiles(), OPERANDS):
        fitted = tiles.fitted(dtype, CPU, a_tiles, b_tiles)
        assert _smem(fitted, dtype, a_tiles, b_tiles) <= H200_SMEM_PER_BLOCK, (tiles, fitted)
        # row tiles are laid out by block_m outside the launch: it never changes
        assert fitted.block_m == tiles.block_m
        assert (fitted.num_warps, fitted.num_programs) == (tiles.num_warps, tiles.num_programs)
        if dtype == torch.float32:  # IEEE dots: within the registers unless block_m alone is too tall
            assert (fma_values_per_thread(fitted, b_tiles) <= FMA_VALUES_PER_THREAD
                    or (fitted.block_n, fitted.block_k) == (16, 16)), (tiles, fitted)
        checked += 1
    assert checked > 200


def test_float32_defaults_need_fitting_and_bf16_defaults_do_not(monkeypatch):
    gate_up = GemmTiles(128, 128, 64, 8, 4)
    # the crash: float32 gate/up tiles at the defaults want 384 KiB
    assert _smem(gate_up, torch.float32, 1, 2) == 393216 > H200_SMEM_PER_BLOCK
    # TF32 dots (tensor cores): fitted to shared memory only, by fewer stages
    monkeypatch.setattr(grouped_gemm, "dot_precision", lambda dtype: "tf32")
    fitted = gate_up.fitted(torch.float32, CPU, 1, 2)
    assert fitted.block_k == gate_up.block_k and fitted.num_stages == 2
    # IEEE float32 dots (the default; FMA units, the operands in registers): the defaults
    # would spill, so block_k, then block_n, are lowered
    monkeypatch.undo()
    for tiles, b_tiles, expected in ((gate_up, 2, (128, 32, 16)), (GemmTiles(128, 256, 64, 8, 3), 1, (128, 64, 16))):
        assert fma_values_per_thread(tiles, b_tiles) > FMA_VALUES_PER_THREAD  # the control: unfitted, too many
        fitted = tiles.fitted(torch.float32, CPU, 1, b_tiles)
        assert (fitted.block_m, fitted.block_n, fitted.block_k) == expected
        assert fma_values_per_thread(fitted, b_tiles) <= FMA_VALUES_PER_THREAD
    # bf16 (what real runs train in) launches exactly the configured tiles
    for tiles, (a_tiles, b_tiles) in ((gate_up, (1, 2)), (GemmTiles(128, 256, 64, 8, 3), (1, 1))):
        assert tiles.fitted(torch.bfloat16, CPU, a_tiles, b_tiles) == tiles


def test_tiles_too_tall_for_any_fit_name_the_fix(monkeypatch):
    import uniep.kernels.grouped_gemm as gg

    monkeypatch.setattr(gg, "smem_limit", lambda device: 1024)
    with pytest.raises(ValueError, match="lower block_m"):
        GemmTiles(256, 128, 64, 8, 4).fitted(torch.float32, CPU)


def test_gate_up_tiles_must_share_the_row_tiles():
    from uniep.kernels.grouped_gemm import ExpertTiles

    tiles, up = GemmTiles(128, 128, 64), GemmTiles(64, 128, 64)
    with pytest.raises(ValueError, match="the gate/up tiles' block_m = 64 must equal the GEMM tiles' block_m = 128"):
        ExpertTiles(tiles, up, tiles, tiles)
    ExpertTiles(tiles, GemmTiles(128, 64, 32), tiles, tiles)  # another width is fine


def test_expert_tiles_from_a_config():
    from uniep import UniEPConfig
    from uniep.kernels.grouped_gemm import ExpertTiles

    tiles = ExpertTiles.from_config(UniEPConfig(gemm_up_block_n=64, wgrad_block_k=32, wgrad_up_block_n=128,
                                                num_programs=7, descriptor_loads=False))
    assert (tiles.up.block_n, tiles.gemm.block_n, tiles.wgrad.block_k, tiles.wgrad_up.block_n) == (64, 256, 32, 128)
    assert tiles.gemm.num_programs == tiles.wgrad_up.num_programs == 7 and not tiles.up.descriptors
    assert ExpertTiles.from_config(UniEPConfig()).gemm.num_programs is None  # 0: one per SM
