"""How much of each transformers mixture-of-experts family becomes int8, at its published size.

    python -m benchmarks.moe_families                  # every family, a table
    python -m benchmarks.moe_families qwen3_moe dbrx   # some
    python -m benchmarks.moe_families --json out.json

A family is a model type whose modeling file defines an ``*Experts`` class. Each is built
from its config's defaults (transformers' configs default to a published model's shape;
:data:`PUBLISHED` gives the shape where the defaults do not build)
on the meta device, so no weight is allocated, then ``fsdp_int8.quantize_`` runs with the
default ``Int8TrainingConfig``. Per family: parameters, the int8 share of parameter
elements, and the int8 routers: 2-D weights with one row per expert (``[E, hidden]``)
inside a MoE block (a module with a child that counts ``E`` experts and holds 3-D expert
weights), not named as a
projection (``*_proj``: shared experts' MLPs, whose widths can equal ``E``), that became
int8. A check independent of the rule ``quantize_`` applies (docs/moe.md). The goal is >= 95% int8 and no int8
router; a family short of it says why (the warnings ``quantize_`` gave).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import re
import time
import warnings
from pathlib import Path

import torch

__all__ = ["families", "measure"]

GOAL = 0.95
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")


def families() -> list[str]:
    """Model types of the installed transformers whose modeling file defines ``*Experts``."""
    import transformers

    root = Path(transformers.__file__).parent / "models"
    found = set()
    for path in root.glob("*/modeling_*.py"):
        if re.search(r"^class \w*Experts?\(", path.read_text(), re.M):
            found.add(path.parent.name)
    return sorted(found)


# Published sizes of the families whose config defaults transformers cannot build (the
# fields the defaults lack or get wrong; the rest stay the defaults):
PUBLISHED = {
    # databricks/dbrx-base's config.json (its attention clamps by clip_qkv, and None fails)
    "dbrx": dict(d_model=6144, n_heads=48, n_layers=40, max_seq_len=32768, vocab_size=100352,
                 attn_config=dict(kv_n_heads=8, clip_qkv=8.0, rope_theta=500000.0),
                 ffn_config=dict(ffn_hidden_size=10752, moe_num_experts=16, moe_top_k=4)),
    # rednote-hilab/dots.llm1.base's config.json (the defaults have no experts)
    "dots1": dict(hidden_size=4096, n_routed_experts=128, n_shared_experts=2, num_experts_per_tok=6,
                  first_k_dense_replace=1),
    # Hunyuan-A13B's model card: 64 experts (top 8) of width 3072, GQA 32 / 8 heads of 128
    # LFM2-8B-A1B as LiquidAI describes it (transformers' other defaults are its shape): 24
    # blocks, the first 2 dense, attention in 1 of 4 (6 blocks; which 6 changes no count)
    "lfm2_moe": dict(num_hidden_layers=24, layer_types=["conv", "conv", "full_attention", "conv"] * 6),
    "hunyuan_v1_moe": dict(vocab_size=128167, intermediate_size=3072, num_key_value_heads=8, head_dim=128,
                           num_experts=64, moe_topk=8),
}


def _configs(family: str) -> list:
    from transformers import CONFIG_MAPPING

    configs = []
    for model_type, config_class in CONFIG_MAPPING.items():
        if config_class.__module__.startswith(f"transformers.models.{family}."):
            try:
                configs.append((model_type, config_class(**PUBLISHED.get(model_type, {}))))
            except Exception:  # noqa: BLE001 -- a config that needs arguments: not this family's model
                continue
    return configs


def _experts(config) -> int | None:
    for owner in (config, getattr(config, "text_config", None), getattr(config, "ffn_config", None)):
        for name in _EXPERT_COUNTS:
            value = getattr(owner, name, None) if owner is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 1:
                return value
    return None


def _build(config):
    import transformers

    errors = []
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        try:
            with torch.device("meta"):
                return auto.from_config(config)
        except Exception as error:  # noqa: BLE001 -- the next auto class may take it
            errors.append(f"{auto.__name__}: {type(error).__name__}: {str(error)[:120]}")
    raise RuntimeError("; ".join(errors))


def measure(family: str) -> list[dict]:
    """One row per config class of ``family`` that builds."""
    import fsdp_int8
    from fsdp_int8.weight import Int8Weight

    rows = []
    for model_type, config in _configs(family):
        started = time.perf_counter()
        row = {"family": family, "model_type": model_type}
        try:
            model = _build(config)
        except RuntimeError as error:
            rows.append({**row, "error": str(error)})
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fsdp_int8.quantize_(model)
        sizes = [(p.numel(), isinstance(p, Int8Weight)) for p in model.parameters()]
        total, int8 = sum(n for n, _ in sizes), sum(n for n, is_int8 in sizes if is_int8)
        experts = _experts(config)
        blocks = tuple(f"{name}." for name, module in model.named_modules() if experts and any(
            any(getattr(child, count, None) == experts for count in _EXPERT_COUNTS)
            and any(p.shape[0] == experts if p.dim() == 3 else p.shape[0] % experts == 0 and p.shape[0] > experts
                    for p in child.parameters())  # 3-D experts, or DBRX's 2-D [E * ffn, hidden]
            for child in module.children()))
        routers = [name for name, p in model.named_parameters() if name.startswith(blocks) and "_proj" not in name
                   and isinstance(p, Int8Weight) and p.dim() == 2 and p.shape[0] == experts]
        rows.append({**row, "model": type(model).__name__, "parameters": total,
                     "int8_share": int8 / max(total, 1), "experts": experts,
                     "int8_routers": routers, "seconds": round(time.perf_counter() - started, 1),
                     "warnings": [str(w.message)[:300] for w in caught if "fsdp_int8" in str(w.filename)
                                  or "quantize_" in str(w.message)]})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help="model types (default: every MoE family)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    importlib.import_module("transformers").logging.set_verbosity_error()
    rows = []
    print(f"{'model type':28s} {'parameters':>12s} {'int8':>7s} {'int8 routers':>12s}  note")
    for family in args.families or families():
        for row in measure(family):
            rows.append(row)
            if "error" in row:
                print(f"{row['model_type']:28s} {'':>12s} {'':>7s} {'':>12s}  not built: {row['error'][:90]}")
                continue
            short = row["int8_share"] < GOAL or row["int8_routers"]
            note = "; ".join(row["warnings"])[:150] if short else ""
            print(f"{row['model_type']:28s} {row['parameters'] / 1e9:11.2f}B {row['int8_share']:7.1%} "
                  f"{len(row['int8_routers']):12d}  {note}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
