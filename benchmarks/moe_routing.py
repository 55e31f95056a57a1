"""Do routing flips explain int8 matmuls' logit error in transformers' MoE models?

With int8 matmuls a MoE model's router sees slightly different inputs than an fp32 model
holding the same weight values, and may send a token to other experts: a discrete change
that later layers carry on. Per model family (gpt-oss, JetMoE, Qwen3-MoE) and seed:

1. a small model (hidden 256, 8 experts top-2, vocabulary 512, ``--layers`` blocks) is
   copied and the copy ``quantize_``d with int8 matmuls, rounding to nearest; the
   reference is the plain model loaded with ``export_full_state_dict(int8, torch.float32)``:
   the same values, only the matmuls' arithmetic differs;
2. eval-mode logits on fixed random tokens, ``||int8 - ref|| / ||ref||``, each model
   routing by itself ("free"); the (token, slot) choices whose expert differs, per router;
3. the same with every router of the int8 model forced to the reference's top-k experts
   (routing weights from its own router logits there), and to the reference's weights too;
4. for scale, free routing for the reference cast to bf16 (weights and compute), and for
   an int8 model whose layers writing the residual stream the routers read
   (``WEIGHT_ONLY``) are weight-only int8 (fp32 matmuls).

Checked on the way: full-precision parameters (routers included) equal the reference's,
each router gives the same logits for the same input in both models, and the patched
routers leave the reference's logits unchanged bit for bit. Each family's router module
(``GptOssTopKRouter``; ``JetMoeTopKGating``, one in the attention and one in the MLP;
``Qwen3MoeTopKRouter``) gets a forward repeating transformers 5's with the top-k taken
by :class:`Routing`, which records the choices or hands back recorded ones.

    python -m benchmarks.moe_routing                              # seeds 0 1 2, 4 blocks
    python -m benchmarks.moe_routing --seeds 0 --layers 2 --log   # + a dated section in benchmarks/results/moe_routing.md

CPU, fp32 compute, eager attention: a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import warnings
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import fsdp_int8
from fsdp_int8.config import router_modules
from fsdp_int8.weight import Int8Weight

HIDDEN, EXPERTS, TOP_K, VOCAB, EXPERT_FFN = 256, 8, 2, 512, 256
BATCH, SEQ = 4, 64
# The int8 layers whose output each family adds to the residual stream that its routers
# read (through an RMSNorm): the variant keeps their matmuls in fp32 (weight-only int8).
# An experts module holds its down projection with its gate/up projection (Qwen3-MoE,
# gpt-oss), so only o_proj can be chosen there.
WEIGHT_ONLY = {"gpt-oss": ["o_proj"], "gpt-oss-int8-experts": ["o_proj"], "jetmoe": ["output_linear"],
               "qwen3-moe": ["o_proj"]}


def _configs(layers: int) -> dict[str, tuple[type, object]]:
    """Each family's causal LM class and a small config: hidden 256, 8 experts top-2."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers, tie_word_embeddings=False)
    gpt_oss = (tf.GptOssForCausalLM, tf.GptOssConfig(
        **common, intermediate_size=EXPERT_FFN, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2)))
    return {
        "gpt-oss": gpt_oss, "gpt-oss-int8-experts": gpt_oss,
        "jetmoe": (tf.JetMoeForCausalLM, tf.JetMoeConfig(
            **common, intermediate_size=EXPERT_FFN, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
            num_key_value_heads=4, kv_channels=64)),
        "qwen3-moe": (tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig(
            **common, intermediate_size=2 * EXPERT_FFN, moe_intermediate_size=EXPERT_FFN, num_experts=EXPERTS,
            num_experts_per_tok=TOP_K, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            norm_topk_prob=True)),
    }


