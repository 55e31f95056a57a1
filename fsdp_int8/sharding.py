"""``shard_model``: quantize, then ``fully_shard`` each block and the root (torchtitan's policy)."""

from __future__ import annotations

import warnings
from typing import Callable, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from fsdp_int8._dist import (PIPELINE_DIM, TENSOR_PARALLEL_DIM, device_type_for, idle_mesh_dims, is_sharded,
                             root_mesh, without_tensor_parallel)
from fsdp_int8._quant.generators import seed_weight_rounding
from fsdp_int8._weight.all_gather import TENSOR_PARALLEL_UNSUPPORTED
from fsdp_int8._weight.census import int8_census
from fsdp_int8._weight.tied_release import release_tied_tables_after_head
from fsdp_int8.config import Int8TrainingConfig, training_config
from fsdp_int8.convert import logger, parameter_owners, quantize_
from fsdp_int8.gradients.install import enable_in_place_reduce_scatter
from fsdp_int8.guard import refuse_steps_on_replaced
from fsdp_int8.parallel import int8_tp_plan

__all__ = ["shard_model", "find_blocks", "BlockSpec"]

#: What ``shard_model(blocks=...)`` and :func:`find_blocks` take: one block type, a
#: sequence of types, or a predicate ``module -> bool``.
BlockSpec = Union[type, Sequence[type], Callable[[nn.Module], bool]]


def _outermost(model: nn.Module, match: Callable[[nn.Module], bool]) -> list[nn.Module]:
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if match(child):
                found.append(child)
            else:
                visit(child)

    visit(model)
    return found


def find_blocks(model: nn.Module, blocks: BlockSpec | None = None) -> list[nn.Module]:
    """The modules ``shard_model`` wraps one by one: the outermost matches, in registration order.

    Args:
        model: The model.
        blocks: Block types (matched with ``isinstance``) or a predicate. ``None``: the
            modules whose class name is in Hugging Face's ``_no_split_modules``, if any
            match; else the elements of every outermost ``nn.ModuleList`` / ``nn.ModuleDict``
            of one module type with parameters (``model.layers``, ``transformer.h``, ...).

    Returns:
        The blocks (never the root; no process group needed); ``[]`` when nothing matches.

    Raises:
        TypeError: when ``blocks`` is neither module types nor a predicate.
    """
    if blocks is not None:
        if isinstance(blocks, type) or (isinstance(blocks, Sequence) and all(isinstance(b, type) for b in blocks)):
            types = (blocks,) if isinstance(blocks, type) else tuple(blocks)
            return _outermost(model, lambda m: isinstance(m, types))
        if callable(blocks):
            return _outermost(model, blocks)
        raise TypeError(f"blocks must be module types or a predicate, got {blocks!r}")
    no_split = getattr(model, "_no_split_modules", None) or ()
    no_split = {no_split} if isinstance(no_split, str) else set(no_split)
    if no_split:
        found = _outermost(model, lambda m: type(m).__name__ in no_split)
        if found:
            return found
    blocks_in_lists = (block for module_list in _outermost(model, _is_repeated_blocks)
                       for block in module_list.children())
    return list({id(b): b for b in blocks_in_lists}.values())  # a block shared twice is one block


def _is_repeated_blocks(module: nn.Module) -> bool:
    """An ``nn.ModuleList`` or ``nn.ModuleDict`` (torchtitan's ``layers``) of one module type."""
    children = list(module.children())
    return (
        isinstance(module, (nn.ModuleList, nn.ModuleDict))
        and len(children) > 0
        and len({type(c) for c in children}) == 1
        and any(True for _ in children[0].parameters())
    )


def _tied_outside(group: nn.Module, owners: dict[int, list[str]], names: dict[int, str]) -> list[str]:
    """Parameters of ``group`` that modules outside it also register, as ``"p (tied to m)"``."""
    prefix = names[id(group)] + "."
    found = []
    for name, param in group.named_parameters(prefix=names[id(group)]):
        outside = [o for o in owners.get(id(param), []) if not (o + ".").startswith(prefix)]
        if outside:
            found.append(f"{name} (tied to {', '.join(outside)})")
    return found


