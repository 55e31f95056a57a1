"""The launcher's two compile flags, as its command line takes and refuses them.

``--compile auto|on|off`` is fsdp_int8's ``Int8TrainingConfig.compile`` (the quantization
kernels; :func:`launch.precisions.resolve_compile` resolves ``auto`` for the model);
``--compile-blocks`` compiles every transformer block whole before sharding (torchtitan's
per-block compile), refused where it is not tested.
"""

from __future__ import annotations

import argparse

from fsdp_int8.config import COMPILE_CHOICES

BLOCKS_FLAG = "--compile-blocks"


def compile_choice(text: str) -> str:
    """argparse ``type=`` of ``--compile``: ``text`` if it is ``auto``, ``on`` or ``off``.
    ``blocks`` is its own flag, :data:`BLOCKS_FLAG`, and the refusal says so."""
    if text == "blocks":
        raise argparse.ArgumentTypeError(
            f"compiling every transformer block whole is its own flag: {BLOCKS_FLAG} instead of --compile blocks "
            f"(--compile {' / '.join(COMPILE_CHOICES)} chooses the quantization kernels, alongside it)")
    if text not in COMPILE_CHOICES:
        raise argparse.ArgumentTypeError(f"--compile takes {', '.join(COMPILE_CHOICES)}, not {text!r}")
    return text


def check_blocks(args: argparse.Namespace, *, fp32: bool) -> None:
    """Refuse :data:`BLOCKS_FLAG` in ``args`` (the launcher's, with its ``model`` shape)
    where it is not tested: with tensor or pipeline parallelism (``--tp``, ``--pp`` above 1),
    and for mixture-of-experts blocks computing in fp32 (``fp32``: torch compiles
    ``torch._grouped_mm`` for bf16 operands only). Nothing to check without the flag.

    Raises:
        ValueError: what does not fit, and what to do.
    """
    if not args.compile_blocks:
        return
    if args.tp > 1 or args.pp > 1:
        raise ValueError(f"{BLOCKS_FLAG} is not tested with --tp or --pp: drop it (--compile on compiles "
                         "the quantization kernels) or leave --tp / --pp at 1")
    if fp32 and args.model.n_experts:
        raise ValueError(f"{BLOCKS_FLAG} with a mixture-of-experts preset needs bf16 compute: torch compiles "
                         "torch._grouped_mm for bf16 operands only. Use --compute-dtype bf16 (and a bf16 or "
                         f"int8 --precision), or drop {BLOCKS_FLAG}")
