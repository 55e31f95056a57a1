"""Int8 embeddings under FSDP2, 2 gloo ranks, one spawn: the launcher's Llama with its head
tied to an int8 embedding, sharded by ``shard_model``, trains like the same model in one
process; the step inside backward equals the step after it bit for bit; weights kept int8
when gathered (``Int8MatmulConfig`` with no int8 GEMM) train like weight-only int8 bit for
bit; a sharded checkpoint loads back bit for bit and the export is the dequantized weight."""

from __future__ import annotations

import warnings
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp_int8
from fsdp_int8 import Int8AdamW, Int8MatmulConfig, Int8TrainingConfig, Int8Weight
from fsdp_int8.testing import run_distributed
from launch.model import ModelArgs, Transformer, next_token_loss

from _cases import case, local_of, mean_over_ranks

STEPS = 3


def _tied_llama(config: Int8TrainingConfig, world: int) -> Transformer:
    torch.manual_seed(0)
    # 41 vocabulary rows: shards of 21 and 20 rows, FSDP2 pads the last
    model = Transformer(ModelArgs(vocab_size=41, dim=32, n_layers=2, n_heads=2, max_seq_len=16))
    model.init_weights()
    model.output.weight = model.tok_embeddings.weight
    if world == 1:
        return fsdp_int8.quantize_(model, config)
    return fsdp_int8.shard_model(model, config=config)


def _batch(rank: int) -> torch.Tensor:
    return torch.randint(0, 41, (2, 13), generator=torch.Generator().manual_seed(100 + rank))


def _train(model, opt, tokens: torch.Tensor, losses: list[float], world: int) -> None:
    for _ in range(STEPS):
        loss = next_token_loss(model, tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss) if world > 1 else loss.item())


class _DenseLookupGradients(TorchDispatchMode):
    """Counts torch's dense lookup gradients of a table of ``rows`` rows."""

    def __init__(self, rows: int):
        super().__init__()
        self.rows, self.count = rows, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.embedding_dense_backward.default:
            self.count += out.shape[0] == self.rows
        return out


def _embedding_rows(model) -> tuple[torch.Tensor, torch.Tensor]:
    weight = local_of(model.tok_embeddings.weight)
    return weight.int_data.clone(), weight.scale.clone()


def _body(rank: int, world: int, directory: str) -> None:
    nearest = Int8TrainingConfig(quantize_embeddings=True, stochastic_rounding=False)
    with case("sharded: the tied head follows the int8 embedding"):
        model = _tied_llama(nearest, world)
        weight = model.tok_embeddings.weight
        assert isinstance(local_of(weight), Int8Weight) and model.output.weight is weight
    with case("2 ranks train like one process"):
        sharded: list[float] = []
        _train(model, Int8AdamW(model.parameters(), lr=1e-2), _batch(rank), sharded, world)
        single = _tied_llama(nearest, 1)
        whole_batch = torch.cat([_batch(r) for r in range(world)])
        reference: list[float] = []
        _train(single, Int8AdamW(single.parameters(), lr=1e-2), whole_batch, reference, 1)
        # Round to nearest everywhere: the runs differ only in fp32 summation order (the
        # gradient's reduce-scatter against one backward), which can move a value across a
        # rounding boundary, one int8 step in a few elements: far below 1e-3 of the loss.
        assert torch.allclose(torch.tensor(sharded), torch.tensor(reference), rtol=1e-3), (sharded, reference)

    with case("an untied int8 embedding sharded on its own returns no view (FSDP2 warns: an in-place op "
              "on a view output drops its pre-backward hook)"):
        torch.manual_seed(0)
        untied = Transformer(ModelArgs(vocab_size=41, dim=32, n_layers=1, n_heads=2, max_seq_len=16))
        untied.init_weights()
        gathered_int8 = replace(nearest, int8_gathered_weights=True)
        untied = fsdp_int8.shard_model(untied, config=gathered_int8)  # the lookup reads the int8 rows
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = untied.tok_embeddings(_batch(rank))
        assert out._base is None and not [w for w in caught if "view" in str(w.message)], caught

    stochastic = Int8TrainingConfig(quantize_embeddings=True, seed=4)
    with case("the step inside backward equals the step after it"):
        rows = []
        for in_backward in (False, True):
            model = _tied_llama(stochastic, world)
            opt = Int8AdamW(model.parameters(), lr=1e-2, state_bits=8, block_size=16, step_in_backward=in_backward)
            _train(model, opt, _batch(rank), [], world)
            rows.append(_embedding_rows(model))
        assert torch.equal(rows[0][0], rows[1][0]) and torch.equal(rows[0][1], rows[1][1])

    with case("int8 at the matmul (no int8 GEMM): the gathered weights stay int8, training is weight-only's "
              "bit for bit, the tied table gets one dense gradient"):
        trained = {}
        for name, config in (("weight-only", stochastic), ("int8 gathered", replace(stochastic, int8_gathered_weights=True))):
            kept = _tied_llama(config, world)
            int8_at_matmul = set()
            for module in (kept.output, kept.layers[0].attention.wq):
                module.register_forward_pre_hook(lambda m, args: int8_at_matmul.add(isinstance(m.weight, Int8Weight)))
            opt_kept = Int8AdamW(kept.parameters(), lr=1e-2, state_bits=8, block_size=16)
            with _DenseLookupGradients(rows=41) as dense:
                _train(kept, opt_kept, _batch(rank), [], world)
            assert int8_at_matmul == {name != "weight-only"}, (name, int8_at_matmul)  # an Int8Weight at the matmul
            # weight-only gathers a plain table: torch's lookup backward makes its dense
            # gradient each step; an int8 one (FSDP2's unsharded leaf) has the lookup's rows
            # go into the head's gradient
            assert dense.count == (STEPS if name == "weight-only" else 0), (name, dense.count)
            trained[name] = {key: local_of(p) for key, p in kept.named_parameters()}
        for key, weight in trained["weight-only"].items():
            other = trained["int8 gathered"][key]
            if isinstance(weight, Int8Weight):
                assert torch.equal(weight.int_data, other.int_data) and torch.equal(weight.scale, other.scale), key
            else:
                assert torch.equal(weight, other), key

    with case("a sharded checkpoint loads back bit for bit; the export is dequantized"):
        fsdp_int8.save_checkpoint(directory, model, opt, step=STEPS)
        saved = _embedding_rows(model)
        again = _tied_llama(stochastic, world)
        again_opt = Int8AdamW(again.parameters(), lr=1e-2, state_bits=8, block_size=16, step_in_backward=True)
        fsdp_int8.load_checkpoint(directory, again, again_opt)
        loaded = _embedding_rows(again)
        assert torch.equal(loaded[0], saved[0]) and torch.equal(loaded[1], saved[1])
        exported = fsdp_int8.export_full_state_dict(again, dtype=torch.float32)
        full = model.tok_embeddings.weight.full_tensor()  # gathers the rows, dequantized
        if rank == 0:
            assert torch.equal(exported["tok_embeddings.weight"], full)
            assert torch.equal(exported["output.weight"], full)
        dist.barrier()


def test_int8_embeddings_under_fsdp2(tmp_path):
    run_distributed(_body, 2, str(tmp_path / "checkpoints"), timeout=600)