def _groups_below_root(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """The groups below the root: embeddings outside blocks (but one tied outside, left to
    the root with its head), then blocks (one tied outside it is refused)."""
    owners = parameter_owners(model)
    names = {id(m): name for name, m in model.named_modules()}
    in_blocks = {id(m) for block in blocks for m in block.modules()}
    embeddings = [
        m for m in model.modules()
        if isinstance(m, nn.Embedding) and id(m) not in in_blocks
        and not _tied_outside(m, owners, names)
    ]
    for block in blocks:
        tied = _tied_outside(block, owners, names)
        if tied:
            raise ValueError(
                f"block {names[id(block)]} shares parameters with modules outside it: "
                f"{', '.join(tied)}. FSDP2 needs tied parameters in one group: pass blocks= "
                "whose modules hold both ends of each tie, or untie them."
            )
    return embeddings + blocks


def _report_int8(model: nn.Module) -> None:
    census = int8_census(model)
    logger.info("shard_model: %s", census)
    if census.int8_weights == 0:
        warnings.warn(
            f"shard_model quantized no weight of {type(model).__name__}: no nn.Linear passed "
            "Int8TrainingConfig's filter (see its module_filter, skip_names and min_features; "
            "quantize_'s warnings name layers it had to leave alone). The model is sharded "
            "in full precision.",
            stacklevel=3,
        )


def _check_reshard_after_forward(value: object) -> None:
    if isinstance(value, bool):
        return
    if isinstance(value, int):
        raise ValueError(
            f"reshard_after_forward={value}: resharding to a smaller group after forward does "
            "not work for parameters that use FSDP2's all-gather hooks in torch "
            f"{torch.__version__} (FSDPParam raises NotImplementedError when it unshards from "
            "that state). Use True (least memory) or False (no second all-gather in "
            "backward); see docs/limits.md."
        )
    raise TypeError(f"reshard_after_forward must be a bool, got {value!r}")


def _check_unsharded(model: nn.Module) -> None:
    """Refuse a model that FSDP2 or another DTensor API (tensor parallelism) sharded."""
    if not is_sharded(model):
        return
    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        placed = {name: p.placements for name, p in model.named_parameters() if isinstance(p, DTensor)}
        name, placements = next(iter(placed.items()))
        raise NotImplementedError(
            f"shard_model got a model whose parameters are already DTensors ({name}: "
            f"{placements}), as tensor parallelism leaves them: " + TENSOR_PARALLEL_UNSUPPORTED
        )
    raise RuntimeError(
        "shard_model got a model that is already sharded; call it once, on the plain model"
    )


def _check_offload(offload_policy: object) -> None:
    """Refuse what is no FSDP2 offload policy, and pinned memory without an accelerator."""
    if offload_policy is None:
        return
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            "offload_policy must be a torch.distributed.fsdp OffloadPolicy (CPUOffloadPolicy(...)) "
            f"or None, got {offload_policy!r}"
        )
    if isinstance(offload_policy, CPUOffloadPolicy) and offload_policy.pin_memory and not torch.accelerator.is_available():
        raise ValueError(
            "CPUOffloadPolicy(pin_memory=True) pins host memory for copies to an accelerator, and "
            "this process has none (torch pins memory only for one): pass "
            "CPUOffloadPolicy(pin_memory=False)"
        )


