"""What checking int8 weights on the way in costs, against the load it guards.

    python -m benchmarks.load_checks                 # the launcher's 1b preset (~0.8 GB of int8 rows)
    python -m benchmarks.load_checks --preset tiny
    python -m benchmarks.load_checks --cold          # the file read from the disk each time

``load_state_dict`` of the preset's int8 state dict into a model quantized by ``quantize_``
(whose pre-hook checks every int8 entry: scales finite and non-negative, values in
-127..127) is timed against the same load into a model whose ``Int8Weight`` parameters
were set by hand (no hook: nothing checked); the difference is the check. The load is
``torch.load`` of the state dict's file plus the unchecked ``load_state_dict``: the file
read from the page cache (the fastest load, so the largest share), or with ``--cold``
from the disk (its pages dropped from the cache before each read, as for a checkpoint
that another job or node wrote). The check alone is timed too, as ``state_dict_from_int8_safetensors``
runs it (the same check, without the copy), and so is one plain read of the same bytes (a
float32 sum over them): the floor of any check that is a pass of its own. Prints seconds
per GB of int8 weights and the check's share of the load; medians of interleaved repeats,
one thread by default.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

import fsdp_int8
from fsdp_int8 import Int8Weight, hardware
from fsdp_int8.integrations.hf_quantizer import int8_safetensors_state_dict, state_dict_from_int8_safetensors
from launch.model import PRESETS, Transformer


def _checked_model(preset: str) -> nn.Module:
    """The preset quantized by ``quantize_`` (checked loads), int8 storage allocated, random rows."""
    with torch.device("meta"):
        model = Transformer(PRESETS[preset])
    fsdp_int8.quantize_(model)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if isinstance(param, Int8Weight):
                param.int_data.copy_(torch.randint(-127, 128, param.int_data.shape, generator=generator))
                param.scale.copy_(torch.rand(param.scale.shape, generator=generator) * 1e-3)
            else:
                param.normal_(generator=generator)
    return model


def _unchecked_model(preset: str, checked: nn.Module) -> nn.Module:
    """The preset with ``Int8Weight`` parameters set by hand where ``checked`` has them: no load hooks."""
    with torch.device("meta"):
        model = Transformer(PRESETS[preset])
    model.to_empty(device="cpu")
    for name, param in checked.named_parameters():
        if isinstance(param, Int8Weight):
            owner, attr = model.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
            weight = param.with_tensors(torch.empty_like(param.int_data), torch.empty_like(param.scale))
            setattr(owner, attr, nn.Parameter(weight, requires_grad=param.requires_grad))
    return model


def _median_seconds(
    fns: dict[str, Callable[[], object]], repeats: int, untimed_before: dict[str, Callable[[], None]] | None = None,
) -> dict[str, float]:
    """Median seconds of each of ``fns``, run in turn ``repeats`` times; ``untimed_before[name]``
    runs before each timed call of ``fns[name]``."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if untimed_before and name in untimed_before:
                untimed_before[name]()
            began = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - began)
    return {name: statistics.median(values) for name, values in times.items()}


def _drop_from_page_cache(file: Path) -> None:
    """Write ``file``'s pages to the disk and drop them from the page cache: its next read
    comes from the disk."""
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def measure(preset: str, repeats: int, cold: bool = False) -> dict[str, float]:
    """Seconds of each part (medians) and the int8 gigabytes they move; ``cold``: the
    file read from the disk, not the page cache."""
    checked = _checked_model(preset)
    unchecked = _unchecked_model(preset, checked)
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "state.pt"
        torch.save(checked.state_dict(), file)
        state = torch.load(file, weights_only=True)  # its own memory: every load below copies
        pairs = int8_safetensors_state_dict(state)  # views of the same rows and scales
        int8_bytes = [v.int_data.view(-1)[: v.int_data.numel() // 4 * 4].view(torch.float32)
                      for v in state.values() if isinstance(v, Int8Weight)]
        seconds = _median_seconds({
            "torch.load": lambda: torch.load(file, weights_only=True),
            "load_state_dict unchecked": lambda: unchecked.load_state_dict(state),
            "load_state_dict checked": lambda: checked.load_state_dict(state),
            "check alone": lambda: state_dict_from_int8_safetensors(pairs),
            "one read of the bytes": lambda: [t.sum() for t in int8_bytes],
        }, repeats, untimed_before={"torch.load": lambda: _drop_from_page_cache(file)} if cold else None)
    gigabytes = sum(v.int_data.numel() + 4 * v.scale.numel() for v in state.values() if isinstance(v, Int8Weight)) / 1e9
    seconds["check"] = max(seconds["load_state_dict checked"] - seconds["load_state_dict unchecked"], 0.0)
    seconds["load"] = seconds["torch.load"] + seconds["load_state_dict unchecked"]
    return {**seconds, "gigabytes": gigabytes}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="1b", choices=sorted(PRESETS))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cold", action="store_true", help="read the file from the disk, not the page cache, each time")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = measure(args.preset, args.repeats, args.cold)
    gb = result["gigabytes"]
    print(f"preset {args.preset}: {gb:.3f} GB of int8 rows and scales; {args.threads} thread(s), "
          f"median of {args.repeats} interleaved repeats; the file read from the {'disk' if args.cold else 'page cache'}")
    print(hardware.hardware_line())
    names = ("torch.load", "load_state_dict unchecked", "load_state_dict checked", "check", "check alone",
             "one read of the bytes", "load")
    for name in names:
        print(f"{name:<27}{result[name]:8.3f} s {result[name] / gb:8.3f} s/GB")
    print(f"check / load: {result['check'] / result['load']:.1%} (checked - unchecked load_state_dict), "
          f"{result['check alone'] / result['load']:.1%} (the check alone, state_dict_from_int8_safetensors); "
          f"a pass of its own costs at least {result['one read of the bytes'] / result['load']:.1%} "
          "(one read of the bytes)")


if __name__ == "__main__":
    main()
