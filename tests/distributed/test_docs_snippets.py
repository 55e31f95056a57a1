"""The first snippets a user copies (README's "Use it", docs/quickstart.md's "Use it in
your training code") run as written on 2 gloo ranks, in one spawn.

Each snippet is read from its page and run as torchrun would run it: its own
``dist.init_process_group()`` from the environment torchrun sets (``RANK``, ``LOCAL_RANK``,
``MASTER_PORT``, ...), after the harness's process group is gone, and its own
``destroy_process_group()`` at the end.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_int8 import Int8Weight, _dist
from fsdp_int8.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
SNIPPETS = {"README.md": "## Use it\n", "docs/quickstart.md": "## Use it in your training code\n"}


def _snippet(page: str, heading: str) -> str:
    """The first Python code block under ``heading`` of ``page``."""
    text = (ROOT / page).read_text()
    start = text.index("```python\n", text.index(heading)) + len("```python\n")
    return text[start:text.index("```", start)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_snippets(rank: int, world: int, root: str) -> dict:
    ports = _dist.broadcast_from_rank0([_free_port() for _ in SNIPPETS])  # rank 0 hosts each store
    dist.destroy_process_group()  # the snippets start their own, as under torchrun
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    out = {}
    for (page, heading), port in zip(SNIPPETS.items(), ports):
        os.environ["MASTER_PORT"] = str(port)
        os.chdir(Path(root) / Path(page).stem)  # where the snippet writes (quickstart: ckpt/)
        namespace = {"__name__": "__main__"}
        exec(compile(_snippet(page, heading), page, "exec"), namespace)
        model = namespace["model"]
        out[page] = dict(
            loss=namespace["loss"].item(),
            int8=sum(isinstance(_dist.local_shard(p), Int8Weight) for p in model.parameters()),
            group_left=dist.is_initialized(),
            files=sorted(os.listdir()),
        )
    os.chdir(root)
    return out


def test_readme_and_quickstart_snippets_run_as_written():
    with tempfile.TemporaryDirectory() as root:
        for page in SNIPPETS:
            (Path(root) / Path(page).stem).mkdir()
        runs = run_distributed(_run_snippets, 2, root)
    for rank, run in enumerate(runs):
        for page, found in run.items():
            assert torch.isfinite(torch.tensor(found["loss"])), (rank, page, found)
            assert found["int8"] == 2 * 7, (rank, page, found)  # the tiny preset: 2 blocks x 7 linear weights
            assert not found["group_left"], (rank, page)
        assert run["docs/quickstart.md"]["files"] == ["ckpt"], run  # save_checkpoint wrote there
