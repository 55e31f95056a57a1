"""``QuantizedReduceScatter``: FSDP2's gradient reduce-scatter as an int8 all-to-all.

The algorithm: docs/design.md, "Quantized gradient reduce-scatter"; the bytes on the wire:
:mod:`fsdp_int8.gradients._wire`.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from fsdp_int8 import _dist
from fsdp_int8._fsdp_compat import ReduceScatter
from fsdp_int8._quant.generators import GeneratorBank
from fsdp_int8.gradients._reduce_op import op_multiplier
from fsdp_int8.gradients._wire import DEFAULT_BLOCK_SIZE, pack_segments, unpack_and_sum

__all__ = ["QuantizedReduceScatter"]

# Mixed into the seed so the gradient noise stream never coincides with the weights'
# stochastic-rounding stream of the same (seed, rank).
_SEED_SALT = 0x5EED_6A2D_0F_C0DE


def _require_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")


class QuantizedReduceScatter(ReduceScatter):
    """FSDP2 ``ReduceScatter`` that sends int8 blocks (stochastic rounding) with fp32 scales.

    Quantizes each peer's slice to int8 blocks of ``block_size`` values with stochastic
    rounding and one fp32 scale each, exchanges them with one ``all_to_all_single``, sums
    in fp32 on the receiving rank (its own slice exactly), then applies FSDP2's ``op``
    (``SUM``, ``AVG``, ``PREMUL_SUM``). A block holding NaN or Inf arrives non-finite
    (nothing raises inside the collective, so checks such as ``GradScaler``'s still see
    it). The noise comes from generators of its own, seeded from ``seed`` and the global
    rank: every rank, HSDP replicas included, draws independent noise, and the weights'
    rounding stream is untouched. :meth:`rng_state` / :meth:`set_rng_state` save and
    restore them (checkpoints do it). How it works: docs/design.md.

    Install with ``fsdp_module.set_custom_reduce_scatter(QuantizedReduceScatter())`` or,
    for every module of a model, :func:`~fsdp_int8.gradients.enable_quantized_reduce_scatter`.
    One instance can serve many modules: the process group arrives with each call.

    Args:
        block_size: Values per fp32 scale (default 256: 4 bytes of scale per 256 bytes of
            int8, 1.6% overhead). Smaller blocks follow the gradient's magnitude more
            closely (less noise) and cost more scale bytes.
        seed: Seed of the rounding noise; each process mixes in its global rank.

    Raises:
        TypeError: ``block_size`` or ``seed`` is not an ``int``.
        ValueError: ``block_size < 1``.
    """

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, *, seed: int = 0) -> None:
        _require_int("block_size", block_size)
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        _require_int("seed", seed)
        self.block_size = block_size
        self.seed = seed
        self._noise = GeneratorBank(salt=_SEED_SALT)
        self._seeded = False

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
        """Reduce-scatter ``input_tensor`` into ``output_tensor`` (see the class).

        Args:
            output_tensor: ``[S]`` in the reduce dtype; receives this rank's reduced slice.
            input_tensor: Flat ``[world * S]`` rank-major buffer in the reduce dtype.
            group: The reduce-scatter process group (FSDP2's shard group).
            op: ``ReduceOp.SUM``, ``ReduceOp.AVG`` or ``ReduceOp.PREMUL_SUM(factor)``.
            async_op: Must be ``False`` (FSDP2 never asks otherwise): the dequantize-and-sum
                runs right after the all-to-all, on the current stream.

        Returns:
            ``None``: the work is complete (queued on the current stream on GPUs).

        Raises:
            ValueError: ``async_op=True``, or buffers whose sizes do not fit ``group``.
            TypeError: a non-floating ``input_tensor``.
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
        received_flat, send_flat = received.view(-1), send.view(-1)
        with _dist.released_by_backend(received_flat, send_flat):
            # Looked up on the module at call time: fsdp_int8.collectives.count_collectives sees it.
            dist.all_to_all_single(received_flat, send_flat, group=group)
        accumulator = output if output.dtype == torch.float32 else None
        total = unpack_and_sum(received, slices[rank], rank, self.block_size, out=accumulator)
        if multiplier is not None:
            total.mul_(multiplier)
        if total is not output:
            output.copy_(total)
        return None

    # -- the noise generator ----------------------------------------------------------
    def _generator(self, device: torch.device) -> torch.Generator:
        self._seed_once()
        return self._noise.generator(device)

    def _seed_once(self) -> None:
        # Seeded at first use, not in __init__: the instance may be built before the
        # process group, and the global rank is only known once it is up.
        if not self._seeded:
            self._noise.manual_seed(self.seed, _dist.rank())
            self._seeded = True

    def rng_state(self) -> dict[str, torch.Tensor]:
        """Copies of the noise generators' states, keyed by device (for exact resumption)."""
        return self._noise.get_state()

    def set_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore states returned by :meth:`rng_state`."""
        self._seed_once()  # a later first seeding would overwrite the restored states
        self._noise.set_state(state)
