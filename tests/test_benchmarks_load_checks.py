"""``python -m benchmarks.load_checks`` at the tiny preset: it times a checked and an
unchecked ``load_state_dict`` of the same int8 state dict and prints the check's share."""

from __future__ import annotations

from benchmarks import load_checks


def test_the_benchmark_measures_checked_and_unchecked_loads(capsys):
    result = load_checks.measure("tiny", repeats=1)
    assert result["gigabytes"] > 0
    assert all(result[name] >= 0 for name in ("torch.load", "load_state_dict checked", "check", "load"))
    load_checks.main(["--preset", "tiny", "--repeats", "1", "--cold"])
    out = capsys.readouterr().out
    assert "check / load:" in out and "s/GB" in out and "read from the disk" in out
    assert "one read of the bytes" in out and result["one read of the bytes"] > 0