def _resolve_mesh(mesh: DeviceMesh | None, device_type: str) -> DeviceMesh:
    """The mesh to shard over: the one given (it must hold this rank), or all ranks."""
    if not dist.is_initialized():
        raise RuntimeError(
            "shard_model needs an initialised process group: call "
            "torch.distributed.init_process_group() first (torchrun sets the environment)"
        )
    if mesh is None:
        return init_device_mesh(device_type, (dist.get_world_size(),))
    if mesh.get_coordinate() is None:
        raise ValueError(
            f"this rank ({dist.get_rank()}) is not in the mesh passed to shard_model "
            f"({mesh}): pass the mesh of the ranks that hold this model (under pipeline "
            "parallelism, this stage's mesh, e.g. world_mesh['dp'] of a ('pp', 'dp') mesh)"
        )
    return mesh


def _check_no_idle_dims(mesh: DeviceMesh) -> None:
    """Refuse a mesh that leaves out a dim of its root mesh other than ``"pp"`` (other
    stages): those ranks would train unsynchronised copies of the same layers."""
    idle = [(name, size) for name, size in idle_mesh_dims(mesh) if name != PIPELINE_DIM]
    if idle:
        dims = ", ".join(f"{name!r} (size {size})" for name, size in idle)
        raise ValueError(
            f"shard_model got a mesh ({mesh.mesh_dim_names or mesh}) that leaves out the "
            f"dim(s) {dims} of its device mesh {root_mesh(mesh).mesh_dim_names}: the ranks "
            "along them would each train an unsynchronised copy of the model on their own "
            "data. Pass a mesh that spans them (Lightning: ModelParallelStrategy("
            "data_parallel_size=N, tensor_parallel_size=1) and mesh=self.device_mesh"
            "['data_parallel']; tensor parallelism: mesh=world_mesh[('dp', 'tp')] with "
            "tp_plan=...). Only a 'pp' dim may be left out (pipeline stages hold other layers)."
        )
    world = dist.get_world_size()
    if root_mesh(mesh) is mesh and mesh.size() < world:
        warnings.warn(
            f"shard_model got a mesh of {mesh.size()} of the {world} ranks that is not a "
            "slice of a larger device mesh: it cannot tell whether the other ranks hold other "
            "pipeline stages or unsynchronised copies of this model. Build it as a slice of "
            "init_device_mesh(..., mesh_dim_names=('pp', 'dp')), e.g. world_mesh['dp'].",
            stacklevel=3,
        )


def _split_mesh(mesh: DeviceMesh, tp_plan: dict | None) -> tuple[DeviceMesh, DeviceMesh | None]:
    """``(data-parallel mesh, tensor-parallel mesh or None)`` of the mesh shard_model got."""
    names = mesh.mesh_dim_names
    if names is not None and "pp" in names:
        raise ValueError(
            f"shard_model got a mesh with a 'pp' dim {names}: shard each pipeline stage on "
            "its own mesh without it, e.g. world_mesh[('dp', 'tp')] (docs/parallelism.md)"
        )
    has_tp = names is not None and TENSOR_PARALLEL_DIM in names
    if tp_plan is None and has_tp:
        raise ValueError(
            f"shard_model got a mesh with a 'tp' dim {names} but no tp_plan: pass "
            "tp_plan={'module name in a block': ColwiseParallel() / RowwiseParallel(), ...}"
        )
    if tp_plan is not None and not has_tp:
        raise ValueError(
            f"tp_plan needs a mesh with a dim named 'tp', e.g. init_device_mesh(device_type, "
            f"(dp, tp), mesh_dim_names=('dp', 'tp')); got dims {names}"
        )
    if has_tp and (names[-1] != TENSOR_PARALLEL_DIM or mesh.ndim == 1):
        raise ValueError(
            f"the 'tp' dim must be the last (innermost) of a mesh with data-parallel dims "
            f"before it (of size 1 for tensor parallelism alone), got {names}"
        )
    dp_mesh = without_tensor_parallel(mesh)
    if dp_mesh.ndim not in (1, 2):
        raise ValueError(
            "shard_model shards over a 1-D data-parallel mesh (FSDP) or a 2-D one (HSDP: "
            f"replicate, shard), plus an optional 'tp' dim; got dims {names or mesh.ndim}"
        )
    if dp_mesh.ndim == 2 and dp_mesh.mesh_dim_names is None:
        raise ValueError("an HSDP mesh needs mesh_dim_names, e.g. ('replicate', 'shard')")
    return dp_mesh, (mesh[TENSOR_PARALLEL_DIM] if has_tp else None)


