"""Every precision the launcher and the benchmarks train in, named once: the registry.

A :class:`Precision` says what is stored, sent and multiplied in which format:

* plain FSDP2 baselines (``fully_shard``, no fsdp_int8): ``fp32``; ``bf16``, bf16
  parameters with an fp32 gradient reduction (torchtitan's default: what users run);
  ``all-bf16``, the reduction in bf16 too;
* fsdp_int8: ``int8`` (int8 weights, matmuls in the compute dtype), ``int8-mm`` (all three
  GEMMs of each linear layer in int8), ``int8-mm-wgrad-bf16`` (the weight gradient's GEMM
  in the compute dtype), ``int8-grads`` and ``int8-mm-grads`` (``int8`` and ``int8-mm``
  plus the int8 gradient reduce-scatter);
* ``torchao``: torchao's int8 weight-only training in the same FSDP2 groups (benchmarks).

How a precision runs is orthogonal to it, so it is not part of the name. A
:class:`Recipe` is a precision with three choices: an fsdp_int8 precision's compute dtype
(``bf16``: FSDP2 mixed precision over fp32 parameters; ``fp32``; ``bf16-model``: the model
itself held in bf16, gradients and their reduction too) and whether its quantization
kernels are ``torch.compile``d (``Int8TrainingConfig.compile``: ``auto``, ``on`` or
``off``), and, for every precision, whether each transformer block is compiled whole
(``blocks``). The launcher takes them as ``--precision``, ``--compute-dtype``,
``--compile auto|on|off`` and ``--compile-blocks``; benchmark rows spell them
``NAME[:OPTION...]``, with the same words::

    int8-mm                  bf16 compute, compiled kernels (compile=on: the rows' default)
    int8-mm:compile=off      the same with eager kernels (--compile off)
    int8:fp32:compile=auto   weight-only int8, fp32 compute, the library's compile="auto"
    int8:bf16-model          weight-only int8 in a bf16 model
    bf16:blocks              bf16 FSDP2, every transformer block compiled whole (--compile-blocks)

:mod:`launch.build` builds and shards the launcher's Transformer for any recipe.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import fsdp_int8
from fsdp_int8.config import COMPILE_CHOICES, OFF, ON

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

# What the launcher's --precision offers besides "auto".
# all-bf16, int8-grads, int8-mm-grads and torchao are rows the benchmarks compare with.
LAUNCHER_PRECISIONS = ("fp32", "bf16", "int8", "int8-mm", "int8-mm-wgrad-bf16")

COMPUTE_DTYPES = ("bf16", "fp32", "bf16-model")  # of fsdp_int8 precisions; bf16 is the default
COMPILE_OPTION = "compile"  # a row option, compile=auto|on|off: Int8TrainingConfig.compile
BLOCKS_OPTION = "blocks"  # a row option: every transformer block compiled whole
# row options that are spelled otherwise, and their spelling
RESPELLED_OPTIONS = {"compiled": f"{COMPILE_OPTION}={ON}", "eager": f"{COMPILE_OPTION}={OFF}"}


@dataclass(frozen=True)
class Recipe:
    """A precision with its run options: what one launcher run or benchmark row trains.

    ``compute_dtype`` and ``compile`` (fsdp_int8's quantization kernels: ``"auto"``,
    ``"on"`` or ``"off"``, the values of ``Int8TrainingConfig.compile``) apply to fsdp_int8
    precisions only; the others fix their own dtypes (``compute_dtype`` ``None``,
    ``compile`` ``"off"``). ``blocks`` (every transformer block compiled whole, before
    sharding) applies to every precision, so that a compiled run is compared with a
    compiled baseline. With both, the quantization kernels are traced into each block's
    graph and run compiled on their own outside it (the optimizer's write-back).
    """

    precision: Precision
    compute_dtype: str | None = "bf16"
    compile: str = OFF
    blocks: bool = False

    def __post_init__(self) -> None:
        fsdp_int8.Int8TrainingConfig(compile=self.compile)  # the library's check of the word, and its message
        if self.precision.int8 and self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute dtype {self.compute_dtype!r} is not one of {', '.join(COMPUTE_DTYPES)}")
        if not self.precision.int8 and (self.compute_dtype is not None or self.compile != OFF):
            raise ValueError(f"{self.precision.name} fixes its own dtypes and kernels: it takes no options "
                             f"but {BLOCKS_OPTION}")

    @classmethod
    def of(cls, name: str, compute_dtype: str = "bf16", compile: str = OFF, blocks: bool = False) -> "Recipe":
        """The recipe of precision ``name``; the options are dropped where it fixes its own."""
        precision = PRECISIONS[name]
        if not precision.int8:
            return cls(precision, None, OFF, blocks)
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
        ``compile=on`` (``int8-mm``, ``int8:fp32:compile=off``)."""
        options = []
        if self.precision.int8:
            options += [self.compute_dtype] if self.compute_dtype != "bf16" else []
            options += [] if self.compile == ON else [f"{COMPILE_OPTION}={self.compile}"]
        options += [BLOCKS_OPTION] if self.blocks else []
        return ":".join([self.precision.name, *options])

    @property
    def label(self) -> str:
        """The precision's label, with the options that differ from bf16 and ``compile=on``."""
        options = self.name.split(":")[1:]
        return self.precision.label + (f" ({', '.join(options)})" if options else "")


def resolve_compile(choice: str, dim: int) -> str:
    """Compile word ``choice`` for a model of width ``dim``: ``"on"`` or ``"off"``; ``"auto"``
    is the library's own rule (``Int8TrainingConfig.compiles``) applied to ``dim`` for every
    layer, so that a run can say before its first step whether it compiles (the launcher's
    ``--compile``, the benchmarks' rows at the launcher's default)."""
    return ON if fsdp_int8.Int8TrainingConfig(compile=choice).compiles(dim) else OFF


def parse_row(text: str, *, compile: str = ON) -> Recipe:
    """The recipe that a benchmark row spells ``NAME[:OPTION...]``; options are a compute
    dtype (:data:`COMPUTE_DTYPES`), ``compile=auto``, ``compile=on`` or ``compile=off``,
    and ``blocks``. ``compile`` is the kernels' choice of a row that spells none.

    Raises:
        ValueError: an unknown name or option (``compiled`` and ``eager`` say their
            spelling, ``compile=on`` and ``compile=off``), or options on a precision that
            takes none.
    """
    name, *options = text.split(":")
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision {name!r}: one of {', '.join(PRECISIONS)}")
    compute_dtype, blocks = "bf16", False
    compile_words = [f"{COMPILE_OPTION}={word}" for word in COMPILE_CHOICES]
    for option in options:
        if option in COMPUTE_DTYPES:
            compute_dtype = option
        elif option in compile_words:
            compile = option.split("=", 1)[1]
        elif option == BLOCKS_OPTION:
            blocks = True
        elif option in RESPELLED_OPTIONS:
            respelled = ":".join(RESPELLED_OPTIONS.get(part, part) for part in text.split(":"))
            raise ValueError(f"row option {option!r} is spelled {RESPELLED_OPTIONS[option]} (the words of --compile "
                             f"and Int8TrainingConfig.compile): {respelled} instead of {text}")
        else:
            raise ValueError(f"unknown option {option!r} in {text!r}: a compute dtype "
                             f"({', '.join(COMPUTE_DTYPES)}), {' / '.join(compile_words)} or {BLOCKS_OPTION}")
    if set(options) - {BLOCKS_OPTION} and not PRECISIONS[name].int8:
        raise ValueError(f"{text!r}: {name} fixes its own dtypes and kernels, it takes no options but {BLOCKS_OPTION}")
    return Recipe.of(name, compute_dtype, compile, blocks)


def row_argument(text: str) -> str:
    """argparse ``type=`` of benchmark ``--rows``: ``text`` if it spells a recipe."""
    try:
        parse_row(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text
