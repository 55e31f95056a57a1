"""``python -m benchmarks.memory`` at its tiny shape: torch's FSDPMemTracker measures each
row in real 2-rank processes, and the figures keep their meaning (docs/memory.md)."""

from __future__ import annotations

from benchmarks import memory


def test_tracker_measures_bf16_fsdp2_and_int8_stepping_inside_backward(capsys):
    results = memory.main(["--rows", "bf16", "int8-8bit-in-backward", "--checkpointing", "on", "--shape", "tiny"])
    bf16, lean = results[("bf16", True)], results[("int8-8bit-in-backward", True)]
    # Between steps bf16 FSDP2 keeps fp32 parameters (4 bytes) and AdamW's two fp32
    # moments (8), nothing else: 12 bytes per parameter up to buffers and the tracker's
    # rounding of sizes to whole blocks.
    assert 12.0 <= bf16["after"] < 12.5, bf16
    # int8 rows (~1 byte + scales) for the linear weights, the fp32 tied embedding (20%
    # of this shape) and 8-bit moments (~2 bytes): about 4 bytes, a third of bf16's.
    assert lean["after"] < 0.45 * bf16["after"], (lean, bf16)
    # at this shape activations and their gradients make most of the peak (~23 of 37
    # bytes/param for both rows); what is left is smaller with int8
    assert lean["peak"] < bf16["peak"], (lean, bf16)
    table = capsys.readouterr().out
    assert "int8-8bit-in-backward" in table and "x bf16" in table
