"""Machinery shared by the multi-tensor Triton kernels (adam.py, flatten.py).

[Note: chunk map]
One launch covers T tensors of any sizes: the grid is the total number of CHUNK-element chunks,
and program ``pid`` reads ``chunk_tensor[pid]`` (which tensor) and ``chunk_start[pid]`` (first
element inside it). A (T, max_blocks) grid would idle most programs when sizes are skewed (an
embedding of 50M elements next to a hundred biases). The map depends only on the sizes, so it is
cached per shape tuple.

[Note: device tables]
Pointer tables and chunk maps are device tensors read by the kernels. Rebuilding and uploading them
every step costs host time and, from pageable memory, a blocking copy. ``DeviceTables`` keeps them
on the device keyed on their contents (the data pointers, the sizes): a step whose tensors did not
move (static parameters and states; gradients reused by ``zero_grad(set_to_none=False)`` or handed
back at the same address by the caching allocator) uploads nothing. A miss uploads from pinned
memory, non-blocking. A cached table is never written in place, so a queued kernel never sees it
change; entries used under CUDA-graph capture are kept for the graph's lifetime, and a miss during
capture raises (warm up first).

[Note: 128-bit accesses]
A GPU load is 128-bit only when the compiler can prove 16-byte alignment and the access is
unmasked. Alignment is decided per tensor inside the kernel, as the CUDA kernel does per block:
each program ORs its tensor's addresses (table entries, region starts) and, when they are 16-byte
aligned, runs its full blocks through a copy of the block body whose pointers carry
``tl.multiple_of(ptr, 16)`` hints; a misaligned tensor (a view at an odd offset, a region after an
odd-sized parameter) takes the unhinted copy, and only that tensor does. Blocks run unmasked when
they lie entirely inside their tensor (chunk starts are multiples of the block), masked only on a
tensor's last block. Every variant therefore compiles to 128-bit accesses (tests/test_codegen.py).
All of a kernel's loads and stores must also share one register layout, or Triton converts between
them through shared memory: each launcher picks num_warps so that one thread's elements per
access fit in 128 bits for every dtype it touches.

[Note: full and rest launches]
A kernel holding both the 128-bit path and the one-element-per-thread paths (misaligned tensors, a tensor's
last block) is given the registers of the hungriest path, and every program pays for them in occupancy, though
the other paths run in a few programs at most (the coded Adam kernel, sm_90: 77-102 registers per thread with
every path, 59-79 with the 128-bit path alone). So a launcher may split its chunk map in two (``split_chunks``,
``split_launch_tables``): the FULL chunks (inside their tensor, every address of the tensor 16-byte aligned:
decided on the host from the pointer table's integers, the same test the kernel does) go to a launch that
compiles the 128-bit path only, the rest to a launch of the kernel with every path. The host decides what the
kernel would: a chunk the host calls full would take the aligned unmasked path in the other kernel too. Both
launches are cached like the others ([Note: device tables]); a step with tails or misaligned tensors costs one
more launch. Users: the coded kernel (kernels/adam_coded.py, SPLIT_FULL on) and the fp32-state kernel
(kernels/adam.py, SPLIT_FULL off: 74-80 registers with every path, 48-52 without, but on the H200 both forms
time within 1-2%, the step already at 97-99% of the streaming ceiling).

[Note: hints mark the defining op]
``tl.multiple_of(x, 16)`` creates no new value: it sets a divisibility attribute on the op that
defined ``x``. A pointer made once before ``if aligned:`` and hinted inside that branch is therefore
hinted everywhere, the unaligned branch included; the two branches then compile to the same 128-bit
code and the compiler merges them (seen on an H200: "misaligned address" on the ZeRO layer's shard
views; the PTX had no alignment test left). So every branch makes its own pointers from the table's
integer addresses (``typed_pointer``, ``offset_pointer``: a fresh op per call, hinted or not), and
tests/test_codegen.py checks that each multi-tensor kernel's PTX still tests the alignment (an
``and`` with 15) besides its 128-bit accesses.

[Note: interpreter bits are GPU bits]
Under TRITON_INTERPRET=1 each fp32 operation is computed by numpy, correctly rounded, and Python
float kernel arguments stay doubles; compiled for a GPU, Triton 3.9 contracts a*b+c into ``fma``
(unless launched with ``enable_fp_fusion=False``), lowers ``/`` to ``div.full.f32`` and
``tl.sqrt`` to ``sqrt.approx.ftz.f32``, ``tl.maximum`` to the NaN-dropping ``max.f32``, and
computes scalar arithmetic on fp32 arguments in fp32. So the kernels: are launched with
``enable_fp_fusion=False``; divide and take square roots with ``tl.div_rn`` / ``tl.sqrt_rn``;
take maxima with ``propagate_nan=tl.PropagateNan.ALL`` (torch.maximum); and compute no
coefficient from their scalar arguments (they receive 1 - beta etc. computed in double on the
host, [Note: coefficients are computed once, in double] in reference.py). Then the interpreter's
result is the GPU's, bit for bit; tests/test_codegen.py checks the PTX, tests/test_numerics.py
runs the kernels with fp32 scalar arguments.
"""
from __future__ import annotations