def build_pair(family: str, layers: int, seed: int, weight_only: tuple[str, ...] = ()) -> tuple[nn.Module, nn.Module]:
    """``(int8 model, fp32 reference)`` holding the same weight values.

    The int8 model is a copy of a freshly initialised model (``torch.manual_seed(seed)``),
    quantized with int8 matmuls and rounding to nearest; layers whose last name part is in
    ``weight_only`` get int8 weights with fp32 matmuls instead (weight-only int8: the
    reference's arithmetic on the same values). The reference is a plain model of the same
    class loaded with the int8 model's dequantized values.
    """
    cls, config = _configs(layers)[family]
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    plain = cls(config).eval()
    int8 = copy.deepcopy(plain)
    rounding = dict(stochastic_rounding=False, compile="off")
    if weight_only:  # first, so that the second call (which leaves int8 weights alone) skips them
        fsdp_int8.quantize_(int8, fsdp_int8.Int8TrainingConfig(
            **rounding, module_filter=lambda module, name: name.split(".")[-1] in weight_only))
    default = fsdp_int8.Int8TrainingConfig(**rounding, int8_matmul=fsdp_int8.Int8MatmulConfig())
    routers = router_modules(int8)

    def selects(module: nn.Module, name: str) -> bool:
        """fsdp_int8's default choice; "gpt-oss" keeps its experts (stored transposed) in full
        precision, as fsdp_int8 did before commit bb77e54 ("gpt-oss-int8-experts": int8)."""
        return (id(module) not in routers and default.selects_by_default(module, name)
                and not (family == "gpt-oss" and "GptOssExperts" in type(module).__name__))

    fsdp_int8.quantize_(int8, dataclasses.replace(default, module_filter=selects))
    reference = copy.deepcopy(plain)
    reference.load_state_dict(fsdp_int8.export_full_state_dict(int8, torch.float32))
    for (name, got), want in zip(int8.named_parameters(), reference.parameters()):
        if not isinstance(got, Int8Weight) and not torch.equal(got, want):
            raise AssertionError(f"{family}: full-precision {name} differs from the reference's")
    return int8.eval(), reference.eval()


