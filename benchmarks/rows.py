"""Every row the timing benchmarks train, built in one place: the row registry.

A row is a model, sharded over all ranks, with its optimizer. Its name is one of

* the library's own calls, written as a user writes them:

  * ``default``: ``shard_model(model, config=Int8TrainingConfig(int8_matmul=Int8MatmulConfig()),
    mp_policy=MixedPrecisionPolicy(bf16 params, fp32 reduce))`` with no compile flag (the
    library's ``compile="auto"``: compiled kernels for layers of 512 inputs or more where
    a compiler exists), trained with fused ``torch.optim.AdamW``;
  * ``lean``: ``shard_model(model, config=Int8TrainingConfig.lean())`` trained with
    ``Int8AdamW.lean`` (8-bit states, the step inside backward, clipping at 1.0 there);

* or a recipe of :mod:`launch.precisions`, ``NAME[:OPTION...]`` (``bf16``: bf16 FSDP2 with
  bf16 parameters and an fp32 gradient reduction, the baseline; ``int8-mm``,
  ``int8:fp32:compile=off``, ``bf16:blocks``, ...), built by :func:`launch.build.build_model`
  in the same FSDP2 groups as ``shard_model``'s and trained with fused ``torch.optim.AdamW``
  (torch's default AdamW for ``torchao``, whose weights the fused kernel does not take).

Every row starts from the same weights (the launcher's ``Transformer.init_weights(0)``,
initialised whole, then sharded) and any row can take another optimizer of
:data:`OPTIMIZERS` (``compare`` trains every row with torch's default AdamW).

``model="hf-llama"`` builds every row on a Hugging Face ``LlamaForCausalLM`` of the same
shape instead (:func:`hf_llama`: transformers' own attention, ``rotate_half`` rotary
embedding, RMSNorm and SwiGLU; weights from seed 0), sharded in the same groups.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import fsdp_int8
from fsdp_int8.config import ON
from fsdp_int8.hardware import device_type_for
from fsdp_int8.sharding import find_blocks
from launch.build import build_model
from launch.model import ModelArgs, Transformer
from launch.precisions import BF16_POLICY, parse_row

EIGHT_BIT_BLOCK = 128  # values per scale of the 8-bit Adam states of "8-bit AdamW"

# name -> what builds it from (parameters, lr, weight decay)
OPTIMIZERS: dict[str, Callable[[Iterable, float, float], torch.optim.Optimizer]] = {
    "torch AdamW": lambda p, lr, wd: torch.optim.AdamW(p, lr=lr, weight_decay=wd),
    "AdamW for-loop": lambda p, lr, wd: torch.optim.AdamW(p, lr=lr, weight_decay=wd, foreach=False),
    "AdamW foreach": lambda p, lr, wd: torch.optim.AdamW(p, lr=lr, weight_decay=wd, foreach=True),
    "fused AdamW": lambda p, lr, wd: torch.optim.AdamW(p, lr=lr, weight_decay=wd, fused=True),
    "Int8AdamW": lambda p, lr, wd: fsdp_int8.Int8AdamW(p, lr=lr, weight_decay=wd),
    "8-bit AdamW": lambda p, lr, wd: fsdp_int8.Int8AdamW(p, lr=lr, weight_decay=wd, state_bits=8,
                                                         block_size=EIGHT_BIT_BLOCK),
    "Int8AdamW.lean": lambda p, lr, wd: fsdp_int8.Int8AdamW.lean(p, lr=lr, weight_decay=wd),
}
# optimizers that clip inside backward (max_grad_norm): the train step must not clip again
CLIPS_ITSELF = ("Int8AdamW.lean",)

LIBRARY_ROWS = {
    "default": ("fsdp_int8 default call", "fused AdamW"),
    "lean": ("fsdp_int8 lean call", "Int8AdamW.lean"),
}


@dataclass(frozen=True)
class Row:
    """One row: its name, what tables print, its optimizer (a key of :data:`OPTIMIZERS`)
    and whether a recipe's fsdp_int8 kernels are compiled (``compile``: ``"auto"``, ``"on"``
    or ``"off"``, unless its own ``compile=`` option says; library calls decide for themselves)."""

    name: str
    label: str
    optimizer: str
    compile: str = ON

    @property
    def clip(self) -> bool:
        """Whether the train step clips gradients (not where the optimizer clips inside backward)."""
        return self.optimizer not in CLIPS_ITSELF

    @property
    def library_call(self) -> bool:
        return self.name in LIBRARY_ROWS


def row(name: str, *, compile: str = ON, optimizer: str | None = None) -> Row:
    """The row ``name`` (a library call or a recipe; a recipe's fsdp_int8 kernels as
    ``compile`` says, ``Int8TrainingConfig.compile``'s word, unless its own ``compile=``
    option says), with ``optimizer`` instead of its own.

    Raises:
        ValueError: an unknown row, option or optimizer.
    """
    if optimizer is not None and optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}: one of {', '.join(OPTIMIZERS)}")
    if name in LIBRARY_ROWS:
        label, own = LIBRARY_ROWS[name]
        return Row(name, label, optimizer or own, compile)
    try:
        recipe = parse_row(name, compile=compile)
    except ValueError as error:
        raise ValueError(f"{error}; or a library call: {', '.join(LIBRARY_ROWS)}") from None
    own = "torch AdamW" if recipe.precision.family == "torchao" else "fused AdamW"
    return Row(name, recipe.label, optimizer or own, compile)


def row_argument(text: str) -> str:
    """argparse ``type=`` of a benchmark's ``--rows``: ``text`` if it names a row."""
    try:
        row(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


LAUNCHER, HF_LLAMA = "launcher", "hf-llama"
MODELS = (LAUNCHER, HF_LLAMA)  # what build's model= takes


class HfLogits(nn.Module):
    """A transformers causal LM called as the launcher's Transformer is: token ids in,
    logits out (no cache)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=tokens, use_cache=False).logits


def hf_llama(args: ModelArgs) -> HfLogits:
    """A Hugging Face ``LlamaForCausalLM`` of the launcher's shape ``args`` (dim, blocks,
    heads, feed-forward width, vocabulary, norm epsilon, RoPE base; untied head, SDPA
    attention), initialised by transformers from seed 0, on the current default device."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.hidden_dim,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads, num_key_value_heads=args.n_heads,
        max_position_embeddings=args.max_seq_len, rms_norm_eps=args.norm_eps, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta}, use_cache=False,
        attn_implementation="sdpa")
    torch.manual_seed(0)
    return HfLogits(transformers.LlamaForCausalLM(config))


