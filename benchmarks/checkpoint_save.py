"""How long a checkpoint save blocks the training loop: synchronous against ``async_=True``.

    python -m benchmarks.checkpoint_save                    # the launcher's small preset
    python -m benchmarks.checkpoint_save --preset base --repeats 5

One process (a gloo process group of one, as under torchrun), the preset quantized by
``quantize_`` with ``Int8AdamW(state_bits=8)``: int8 weights and 8-bit optimizer states.
Each repeat runs a training step, a synchronous ``save_checkpoint`` (timed: the loop is
blocked for all of it), another step, an ``async_=True`` save (timed until it returns: the
state is checked and copied to CPU memory), one more step while the write goes on in the
background, and then waits for that write (its time to publish is printed too). Prints
the medians of the repeats and the ratio, with the CPU line.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import fsdp_int8
from fsdp_int8 import hardware
from launch.model import PRESETS, Transformer, next_token_loss


def _train_step(model: Transformer, optimizer: torch.optim.Optimizer, seed: int) -> None:
    batch = torch.randint(0, model.args.vocab_size, (4, 65), generator=torch.Generator().manual_seed(seed))
    next_token_loss(model, batch[:, :-1], batch[:, 1:]).backward()
    optimizer.step()
    optimizer.zero_grad()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--repeats", type=int, default=5, help="saves of each kind (the medians are printed)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with socket.socket() as probe:  # a free port for the process group's store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = fsdp_int8.quantize_(Transformer(PRESETS[args.preset]))
        optimizer = fsdp_int8.Int8AdamW(model.parameters(), lr=1e-4, state_bits=8)
        _train_step(model, optimizer, 0)
        state_mb = sum(t.numel() * t.element_size() for t in _tensors(model, optimizer)) / 2**20
        print(f"# {hardware.hardware_line('cpu')}; {args.threads} threads; preset "
              f"{args.preset}: {state_mb:.1f} MB of weights and optimizer states", flush=True)
        blocked_sync, blocked_async, published = [], [], []
        with tempfile.TemporaryDirectory() as root:
            for repeat in range(args.repeats):
                began = time.perf_counter()
                fsdp_int8.save_checkpoint(root, model, optimizer, step=2 * repeat, keep=2)
                blocked_sync.append(time.perf_counter() - began)
                _train_step(model, optimizer, 2 * repeat + 1)
                began = time.perf_counter()
                pending = fsdp_int8.save_checkpoint(root, model, optimizer, step=2 * repeat + 1, keep=2, async_=True)
                blocked_async.append(time.perf_counter() - began)
                _train_step(model, optimizer, 2 * repeat + 2)  # while the write goes on
                pending.result()
                published.append(time.perf_counter() - began)
        sync, background = statistics.median(blocked_sync), statistics.median(blocked_async)
        print(f"training loop blocked per save (median of {args.repeats}): synchronous {sync * 1e3:.1f} ms, "
              f"async_=True {background * 1e3:.1f} ms, ratio {background / sync:.3f} "
              f"(async save published {statistics.median(published) * 1e3:.1f} ms after it began, "
              "one training step included)", flush=True)
    finally:
        dist.destroy_process_group()


def _tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor a checkpoint holds: int8 rows and scales, other parameters, states."""
    out: list[torch.Tensor] = []
    for param in model.parameters():
        out += [param.int_data, param.scale] if isinstance(param, fsdp_int8.Int8Weight) else [param.detach()]
    for state in optimizer.state.values():
        out += [value for value in state.values() if torch.is_tensor(value)]
    return out


if __name__ == "__main__":
    main()
