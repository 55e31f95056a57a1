"""Quantized gradient reduce-scatter: int8 blocks on the wire, fp32 sums on the receiver.

FSDP2 reduce-scatters each parameter group's gradients through a ``ReduceScatter`` object
(``FSDPModule.set_custom_reduce_scatter``). It hands that object one flat, padded,
rank-major buffer in the reduce dtype: ``input[j * S:(j + 1) * S]`` is the part destined
for rank ``j`` of the reduce-scatter group, ``S = input.numel() // world_size``.
:class:`QuantizedReduceScatter` replaces the collective with:

1. **quantize** every peer's slice to int8 in fixed-size blocks (no row boundaries
   survive in the flat buffer), one fp32 absmax scale per block, with *stochastic*
   rounding: ``q = floor(x / scale + u)``, ``u ~ U[0, 1)``, so ``E[q * scale] = x``;
2. **exchange** the slices with ONE ``torch.distributed.all_to_all_single`` of int8 bytes,
   the scales packed behind the values of each slice (see :func:`segment_bytes`);
3. **dequantize and sum in fp32** on the receiving rank (int8 is never summed on the wire:
   it would overflow), adding the rank's own slice exactly (it never crosses the wire);
4. apply the ``op`` FSDP2 asked for (``SUM``, ``AVG``, ``PREMUL_SUM(factor)``) and write
   the result into the output buffer in its dtype (the reduce dtype).

Wire format of the slice that rank ``i`` sends to rank ``j`` (``nb = ceil(S / block_size)``)::

    | q[0] q[1] ... q[S-1]  (S int8) | scale[0] ... scale[nb-1]  (nb fp32 = 4 * nb bytes) |

The last block of a slice may be partial (``S % block_size`` values): its scale is the
absmax of those values only, and nothing is padded on the wire. An all-zero block has
scale 0 and arrives as exact zeros. A block holding NaN or Inf gets a non-finite scale and
arrives non-finite (NaN or Inf in every element of that block), so overflow checks such as
``GradScaler``'s still see it; nothing raises, since one rank raising in the middle of a
collective would leave the others waiting forever.

The noise comes from a generator owned by the :class:`QuantizedReduceScatter` (one per
device), seeded from ``seed`` and the process's *global* rank: every rank, HSDP replicas
included, draws independent noise, and the weights' stochastic-rounding stream
(:mod:`fsdp_int8._rng`, which HSDP replicas must share) is left untouched.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    DefaultReduceScatter,
    ProcessGroupAllocReduceScatter,
)

from fsdp_int8._generators import seed_for

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "QuantizedReduceScatter",
    "enable_quantized_reduce_scatter",
    "installed_quantized_reduce_scatter",
    "quantize_blocks",
    "dequantize_blocks",
    "num_blocks",
    "segment_bytes",
    "pack_segments",
    "unpack_and_sum",
    "op_multiplier",
]

DEFAULT_BLOCK_SIZE = 256
INT8_MAX = 127
SCALE_BYTES = 4  # one fp32 scale per block
# Mixed into the seed so the gradient noise stream never coincides with the weights'
# stochastic-rounding stream of the same (seed, rank).
_SEED_SALT = 0x5EED_6A2D_0F_C0DE


def _check_block_size(block_size: int) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int, got {block_size!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return block_size


def num_blocks(numel: int, block_size: int) -> int:
    """Blocks (and so scales) of a slice of ``numel`` values: ``ceil(numel / block_size)``."""
    return -(-numel // block_size)


def segment_bytes(numel: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Bytes of one rank-to-rank slice on the wire: ``numel`` int8 values + 4 bytes a block."""
    return numel + SCALE_BYTES * num_blocks(numel, _check_block_size(block_size))


def _block_parts(numel: int, block_size: int) -> list[tuple[slice, slice, int, int]]:
    """``(columns, scale columns, blocks, width)`` of the full blocks and the partial tail."""
    full, tail = divmod(numel, block_size)
    parts = []
    if full:
        parts.append((slice(0, full * block_size), slice(0, full), full, block_size))
    if tail:
        parts.append((slice(full * block_size, numel), slice(full, full + 1), 1, tail))
    return parts