import contextlib
import operator
from collections import OrderedDict
from functools import reduce
from typing import Any, Callable, ContextManager, Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def program_chunk(chunk_tensor, chunk_start, numels):
    """(tensor index, first element of this program's chunk in it, the tensor's size) from the chunk
    map ([Note: chunk map]); all int64."""
    pid = tl.program_id(0).to(tl.int64)
    t = tl.load(chunk_tensor + pid).to(tl.int64)
    return t, tl.load(chunk_start + pid), tl.load(numels + t)


@triton.jit
def typed_pointer(address, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """A pointer-table entry (an int64 address) as a *DTYPE pointer, hinted 16-byte aligned iff ALIGNED.
    Call it inside the branch that uses the pointer ([Note: hints mark the defining op])."""
    ptr = address.to(tl.pointer_type(DTYPE))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def offset_pointer(base, offset, ALIGNED: tl.constexpr):
    """``base + offset`` (elements), hinted 16-byte aligned iff ALIGNED; inside its branch, as typed_pointer."""
    ptr = base + offset
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def block_offsets(start, i, BLOCK_SIZE: tl.constexpr):
    """(first element, int64 offsets) of iteration ``i`` of a chunk: BLOCK_SIZE contiguous elements
    starting at a multiple of BLOCK_SIZE (the hints that make full blocks vectorize)."""
    block_start = start + i * BLOCK_SIZE
    offs = block_start + tl.arange(0, BLOCK_SIZE).to(tl.int64)
    return block_start, tl.max_contiguous(tl.multiple_of(offs, BLOCK_SIZE), BLOCK_SIZE)


@triton.jit
def scalar_offsets(start, i, BLOCK_SIZE: tl.constexpr):
    """int64 offsets of iteration ``i`` of a chunk for the unhinted paths (a misaligned tensor's blocks, every
    tensor's last block), shaped [BLOCK_SIZE // 32, 32]: one element per thread, a warp's 32 consecutive.
    The other shape keeps Triton from giving these accesses the 128-bit path's layout (4 per thread): its
    coalescing widens loads to the widest layout among accesses of the same shape, but not stores to a
    pointer of unknown alignment, and the two layouts would meet in a conversion through shared memory."""
    rows = tl.arange(0, BLOCK_SIZE // 32).to(tl.int64)[:, None] * 32
    return start + i * BLOCK_SIZE + rows + tl.arange(0, 32).to(tl.int64)[None, :]


@triton.jit
def round_bf16_bits(x):
    """fp32 -> bf16 bit pattern (uint16), round to nearest even; NaN stays a quiet NaN.

    Explicit on the bits because the interpreter truncates fp32->bf16 casts while a GPU rounds;
    this way both agree bitwise with torch's ``.bfloat16()``.
    """
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    quiet_nan = (bits >> 16) | 0x40
    return tl.where(x != x, quiet_nan, rounded).to(tl.uint16)


class DeviceTables:
    """Device-resident integer tables (pointer tables, chunk maps) keyed on their host contents.

    See [Note: device tables]. ``get(key, device, build, dtypes)`` returns ``(tensors, extra)`` cached
    for ``key``, or calls ``build() -> (host lists, extra)`` once and uploads the lists (``extra``: a
    host-side fact about them, e.g. whether every pointer is aligned). Entries used while a CUDA
    graph is being captured are never evicted: the graph reads them at every replay.
    """

    def __init__(self, maxsize: int = 256) -> None:
        self.maxsize = maxsize
        self._entries: OrderedDict[tuple, tuple[tuple[Tensor, ...], Any]] = OrderedDict()
        self._captured: dict[tuple, tuple[tuple[Tensor, ...], Any]] = {}
        self.misses = 0   # uploads done (tests: "the second step is a hit")

    def get(self, key: tuple, device: torch.device, build: Callable[[], tuple[Sequence[Sequence[int]], Any]],
            dtypes: Sequence[torch.dtype]) -> tuple[tuple[Tensor, ...], Any]:
        full_key = (device, *key)
        hit = self._entries.get(full_key)
        capturing = _capturing(device)
        if hit is None:
            if capturing:
                raise RuntimeError(
                    "zero_kernels: a pointer table or chunk map changed while a CUDA graph is being "
                    "captured (new parameters, gradients or shapes). Run a few eager steps with the same "
                    "tensors before capturing (static gradients: zero_grad(set_to_none=False)).")
            self.misses += 1
            lists, extra = build()
            hit = (tuple(upload(rows, dt, device) for rows, dt in zip(lists, dtypes)), extra)
            self._entries[full_key] = hit
            if len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(full_key)
        if capturing:
            self._captured[full_key] = hit
        return hit

    def clear(self) -> None:
        self._entries.clear()


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def upload(rows: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A host list as a device tensor: one non-blocking copy from pinned memory on CUDA (a copy from
    pageable memory would block the host), a plain tensor elsewhere."""
    host = torch.tensor(rows, dtype=dtype)
    if device.type == "cuda" and torch.cuda.is_available():
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def device_guard(device: torch.device) -> ContextManager[Any]:
    """The context every launch runs in: the tensors' CUDA device (Triton launches on the current
    device, so a group on cuda:1 would otherwise run on cuda:0); nothing to select elsewhere."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


# One cache for every launcher in this package (tables are small: 8 B per tensor and per chunk).
TABLES = DeviceTables()


def chunk_map(numels: tuple[int, ...], chunk: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """(numels, chunk_tensor, chunk_start) device tensors for a tuple of tensor sizes."""
    def build():
        counts = [(n + chunk - 1) // chunk for n in numels]
        tensor_idx = [t for t, c in enumerate(counts) for _ in range(c)]
        starts = [j * chunk for c in counts for j in range(c)]
        return (list(numels), tensor_idx, starts), None
    return TABLES.get(("chunks", chunk, numels), device, build, (torch.int64, torch.int32, torch.int64))[0]


def split_chunks(numels: Sequence[int], aligned: Sequence[bool], chunk: int) -> tuple[list[int], ...]:
    """The chunk map split in two ([Note: full and rest launches]): (tensor, start) lists of the full chunks and
    of the rest, ``(full_tensor, full_start, rest_tensor, rest_start)``. Chunk j of tensor t is full iff
    ``aligned[t]`` and it lies inside the tensor, (j + 1) * chunk <= numels[t]; the order is kept in each."""
    full_t, full_s, rest_t, rest_s = [], [], [], []
    for t, (n, ok) in enumerate(zip(numels, aligned)):
        whole = n // chunk if ok else 0
        full_t += [t] * whole
        full_s += range(0, whole * chunk, chunk)
        rest_t += [t] * ((n + chunk - 1) // chunk - whole)
        rest_s += range(whole * chunk, n, chunk)
    return full_t, full_s, rest_t, rest_s


def split_launch_tables(rows: Sequence[int], numels: Sequence[int],
                        aligned: Callable[[Sequence[int]], Sequence[bool]], chunk: int,
                        device: torch.device) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """(pointer table, numels, (chunk_tensor, chunk_start) of the full chunks, the same of the rest) as device
    tensors, cached on the pointers and sizes like ``pointer_table`` and ``chunk_map`` (a hit costs their two
    hashes); ``aligned(rows)``, per tensor whether the kernel may take the 128-bit path, runs on a miss only."""
    rows, numels = tuple(rows), tuple(numels)

    def build():
        return (rows, numels, *split_chunks(numels, aligned(rows), chunk)), None
    table, numels_t, full_t, full_s, rest_t, rest_s = TABLES.get(
        ("split_launch", chunk, rows, numels), device, build,
        (torch.int64, torch.int64, torch.int32, torch.int64, torch.int32, torch.int64))[0]
    return table, numels_t, (full_t, full_s), (rest_t, rest_s)


def launch_tables(rows: Sequence[int], numels: Sequence[int], chunk: int, device: torch.device,
                  aligned: Callable[[Sequence[int]], Sequence[bool]] | None = None
                  ) -> tuple[Tensor, Tensor, list[tuple[tuple[Tensor, Tensor], bool]]]:
    """(pointer table, numels, launches) of one group: each launch ((chunk_tensor, chunk_start), full), those
    without chunks left out. With ``aligned`` (the kernel's alignment test per tensor, ``aligned_columns``) the
    full chunks and the rest in two launches ([Note: full and rest launches]), else every chunk in one."""
    if aligned is not None:
        table, numels_t, full, rest = split_launch_tables(rows, numels, aligned, chunk, device)
        launches = ((full, True), (rest, False))
    else:
        table = pointer_table(rows, device)
        numels_t, *rest = chunk_map(tuple(numels), chunk, device)
        launches = ((tuple(rest), False),)
    return table, numels_t, [(chunks, full) for chunks, full in launches if chunks[0].numel()]


def aligned_columns(rows: Sequence[int], width: int, columns: Sequence[int]) -> tuple[bool, ...]:
    """Per tensor of pointer rows ``width`` wide: are its addresses in ``columns`` (0 = absent) all 16-byte
    aligned? A kernel's own test of the 128-bit path, on the host."""
    return tuple((reduce(operator.or_, (rows[t + c] for c in columns)) & 15) == 0 for t in range(0, len(rows), width))


def pointer_table(rows: Sequence[int], device: torch.device) -> Tensor:
    """An int64 device tensor of the pointers or element offsets ``rows``, cached on the contents: an
    unchanged table costs one hash, no upload ([Note: device tables])."""
    rows = tuple(rows)
    return TABLES.get(("ptrs", rows), device, lambda: ((rows,), None), (torch.int64,))[0][0]