def _short(name: str) -> str:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``self_attn.q_proj``."""
    parts = name.removesuffix(".weight").split(".")
    return ".".join(parts[3:] if parts[:2] == ["model", "layers"] else parts)


def int8_summary(model: nn.Module) -> str:
    """The int8 share of the parameter elements (what ``int8_census`` counts) and which
    weights are int8, with int8 GEMMs or weight-only."""
    int8 = total = 0
    by_kind: dict[str, set[str]] = {"int8 GEMMs": set(), "weight-only": set()}
    for name, param in model.named_parameters():
        total += param.numel()
        if isinstance(param, Int8Weight):
            int8 += param.numel()
            by_kind["int8 GEMMs" if param.int8_matmul is not None else "weight-only"].add(_short(name))
    kinds = "; ".join(f"{kind}: {', '.join(sorted(names))}" for kind, names in by_kind.items() if names)
    return f"{100 * int8 / total:.1f}% of {total / 1e6:.2f} M parameter elements int8 ({kinds}); the rest fp32"


class Routing:
    """Takes every router's top-k, by mode.

    ``"free"``: ``torch.topk`` of the router's scores, recorded in :attr:`chosen`
    (indices) and :attr:`weights` (the routing weights the block multiplies expert
    outputs by). ``"force"``: the indices of :attr:`imposed` (another model's
    :attr:`chosen`), each choice's score read at those experts; with
    ``force_weights`` also the imposed routing weights.
    """

    def __init__(self) -> None:
        self.mode, self.force_weights = "free", False
        # router name -> top-k indices, routing weights, margins (k-th score minus (k+1)-th)
        self.chosen, self.weights, self.margins = {}, {}, {}
        self.imposed, self.imposed_weights = {}, {}  # what "force" hands back

    def top_k(self, name: str, scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mode == "force":
            indices = self.imposed[name]
            values = scores.gather(-1, indices)
        else:
            values, indices = torch.topk(scores, k, dim=-1)
            if scores.shape[-1] > k:  # how close the k-th choice came to being the (k+1)-th
                next_best = torch.topk(scores, k + 1, dim=-1).values[..., k]
                self.margins[name] = values[..., k - 1] - next_best
        self.chosen[name] = indices
        return values, indices

    def routing_weights(self, name: str, weights: torch.Tensor) -> torch.Tensor:
        if self.mode == "force" and self.force_weights:
            weights = self.imposed_weights[name].to(weights.dtype)
        self.weights[name] = weights
        return weights


def _gpt_oss_router(module: nn.Module, name: str, routing: Routing) -> Callable:
    # transformers.models.gpt_oss.modeling_gpt_oss.GptOssTopKRouter.forward
    def forward(hidden_states):
        router_logits = F.linear(hidden_states, module.weight, module.bias)
        top_value, indices = routing.top_k(name, router_logits, module.top_k)
        scores = F.softmax(top_value, dim=1, dtype=top_value.dtype)
        return router_logits, routing.routing_weights(name, scores), indices
    return forward


def _qwen3_moe_router(module: nn.Module, name: str, routing: Routing) -> Callable:
    # transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter.forward
    def forward(hidden_states):
        hidden_states = hidden_states.reshape(-1, module.hidden_dim)
        router_logits = F.linear(hidden_states, module.weight)
        probs = F.softmax(router_logits, dtype=torch.float, dim=-1)
        top_value, indices = routing.top_k(name, probs, module.top_k)
        if module.norm_topk_prob:
            top_value = top_value / top_value.sum(dim=-1, keepdim=True)
        return router_logits, routing.routing_weights(name, top_value.to(router_logits.dtype)), indices
    return forward


def _jetmoe_router(module: nn.Module, name: str, routing: Routing) -> Callable:
    # transformers.models.jetmoe.modeling_jetmoe.JetMoeTopKGating.forward
    def forward(hidden_states):
        logits = module.layer(hidden_states).float()
        top_k_logits, top_k_indices = routing.top_k(name, logits, module.top_k)
        top_k_gates = torch.softmax(top_k_logits, dim=1).type_as(hidden_states)
        top_k_gates = routing.routing_weights(name, top_k_gates)
        expert_size = torch.bincount(top_k_indices.flatten(), minlength=module.num_experts).tolist()
        _, index_sorted_experts = top_k_indices.flatten().sort(0)
        batch_index = index_sorted_experts.div(module.top_k, rounding_mode="trunc")
        batch_gates = top_k_gates.flatten()[index_sorted_experts]
        return index_sorted_experts, batch_index, batch_gates, expert_size, logits
    return forward


ROUTERS = {"GptOssTopKRouter": _gpt_oss_router, "Qwen3MoeTopKRouter": _qwen3_moe_router,
           "JetMoeTopKGating": _jetmoe_router}


def patch_routers(model: nn.Module) -> Routing:
    """Give every router of ``model`` a forward that takes its top-k through one :class:`Routing`."""
    routing = Routing()
    for name, module in model.named_modules():
        if type(module).__name__ in ROUTERS:
            module.forward = ROUTERS[type(module).__name__](module, name, routing)
    return routing


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


def _moved(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per (token, slot): ``got``'s expert is not among ``want``'s top-k for that token (the
    order within the top-k does not count)."""
    return ~(got.unsqueeze(-1) == want.unsqueeze(-2)).any(-1)


def flipped(got: torch.Tensor, want: torch.Tensor) -> float:
    """Fraction of (token, slot) choices of ``got`` whose expert ``want`` did not choose."""
    return _moved(got, want).float().mean().item()


def first_flips(ref: Routing, other: Routing) -> dict[str, torch.Tensor]:
    """Per router (in execution order), the tokens whose choice ``other`` changed there and
    at no earlier router: flips the int8 arithmetic caused, not an earlier flip."""
    seen, first = None, {}
    for name in ref.chosen:
        changed = _moved(other.chosen[name], ref.chosen[name]).any(-1)
        seen = torch.zeros_like(changed) if seen is None else seen
        first[name], seen = changed & ~seen, changed | seen
    return first


def margin_rank(ref: Routing, other: Routing) -> float:
    """The highest rank of the reference's margin at a first flip among all tokens' margins at
    its router: 0.02, every first flip was among the 2% of tokens closest to a tie (NaN: none)."""
    ranks = []
    for name, changed in first_flips(ref, other).items():
        margins = ref.margins[name]
        ranks += [(margins < m).float().mean().item() for m in margins[changed]]
    return max(ranks) if ranks else float("nan")


