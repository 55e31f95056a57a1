"""Every precision the launcher and the benchmarks train in, named once, and the one builder.

A :class:`Precision` says what is stored, sent and multiplied in which format:

* plain FSDP2 baselines (``fully_shard``, no fsdp_int8): ``fp32``; ``bf16``, bf16
  parameters with an fp32 gradient reduction (torchtitan's default: what users run);
  ``all-bf16``, the reduction in bf16 too;
* fsdp_int8: ``int8`` (int8 weights, matmuls in the compute dtype), ``int8-mm`` (all three
  GEMMs of each linear layer in int8), ``int8-mm-wgrad-bf16`` (the weight gradient's GEMM
  in the compute dtype), ``int8-grads`` and ``int8-mm-grads`` (``int8`` and ``int8-mm``
  plus the int8 gradient reduce-scatter);
* ``torchao``: torchao's int8 weight-only training in the same FSDP2 groups (benchmarks).

How an fsdp_int8 precision runs is orthogonal to it, so it is not part of the name: its
compute dtype (``bf16``: FSDP2 mixed precision over fp32 parameters; ``fp32``;
``bf16-model``: the model itself held in bf16, gradients and their reduction too) and
whether its quantization kernels are ``torch.compile``d. A :class:`Recipe` is a precision
with those two choices. The launcher takes them as ``--precision``, ``--compute-dtype``
and ``--compile``; benchmark rows spell them ``NAME[:OPTION...]``::

    int8-mm              bf16 compute, the benchmark's default kernels
    int8-mm:eager        the same without torch.compile
    int8:fp32:compiled   weight-only int8, fp32 compute, compiled kernels
    int8:bf16-model      weight-only int8 in a bf16 model

:func:`build_model` builds and shards the launcher's Transformer for any recipe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor.parallel import parallelize_module

import fsdp_int8
from fsdp_int8 import hardware
from fsdp_int8.gradients import enable_quantized_reduce_scatter
from fsdp_int8.sharding import find_blocks
from launch import parallel
from launch.model import ModelArgs, Transformer, check_tp, tp_plan

BF16_POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


@dataclass(frozen=True)
class Precision:
    """One precision: its name (CLI and row spelling), table label, and how it is built.

    Attributes:
        name: What ``--precision`` and benchmark rows call it.
        label: What tables print.
        help: One line for ``--help`` and docs.
        family: ``"fsdp2"`` (a baseline: plain ``fully_shard`` under ``policy``),
            ``"fsdp_int8"`` (``shard_model`` with ``int8_matmul``), or ``"torchao"``.
        policy: A baseline's FSDP2 mixed precision (``None``: fp32 throughout).
        int8_matmul: Which GEMMs an fsdp_int8 precision runs in int8 (``None``: weight-only).
        int8_gradients: Replace FSDP2's gradient reduce-scatter with fsdp_int8's int8 one.
    """

    name: str
    label: str
    help: str
    family: str
    policy: MixedPrecisionPolicy | None = None
    int8_matmul: fsdp_int8.Int8MatmulConfig | None = None
    int8_gradients: bool = False

    @property
    def baseline(self) -> bool:
        """A plain FSDP2 run, what fsdp_int8 is compared with."""
        return self.family == "fsdp2"

    @property
    def int8(self) -> bool:
        """Built by fsdp_int8: the compute dtype and the compiled kernels apply."""
        return self.family == "fsdp_int8"


PRECISIONS: dict[str, Precision] = {p.name: p for p in (
    Precision("fp32", "fp32 FSDP2", "FSDP2 in fp32", "fsdp2"),
    Precision("bf16", "bf16 FSDP2", "FSDP2 with bf16 parameters and an fp32 gradient reduction "
              "(torchtitan's default)", "fsdp2", policy=BF16_POLICY),
    Precision("all-bf16", "all-bf16 FSDP2 (bf16 reduce)", "FSDP2 with bf16 parameters and a bf16 "
              "gradient reduction", "fsdp2",
              policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)),
    Precision("int8", "int8 weight-only", "int8 weights, matmuls in the compute dtype", "fsdp_int8"),
    Precision("int8-mm", "int8 matmuls", "int8 weights and int8 GEMMs for all three matmuls",
              "fsdp_int8", int8_matmul=fsdp_int8.Int8MatmulConfig()),
    Precision("int8-mm-wgrad-bf16", "int8 matmuls, float wgrad", "int8-mm with the weight gradient's "
              "GEMM in the compute dtype", "fsdp_int8",
              int8_matmul=fsdp_int8.Int8MatmulConfig(grad_weight=False)),
    Precision("int8-grads", "int8 + int8 gradients", "int8 weights and the int8 gradient reduce-scatter",
              "fsdp_int8", int8_gradients=True),
    Precision("int8-mm-grads", "int8 matmuls + int8 gradients", "int8-mm and the int8 gradient reduce-scatter",
              "fsdp_int8", int8_matmul=fsdp_int8.Int8MatmulConfig(), int8_gradients=True),
    Precision("torchao", "torchao int8 weight-only", "torchao's int8 weight-only training "
              "(pip install torchao)", "torchao"),
)}

# Weight-only int8's values with FSDP2's gathered weights kept int8: no int8 GEMM, each
# matmul and lookup dequantizes a transient copy (--int8-gathered-weights, part of --lean).
INT8_GATHERED_WEIGHTS = fsdp_int8.Int8MatmulConfig(output=False, grad_input=False, grad_weight=False)

# What the launcher's --precision offers besides "auto".
# all-bf16, int8-grads, int8-mm-grads and torchao are rows the benchmarks compare with.
LAUNCHER_PRECISIONS = ("fp32", "bf16", "int8", "int8-mm", "int8-mm-wgrad-bf16")
AUTO = "auto"

COMPUTE_DTYPES = ("bf16", "fp32", "bf16-model")  # of fsdp_int8 precisions; bf16 is the default
_COMPUTE_POLICY = {"bf16": BF16_POLICY, "fp32": None, "bf16-model": None}  # bf16-model: cast, no policy
COMPILE_OPTIONS = ("compiled", "eager")
BLOCKS_OPTION = "blocks"  # a row option: every transformer block compiled whole
COMPILE_MODES = ("auto", "on", "off", "blocks")


def compile_wanted(mode: str, dim: int) -> bool:
    """Whether ``--compile`` ``mode`` compiles fsdp_int8's quantization kernels: ``"on"``,
    or ``"auto"`` and ``"blocks"`` as the library's own ``compile="auto"`` chooses for
    layers of width ``dim``. Inside a compiled block the kernels are traced into the
    block's graph; outside it (the optimizer's write-back of each weight) they run
    compiled on their own."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"--compile is one of {', '.join(COMPILE_MODES)}, not {mode!r}")
    return mode == "on" or (mode in ("auto", "blocks") and fsdp_int8.Int8TrainingConfig().compiles(dim))


