"""The peer buffers of the megakernel: every rank's landing, return, metadata and flag
regions, addressed from one base pointer.

Shape legend: W ranks, T_cap the most tokens of a rank, P_cap the most (token, k)
pairs a sender gets back, R_cap the most rows of an owner, D model dim.

A launch covers the ranks ``[rank0, rank0 + local_ranks)``; an allocator, passed in,
decides where the other ranks' regions live:

- :class:`SymmetricAllocator`: one real rank per process, the peers' regions in
  ``torch.distributed`` symmetric memory (one node);
- :class:`DeviceAllocator`: all W ranks in one process and one launch, the regions
  separate allocations on one device (``uniep.testing``'s virtual ranks; the Triton
  interpreter runs it on the CPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from uniep.kernels.flags import raise_on_error
from uniep.plan import device_ints

# Buffer regions of one rank: name -> dtype (None: the activation dtype).
# "land" is (W * T_cap, D), "ret" is (P_cap, D), "ret_flag" is (P_cap,), the others (R_cap,).
_REGIONS = {
    "land": None, "ret": None, "ret_flag": torch.int32,
    "a_row": torch.int32, "scale": torch.float32, "origin": torch.int32, "row_flag": torch.int32,
}
_ROW_REGIONS = ("a_row", "scale", "origin", "row_flag")

Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]


def _round_up(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


class SymmetricAllocator:
    """This process is one rank of ``group`` (inside one node); the peers' regions are
    reached through symmetric memory."""

    flag_scope = "sys"
    """Memory scope of the ready flags: peers on other GPUs need "sys"."""
    local_ranks = 1

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def rows(self, rows_per_owner: list[int], device: torch.device) -> tuple[int, torch.Tensor | None]:
        """(rows a rank's row regions must hold, None: each owner's rows start at row 0)."""
        return max(rows_per_owner), None

    def allocate(self, shapes: Shapes, device: torch.device) -> tuple[dict, dict]:
        """(this rank's regions, each region's per-rank offsets in elements, (W,) int64)."""
        import torch.distributed._symmetric_memory as symm_mem

        offsets, total = {}, 0
        for name, (shape, dtype) in shapes.items():
            offsets[name] = total
            total += _round_up(int(torch.Size(shape).numel()) * dtype.itemsize, 256)
        symm_mem.enable_symm_mem_for_group(self.group.group_name)  # needed by older PyTorch; idempotent
        buffer = symm_mem.empty(total, dtype=torch.uint8, device=device)
        buffer.zero_()
        handle = symm_mem.rendezvous(buffer, self.group.group_name)
        self._buffer, self._handle = buffer, handle  # keep the mapping alive
        local, deltas = {}, {}
        byte_deltas = [ptr - handle.buffer_ptrs[self.rank] for ptr in handle.buffer_ptrs]
        for name, (shape, dtype) in shapes.items():
            nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
            local[name] = buffer[offsets[name] : offsets[name] + nbytes].view(dtype).view(shape)
            if any(delta % (16 * dtype.itemsize) for delta in byte_deltas):
                raise RuntimeError(f"symmetric buffers are not 16-element aligned to each other: {byte_deltas}")
            deltas[name] = torch.tensor([d // dtype.itemsize for d in byte_deltas], dtype=torch.int64, device=device)
        handle.barrier()
        return local, deltas


class DeviceAllocator:
    """All ``world`` ranks in this process and one launch, on one device. The owners
    share one row space: owner d's rows start where owner d-1's end."""

    flag_scope = "gpu"
    rank = 0

    def __init__(self, world: int):
        self.world = self.local_ranks = world

    def rows(self, rows_per_owner: list[int], device: torch.device) -> tuple[int, torch.Tensor | None]:
        row_base = device_ints([sum(rows_per_owner[:d]) for d in range(self.world)], device)
        return sum(rows_per_owner), row_base

    def allocate(self, shapes: Shapes, device: torch.device) -> tuple[dict, dict]:
        W = self.world
        local, deltas = {}, {}
        for name, (shape, dtype) in shapes.items():
            copies = 1 if name in _ROW_REGIONS else W  # row regions: one shared row space
            local[name] = torch.zeros((copies * shape[0], *shape[1:]), dtype=dtype, device=device)
            step = int(torch.Size(shape).numel()) if copies > 1 else 0
            deltas[name] = torch.arange(W, dtype=torch.int64, device=device) * step
        return local, deltas


class PeerBuffers:
    """Every rank's regions. Rank r's copy of a region is at ``local(name).data_ptr()``
    plus ``deltas[name][r]`` elements ((W,) int64 on the device): kernels address peers
    from one base pointer, which keeps the compiler's alignment facts (vector loads and
    stores). One set serves every layer of a path (the layers run one after another,
    and each launch has its own epoch)."""

    def __init__(self, allocator: SymmetricAllocator | DeviceAllocator):
        self.allocator = allocator
        self.world = allocator.world
        self.rank0 = allocator.rank
        self.local_ranks = allocator.local_ranks
        self.tokens_cap = self.pairs_cap = self.rows_cap = 0
        self.dim, self.dtype = 0, None
        self.epoch = 0
        self.deltas: dict[str, torch.Tensor] = {}
        self._pending_errors: list[tuple[torch.Tensor, str]] = []
        self._local: dict[str, torch.Tensor] = {}

    @property
    def flag_scope(self) -> str:
        return self.allocator.flag_scope

    def local(self, name: str) -> torch.Tensor:
        """This launch's view of a region: its ranks' regions, contiguous."""
        return self._local[name]

    def record_errors(self, error_word: torch.Tensor, what: str) -> None:
        """Queue a launch's error word for checking without a host sync now."""
        host = torch.empty(4, dtype=torch.int32, pin_memory=error_word.is_cuda)
        host.copy_(error_word, non_blocking=True)
        self._pending_errors.append((host, what))

    def raise_pending_errors(self, synchronize: bool = True) -> None:
        """Raise :class:`~uniep.kernels.flags.MegakernelWaitError` if a queued launch
        timed out. Each call checks the earlier calls' words after its own host sync
        (so a timeout surfaces at the next megakernel call at the latest);
        ``synchronize=False`` is for callers that have just synchronized."""
        if synchronize and torch.cuda.is_available():
            torch.cuda.synchronize()
        pending, self._pending_errors = self._pending_errors, []
        for host, what in pending:
            raise_on_error(host, what)

    def next_epoch(self) -> int:
        self.epoch += 1
        return self.epoch

    def prepare(self, tokens: int, top_k: int, rows_per_owner: list[int], dim: int, dtype: torch.dtype,
                device: torch.device, pairs: int | None = None) -> torch.Tensor | None:
        """Make room for a call (every rank of a real group decides the same: the inputs
        come from the all-gathered count table) and point the row regions at each
        owner's rows. ``pairs``: return rows a sender needs (default ``tokens * top_k``).
        Returns the call's row bases (owners sharing one row space move with each call's
        rows; None when each owner has its own): its backward points the row regions
        back at them with :meth:`point_rows`, after later layers' calls."""
        rows, row_base = self.allocator.rows(rows_per_owner, device)
        pairs = tokens * top_k if pairs is None else pairs
        if (tokens > self.tokens_cap or pairs > self.pairs_cap or rows > self.rows_cap
                or dim != self.dim or dtype != self.dtype):
            self.tokens_cap = _round_up(max(tokens, self.tokens_cap), 1024)
            self.pairs_cap = _round_up(max(pairs, self.pairs_cap), 1024 * top_k)
            self.rows_cap = _round_up(max(rows, self.rows_cap), 4096)
            self.dim, self.dtype = dim, dtype
            self._local, self.deltas = self.allocator.allocate(self._shapes(), device)
        self.point_rows(row_base)
        return row_base

    def point_rows(self, row_base: torch.Tensor | None) -> None:
        """Point the row regions at a call's rows (``prepare``'s result; None: nothing to do)."""
        if row_base is not None:
            self.deltas.update({name: row_base for name in _ROW_REGIONS})

    def _shapes(self) -> Shapes:
        W, D = self.world, self.dim
        shapes = {"land": (W * self.tokens_cap, D), "ret": (self.pairs_cap, D), "ret_flag": (self.pairs_cap,)}
        shapes.update({name: (self.rows_cap,) for name in _ROW_REGIONS})
        return {name: (shape, _REGIONS[name] or self.dtype) for name, shape in shapes.items()}