def flipped_share(ref: Routing, other: Routing, got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """``(tokens, error)``: the share of tokens with a flipped choice at any router, and
    their share of the squared logit error."""
    tokens = torch.stack(list(first_flips(ref, other).values())).any(0)
    error = (got - want).pow(2).sum(-1).flatten()
    return tokens.float().mean().item(), (error[tokens].sum() / error.sum()).item()


def run_free(model: nn.Module, routing: Routing, tokens: torch.Tensor, ref: Routing, want: torch.Tensor) -> dict:
    """``model``'s own routing: its logit error and flips against the reference."""
    routing.mode = "free"
    got = model(tokens).logits.float()
    return dict(error=relative_error(got, want),
                flips={name: flipped(routing.chosen[name], ref.chosen[name]) for name in ref.chosen},
                margin_rank=margin_rank(ref, routing), share=flipped_share(ref, routing, got, want))


@torch.no_grad()
def measure(family: str, layers: int, seed: int, weight_only: tuple[str, ...]) -> dict:
    """One family and seed: the int8 model's errors free, forced and forced with weights, its
    flips per router; a plain bf16 copy of the reference and, with ``weight_only``, an int8
    model with those layers weight-only, both routing freely."""
    int8, reference = build_pair(family, layers, seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1000 + seed))
    x = torch.randn(BATCH * SEQ, HIDDEN, generator=torch.Generator().manual_seed(seed))
    for name, module in reference.named_modules():  # the routers compute alike: same input, same logits
        if type(module).__name__ in ROUTERS:
            logits = -1 if family == "jetmoe" else 0
            if not torch.equal(int8.get_submodule(name)(x)[logits], module(x)[logits]):
                raise AssertionError(f"{family}: router {name} computes differently in the int8 model")
    unpatched = reference(tokens).logits
    ref_routing, int8_routing = patch_routers(reference), patch_routers(int8)
    want = reference(tokens).logits
    if not torch.equal(want, unpatched):
        raise AssertionError(f"{family}: the patched routers changed the reference's logits")
    routers = list(ref_routing.chosen)

    row = dict(int8=int8_summary(int8), routers=routers, free=run_free(int8, int8_routing, tokens, ref_routing, want))
    int8_routing.mode = "force"
    int8_routing.imposed, int8_routing.imposed_weights = dict(ref_routing.chosen), dict(ref_routing.weights)
    row["forced"] = relative_error(int8(tokens).logits, want)
    row["weight_error"] = max(relative_error(int8_routing.weights[n], ref_routing.weights[n]) for n in routers)
    int8_routing.force_weights = True
    row["forced_weights"] = relative_error(int8(tokens).logits, want)

    bf16 = copy.deepcopy(reference).to(torch.bfloat16)
    row["bf16"] = run_free(bf16, patch_routers(bf16), tokens, ref_routing, want)
    if weight_only:
        variant, variant_reference = build_pair(family, layers, seed, weight_only)
        if not all(torch.equal(a, b) for a, b in zip(variant_reference.state_dict().values(),
                                                     reference.state_dict().values())):
            raise AssertionError(f"{family}: the weight-only variant holds other values")
        row["variant"] = run_free(variant, patch_routers(variant), tokens, ref_routing, want)
        row["variant_int8"] = int8_summary(variant)
    return row


def _percents(values) -> str:
    return " ".join(f"{100 * v:.1f}" for v in values)


def _print_row(family: str, seed: int, row: dict, weight_only: tuple[str, ...]) -> None:
    free = row["free"]
    print(f"{family} seed {seed}: int8 free {100 * free['error']:.2f}%, forced experts {100 * row['forced']:.2f}%, "
          f"forced experts + weights {100 * row['forced_weights']:.2f}%; flips per router (%) "
          f"{_percents(free['flips'].values())}", flush=True)
    print(f"    tokens with a flip: {100 * free['share'][0]:.1f}% of the tokens, {100 * free['share'][1]:.0f}% of the "
          f"squared error; each first flip (no earlier one at that token) among the {100 * free['margin_rank']:.1f}% "
          f"of tokens closest to a tie at its router; routing weights within {100 * row['weight_error']:.2f}% of the "
          "reference's when forced")
    for key, label in (("bf16", "plain bf16 model"), ("variant", f"int8, {'/'.join(weight_only)} weight-only")):
        if key in row:
            print(f"    {label}: {100 * row[key]['error']:.2f}%, flips per router (%) "
                  f"{_percents(row[key]['flips'].values())}", flush=True)