def _parallelize_blocks(blocks: list[nn.Module], tp_mesh: DeviceMesh, tp_plan: dict) -> None:
    """Tensor parallelism inside each block, with the int8-aware styles."""
    plan = int8_tp_plan(tp_plan)
    for block in blocks:
        names = {name for name, _ in block.named_modules()}
        missing = [key for key in plan if "*" not in key and key not in names]
        if missing:
            raise ValueError(
                f"tp_plan names {missing}, which {type(block).__name__} does not have: plan "
                "keys are module names relative to each block (e.g. 'self_attn.q_proj')"
            )
        parallelize_module(block, tp_mesh, plan)


def _mixed_precision(mp_policy: MixedPrecisionPolicy | None, config: Int8TrainingConfig) -> MixedPrecisionPolicy:
    """``mp_policy``, or the one ``config.compute_dtype`` asks for; both, disagreeing, are refused."""
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        hint = f" (MixedPrecisionPolicy(param_dtype={mp_policy}))" if isinstance(mp_policy, torch.dtype) else ""
        raise TypeError(f"mp_policy takes a MixedPrecisionPolicy or None, got {type(mp_policy).__name__} {mp_policy!r}{hint}")
    if mp_policy is None:
        if config.compute_dtype is None:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=config.compute_dtype, reduce_dtype=torch.float32)
    if config.compute_dtype is not None and mp_policy.param_dtype != config.compute_dtype:
        raise ValueError(f"config.compute_dtype is {config.compute_dtype} but mp_policy.param_dtype is "
                         f"{mp_policy.param_dtype}: set one of them")
    return mp_policy


