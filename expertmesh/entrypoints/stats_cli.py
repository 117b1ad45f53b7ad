"""Expert load statistics for people: the summary `generate` prints, the JSON file
`--expert-stats FILE` writes, and `expertmesh stats plot FILE -o heat.png` (a layer x expert
heatmap; matplotlib, the `plot` extra: pip install 'expertmesh[plot]').

    expertmesh generate --model DIR --prompt "..." --expert-stats load.json
    expertmesh stats show load.json
    expertmesh stats plot load.json -o heat.png
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def summary(stats: dict[str, Any], hottest: int = 3) -> str:
    """A few lines: per layer, tokens, the hottest experts' share, EP ranks' pairs and imbalance."""
    k, lines = stats["top_k"], []
    lines.append(
        f"expert load: {len(stats['layers'])} MoE layers, {stats['num_experts']} experts (top-{k}), "
        f"{stats['num_slots']} slots over {stats['ep_size']} EP rank(s), {stats['steps']} steps, "
        f"mean imbalance {stats['mean_imbalance']:.2f} (max/mean over EP ranks), "
        f"{stats['rebalances']} EPLB rebalance(s)"
    )
    for layer, counts in stats["layers"].items():
        pairs = sum(counts) or 1
        top = sorted(range(len(counts)), key=lambda e: (-counts[e], e))[:hottest]
        hot = ", ".join(f"e{e} {100 * counts[e] / pairs:.0f}%" for e in top)
        ranks = stats["ep_rank_tokens"][layer]
        lines.append(
            f"  layer {layer}: {stats['tokens'][layer]} tokens; hottest {hot}; EP rank pairs {ranks}, "
            f"imbalance {stats['imbalance'][layer]:.2f}"
        )
    return "\n".join(lines)


def write_json(stats: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(stats, f, indent=1)
        f.write("\n")


def read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            stats = json.load(f)
        stats["layers"] = {int(k): v for k, v in stats["layers"].items()}
        for key in ("tokens", "ep_rank_tokens", "imbalance", "last_step", "placement"):
            stats[key] = {int(k): v for k, v in stats.get(key, {}).items()}
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        raise SystemExit(f"expertmesh stats: {path} is not an --expert-stats file ({exc})") from exc
    return stats


def plot(stats: dict[str, Any], out: str, title: str | None = None) -> None:
    """Layer x expert heatmap of each layer's share of routed pairs, EP ranks' imbalance beside it."""
    try:  # optional dependency (matplotlib): only --plot needs it
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("expertmesh stats plot needs matplotlib: pip install 'expertmesh[plot]'") from exc
    layers = sorted(stats["layers"])
    share = [[c / (sum(stats["layers"][i]) or 1) for c in stats["layers"][i]] for i in layers]
    fig, ax = plt.subplots(
        figsize=(max(4.0, 0.35 * stats["num_experts"] + 2), max(2.5, 0.3 * len(layers) + 1.5))
    )
    image = ax.imshow(share, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer (EP imbalance)")
    ax.set_yticks(range(len(layers)), [f"{i} ({stats['imbalance'][i]:.2f})" for i in layers])
    if stats["num_experts"] <= 64:
        ax.set_xticks(range(stats["num_experts"]))
    fig.colorbar(image, ax=ax, label="share of pairs")
    tokens = stats["tokens"][layers[0]] if layers else 0
    default = f"{tokens} tokens, top-{stats['top_k']}, {stats['ep_size']} EP rank(s)"
    ax.set_title(title or default, fontsize=9, wrap=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def add_parser(sub: Any) -> None:
    stats = sub.add_parser("stats", help="show or plot an --expert-stats file")
    what = stats.add_subparsers(dest="stats_command", required=True)
    show = what.add_parser("show", help="print the summary of an --expert-stats file")
    show.add_argument("file")
    draw = what.add_parser("plot", help="draw a layer x expert heatmap (needs matplotlib)")
    draw.add_argument("file")
    draw.add_argument("-o", "--output", required=True, help="image file to write (.png, .svg, ...)")
    draw.add_argument("--title", default=None, help="the plot's title (default: tokens and top-k)")


def main(args: argparse.Namespace) -> int:
    stats = read_json(args.file)
    if args.stats_command == "show":
        print(summary(stats))
        return 0
    plot(stats, args.output, args.title)
    print(f"wrote {args.output}")
    return 0