def _spread(values: list[float]) -> str:
    return f"{100 * statistics.mean(values):.2f}% ({100 * min(values):.2f}-{100 * max(values):.2f})"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="model-initialisation seeds; each seed's batch is seeded 1000 + seed")
    parser.add_argument("--layers", type=int, default=4, help="decoder blocks per model")
    parser.add_argument("--families", nargs="+", default=["gpt-oss", "jetmoe", "qwen3-moe"], choices=list(WEIGHT_ONLY),
                        help="gpt-oss: experts in full precision; gpt-oss-int8-experts: int8 too (fsdp_int8 >= bb77e54)")
    parser.add_argument("--variant", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure an int8 model whose router feeders (WEIGHT_ONLY: the layers whose "
                        "output is added to the residual stream a router reads) are weight-only int8")
    parser.add_argument("--log", action="store_true",
                        help="also append a dated section (command, hardware line, output) to "
                        "benchmarks/results/moe_routing.md")
    args = parser.parse_args(argv)

    from benchmarks.report import RunLog
    from fsdp_int8.hardware import hardware_line

    log = RunLog("moe_routing.md", "MoE routing flips under int8 matmuls", "benchmarks.moe_routing", argv) \
        if args.log else None
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    warnings.filterwarnings("ignore", message="fsdp_int8: int8 matmuls .* run slowly")  # known on AVX2 CPUs
    warnings.filterwarnings("ignore", message="quantize_: only")  # the variant's first, weight-only pass
    print(hardware_line())
    print(f"hidden {HIDDEN}, {args.layers} blocks, {EXPERTS} experts top-{TOP_K}, expert ffn {EXPERT_FFN}, "
          f"vocab {VOCAB}; batch {BATCH} x {SEQ} random tokens; fp32 compute, eval mode, eager attention; "
          f"int8 matmuls (Int8MatmulConfig()), rounding to nearest; seeds {args.seeds}\nerrors: ||int8 - ref|| / "
          "||ref|| of the logits; flips: (token, slot) routing choices whose expert differs from the reference's\n")
    results: dict[str, list[dict]] = {}
    for family in args.families:
        results[family] = rows = []
        weight_only = tuple(WEIGHT_ONLY[family]) if args.variant else ()
        for seed in args.seeds:
            row = measure(family, args.layers, seed, weight_only)
            rows.append(row)
            _print_row(family, seed, row, weight_only)
        print(f"  int8 model: {rows[0]['int8']}")
        if "variant_int8" in rows[0]:
            print(f"  variant: {rows[0]['variant_int8']}")
        print(f"  routers: {', '.join(_short(n) for n in rows[0]['routers'])}")
        print()

    columns = [("int8, free routing", lambda r: r["free"]["error"]), ("int8, forced experts", lambda r: r["forced"]),
               ("int8, forced experts + weights", lambda r: r["forced_weights"]),
               ("int8 flipped choices", lambda r: statistics.mean(r["free"]["flips"].values())),
               ("plain bf16 model", lambda r: r["bf16"]["error"]),
               ("bf16 flipped choices", lambda r: statistics.mean(r["bf16"]["flips"].values()))]
    if args.variant:
        columns += [("int8, router feeders weight-only", lambda r: r["variant"]["error"]),
                    ("its flipped choices", lambda r: statistics.mean(r["variant"]["flips"].values()))]
    print(f"Relative logit error against the fp32 reference, and routing choices flipped (mean over routers); "
          f"mean over seeds {' '.join(map(str, args.seeds))} (range), {args.layers} blocks:\n")
    print("| model | " + " | ".join(label for label, _ in columns) + " |\n|---|" + "---:|" * len(columns))
    for family, rows in results.items():
        print(f"| {family} | " + " | ".join(_spread([get(r) for r in rows]) for _, get in columns) + " |")
    if log is not None:
        log.finish()
    return results


if __name__ == "__main__":
    main()