def blocks_wanted(mode: str, device_type: str, *, tp: int = 1, pp: int = 1, fp32_experts: bool = False) -> bool:
    """Whether ``--compile`` ``mode`` compiles each transformer block whole
    (``torch.compile(fullgraph=True)`` before sharding, torchtitan's per-block compile).

    ``"blocks"``: yes. ``"auto"``: on accelerators, where it is what FSDP2 users run; not
    on CPUs, where inductor's C++ build of every block shape costs each process minutes
    on a few cores, and no CPU speed-up has been measured yet (docs/performance.md). Not
    with tensor or pipeline parallelism, which are not tested compiled yet, nor for
    mixture-of-experts blocks computing in fp32 (``fp32_experts``): torch compiles
    ``torch._grouped_mm`` for bf16 operands only.
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"--compile is one of {', '.join(COMPILE_MODES)}, not {mode!r}")
    if mode == "blocks" and (tp > 1 or pp > 1):
        raise ValueError("--compile blocks is not tested with --tp or --pp yet: use --compile on "
                         "(the quantization kernels) or leave --tp / --pp at 1")
    if mode == "blocks" and fp32_experts:
        raise ValueError("--compile blocks with a mixture-of-experts preset needs bf16 compute: torch "
                         "compiles torch._grouped_mm for bf16 operands only. Use --compute-dtype bf16 "
                         "(and a bf16 or int8 --precision), or --compile on")
    return mode == "blocks" or (mode == "auto" and device_type != "cpu" and tp == 1 and pp == 1
                                and not fp32_experts)


@dataclass(frozen=True)
class Recipe:
    """A precision with its run options: what one launcher run or benchmark row trains.

    ``compute_dtype`` and ``compile`` (fsdp_int8's quantization kernels) apply to fsdp_int8
    precisions only; the others fix their own dtypes (``compute_dtype`` ``None``,
    ``compile`` ``False``). ``blocks`` (every transformer block compiled whole, before
    sharding) applies to every precision, so that a compiled run is compared with a
    compiled baseline. With both, the quantization kernels are traced into each block's
    graph and run compiled on their own outside it (the optimizer's write-back).
    """

    precision: Precision
    compute_dtype: str | None = "bf16"
    compile: bool = False
    blocks: bool = False

    def __post_init__(self) -> None:
        if self.precision.int8 and self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute dtype {self.compute_dtype!r} is not one of {', '.join(COMPUTE_DTYPES)}")
        if not self.precision.int8 and (self.compute_dtype is not None or self.compile):
            raise ValueError(f"{self.precision.name} fixes its own dtypes and kernels: it takes no options "
                             f"but {BLOCKS_OPTION}")

    @classmethod
    def of(cls, name: str, compute_dtype: str = "bf16", compile: bool = False, blocks: bool = False) -> "Recipe":
        """The recipe of precision ``name``; the options are dropped where it fixes its own."""
        precision = PRECISIONS[name]
        if not precision.int8:
            return cls(precision, None, False, blocks)
        return cls(precision, compute_dtype, compile, blocks)

    @property
    def computes_in_fp32(self) -> bool:
        """Whether its matmuls run in fp32: an fsdp_int8 precision with fp32 compute, or a
        baseline without a bf16 policy."""
        if self.precision.int8:
            return self.compute_dtype == "fp32"
        return self.precision.policy is None or self.precision.policy.param_dtype != torch.bfloat16

    @property
    def name(self) -> str:
        """The row spelling: the precision, then each option that differs from bf16 and
        compiled (``int8-mm``, ``int8:fp32:eager``)."""
        options = []
        if self.precision.int8:
            options += [self.compute_dtype] if self.compute_dtype != "bf16" else []
            options += [] if self.compile else ["eager"]
        options += [BLOCKS_OPTION] if self.blocks else []
        return ":".join([self.precision.name, *options])

    @property
    def label(self) -> str:
        """The precision's label, with the options that differ from bf16 and compiled."""
        options = self.name.split(":")[1:]
        return self.precision.label + (f" ({', '.join(options)})" if options else "")


def parse_row(text: str, *, compile: bool) -> Recipe:
    """The recipe that a benchmark row spells ``NAME[:OPTION...]``; options are a compute
    dtype (:data:`COMPUTE_DTYPES`) and ``compiled`` or ``eager``, ``compile`` the default.

    Raises:
        ValueError: an unknown name or option, or options on a precision that takes none.
    """
    name, *options = text.split(":")
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision {name!r}: one of {', '.join(PRECISIONS)}")
    compute_dtype, blocks = "bf16", False
    for option in options:
        if option in COMPUTE_DTYPES:
            compute_dtype = option
        elif option in COMPILE_OPTIONS:
            compile = option == "compiled"
        elif option == BLOCKS_OPTION:
            blocks = True
        else:
            raise ValueError(f"unknown option {option!r} in {text!r}: a compute dtype "
                             f"({', '.join(COMPUTE_DTYPES)}), {' / '.join(COMPILE_OPTIONS)} or {BLOCKS_OPTION}")
    if set(options) - {BLOCKS_OPTION} and not PRECISIONS[name].int8:
        raise ValueError(f"{text!r}: {name} fixes its own dtypes and kernels, it takes no options but {BLOCKS_OPTION}")
    return Recipe.of(name, compute_dtype, compile, blocks)


def row_argument(text: str) -> str:
    """argparse ``type=`` of benchmark ``--rows``: ``text`` if it spells a recipe."""
    import argparse

    try:
        parse_row(text, compile=True)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def resolve_auto(precision: str, compute_dtype: str, device: torch.device) -> tuple[str, str, str | None]:
    """Resolve ``auto`` in ``--precision`` and ``--compute-dtype`` from what ``device`` runs fast.

    ``auto`` precision: ``int8-mm`` with a fast int8 GEMM, else ``int8``; ``auto`` compute
    dtype (of an int8 precision): ``bf16`` with fast bf16 matmuls, else ``fp32``. Under a
    process group rank 0 decides (its check may time a kernel) and every rank takes its
    answer, so all ranks build the same model. Returns the two choices and the line that
    says what was chosen and why (``None`` if nothing was ``auto``).
    """
    needs_compute = compute_dtype == AUTO and (precision == AUTO or PRECISIONS[precision].int8)
    if precision != AUTO and not needs_compute:
        return precision, compute_dtype, None
    found = [hardware.capability(device) if not dist.is_initialized() or dist.get_rank() == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(found, src=0)
    found = found[0]
    reasons = []
    if precision == AUTO:
        precision = "int8-mm" if found.int8_gemm_fast else "int8"
        kind = "a fast" if found.int8_gemm_fast else "no fast"
        reasons.append(f"--precision {precision} ({kind} int8 GEMM: {found.int8_evidence})")
    if needs_compute:
        compute_dtype = "bf16" if found.bf16_matmul_fast else "fp32"
        kind = "a fast" if found.bf16_matmul_fast else "no fast"
        reasons.append(f"--compute-dtype {compute_dtype} ({kind} bf16 matmul: {found.bf16_evidence})")
    return precision, compute_dtype, f"auto on {found.name}: " + "; ".join(reasons)


# ---------------------------------------------------------------- the builder
def build_model(recipe: Recipe, args: ModelArgs, device: torch.device | str, *, seed: int = 0,
                replicas: int = 1, full_init: bool = False, mesh: DeviceMesh | None = None,
                stage: tuple[int, int] = (0, 1), quantize_embeddings: bool = False,
                activation_checkpointing: bool = False, int8_gathered_weights: bool = False,
                cpu_offload: bool = False, lean: bool = False) -> Transformer:
    """The launcher's Transformer of shape ``args``, sharded over all ranks for ``recipe``.

    Weights come from ``Transformer.init_weights(seed)`` (fsdp_int8's stochastic rounding
    from ``seed`` too). By default the model is built on the meta device, sharded,
    allocated on ``device`` and initialised shard by shard: no rank holds more than one
    whole parameter at a time, which large models need. ``full_init=True`` initialises the
    whole model on ``device`` first and then shards it (``torchao`` is built this way only).
    Both give every rank, layout and recipe bit for bit the single-process weights.

    Args:
        recipe: What to build (see :class:`Recipe`).
        args: The model's shape.
        device: Where the shards live (one GPU per rank, or the CPU).
        seed: Seed of the initial weights and of stochastic rounding.
        replicas: HSDP: replicate the sharded model over this many groups of ranks.
        full_init: Initialise the whole model before sharding (see above).
        mesh: The mesh to shard over (default: all ranks, ``replicas`` groups of them), from
            :func:`launch.parallel.device_mesh`. With a last ``"tp"`` dim the blocks are split
            by tensor parallelism first (:func:`launch.model.tp_plan`; fsdp_int8's int8-aware
            styles for int8 precisions, torch's own for the baselines). Under pipeline
            parallelism: this stage's mesh (:func:`launch.parallel.stage_mesh`, no ``"pp"`` dim).
        stage: ``(index, count)``: build pipeline stage ``index`` of ``count`` only
            (:meth:`launch.model.Transformer.keep_stage`; its parameters keep the whole
            model's names, so a stage's weights are the whole model's).
        quantize_embeddings: An int8 precision's token embedding is int8 too
            (``Int8TrainingConfig.quantize_embeddings``).
        activation_checkpointing: Each block recomputes its activations in backward
            (:attr:`launch.model.Transformer.checkpoint_blocks`).
        int8_gathered_weights: A weight-only int8 precision keeps FSDP2's gathered weights
            int8 and dequantizes a transient copy per matmul (``Int8MatmulConfig`` with no
            int8 GEMM): the same values, half the gathered bytes. Int8-matmul precisions
            gather int8 anyway.
        cpu_offload: FSDP2's ``CPUOffloadPolicy``: the shards, gradients and optimizer step
            live in host memory (pinned when ``device`` is an accelerator), built there.
        lean: An int8 precision is quantized and sharded with the library's lean
            configuration (``Int8TrainingConfig.lean``, in this recipe's compute dtype and
            matmuls; it implies ``quantize_embeddings``): what ``--lean`` trains.
    """
    device = torch.device(device)
    precision = recipe.precision
    if quantize_embeddings and not precision.int8:
        raise ValueError(f"quantize_embeddings needs an int8 precision, not {precision.name}")
    if (int8_gathered_weights or lean) and not precision.int8:
        raise ValueError(f"int8_gathered_weights and lean need an int8 precision, not {precision.name}")
    if cpu_offload and precision.family == "torchao":
        raise ValueError("torchao's int8 weights are not run with CPU offload: drop cpu_offload")
    offload = CPUOffloadPolicy(pin_memory=device.type != "cpu") if cpu_offload else None
    if precision.family == "torchao" and not full_init:
        raise ValueError("torchao's int8 weights are built from initialised weights: pass full_init=True")
    mesh = mesh or parallel.device_mesh(device.type, replicas=replicas)
    tensor_parallel = parallel.has_tp(mesh)
    if tensor_parallel:
        if precision.family == "torchao":
            raise ValueError("torchao's int8 weights do not run under tensor parallelism: use a tp-free mesh")
        check_tp(args, mesh["tp"].size())
    index, count = stage
    if full_init:
        with torch.device(device):
            model = Transformer(args)
        model.init_weights(seed)
    else:
        with torch.device("meta"):
            model = Transformer(args)
    if count > 1:
        model.keep_stage(index, count)
    model.checkpoint_blocks = activation_checkpointing
    if recipe.compute_dtype == "bf16-model":
        model.to(torch.bfloat16)
    if recipe.blocks:  # torchtitan's order: compile each block in place, then shard
        for block in model.blocks():
            block.compile(fullgraph=True)
    if precision.int8:
        int8_matmul = precision.int8_matmul
        if int8_matmul is None and int8_gathered_weights:
            int8_matmul = INT8_GATHERED_WEIGHTS
        fields = dict(seed=seed, compile=recipe.compile)
        if int8_matmul is not None:  # else the config's own: none, or the lean call's gathered int8
            fields["int8_matmul"] = int8_matmul
        if lean:  # the library's lean call, computing in this recipe's dtype
            config = fsdp_int8.Int8TrainingConfig.lean(
                **fields, compute_dtype=torch.bfloat16 if recipe.compute_dtype == "bf16" else None)
        else:
            config = fsdp_int8.Int8TrainingConfig(**fields, quantize_embeddings=quantize_embeddings)
        fsdp_int8.shard_model(model, mesh=mesh, config=config, mp_policy=_COMPUTE_POLICY[recipe.compute_dtype],
                              tp_plan=tp_plan() if tensor_parallel else None, offload_policy=offload)
        if precision.int8_gradients:
            enable_quantized_reduce_scatter(model, seed=seed)
    else:
        if precision.family == "torchao":
            from torchao.prototype.quantized_training import int8_weight_only_quantized_training
            from torchao.quantization import quantize_

            quantize_(model, int8_weight_only_quantized_training())
        _fully_shard(model, mesh, precision.policy, offload)
    if not full_init:
        model.to_empty(device="cpu" if cpu_offload else device)  # FSDP2 offloads shards that are on the host
        model.init_weights(seed)  # each rank's piece of the whole model's init (any mesh, any device)
    return model


def _fully_shard(model: Transformer, mesh: DeviceMesh, policy: MixedPrecisionPolicy | None,
                 offload: CPUOffloadPolicy | None = None) -> None:
    """Plain FSDP2 in the groups ``shard_model`` makes, found by its own
    ``fsdp_int8.sharding.find_blocks``: each embedding outside the blocks and not tied to
    another module, each block, then the root (the rest), so a baseline gathers and
    reduces what an fsdp_int8 run does. The last group and the root stay gathered after
    forward: backward needs them first. A mesh with a ``"tp"`` dim splits each block with
    torch's styles first, as shard_model does."""
    blocks = find_blocks(model)
    if parallel.has_tp(mesh):
        for block in blocks:
            parallelize_module(block, mesh["tp"], tp_plan())
    in_blocks = {id(m) for block in blocks for m in block.modules()}
    elsewhere = {id(p) for m in model.modules() if not isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    embeddings = [m for m in model.modules()
                  if isinstance(m, nn.Embedding) and id(m) not in in_blocks and id(m.weight) not in elsewhere]
    groups = [*embeddings, *blocks]
    options = dict(mesh=parallel.dp_mesh(mesh), mp_policy=policy or MixedPrecisionPolicy(),
                   offload_policy=offload or OffloadPolicy())
    for index, group in enumerate(groups):
        fully_shard(group, reshard_after_forward=index < len(groups) - 1, **options)
    fully_shard(model, reshard_after_forward=False, **options)
