"""Tune UniEP's kernel schedule on this GPU and cache the choice for ``config = "auto"``.

    python scripts/tune.py CONFIG.toml [--top 8]
    python scripts/tune.py --shape DIM,HIDDEN,EXPERTS,TOPK --tokens 16384 [--top 8]
    python scripts/tune.py --describe

Ranks the whole schedule space with the cost model, measures the best ``--top``
predictions, the default config and its best-predicted one-knob neighbours (forward+backward, median of CUDA-event timings),
then flips each switch the model does not rank (``uniep.tune.space.SWITCHES``) on the
fastest point, keeping a flip 1% faster than that point timed before and after it in
each of 3 rounds; writes the fastest into the tuning cache (keyed by device, EP degree,
shape and 4096-token bucket) and prints the cost model's error against the measurements.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def shape_from_toml(path: str):
    """(MoEShape, tokens per rank, EP degree, score func, score before experts) of a training config."""
    try:
        import tomllib
    except ModuleNotFoundError:
        import tomli as tomllib
    from torchtitan.protocols.train_spec import get_train_spec

    from recipes.models import register_all
    from uniep.tune import MoEShape

    register_all()
    with open(path, "rb") as f:
        toml = tomllib.load(f)
    args = get_train_spec(toml["model"]["name"]).model_args[toml["model"]["flavor"]]
    moe = args.moe_args
    training = toml.get("training", {})
    tokens = training.get("local_batch_size", 8) * training.get("seq_len", 2048)
    ep = toml.get("parallelism", {}).get("expert_parallel_degree", 1)
    shape = MoEShape(args.dim, args.moe_inter_dim, moe.num_experts, moe.top_k)
    return shape, tokens, ep, moe.score_func, moe.score_before_experts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", nargs="?", help="training TOML to take the layer shape from")
    parser.add_argument("--shape", help="DIM,HIDDEN,EXPERTS,TOPK (instead of a config)")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per GPU (with --shape)")
    parser.add_argument("--top", type=int, default=8, help="predicted candidates to measure")
    parser.add_argument("--local-search", type=int, default=8,
                        help="also measure up to N one-knob neighbours of the default config")
    parser.add_argument("--describe", action="store_true", help="print the space and exit")
    parser.add_argument("--json", help="write every measured point (knobs, predicted, measured) here, as it goes")
    args = parser.parse_args()

    from uniep.tune import MoEShape, describe, device_spec, rank

    if args.describe:
        print(describe())
        return
    if args.config:
        shape, tokens, ep, score_func, score_before = shape_from_toml(args.config)
    elif args.shape:
        try:
            shape = MoEShape(*map(int, args.shape.split(",")))
            tokens, ep, score_func, score_before = args.tokens, 1, "softmax", False
        except (TypeError, ValueError):
            parser.error(f"--shape {args.shape!r}: expected four integers DIM,HIDDEN,EXPERTS,TOPK")
    else:
        parser.error("give a CONFIG.toml or --shape")

    import torch

    if not torch.cuda.is_available():
        sys.exit("tune.py measures on a CUDA GPU; none is visible")
    if ep != 1:
        print(f"note: the config has expert-parallel degree {ep}; the Triton kernels tune the single-rank block "
              f"(tokens per rank {tokens}), cached under EP 1")
        ep = 1
    spec = device_spec()
    print(f"device {spec.name}: matmul {spec.matmul_flops / 1e12:.0f} TFLOP/s, "
          f"copy {spec.copy_bytes_per_s / 1e12:.2f} TB/s (measured, cached)")
    start = time.perf_counter()
    rank(shape, tokens, spec, top=1)
    print(f"cost model: full space searched in {time.perf_counter() - start:.3f} s")

    from uniep.tune.measure import tune

    def save(results):
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"shape": shape.key(), "tokens": tokens, "device": spec.name, "results": results}, f, indent=1)

    report = tune(shape, tokens, spec, top=args.top, ep_size=ep, score_func=score_func,
                  score_before_experts=score_before, local_search=args.local_search, on_result=save)
    print(summary(report, shape, tokens))


def summary(report: dict, shape, tokens: int) -> str:
    """The measured points as a table, fastest first, then the best against the default."""
    lines = ["", "| candidate | predicted ms | measured ms |", "|---|---|---|"]
    for r in sorted(report["results"], key=lambda r: r["measured_ms"]):
        lines.append(f"| {r['label']} | {r['predicted_ms']:.3f} | {r['measured_ms']:.3f} |")
    lines.append("")
    best, default_ms = report["best"], report["default_ms"]
    if best["label"] == "default":
        lines.append(f"the default is the fastest point measured: {best['measured_ms']:.3f} ms (median of its timings)")
    elif default_ms is not None:
        lines.append(f"best {best['measured_ms']:.3f} ms ({best['label']}) vs default {default_ms:.3f} ms "
                     f"(medians of their timings): {default_ms / best['measured_ms']:.2f}x")
    lines.append(f"cost-model error vs measured: median {report['median_error']:.1%}, "
                 f"worst {report['worst_error']:.1%}")
    lines.append(f"cached for {shape.key()}, {tokens} tokens: {best['knobs']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
