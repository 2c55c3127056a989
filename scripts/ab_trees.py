"""The UniEP layer from two source trees, timed in turns on one GPU: whether a change (or
the commits since an old one) made the layer faster or slower, nothing else changed.

    mkdir -p ../old && git archive OLD uniep scripts | tar -x -C ../old
    python scripts/ab_trees.py ../old . [--shapes qwen3,qwen3_4k] [--rounds 2] [--calls 20] [--warmup 3]

Each tree's layer runs in a process of its own (one process cannot import two versions
of ``uniep``): the tree's ``uniep`` and the ``build_layers`` of its
``scripts/bench_moe.py``, so both trees' layers get the same weights and inputs. The
timing is this script's, the same for both. The trees take turns, ``--rounds`` rounds at
each shape (a GPU's speed drifts during a run as much as the differences sought). Per
process: the median of ``--calls`` forward+backward calls synchronized one at a time
(the host's work before the first large kernel counted), the time per call of
``--calls`` calls issued back to back (the median of 3 runs; the host's lead hidden, as
across the layers of a training step), and the host's time to issue one call; and a
digest of the output's and the input gradient's bits. Prints each tree's medians over
the rounds, the second tree's times over the first's, and whether the bits agree.
``--device cpu`` runs the Triton interpreter on the ``tiny`` shape (tests the script;
its times say nothing about a GPU).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

_RESULT = "ab_trees result: "
"""The child's result line starts with this."""