@torch.no_grad()
def quantize_blocks(
    values: torch.Tensor,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    stochastic: bool = True,
    generator: torch.Generator | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of ``values`` to int8 in blocks of ``block_size`` columns.

    Args:
        values: ``[rows, numel]`` floating tensor (any floating dtype; the arithmetic runs
            in fp32). Rows may be strided (e.g. rows of a larger buffer).
        block_size: Values per block; the last block of a row holds ``numel % block_size``
            values when that is not 0.
        stochastic: ``floor(x / scale + u)`` with ``u ~ U[0, 1)`` (unbiased); otherwise
            round to nearest.
        generator: Source of ``u`` (``None``: torch's default generator).
        out: Optional ``int8 [rows, numel]`` destination (may be strided, e.g. the value
            columns of a wire buffer); allocated when ``None``.

    Returns:
        ``(q, scales)``: ``int8 [rows, numel]`` in ``[-127, 127]`` and
        ``fp32 [rows, ceil(numel / block_size)]`` with ``scale = absmax(block) / 127``.
        An all-zero block has scale 0 and q 0. A block holding NaN or Inf gets a
        non-finite scale (its q values are then meaningless but in range).
    """
    block_size = _check_block_size(block_size)
    if values.dim() != 2:
        raise ValueError(f"quantize_blocks expects a 2-D tensor, got shape {tuple(values.shape)}")
    if not values.is_floating_point():
        raise TypeError(f"quantize_blocks expects a floating tensor, got {values.dtype}")
    rows, numel = values.shape
    if out is None:
        out = torch.empty(rows, numel, dtype=torch.int8, device=values.device)
    elif out.shape != values.shape or out.dtype != torch.int8:
        raise ValueError(
            f"out must be int8 of shape {tuple(values.shape)}, got {out.dtype} {tuple(out.shape)}"
        )
    scales = torch.empty(rows, num_blocks(numel, block_size), dtype=torch.float32, device=values.device)
    for columns, scale_columns, blocks, width in _block_parts(numel, block_size):
        x = values[:, columns].float().reshape(rows, blocks, width)
        low, high = torch.aminmax(x, dim=2)  # no |x| temporary; NaN propagates into both
        scale = torch.maximum(high, low.neg()) / INT8_MAX
        scales[:, scale_columns] = scale
        # All-zero blocks divide by 1 (q = 0), non-finite ones too (their scale carries
        # the NaN / Inf to the receiver, which dequantizes them to non-finite values).
        divisor = torch.where(torch.isfinite(scale) & (scale > 0), scale, torch.ones_like(scale))
        scaled = x / divisor.unsqueeze(2)
        if stochastic:
            noise = torch.rand(
                scaled.shape, dtype=torch.float32, device=scaled.device, generator=generator
            )
            scaled.add_(noise).floor_()
        else:
            scaled.round_()
        # |x / scale| <= 127 up to one ulp of the division: the clamp keeps the range
        # symmetric (never -128); nan_to_num keeps a NaN block's bytes defined.
        scaled.nan_to_num_(0.0).clamp_(-INT8_MAX, INT8_MAX)
        out[:, columns].view(rows, blocks, width).copy_(scaled)
    return out, scales


@torch.no_grad()
def dequantize_blocks(
    q: torch.Tensor, scales: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE
) -> torch.Tensor:
    """Inverse of :func:`quantize_blocks`: ``fp32 [rows, numel]``, ``q * scale`` per block."""
    block_size = _check_block_size(block_size)
    if q.dim() != 2 or scales.dim() != 2:
        raise ValueError(f"expected 2-D q and scales, got {tuple(q.shape)} and {tuple(scales.shape)}")
    rows, numel = q.shape
    if scales.shape != (rows, num_blocks(numel, block_size)):
        raise ValueError(
            f"{rows} rows of {numel} values in blocks of {block_size} need scales of shape "
            f"{(rows, num_blocks(numel, block_size))}, got {tuple(scales.shape)}"
        )
    result = torch.empty(rows, numel, dtype=torch.float32, device=q.device)
    for columns, scale_columns, blocks, width in _block_parts(numel, block_size):
        torch.mul(
            q[:, columns].reshape(rows, blocks, width),
            scales[:, scale_columns].unsqueeze(2),
            out=result[:, columns].view(rows, blocks, width),
        )
    return result


@torch.no_grad()
def pack_segments(
    slices: torch.Tensor,
    skip: int | None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The all-to-all send buffer: ``int8 [world, segment_bytes(S)]``, row ``j`` for rank ``j``.

    Args:
        slices: ``[world, S]`` view of the rank-major reduce-scatter input.
        skip: The sender's own rank: its row is zeroed instead of quantized (the receiver
            adds its own slice exactly; the slot only keeps the buffer rank-major).
        block_size: Values per block.
        generator: Stochastic-rounding noise.
    """
    world, numel = slices.shape
    send = torch.empty(world, segment_bytes(numel, block_size), dtype=torch.int8, device=slices.device)
    ranges = [(0, world)] if skip is None else [(0, skip), (skip + 1, world)]
    for start, stop in ranges:
        if stop <= start:
            continue
        _, scales = quantize_blocks(
            slices[start:stop], block_size, generator=generator,
            out=send[start:stop, :numel],
        )
        send[start:stop, numel:] = scales.view(torch.int8)  # fp32 scales as raw bytes
    if skip is not None:
        send[skip].zero_()
    return send


@torch.no_grad()
def unpack_and_sum(
    received: torch.Tensor,
    own: torch.Tensor,
    own_rank: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum, in fp32, the rank's own slice and every peer's dequantized segment.

    Args:
        received: ``int8 [world, segment_bytes(S)]``: row ``i`` came from rank ``i``.
        own: This rank's own ``[S]`` slice, in full precision (row ``own_rank`` of
            ``received`` is ignored).
        own_rank: This rank's index in the group.
        block_size: Values per block.
        out: Optional ``fp32 [S]`` accumulator (e.g. FSDP2's output buffer).

    Returns:
        ``fp32 [S]``: ``own + sum over peers of dequantize(segment)``, peers in rank order.
    """
    world, width = received.shape
    numel = own.numel()
    if width != segment_bytes(numel, block_size):
        raise ValueError(
            f"received segments of {width} bytes; {numel} values in blocks of {block_size} "
            f"need {segment_bytes(numel, block_size)}"
        )
    if out is None:
        out = own.to(torch.float32, copy=True)
    else:
        out.copy_(own)
    # Scales travel as raw bytes at offset S, which need not be 4-byte aligned: copy them
    # out (4 bytes a block) before viewing them as fp32.
    scales = received[:, numel:].contiguous().view(torch.float32)
    for peer in range(world):
        if peer != own_rank:  # one peer at a time: S temporary values, not world * S
            segment = received[peer: peer + 1, :numel]
            out.add_(dequantize_blocks(segment, scales[peer: peer + 1], block_size)[0])
    return out


def _op_type(op: object) -> object:
    # ReduceOp.SUM is a RedOpType; ReduceOp.PREMUL_SUM(f) is a ReduceOp carrying .op, .factor
    # (and isinstance(RedOpType, ReduceOp) holds too, so test the narrower type first).
    return op if isinstance(op, dist.ReduceOp.RedOpType) else getattr(op, "op", op)


def op_multiplier(op: object, world_size: int) -> float | torch.Tensor | None:
    """What the sum of the ranks' slices is multiplied by for FSDP2's ``op``.

    ``SUM`` -> ``None`` (nothing), ``AVG`` -> ``1 / world_size``, ``PREMUL_SUM(f)`` -> ``f``
    (``sum(f * x_i) = f * sum(x_i)``; ``f`` may be a float or a 0-d tensor).

    Raises:
        ValueError: for any other op (FSDP2 only issues these three).
    """
    kind = _op_type(op)
    if kind == dist.ReduceOp.SUM:
        return None
    if kind == dist.ReduceOp.AVG:
        return None if world_size == 1 else 1.0 / world_size
    if kind == dist.ReduceOp.PREMUL_SUM:
        if isinstance(op, dist.ReduceOp.RedOpType):
            raise ValueError("PREMUL_SUM needs its factor: pass ReduceOp.PREMUL_SUM(factor)")
        return op.factor
    raise ValueError(
        f"the quantized reduce-scatter supports SUM, AVG and PREMUL_SUM (what FSDP2 issues), "
        f"got {kind}"
    )


class QuantizedReduceScatter(ReduceScatter):
    """FSDP2 ``ReduceScatter`` that sends int8 blocks (stochastic rounding) with fp32 scales.

    Install with ``fsdp_module.set_custom_reduce_scatter(QuantizedReduceScatter())`` or,
    for every module of a model, :func:`enable_quantized_reduce_scatter`. One instance
    can serve many modules: the process group arrives with each call.

    Args:
        block_size: Values per fp32 scale (default 256: 4 bytes of scale per 256 bytes of
            int8, 1.6% overhead). Smaller blocks follow the gradient's magnitude more
            closely (less noise) and cost more scale bytes.
        seed: Seed of the rounding noise; each process mixes in its global rank.
    """

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, *, seed: int = 0) -> None:
        self.block_size = _check_block_size(block_size)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        self.seed = seed
        self._generators: dict[str, torch.Generator] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block_size={self.block_size}, seed={self.seed})"

    # -- the Comm contract ------------------------------------------------------------
    def allocate(
        self,
        size: Sequence[int | torch.SymInt],
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        """FSDP2's input and output buffers: plain ``torch.empty``."""
        return torch.empty(*size, dtype=dtype, device=device)

    @torch.no_grad()
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: object,
        async_op: bool = False,
    ) -> None:
        """Reduce-scatter ``input_tensor`` into ``output_tensor`` (see the module docstring).

        Args:
            output_tensor: ``[S]`` in the reduce dtype; receives this rank's reduced slice.
            input_tensor: Flat ``[world * S]`` rank-major buffer in the reduce dtype.
            group: The reduce-scatter process group (FSDP2's shard group).
            op: ``ReduceOp.SUM``, ``ReduceOp.AVG`` or ``ReduceOp.PREMUL_SUM(factor)``.
            async_op: Must be ``False`` (FSDP2 never asks otherwise): the dequantize-and-sum
                runs right after the all-to-all, on the current stream.

        Returns:
            ``None``: the work is complete (queued on the current stream on GPUs).
        """
        if async_op:
            raise ValueError(
                "QuantizedReduceScatter runs synchronously (it dequantizes and sums after the "
                "all-to-all); call it with async_op=False, as FSDP2 does"
            )
        world = dist.get_world_size(group)
        if not input_tensor.is_floating_point():
            raise TypeError(f"gradients must be floating point, got {input_tensor.dtype}")
        if input_tensor.numel() % world:
            raise ValueError(
                f"reduce-scatter input of {input_tensor.numel()} values does not split "
                f"evenly over {world} ranks (FSDP2 pads it: was it built by FSDP2?)"
            )
        numel = input_tensor.numel() // world
        if output_tensor.numel() != numel:
            raise ValueError(
                f"output holds {output_tensor.numel()} values, expected {numel} "
                f"(= {input_tensor.numel()} / {world})"
            )
        multiplier = op_multiplier(op, world)
        output = output_tensor.view(-1)
        slices = input_tensor.reshape(world, numel)
        rank = dist.get_rank(group)
        if world == 1:  # nothing crosses: copy through
            output.copy_(slices[0] if multiplier is None else slices[0].float() * multiplier)
            return None
        send = pack_segments(
            slices, rank, self.block_size, generator=self._generator(input_tensor.device)
        )
        received = torch.empty_like(send)
        # Looked up on the module at call time: fsdp_int8.count_collectives sees it.
        dist.all_to_all_single(received.view(-1), send.view(-1), group=group)
        accumulator = output if output.dtype == torch.float32 else None
        total = unpack_and_sum(received, slices[rank], rank, self.block_size, out=accumulator)
        if multiplier is not None:
            total.mul_(multiplier)
        if total is not output:
            output.copy_(total)
        return None

    # -- the noise generator ----------------------------------------------------------
    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        gen = self._generators.get(key)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self._process_seed())
            self._generators[key] = gen
        return gen

    def _process_seed(self) -> int:
        rank = dist.get_rank() if dist.is_initialized() else 0
        return seed_for(self.seed ^ _SEED_SALT, rank)

    def rng_state(self) -> dict[str, torch.Tensor]:
        """Copies of the noise generators' states, keyed by device (for exact resumption)."""
        return {key: gen.get_state().clone() for key, gen in self._generators.items()}

    def set_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore states returned by :meth:`rng_state`."""
        for key, value in state.items():
            self._generator(torch.device(key)).set_state(value.clone())


def _fsdp_modules(model: nn.Module) -> list[tuple[str, FSDPModule]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]


_REPLACEABLE = (DefaultReduceScatter, ProcessGroupAllocReduceScatter, QuantizedReduceScatter)


def enable_quantized_reduce_scatter(
    model: nn.Module, *, block_size: int = DEFAULT_BLOCK_SIZE, seed: int = 0
) -> int:
    """Install a :class:`QuantizedReduceScatter` on every ``FSDPModule`` of ``model``.

    Call it after ``fully_shard`` / :func:`fsdp_int8.shard_model` and before the first
    backward. Only the reduce-scatter over the shard dimension changes: with HSDP, FSDP2's
    all-reduce over the replicate dimension still runs in full precision (reduce dtype),
    and a shard dimension of size 1 calls no reduce-scatter at all.

    Args:
        model: A model sharded with ``fully_shard`` (the root or any module containing
            FSDP modules).
        block_size: Values per fp32 scale (see :class:`QuantizedReduceScatter`).
        seed: Seed of the rounding noise (each process mixes in its global rank).

    Returns:
        How many FSDP modules (with parameters) now use the quantized reduce-scatter.

    Raises:
        ValueError: ``model`` holds no FSDP module; or a module has several parameter
            groups (per-parameter meshes from ``shard_placement_fn``), which FSDP2's
            hook cannot serve; or a module already uses another custom reduce-scatter.
    """
    comm = QuantizedReduceScatter(block_size, seed=seed)
    modules = _fsdp_modules(model)
    if not modules:
        raise ValueError(
            f"{type(model).__name__} holds no FSDP module: shard it first "
            "(fsdp_int8.shard_model or torch.distributed.fsdp.fully_shard), then enable "
            "the quantized reduce-scatter"
        )
    installed = 0
    for name, module in modules:
        groups = getattr(module._get_fsdp_state(), "_fsdp_param_groups", None)
        for group in groups or ():
            current = getattr(group, "_reduce_scatter_comm", None)
            if current is not None and not isinstance(current, _REPLACEABLE):
                raise ValueError(
                    f"FSDP module {name or '<root>'!r} already uses a custom reduce-scatter "
                    f"({type(current).__name__}); the quantized reduce-scatter would replace it"
                )
        try:
            module.set_custom_reduce_scatter(comm)
        except ValueError as error:
            raise ValueError(
                f"cannot install the quantized reduce-scatter on FSDP module "
                f"{name or '<root>'!r}: it has {len(groups or ())} parameter groups "
                "(per-parameter meshes from fully_shard's shard_placement_fn), and FSDP2 "
                "takes one custom reduce-scatter per module only. Shard those parameters "
                f"in a module of their own. (FSDP2: {error})"
            ) from error
        installed += bool(groups)
    return installed


def installed_quantized_reduce_scatter(model: nn.Module) -> QuantizedReduceScatter | None:
    """The :class:`QuantizedReduceScatter` serving ``model``'s FSDP modules, if any."""
    for _, module in _fsdp_modules(model):
        for group in getattr(module._get_fsdp_state(), "_fsdp_param_groups", None) or ():
            comm = getattr(group, "_reduce_scatter_comm", None)
            if isinstance(comm, QuantizedReduceScatter):
                return comm
    return None
