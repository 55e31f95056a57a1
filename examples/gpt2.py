"""GPT-2 with int8 weights: its Conv1D layers quantized, trained, and exported back to GPT-2.

    pip install "fsdp_int8[hf]"
    python examples/gpt2.py

GPT-2 builds its linear layers from transformers' ``Conv1D``, whose weight is stored
``[in, out]``. ``quantize_`` turns each one in place into an ``nn.Linear`` over the
``[out, in]`` int8 transpose (one fp32 scale per output feature) that keeps GPT-2's
state-dict keys. The model trains as any int8 model does; ``export_full_state_dict`` gives
GPT-2's own ``[in, out]`` layout back, so a plain ``GPT2LMHeadModel`` loads it, and its
logits are the int8 model's.
"""

from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import fsdp_int8

VOCAB, SEQ = 128, 16


def tiny_gpt2() -> GPT2LMHeadModel:
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def batch(seed: int) -> torch.Tensor:
    """Chains ``x[t + 1] = (5 x[t] + 3) mod VOCAB`` from random starts: a pattern to learn."""
    tokens = torch.randint(0, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(seed))
    for t in range(1, SEQ):
        tokens[:, t] = (5 * tokens[:, t - 1] + 3) % VOCAB
    return tokens


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = fsdp_int8.quantize_(tiny_gpt2())  # c_attn, c_proj, c_fc, mlp.c_proj of each block
    int8 = [n for n, p in model.named_parameters() if isinstance(p, fsdp_int8.Int8Weight)]
    optimizer = fsdp_int8.Int8AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(args.steps):
        tokens = batch(step)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    print(f"{len(int8)} int8 weights; loss {losses[0]:.3f} -> {losses[-1]:.3f}")

    plain = tiny_gpt2()  # full precision, GPT-2's own Conv1D layers
    plain.load_state_dict(fsdp_int8.export_full_state_dict(model, torch.float32))
    tokens = batch(10_000)
    with torch.no_grad():
        ours, theirs = model(input_ids=tokens).logits, plain(input_ids=tokens).logits
    difference = (ours - theirs).abs().max().item()
    print(f"exported into a plain GPT-2: logits within {difference:.1e} of the int8 model's")
    return {"int8_weights": len(int8), "losses": losses, "export_logit_difference": difference,
            "scale": ours.abs().max().item()}


if __name__ == "__main__":
    main()
