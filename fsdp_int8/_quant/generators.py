"""Generators of stochastic-rounding noise: one bank per purpose, a generator per device.

Two banks exist. :data:`WEIGHT_ROUNDING` rounds the weights' optimizer updates: it is
seeded from the configured seed and the *shard coordinate* (see
:func:`seed_weight_rounding`), because FSDP shards must draw different noise while HSDP or
DDP replicas of one shard must draw the same, or they would drift apart. Seeded before
the model is sharded (``quantize_``, then ``fully_shard`` by hand or by a framework), it
learns the coordinate from the first all-gather of a weight shard (see
:meth:`GeneratorBank.adopt_shard_coordinate`). The coordinate is the rank's (pp, dp shard)
index (:func:`fsdp_int8._dist.rounding_coordinate`); a weight split by tensor parallelism
draws from a stream of its own per tp coordinate (keyed ``tp<coordinate>of<size>``), while
weights that tp peers replicate draw the same noise on every peer. Each
:class:`~fsdp_int8.gradients.QuantizedReduceScatter` owns a bank of its own, seeded by
global rank. Both save and restore their states for exact resumption.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh

from fsdp_int8 import _dist

_GOLDEN = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads consecutive ranks apart
_MASK63 = (1 << 63) - 1
_TENSOR_PARALLEL_SALT = 0x5445_4E53_4F52  # tp streams never repeat a dp coordinate's stream


def seed_for(seed: int, coordinate: int) -> int:
    """The generator seed of ``coordinate`` (a shard index or a rank) for ``seed``."""
    return (seed * _GOLDEN + coordinate * (_GOLDEN >> 1) + coordinate) & _MASK63


def _device_key(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        device = torch.device(device.type, torch.get_device_module(device.type).current_device())
    return str(device)


class GeneratorBank:
    """One ``torch.Generator`` per device, all seeded alike, created on first use.

    Args:
        salt: Mixed into every seed, so banks with the same ``(seed, coordinate)`` never
            draw the same stream.
    """

    def __init__(self, salt: int = 0) -> None:
        self._salt = salt
        self._base_seed = 0
        self._coordinate = 0
        self._awaiting_coordinate = False
        self._generators: dict[str, torch.Generator] = {}  # "cpu", "cuda:0", "cpu/tp1of2", ...

    def manual_seed(self, seed: int, coordinate: int | None = 0) -> None:
        """Reset every device's generator to the stream of ``(seed, coordinate)``.

        ``coordinate=None``: not known yet; the stream is coordinate 0's until
        :meth:`adopt_shard_coordinate` supplies it.
        """
        self._base_seed = seed
        self._awaiting_coordinate = coordinate is None
        self._coordinate = coordinate or 0
        for key, gen in self._generators.items():
            gen.manual_seed(self._seed_of(key.partition("/")[2]))

    def _seed_of(self, stream: str) -> int:
        """The seed of stream ``""`` (the rank's) or ``"tp<coordinate>of<size>"``."""
        if not stream:
            return seed_for(self._base_seed ^ self._salt, self._coordinate)
        tp_coordinate, tp_size = (int(n) for n in stream[len("tp"):].split("of"))
        return seed_for(
            self._base_seed ^ self._salt ^ _TENSOR_PARALLEL_SALT, self._coordinate * tp_size + tp_coordinate
        )

    def adopt_shard_coordinate(self, mesh: DeviceMesh) -> None:
        """Reseed for this rank's coordinate on the shard ``mesh`` if the bank was seeded
        without one; else do nothing.

        Without this, a model quantized and then sharded by ``fully_shard`` itself would
        round every shard with the same noise (rows ``i`` and ``i + rows / world`` alike).
        Coordinate 0 keeps the stream it has. Called at every all-gather: once the
        coordinate is known, the check is one attribute read (the mesh is not asked).
        """
        if not self._awaiting_coordinate:
            return
        self._awaiting_coordinate = False
        coordinate = _dist.rounding_coordinate(mesh)
        if coordinate != 0:
            self.manual_seed(self._base_seed, coordinate)

    def generator(self, device: torch.device | str, tensor_parallel: Any = None) -> torch.Generator | None:
        """The generator for ``device`` (``None`` on meta: nothing is drawn there).

        ``tensor_parallel``: a weight's ``TensorParallelShard`` (its own stream per tp
        coordinate), or ``None`` for the rank's (pp, dp shard) stream.
        """
        if torch.device(device).type == "meta":
            return None
        device_key = _device_key(device)
        stream = "" if tensor_parallel is None else f"tp{tensor_parallel.coordinate}of{tensor_parallel.size}"
        key = f"{device_key}/{stream}" if stream else device_key
        gen = self._generators.get(key)
        if gen is None:
            gen = torch.Generator(device=device_key)
            gen.manual_seed(self._seed_of(stream))
            self._generators[key] = gen
        return gen

    def get_state(self) -> dict[str, torch.Tensor]:
        """A copy of every device generator's state, keyed by device."""
        return {key: gen.get_state().clone() for key, gen in self._generators.items()}

    def set_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore states returned by :meth:`get_state` (which already hold the stream of
        this rank's shard: no coordinate is adopted after this)."""
        self._awaiting_coordinate = False
        for key, value in state.items():
            gen = self._generators.get(key)
            if gen is None:
                gen = self._generators[key] = torch.Generator(device=key.partition("/")[0])
            gen.set_state(value.clone())


WEIGHT_ROUNDING = GeneratorBank()


def seed_weight_rounding(seed: int, mesh: DeviceMesh | None = None) -> None:
    """Seed the weights' stochastic rounding from ``seed`` and this rank's shard coordinate.

    The one place that seeds :data:`WEIGHT_ROUNDING` (``quantize_``, ``shard_model`` and
    ``load_checkpoint`` call it). Only the shard coordinate is mixed in: replicas of one
    shard (HSDP's replicate dimension, DDP, an unsharded model) draw the same noise and so
    stay bit-identical. ``mesh=None`` (not sharded yet): coordinate 0 until a sharded
    weight's first all-gather tells the coordinate (``Int8Weight.fsdp_pre_all_gather``).
    """
    WEIGHT_ROUNDING.manual_seed(seed, None if mesh is None else _dist.rounding_coordinate(mesh))


# A generator that replaces every weight's bank stream while one optimizer update writes
# its weight (see :func:`update_stream`).
_UPDATE_STREAM: contextvars.ContextVar[torch.Generator | None] = contextvars.ContextVar(
    "fsdp_int8_update_stream", default=None
)


def _draw_counts(generators: list[torch.Generator]) -> list[tuple[torch.Generator, int]]:
    """Each distinct generator of ``generators``, in order of first use, with how many of
    the entries use it: how many seeds it draws."""
    counts: dict[int, tuple[torch.Generator, int]] = {}
    for gen in generators:
        counts[id(gen)] = (gen, counts.get(id(gen), (gen, 0))[1] + 1)
    return list(counts.values())


def draw_update_seed_values(generators: list[torch.Generator]) -> torch.Tensor | None:
    """The draws behind :func:`draw_update_seeds`, not read back: one int64 tensor on the
    first generator's device, each distinct generator's draws in turn (``None`` for no
    generators). :func:`update_seeds_from` turns the values into seeds."""
    if not generators:
        return None
    device = generators[0].device
    return torch.cat([
        torch.randint(0, _MASK63, (count,), dtype=torch.int64, generator=gen, device=gen.device).to(device)
        for gen, count in _draw_counts(generators)
    ])


def update_seeds_from(generators: list[torch.Generator], values: list[int]) -> list[int]:
    """One seed per entry of ``generators`` from :func:`draw_update_seed_values`' values
    (read back): entries that share a generator take its draws in list order."""
    drawn: dict[int, list[int]] = {}
    start = 0
    for gen, count in _draw_counts(generators):
        drawn[id(gen)] = values[start:start + count][::-1]  # popped from the end: list order
        start += count
    return [drawn[id(gen)].pop() for gen in generators]


def draw_update_seeds(generators: list[torch.Generator]) -> list[int]:
    """One 63-bit seed per entry of ``generators``, drawn from each in list order (one
    draw per entry; entries that share a generator draw from it in turn)."""
    values = draw_update_seed_values(generators)
    return [] if values is None else update_seeds_from(generators, values.tolist())


@contextlib.contextmanager
def update_stream(generator: torch.Generator) -> Iterator[None]:
    """Round the weight written inside this block from ``generator``.

    An optimizer draws one seed per int8 weight at the start of a step, in its parameter
    order (:func:`draw_update_seeds`), then updates each weight from a generator seeded
    with it: the noise a weight gets does not depend on the order in which weights are
    updated (after backward, in parameter order; inside backward, in the order gradients
    arrive).
    """
    token = _UPDATE_STREAM.set(generator)
    try:
        yield
    finally:
        _UPDATE_STREAM.reset(token)


def active_update_stream() -> torch.Generator | None:
    """The generator of the update running now (:func:`update_stream`), else ``None``."""
    return _UPDATE_STREAM.get()
