"""The configurations of int8 training: which layers are int8 and how they round and are
sharded (``Int8TrainingConfig``), and which matmuls run as int8 GEMMs (``Int8MatmulConfig``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
import torch.nn as nn

from fsdp_int8._dist import device_type_for
from fsdp_int8._quant.kernels import compiler_available
from fsdp_int8._moe.layout import (  # noqa: F401 (re-exported: the rule's vocabulary)
    counts_experts, expert_count, expert_features, expert_weight_names, router_modules, stores_experts_transposed,
    transposed_expert_weights,
)

AUTO, ON, OFF = "auto", "on", "off"
COMPILE_CHOICES = (AUTO, ON, OFF)  # also the launcher's --compile and the benchmark rows' compile=
# compile="auto" compiles from this row length: narrower kernels do not repay the start-up
COMPILE_FROM_WIDTH = 512

__all__ = ["Int8TrainingConfig", "Int8MatmulConfig", "ModuleFilter"]

#: The type of ``Int8TrainingConfig.module_filter``: ``module_filter(module, qualified_name)``
#: returns ``True`` for each offered module (``nn.Linear``, GPT-2 ``Conv1D``, experts module,
#: with ``quantize_embeddings`` ``nn.Embedding``) that gets an int8 weight.
ModuleFilter = Callable[[nn.Module, str], bool]


@dataclass(frozen=True)
class Int8MatmulConfig:
    """Which of a linear layer's three matmuls run as int8 x int8 -> int32 GEMMs.

    The GEMMs are ``torch._int_mm``. Activations and gradients are quantized per row on the
    fly (per channel for ``grad_weight``), rounding to nearest, compiled or not as
    ``Int8TrainingConfig.compile`` says; the weight's stored int8 values are used as they
    are, never dequantized. Each :class:`fsdp_int8.weight.Int8Weight` carries its config
    (``w.int8_matmul``). Give it as ``Int8TrainingConfig(int8_matmul=Int8MatmulConfig())``.

    Attributes:
        output: ``y = x W^T`` (forward).
        grad_input: ``grad_x = grad_y W`` (backward).
        grad_weight: ``grad_W = grad_y^T x`` (backward), both operands quantized per
            channel over the tokens. On by default, as in torchao (its quality:
            docs/performance.md); off keeps the weight gradient, a sum over every token, in
            the compute dtype.
        save_int8_input: Keep the forward's int8 input (its int8 rows and one fp32 scale
            per token) for the weight gradient, instead of the input in the compute
            dtype: about half the saved bytes of a bf16 input. Layers that read the same
            input (q / k / v, gate / up) share one copy. The weight gradient folds the
            per-token scales into grad_y, so the input carries no rounding beyond the
            forward's; the output and ``grad_input`` are the same bit for bit. Needs
            ``output`` and ``grad_weight``. Off by default (docs/memory.md).

    On CUDA, an int8 GEMM needs in and out features divisible by 8 (``ValueError`` at the
    layer's first forward otherwise). On a device without a fast int8 GEMM
    (docs/performance.md, "Which kernels are fast where"; :func:`fsdp_int8.hardware.capability`)
    the first forward with one warns once per process (``UserWarning`` starting
    ``fsdp_int8:``) and runs as configured: weight-only int8 is faster there.

    Raises:
        ValueError: when all three GEMMs are off (to keep FSDP2's gathered weights int8
            without any int8 GEMM, set ``Int8TrainingConfig(int8_gathered_weights=True)``
            instead), or ``save_int8_input`` is on without ``output`` and ``grad_weight``.
    """

    output: bool = True
    grad_input: bool = True
    grad_weight: bool = True
    save_int8_input: bool = False

    def __post_init__(self) -> None:
        if not (self.output or self.grad_input or self.grad_weight):
            raise ValueError(
                "Int8MatmulConfig(output=False, grad_input=False, grad_weight=False) runs no matmul in "
                "int8. To keep FSDP2's gathered weights int8 without int8 GEMMs, use "
                "Int8TrainingConfig(int8_gathered_weights=True) (int8_matmul=None); for weight-only int8, "
                "int8_matmul=None alone"
            )
        if self.save_int8_input and not (self.output and self.grad_weight):
            raise ValueError(
                "Int8MatmulConfig(save_int8_input=True) keeps the output GEMM's int8 input for the "
                "weight gradient's int8 GEMM: it needs output=True and grad_weight=True"
            )


# Quantized layers keep their Int8MatmulConfig (in their weights and load hooks): a whole
# model saved with torch.save loads under torch.load(weights_only=True) with it allow-listed
# (plain data: three bools).
torch.serialization.add_safe_globals([Int8MatmulConfig])


def __getattr__(name: str) -> Any:
    if name == "INT8_GATHERED_WEIGHTS":  # the earlier spelling of int8_gathered_weights
        raise AttributeError("fsdp_int8.config.INT8_GATHERED_WEIGHTS is no longer a matmul config: keeping "
                             "FSDP2's gathered weights int8 is Int8TrainingConfig(int8_gathered_weights=True)")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The lean recipe's loss chunks: about 12 x 64 x vocabulary bytes of fp32 logits and their
# gradient (100 MB at Llama 3's vocabulary; 6.3 GB for 4,096 tokens in transformers' loss).
LEAN_LOSS_CHUNK_TOKENS = 64


@dataclass(frozen=True)
class Int8TrainingConfig:
    """Every switch of int8 training, read by ``quantize_`` and ``shard_model``.

    :func:`fsdp_int8.quantize_`, :func:`fsdp_int8.shard_model` and the torchtitan converter
    read from it which layers get an int8 weight, how optimizer updates round back into
    int8, how the stochastic-rounding generator is seeded, which matmuls run as int8 GEMMs
    and whether the quantization kernels are compiled. Frozen: derive a variant with
    ``dataclasses.replace(config, seed=1)``. :meth:`lean` is the lean-memory recipe.

    Attributes:
        stochastic_rounding: Write optimizer updates back with stochastic rounding
            (unbiased, so updates smaller than one int8 step survive on average).
            ``False`` rounds to nearest: deterministic, for debugging and exact parity
            tests. Initialisation and loading always round to nearest.
        seed: Seed of the stochastic-rounding generator. Each shard rank mixes in its
            shard index, so shards draw different noise while replicas (HSDP, or DDP
            around an unsharded model) draw the same and stay bit-identical.
        module_filter: ``module_filter(module, qualified_name) -> bool`` (:data:`ModuleFilter`)
            decides which offered modules are quantized, replacing the default rule
            (``skip_names``, ``min_features``) entirely. Offered: ``nn.Linear``,
            transformers' ``Conv1D`` (GPT-2; ``nx`` in and ``nf`` out features, not
            ``in_features`` / ``out_features``), mixture-of-experts modules and, with
            ``quantize_embeddings``, ``nn.Embedding``. PEFT adapter layers (LoRA's
            ``lora_A`` / ``lora_B``) are never offered. ``None``: :meth:`selects_by_default`.
        skip_names: Last name components that stay in full precision (output heads,
            whose error is the most visible in the loss).
        min_features: Smaller layers stay in full precision: a row of K weights
            carries a 4-byte scale, so tiny rows save little and lose precision. For a
            ``Conv1D`` it is compared with ``nx`` and ``nf``.
        int8_matmul: Run the linear layers' matmuls as int8 GEMMs (see
            :class:`Int8MatmulConfig`); ``None`` (default) keeps weight-only int8, whose
            matmuls run in the compute dtype.
        int8_gathered_weights: Weight-only layers keep FSDP2's all-gathered (unsharded)
            weights as int8 rows and scales, and each matmul and lookup dequantizes a
            transient copy in the compute dtype: weight-only int8's values bit for bit
            with half the gathered bytes (docs/memory.md). Layers with int8 matmuls gather
            int8 anyway. Off by default; the lean recipe turns it on.
        compile: Run the quantization kernels of this model's int8 weights (optimizer
            updates, dequantization, the int8 matmuls' activation quantization) as
            ``torch.compile``d passes, one fused pass instead of five to ten, with the same
            results bit for bit; each compiles once per process and dtype
            (docs/performance.md). ``"auto"`` (default): on for a layer whose rows hold
            at least 512 inputs, on a machine with a compiler for its device (a C++ compiler for the CPU, Triton for GPUs),
            off elsewhere (:meth:`compiles`); if compiling then fails, the kernels run
            eagerly from then on, logged (INFO), with no warning. ``"on"``: on for every
            layer, and a failure warns once (``RuntimeWarning``) before going eager.
            ``"off"``: eager kernels. Each weight carries the resolved choice
            (``w.compiled``); meta and empty tensors run eagerly.
        quantize_embeddings: Also make ``nn.Embedding`` weights int8 (one scale per token
            row); a lookup dequantizes only the rows it reads. An output head tied to the
            embedding follows it onto the int8 weight (with ``int8_matmul``'s GEMMs when set).
            Without ``module_filter``, an embedding is selected when its ``embedding_dim``
            is at least ``min_features``. Embeddings with ``max_norm`` (it renormalises
            rows in place) or ``sparse`` gradients stay in full precision, with a warning.
            Off by default (docs/memory.md: what it saves, and its quality).
        compute_dtype: The dtype the unsharded weights compute in under
            :func:`fsdp_int8.shard_model` when it is given no ``mp_policy``: FSDP2 mixed
            precision with this ``param_dtype`` and an fp32 gradient reduction
            (torchtitan's default with ``torch.bfloat16``). ``None`` (default): FSDP2's
            own default, the parameters' dtype. With an ``mp_policy`` of another
            ``param_dtype``, ``shard_model`` raises ``ValueError``. A framework that sets
            its own mixed precision (accelerate, Lightning, torchtitan) decides there.
        in_place_reduce_scatter: :func:`fsdp_int8.shard_model` installs
            :class:`fsdp_int8.gradients.InPlaceReduceScatter` on every FSDP module: on gloo
            (CPUs) the gradient reduce-scatter sums each rank's chunk in place instead of
            all-reducing a copy of its whole input; the same fp32 sums. Other backends keep
            FSDP2's own. Off by default (docs/memory.md, "Gloo's reduce-scatter copy").
        loss_chunk_tokens: A transformers causal LM that :func:`fsdp_int8.quantize_` (or
            ``shard_model``) quantizes computes its loss with
            :func:`fsdp_int8.integrations.hf_loss.chunked_causal_lm_loss`, this many tokens
            at a time (``model.loss_function``): the same loss without the batch's fp32
            logits. Other losses, and a model's own ``loss_function``, stay. ``None``
            (default): transformers' loss.
        reshard_early: :func:`fsdp_int8.shard_model` frees gathered weights as soon as
            nothing reads them: the last block's after forward too (gathered again at the
            start of backward: one more all-gather of one block per step), and an int8
            table tied to the output head after the head's last backward (the lookup's
            backward reads no weight). Assumes the table is read only by its lookup and
            the head. The same values; off by default, on in the lean recipe.

    Experts modules (:func:`counts_experts`, 3-D weights ``[E, out, in]`` or ``[E, in,
    out]``; DBRX's 2-D ones) get one scale per expert and output feature; routers stay in full precision
    (docs/moe.md, "What becomes int8").

    The int8 gradient reduce-scatter is not a field: it replaces the communication of an
    already sharded model (:func:`fsdp_int8.gradients.enable_quantized_reduce_scatter`).

    Raises:
        TypeError: when a field has the wrong type (``seed`` not an int,
            ``int8_matmul=True``, ``compile="yes"``, a ``module_filter`` that is not
            callable, ...; ``compile=True`` names the word to use, ``"on"``), or for an
            unknown keyword. ``quantize_`` and ``shard_model`` refuse a ``config`` that is
            not an ``Int8TrainingConfig`` (an ``Int8MatmulConfig`` goes inside it).
        ValueError: when ``min_features < 1``.

    Example:
        All three matmuls in int8, compiled kernels for every layer, only the attention
        projections::

            config = Int8TrainingConfig(
                int8_matmul=Int8MatmulConfig(), compile="on",
                module_filter=lambda module, name: "attn" in name)
    """

    stochastic_rounding: bool = True
    seed: int = 0
    module_filter: ModuleFilter | None = None
    skip_names: tuple[str, ...] = ("lm_head", "output", "head")
    min_features: int = 16
    int8_matmul: Int8MatmulConfig | None = None
    int8_gathered_weights: bool = False
    compile: Literal["auto", "on", "off"] = AUTO
    quantize_embeddings: bool = False
    compute_dtype: torch.dtype | None = None
    in_place_reduce_scatter: bool = False
    loss_chunk_tokens: int | None = None
    reshard_early: bool = False

    @classmethod
    def lean(cls, **changes: Any) -> "Int8TrainingConfig":
        """The lean-memory recipe's configuration (docs/memory.md, "The lean call").

        A new config with ``quantize_embeddings=True`` (a tied head follows),
        ``int8_gathered_weights=True``, ``compute_dtype=torch.bfloat16``,
        ``in_place_reduce_scatter=True``, ``loss_chunk_tokens=64`` and
        ``reshard_early=True``; ``changes`` set fields instead. Train it with
        :meth:`fsdp_int8.Int8AdamW.lean` (8-bit states, the step inside backward).
        """
        recipe = dict(quantize_embeddings=True, int8_gathered_weights=True, compute_dtype=torch.bfloat16,
                      in_place_reduce_scatter=True, loss_chunk_tokens=LEAN_LOSS_CHUNK_TOKENS, reshard_early=True)
        return cls(**{**recipe, **changes})

    def __post_init__(self) -> None:
        if isinstance(self.min_features, bool) or not isinstance(self.min_features, int):
            raise TypeError(f"min_features takes an int (the fewest in and out features a quantized layer "
                            f"has), got {type(self.min_features).__name__} {self.min_features!r}")
        if self.min_features < 1:
            raise ValueError(f"min_features must be >= 1, got {self.min_features}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__}")
        if self.int8_matmul is not None and not isinstance(self.int8_matmul, Int8MatmulConfig):
            raise TypeError(
                f"int8_matmul takes an Int8MatmulConfig or None, got {self.int8_matmul!r}: "
                "Int8TrainingConfig(int8_matmul=Int8MatmulConfig()) runs all three matmuls in int8")
        if isinstance(self.compile, bool):
            raise TypeError(f"compile takes {AUTO!r}, {ON!r} or {OFF!r}, not a bool: use "
                            f"compile={ON if self.compile else OFF!r} instead of compile={self.compile}")
        if not isinstance(self.compile, str) or self.compile not in COMPILE_CHOICES:
            raise TypeError(f"compile takes {AUTO!r}, {ON!r} or {OFF!r}, got {self.compile!r}")
        if self.module_filter is not None and not callable(self.module_filter):
            raise TypeError(f"module_filter takes a callable (module, name) -> bool, got {self.module_filter!r}")
        for name in ("stochastic_rounding", "int8_gathered_weights", "quantize_embeddings", "in_place_reduce_scatter",
                     "reshard_early"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} takes a bool, got {getattr(self, name)!r}")
        chunk = self.loss_chunk_tokens
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise TypeError(f"loss_chunk_tokens takes a positive int or None, got {chunk!r}")
        if self.compute_dtype is not None and not (
                isinstance(self.compute_dtype, torch.dtype) and self.compute_dtype.is_floating_point):
            raise TypeError(f"compute_dtype takes a floating torch.dtype or None, got {self.compute_dtype!r}")

    def compiles(self, row_len: int) -> bool:
        """Whether a layer whose rows hold ``row_len`` inputs runs compiled kernels:
        ``compile == "on"``, or with ``"auto"`` at least 512 inputs and a compiler for the
        training device."""
        if self.compile != AUTO:
            return self.compile == ON
        return row_len >= COMPILE_FROM_WIDTH and compiler_available(device_type_for())

    def should_quantize(self, module: nn.Module, name: str, *, router: bool = False) -> bool:
        """Whether ``module`` (found at ``name`` in the model) gets an int8 weight.

        The one rule, asked by ``quantize_``, ``shard_model``, the transformers quantizer
        and the torchtitan converter (``quantize_`` skips PEFT adapter layers before
        asking): ``False`` for anything but an ``nn.Linear``, a GPT-2 ``Conv1D``, a
        mixture-of-experts module or (with ``quantize_embeddings``) an ``nn.Embedding``;
        else ``module_filter(module, name)`` when it is set; else ``False`` for a
        ``router``; else :meth:`selects_by_default`.

        Args:
            module: The candidate module.
            name: Its qualified name in the model.
            router: It is a MoE router (the rule: docs/moe.md, "What becomes int8").
        """
        if router and self.module_filter is None:
            return False
        if isinstance(module, nn.Embedding):
            if not self.quantize_embeddings:
                return False
        elif linear_features(module) is None and not expert_weight_names(module):
            return False
        if self.module_filter is not None:
            return bool(self.module_filter(module, name))
        return self.selects_by_default(module, name)

    def selects_by_default(self, module: nn.Module, name: str) -> bool:
        """The rule without ``module_filter``: a linear layer (a ``Conv1D``: ``nx`` and
        ``nf``), or a mixture-of-experts module, whose last name component is not in
        ``skip_names`` and whose input and output features are both at least
        ``min_features`` (for experts: those of every expert weight); with
        ``quantize_embeddings``, an embedding whose rows hold at least ``min_features``
        values."""
        if isinstance(module, nn.Embedding):
            return self.quantize_embeddings and module.embedding_dim >= self.min_features
        if name.rsplit(".", 1)[-1] in self.skip_names:
            return False
        experts = expert_weight_names(module)
        if experts:
            return all(min(expert_features(module, name)) >= self.min_features for name in experts)
        features = linear_features(module)
        return features is not None and min(features) >= self.min_features


def training_config(config: Any) -> Int8TrainingConfig:
    """``config``, or the default for ``None``; anything else is refused naming the fix."""
    if config is None:
        return Int8TrainingConfig()
    if not isinstance(config, Int8TrainingConfig):
        hint = (" (an Int8MatmulConfig goes inside: Int8TrainingConfig(int8_matmul=Int8MatmulConfig()))"
                if isinstance(config, Int8MatmulConfig) else "")
        raise TypeError(f"config takes an Int8TrainingConfig, got {type(config).__name__}{hint}")
    return config


def is_conv1d(module: nn.Module) -> bool:
    """A ``transformers.pytorch_utils.Conv1D`` (GPT-2's linears: weight ``[nx, nf]``),
    recognised by name and attributes, so that ``fsdp_int8`` never imports transformers."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def linear_features(module: nn.Module) -> tuple[int, int] | None:
    """``(in_features, out_features)`` of a layer :meth:`Int8TrainingConfig.should_quantize`
    can select (``nn.Linear``, or GPT-2's ``Conv1D``: ``nx`` in, ``nf`` out); ``None`` for
    any other module."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if is_conv1d(module):
        return module.nx, module.nf
    return None