def shard_model(
    model: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    config: Int8TrainingConfig | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    blocks: BlockSpec | None = None,
    tp_plan: dict[str, ParallelStyle] | None = None,
    offload_policy: OffloadPolicy | None = None,
) -> nn.Module:
    """Quantize ``model`` (:func:`fsdp_int8.quantize_`) and shard it with FSDP2.

    Groups (torchtitan's policy, docs/design.md): each embedding outside the blocks, each
    block, then the root with the rest (final norm, head, an embedding tied to it); the
    root and the last block are not resharded after forward (the last block is with
    ``config.reshard_early``, and a table tied to the head is after the head's backward). With ``tp_plan``, blocks are
    first split on the mesh's ``"tp"`` dim with :mod:`fsdp_int8.parallel`'s styles
    (docs/parallelism.md). It reseeds the stochastic-rounding generator from ``config.seed``
    and the rank's shard coordinate (HSDP replicas round alike). Works on the meta device
    (``model.to_empty(device=...)`` afterwards). Logs how much is int8 (INFO), warns if none.

    Args:
        model: The unsharded, plain PyTorch model.
        mesh: 1-D mesh (FSDP) or 2-D ``(replicate, shard)`` mesh with ``mesh_dim_names``
            (HSDP), plus a last dim ``"tp"`` with ``tp_plan`` (``("dp", "tp")``,
            ``("dp_replicate", "dp_shard", "tp")``). It must hold this rank; a slice of a
            larger mesh may leave out only its ``"pp"`` dim. Default: all ranks, on the
            first parameter's device type (the default accelerator, else CPU, for a meta,
            parameterless or offloaded model).
        config: Quantization config; default ``Int8TrainingConfig()``.
        mp_policy: FSDP2 mixed precision; its ``param_dtype`` is the compute dtype of the
            unsharded weights; the all-gather moves int8 regardless. Default: ``config``'s
            ``compute_dtype`` with an fp32 gradient reduction where set, else FSDP2's own.
        reshard_after_forward: ``True`` frees unsharded weights after forward (least
            memory); ``False`` keeps them until backward (no second all-gather).
        blocks: Block types or a predicate (:data:`BlockSpec`); default: discovered.
        tp_plan: Module names relative to each block (``"self_attn.q_proj"``, ``*``
            wildcards) to torch ``ParallelStyle``s, as in torchtitan's Llama plan.
        offload_policy: FSDP2's ``CPUOffloadPolicy``: shards, gradients and the optimizer
            step stay in host memory (a meta model: ``to_empty(device="cpu")``); each
            all-gather copies the int8 shard to the compute device. Default: none.

    Returns:
        ``model``, now an ``FSDPModule``. Build the optimizer afterwards (one holding the
        replaced parameters raises ``RuntimeError`` at its first ``step()``); for int8
        gradients call :func:`fsdp_int8.gradients.enable_quantized_reduce_scatter` next.

    Raises:
        TypeError: when ``config``, ``mp_policy``, ``offload_policy``, ``blocks`` or
            ``reshard_after_forward`` has the wrong type.
        ValueError: when ``reshard_after_forward`` is an int (docs/limits.md);
            ``pin_memory=True`` without an accelerator; ``compute_dtype`` differs from
            ``mp_policy.param_dtype``; the mesh lacks this rank, has a ``"pp"`` dim, leaves
            out another dim, or has ``"tp"`` missing, misplaced or unasked-for; no blocks
            are found; a block is tied outside itself; a ``tp_plan`` key names no module,
            or the tp size does not divide a split weight.
        NotImplementedError: when the parameters are DTensors without FSDP.
        RuntimeError: when the model is already sharded, or no process group exists.
    """
    config = training_config(config)
    mp_policy = _mixed_precision(mp_policy, config)
    _check_reshard_after_forward(reshard_after_forward)
    _check_unsharded(model)
    _check_offload(offload_policy)
    param = next(model.parameters(), None)
    # offloaded parameters live on the CPU whatever the compute device: the mesh's is the accelerator
    device_type = (
        param.device.type
        if param is not None and param.device.type != "meta" and not isinstance(offload_policy, CPUOffloadPolicy)
        else device_type_for()
    )
    mesh = _resolve_mesh(mesh, device_type)
    dp_mesh, tp_mesh = _split_mesh(mesh, tp_plan)
    _check_no_idle_dims(mesh)  # after _split_mesh: its errors about 'tp' are the more precise
    found = find_blocks(model, blocks)  # before quantizing: a refused model stays as it was
    if not found:
        raise ValueError(
            f"shard_model found no blocks in {type(model).__name__}: no nn.ModuleList or "
            "nn.ModuleDict of repeated modules and no _no_split_modules. Pass blocks=(MyBlock,) "
            "or a predicate."
        )
    groups = _groups_below_root(model, found)  # before quantizing, too
    original = list(model.parameters())  # FSDP2 replaces them: an optimizer holding one is refused
    quantize_(model, config)
    if tp_mesh is not None:
        _parallelize_blocks(found, tp_mesh, tp_plan)
    seed_weight_rounding(config.seed, dp_mesh)

    options = dict(mesh=dp_mesh, mp_policy=mp_policy,
                   offload_policy=offload_policy or OffloadPolicy())
    for index, group in enumerate(groups):
        keep = index == len(groups) - 1 and not config.reshard_early  # backward starts with the last block
        fully_shard(group, reshard_after_forward=reshard_after_forward and not keep, **options)
    # Backward needs the root's parameters (norm, head) first: keep them gathered.
    fully_shard(model, reshard_after_forward=False, **options)
    if config.in_place_reduce_scatter:
        enable_in_place_reduce_scatter(model)
    if config.reshard_early:
        release_tied_tables_after_head(model)
    refuse_steps_on_replaced(original, model, "shard_model")
    _report_int8(model)
    return model