def _shard_hf(which: Row, model: HfLogits) -> None:
    """Row ``which`` applied to a Hugging Face Llama: a library call or an fsdp_int8 recipe
    through ``shard_model``, a baseline through plain ``fully_shard`` in ``shard_model``'s
    groups (the token embedding, each block, then the root); ``:blocks`` compiles each
    decoder layer first."""
    if which.library_call:
        _shard_library_call(which, model)
        return
    recipe = parse_row(which.name, compile=which.compile)
    precision = recipe.precision
    if precision.family == "torchao" or precision.int8_gradients or recipe.compute_dtype == "bf16-model":
        raise ValueError(f"row {which.name!r} is not built on the Hugging Face Llama: bf16 or fp32 FSDP2 and "
                         "int8 / int8-mm recipes (bf16 or fp32 compute) are")
    if recipe.blocks:  # torchtitan's order: compile each block in place, then shard
        for block in find_blocks(model):
            block.compile(fullgraph=True)
    if precision.int8:
        fields = dict(seed=0, compile=recipe.compile)
        if precision.int8_matmul is not None:
            fields["int8_matmul"] = precision.int8_matmul
        fsdp_int8.shard_model(model, config=fsdp_int8.Int8TrainingConfig(**fields),
                              mp_policy=BF16_POLICY if recipe.compute_dtype == "bf16" else None)
        return
    blocks = find_blocks(model)
    groups = [model.lm.get_input_embeddings(), *blocks]  # the head is untied: it stays in the root
    for index, group in enumerate(groups):
        fully_shard(group, mp_policy=precision.policy, reshard_after_forward=index < len(groups) - 1)
    fully_shard(model, mp_policy=precision.policy, reshard_after_forward=False)


def _shard_library_call(which: Row, model: torch.nn.Module) -> None:
    if which.name == "default":
        config = fsdp_int8.Int8TrainingConfig(int8_matmul=fsdp_int8.Int8MatmulConfig())
        fsdp_int8.shard_model(model, config=config, mp_policy=BF16_POLICY)
    else:
        fsdp_int8.shard_model(model, config=fsdp_int8.Int8TrainingConfig.lean())


def build(which: Row | str, args: ModelArgs, *, lr: float = 1e-3, weight_decay: float = 0.1,
          model: str = LAUNCHER) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Row ``which``'s model of shape ``args`` on this process group's device, and its
    optimizer. Weights and stochastic rounding come from seed 0 (the configs' default).
    ``model``: the launcher's Transformer, or ``"hf-llama"`` (:func:`hf_llama`)."""
    which = which if isinstance(which, Row) else row(which)
    device = torch.device(device_type_for(dist.get_world_size() if dist.is_initialized() else 1))
    if model not in MODELS:
        raise ValueError(f"model is one of {', '.join(MODELS)}, not {model!r}")
    if model == HF_LLAMA:
        with torch.device(device):
            built = hf_llama(args)
        _shard_hf(which, built)
    elif which.library_call:
        with torch.device(device):
            built = Transformer(args)
        built.init_weights(0)
        _shard_library_call(which, built)
    else:
        built = build_model(parse_row(which.name, compile=which.compile), args, device, full_init=True)
    optimizer = OPTIMIZERS[which.optimizer](built.parameters(), lr, weight_decay)
    if not isinstance(optimizer, fsdp_int8.Int8AdamW):  # as the launcher: one device sync per step on GPUs
        fsdp_int8.optim.batch_int8_updates(optimizer)
    return built, optimizer
