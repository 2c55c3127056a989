"""Named GEMM tile settings of the benchmarks: ``bench_gemm.py`` times each launch under
them (``--variants``), ``bench_moe.py`` the whole layer under the ones it names (``--sweep``).
"""

# variant name -> config knobs changed from the defaults, or how a launch is done:
# "swiglu_bwd_fused": the down input gradient with the SwiGLU backward in its epilogue
# (the megakernel's way, on the gate/up tiles) instead of a plain GEMM and an
# elementwise launch; "gather_in_kernel": the gate/up launch and the w1/w3 gradient
# gather their token rows in the kernel (pointer loads) instead of reading a plan-order
# copy through descriptors
VARIANTS = {
    "default": {},
    "swiglu_bwd_fused": dict(swiglu_bwd_fused=True),
    "gather_in_kernel": dict(gather_in_kernel=True),
    "pointer_loads": dict(descriptor_loads=False),
    "gemm_stages4": dict(gemm_num_stages=4, gemm_few_rows_num_stages=0),  # the default before 3
    "gemm_stages5": dict(gemm_num_stages=5, gemm_few_rows_num_stages=0),
    "few_rows_stages_off": dict(gemm_few_rows_num_stages=0),  # gemm_num_stages at every row count
    "gemm_bn128": dict(gemm_block_n=128),
    "gemm_up_bn64": dict(gemm_up_block_n=64),
    "gemm_bk128_s2": dict(gemm_block_k=128, gemm_num_stages=2),
    "wgrad_stages2": dict(wgrad_num_stages=2),
    "wgrad_stages4": dict(wgrad_num_stages=4),
    "wgrad_bk128_s2": dict(wgrad_block_k=128, wgrad_num_stages=2),
    # the weight-gradient tiles before 128x128 (one program per SM)
    "wgrad_bn256": dict(wgrad_block_n=256, wgrad_up_block_n=256),
    "wgrad_w4": dict(wgrad_num_warps=4),
    "wgrad_bm256_w8": dict(wgrad_block_m=256),
    "programs_264": dict(num_programs=264),
    # one program per tile (not persistent): the hardware starts tiles in order as SMs
    # free up (on an H100 slower at 4096 and 16384 tokens, the same DRAM bytes)
    "program_per_tile": dict(num_programs=1 << 20),
    # 256-row tiles (two warpgroups of 128 rows): each weight tile loaded once for 256 rows
    # (an expert's rows at 4096 tokens), narrower columns to keep the accumulators in
    # registers (on an H100 slower at 4096 and 16384 tokens)
    "gemm_bm256": dict(gemm_block_m=256, gemm_block_n=128, gemm_up_block_n=64),
    "gemm_bm256_half_tiles": dict(gemm_block_m=256, gemm_block_n=128, gemm_up_block_n=64, gemm_half_tiles=True),
    # two row-GEMM programs per SM: 3 stages of 128x128 tiles leave room for a second in
    # shared memory, so one's epilogue overlaps the other's loads
    "gemm_bn128_p264": dict(gemm_block_n=128, num_programs=264),
    "swiglu_bwd_fused_p264": dict(swiglu_bwd_fused=True, num_programs=264),
    "swiglu_bwd_fused_up_bn64": dict(swiglu_bwd_fused=True, gemm_up_block_n=64),
    # 64x128 weight-gradient tiles with 4 warps: three programs per SM (``grouped_gemm.programs_per_sm``)
    "wgrad_bm64_w4": dict(wgrad_block_m=64, wgrad_num_warps=4),
    "wgrad_bm64_w4_bk32_s4": dict(wgrad_block_m=64, wgrad_num_warps=4, wgrad_block_k=32, wgrad_num_stages=4),
    # row GEMMs on 64-row tiles of one warpgroup (4 warps), as many programs per SM as fit
    # (``grouped_gemm.programs_per_sm``): one program's epilogue runs beside another's
    # reduction loop, and the experts' last row tiles are padded less
    "gemm_bm64_w4": dict(gemm_block_m=64, gemm_num_warps=4),  # one per SM (3 stages of 64x256)
    "gemm_bm64_w4_s2": dict(gemm_block_m=64, gemm_num_warps=4, gemm_num_stages=2),  # two per SM
    "gemm_bm64_w4_bk32_s4": dict(gemm_block_m=64, gemm_num_warps=4, gemm_block_k=32, gemm_num_stages=4),  # two
    "gemm_bm64_w4_bn128_up64": dict(gemm_block_m=64, gemm_num_warps=4, gemm_block_n=128, gemm_up_block_n=64),  # three
    "gemm_bm64_s2": dict(gemm_block_m=64, gemm_num_stages=2),  # 8 warps, two per SM
    # an expert's last row tile of at most half its rows on a half-size dot (the same bits)
    "half_tiles": dict(gemm_half_tiles=True),
    # full row tiles of the plan-order outputs stored through descriptors (the same bits)
    "store_descriptors": dict(descriptor_stores=True),
    "half_tiles_store_descriptors": dict(gemm_half_tiles=True, descriptor_stores=True),
    # weight gradients on 32-row steps, more of them in flight (short per-expert reductions)
    "wgrad_bk32_s4": dict(wgrad_block_k=32, wgrad_num_stages=4),
    "wgrad_bk32_s6": dict(wgrad_block_k=32, wgrad_num_stages=6),
    # runs of J consecutive tiles of one expert per weight-gradient program, its partial
    # last row chunk inside the pipelined loop (descriptors built per run)
    "wgrad_run0": dict(wgrad_expert_run=0),
    "wgrad_run1": dict(wgrad_expert_run=1),
    "wgrad_run2": dict(wgrad_expert_run=2),
    "wgrad_run4": dict(wgrad_expert_run=4),
    "wgrad_run8": dict(wgrad_expert_run=8),
    "wgrad_run4_bk32_s4": dict(wgrad_expert_run=4, wgrad_block_k=32, wgrad_num_stages=4),
    # the row GEMMs ask L2 for their weights 4 or 8 steps ahead of the dots (the same bits)
    "prefetch4": dict(gemm_prefetch_steps=4),
    "prefetch8": dict(gemm_prefetch_steps=8),
    # weight-gradient tiles stored through descriptors (the same bits)
    "wgrad_store_desc": dict(wgrad_descriptor_stores=True),
}
