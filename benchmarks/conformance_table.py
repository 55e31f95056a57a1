"""The FSDP2 conformance table of docs/testing.md: which scenarios each weight passes.

    python -m benchmarks.conformance_table              # Int8Weight
    python -m benchmarks.conformance_table --torchao    # also torchao's int8 training weight
                                                        # (pip install torchao==0.18.0)

Runs :func:`fsdp_int8.testing.check_fsdp2_conformance` at world sizes 1, 2 and 4 for each
weight (about a minute each on 2 CPU cores), then prints one markdown table (scenario x
weight) and every failure's reason. ``Int8Weight``'s spec is the one our tests run
(``fsdp_int8.testing.int8_weight_spec``); torchao's is defined here, since only this
script runs it. The tests' reference subclass is not tabulated: a benchmark never imports
the tests, and ``tests/distributed/test_conformance.py`` asserts that it passes every
scenario. A failure is a finding about that weight, not an error of this script.
"""

from __future__ import annotations

import argparse
import platform
import sys

import torch

from fsdp_int8.hardware import device_type_for
from fsdp_int8.testing import SubclassSpec, check_fsdp2_conformance
from fsdp_int8.testing.int8_weight_spec import INT8_ROUNDING_STEP, INT8_WEIGHT, int8_wire_bytes


# ---------------------------------------------------------------- torchao (optional)
# Module-level: the spawned ranks unpickle the spec's callables by name.
def torchao_from_float(tensor: torch.Tensor) -> torch.Tensor:
    from torchao.prototype.quantized_training.int8 import Int8QuantizedTrainingLinearWeight

    return Int8QuantizedTrainingLinearWeight.from_float(tensor)


def torchao_to_float(weight: torch.Tensor) -> torch.Tensor:
    return weight.dequantize()


def torchao_spec() -> SubclassSpec:
    """torchao 0.18's int8 training weight: int8 data plus one scale per row (in the
    weight's dtype, fp32 here); every in-place update rounds stochastically."""
    import torchao

    return SubclassSpec(
        name=f"torchao {torchao.__version__} Int8QuantizedTrainingLinearWeight",
        from_float=torchao_from_float,
        to_float=torchao_to_float,
        wire_bytes_per_element=int8_wire_bytes,
        rounding_step=INT8_ROUNDING_STEP,
    )


def _specs(with_torchao: bool) -> list[SubclassSpec]:
    return [INT8_WEIGHT, torchao_spec()] if with_torchao else [INT8_WEIGHT]


def _cell(result) -> str:
    if result.status == "passed" and "unsupported, with a clear error" in result.detail:
        return "passed (clear error)"
    return {"failed": "**failed**", "not applicable": "n/a"}.get(result.status, result.status)


def table(reports: list) -> str:
    """Scenario rows, one column per report."""
    header = "| scenario | " + " | ".join(r.spec_name for r in reports) + " |"
    lines = [header, "|---" * (len(reports) + 1) + "|"]
    for key in reports[0].results:
        lines.append(f"| {key} | " + " | ".join(_cell(r.results[key]) for r in reports) + " |")
    return "\n".join(lines)


def reasons(reports: list, limit: int = 400) -> str:
    """Every failed and not-applicable scenario with its reason, shortened."""
    lines = []
    for report in reports:
        for key, result in report.results.items():
            if result.status != "passed":
                detail = result.detail if len(result.detail) <= limit else result.detail[:limit] + " ..."
                lines.append(f"- {report.spec_name}, {key} ({result.status}): {detail}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torchao", action="store_true", help="also run torchao's weight")
    parser.add_argument("--world-sizes", default="1,2,4")
    args = parser.parse_args()
    world_sizes = tuple(int(w) for w in args.world_sizes.split(","))
    reports = []
    for spec in _specs(args.torchao):
        print(f"running {spec.name} ...", file=sys.stderr, flush=True)
        reports.append(check_fsdp2_conformance(spec, world_sizes))
        print(f"  {reports[-1].summary()} in {reports[-1].seconds:.0f} s", file=sys.stderr, flush=True)
    versions = f"torch {torch.__version__}"
    if args.torchao:
        import torchao

        versions += f", torchao {torchao.__version__}"
    device = device_type_for(max(world_sizes))
    print(f"{versions}; {device} ({'NCCL' if device == 'cuda' else 'gloo'}); world sizes "
          f"{world_sizes}; {platform.machine()}\n")
    print(table(reports))
    print()
    print(reasons(reports))


if __name__ == "__main__":
    main()