def _tree_bench(tree: Path):
    """The tree's ``scripts/bench_moe.py`` as a module, after checking that ``uniep`` is the tree's."""
    import uniep

    package = Path(uniep.__file__).resolve().parent
    if package != (tree / "uniep").resolve():
        raise SystemExit(f"ab_trees: imported uniep from {package}, not from the tree {tree}")
    path = tree / "scripts" / "bench_moe.py"
    spec = importlib.util.spec_from_file_location("ab_trees_bench_moe", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    return bench


def _digest(t) -> str:
    return hashlib.sha256(t.detach().float().cpu().numpy().tobytes()).hexdigest()[:16]


def measure_tree(tree: Path, shape: str, calls: int, warmup: int, device: str) -> dict:
    """One process's measurements of the tree's layer at ``shape`` (see the module docstring)."""
    import torch

    bench = _tree_bench(tree)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    _, layer, T, D, *_ = bench.build_layers(shape, dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(1, T, D, device=device, dtype=dtype, generator=gen)
    grad = torch.randn(1, T, D, device=device, dtype=dtype, generator=gen)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step():
        xi = x.detach().requires_grad_(True)
        out = layer(xi)
        out.backward(grad)
        layer.zero_grad(set_to_none=True)
        return out, xi.grad

    out, grad_x = step()
    bits = {"out": _digest(out), "grad x": _digest(grad_x)}
    for _ in range(warmup):  # after the first call's compiles: the allocator's cache, the clocks
        step()
    sync()

    def elapsed_ms(run) -> tuple[float, float]:
        """(device ms, host ms) of ``run()``: CUDA events on a GPU, else the host clock."""
        sync()
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            host = time.perf_counter()
            start.record()
            run()
            end.record()
            host = time.perf_counter() - host
            sync()
            return start.elapsed_time(end), host * 1e3
        host = time.perf_counter()
        run()
        host = (time.perf_counter() - host) * 1e3
        return host, host

    synchronized = [elapsed_ms(step) for _ in range(calls)]

    def back_to_back():
        for _ in range(calls):
            step()

    runs = [elapsed_ms(back_to_back)[0] / calls for _ in range(3)]
    return {"synchronized_ms": statistics.median(t for t, _ in synchronized),
            "back_to_back_ms": statistics.median(runs),
            "host_issue_ms": statistics.median(h for _, h in synchronized), "bits": bits}


def run_child(tree: Path, shape: str, calls: int, warmup: int, device: str) -> dict:
    """``measure_tree`` in a fresh process whose ``uniep`` is the tree's."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])))
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    # (this script's folder, first on the child's path, holds no uniep; the tree's bench_moe.py puts its own first)
    cmd = [sys.executable, __file__, "--child", str(tree), shape, str(calls), str(warmup), device]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    results = [line for line in done.stdout.splitlines() if line.startswith(_RESULT)]
    if done.returncode != 0 or not results:
        raise SystemExit(f"ab_trees: the run of tree {tree} at {shape} failed (exit {done.returncode}):\n"
                         f"{(done.stdout + done.stderr)[-3000:]}")
    return json.loads(results[-1][len(_RESULT):])


def compare(trees: list[Path], shapes: list[str], rounds: int, calls: int, warmup: int, device: str,
            log=print) -> list[dict]:
    """Rows of (shape, tree, the medians over the rounds, each round's times, bits), the
    trees in turns within each round."""
    rows = []
    for shape in shapes:
        runs = [[] for _ in trees]
        for r in range(rounds):
            for tree, got in zip(trees, runs):
                result = run_child(tree, shape, calls, warmup, device)
                got.append(result)
                log(f"[ab_trees] {shape} round {r + 1}/{rounds} {tree}: synchronized "
                    f"{result['synchronized_ms']:.3f} ms, back to back {result['back_to_back_ms']:.3f} ms, "
                    f"host issue {result['host_issue_ms']:.3f} ms")
        for tree, got in zip(trees, runs):
            rows.append({"shape": shape, "tree": str(tree),
                         **{key: statistics.median(g[key] for g in got)
                            for key in ("synchronized_ms", "back_to_back_ms", "host_issue_ms")},
                         "rounds": got, "bits": got[0]["bits"]})
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: each tree's medians, then per shape the second tree's times over the first's."""
    lines = ["| shape | tree | synchronized ms | back to back ms | host issue ms | rounds (synchronized) |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        rounds = " / ".join(f"{g['synchronized_ms']:.3f}" for g in row["rounds"])
        lines.append(f"| {row['shape']} | {row['tree']} | {row['synchronized_ms']:.3f} | {row['back_to_back_ms']:.3f} "
                     f"| {row['host_issue_ms']:.3f} | {rounds} |")
    for shape in dict.fromkeys(row["shape"] for row in rows):
        first, second = [row for row in rows if row["shape"] == shape][:2]
        same = first["bits"] == second["bits"]
        lines.append(f"\n{shape}: {second['tree']} / {first['tree']}: synchronized "
                     f"{second['synchronized_ms'] / first['synchronized_ms']:.3f}, back to back "
                     f"{second['back_to_back_ms'] / first['back_to_back_ms']:.3f}; "
                     f"{'the same bits' if same else 'other bits'} (out, grad x)")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        tree, shape, calls, warmup, device = sys.argv[2:7]
        print(_RESULT + json.dumps(measure_tree(Path(tree), shape, int(calls), int(warmup), device)), flush=True)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trees", nargs=2, type=Path, help="two source trees, each with uniep/ and scripts/bench_moe.py")
    parser.add_argument("--shapes", default="qwen3,qwen3_4k", help="bench_moe.py shapes, comma-separated")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="calls after the first, before timing")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    for tree in args.trees:
        missing = [p for p in ("uniep/__init__.py", "scripts/bench_moe.py") if not (tree / p).is_file()]
        if missing:
            parser.error(f"tree {tree} lacks {', '.join(missing)}")
    if args.rounds < 1 or args.calls < 1 or args.warmup < 0:
        parser.error(f"--rounds = {args.rounds}, --calls = {args.calls}, --warmup = {args.warmup}: allowed values: "
                     "rounds and calls 1 or more, warmup 0 or more")
    shapes = args.shapes.split(",")
    if args.device == "cpu" and shapes != ["tiny"]:
        parser.error(f"--device cpu runs the shape tiny only; got --shapes {args.shapes}")
    rows = compare([tree.resolve() for tree in args.trees], shapes, args.rounds, args.calls, args.warmup, args.device)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
