"""Tables, target checks and the plot of a benchmark run (works on the JSON record)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

MiB = 2**20

# Targets of the speed work (see docs/benchmarks.md).
FLOP_TARGET = {"seq_len": 4096, "d": 1024, "p": 1024, "sketch_size": 32, "max_ratio": 0.01}
SLOPE_TARGET = 1.05  # log-log slope of the estimators' peak memory in T ("linear in T")
STEP_TARGET_SHAPES = ("T=2048,d=512,b=1", "T=4096,d=256,b=2", "T=512,d=768,b=8")
STEP_TIME_TARGET = 1.5
STEP_MEMORY_TARGET = 1.10
#: (time, memory) targets per randomized configuration: two-pass and book-keeping.
STEP_TARGETS = {
    "randomized": (STEP_TIME_TARGET, STEP_MEMORY_TARGET),
    "randomized_bk": (1.2, 1.5),
    "randomized_bk_ghost": (1.2, 1.5),
}
# Figures measured before this benchmark existed (Opacus hooks / Opacus ghost), for reference.
REFERENCE = {
    "T=2048,d=512,b=1": {"hooks": (1.35, 1.23), "ghost": (4.01, 2.36)},
    "T=4096,d=256,b=2": {"hooks": (1.16, 1.04), "ghost": (6.34, 2.11)},
    "T=512,d=768,b=8": {"hooks": (1.41, 1.86), "ghost": (2.03, 1.62)},
}


def _fmt(x: Optional[float], spec: str = ".2f", suffix: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{suffix}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _by_shape(
    records: Sequence[dict], value: Callable[[dict], Any]
) -> List[Tuple[Tuple[int, int, int, int], Dict[str, Any]]]:
    """``((d, p, batch, seq_len), {method: value(record)})`` per layer shape and T, sorted."""
    by_key: Dict[Tuple[int, int, int, int], Dict[str, Any]] = {}
    for r in records:
        by_key.setdefault((r["d"], r["p"], r["batch"], r["seq_len"]), {})[r["method"]] = value(r)
    return sorted(by_key.items())


def layer_table(layers: Sequence[dict]) -> str:
    """FLOPs (GFLOP) and peak extra memory (MiB) per shape and T, with ratios to ghost."""
    rows = []
    for (d, p, b, t), m in _by_shape(layers, lambda r: r):
        ghost = m.get("ghost")
        row = [f"{d}x{p}", str(b), str(t)]
        for name in ("ghost", "fgc", "hutchinson", "hutchpp"):
            r = m.get(name)
            if r is None:
                row.append("-")
                continue
            cell = f"{r['flops'] / 1e9:.3g} GF, {r['peak_bytes'] / MiB:.3g} MiB"
            if ghost and name != "ghost" and ghost["flops"]:
                cell += f" ({r['flops'] / ghost['flops']:.3g}x F, {r['peak_bytes'] / ghost['peak_bytes']:.2g}x M)"
            row.append(cell)
        rows.append(row)
    header = ["d x p", "B", "T", "Opacus ghost", "FGC", "Hutchinson k", "Hutch++ k+k"]
    return _table(header, rows)


def layer_time_table(layer_times: Sequence[dict]) -> str:
    rows = []
    for (d, p, b, t), m in _by_shape(layer_times, lambda r: r["time_s"]):
        ghost = m.get("ghost")
        cells = [f"{d}x{p}", str(b), str(t)]
        for name in ("ghost", "fgc", "hutchinson", "hutchpp"):
            s = m.get(name)
            ratio = f" ({s / ghost:.2g}x)" if (s is not None and ghost and name != "ghost") else ""
            cells.append("-" if s is None else f"{1e3 * s:.1f} ms{ratio}")
        rows.append(cells)
    return _table(["d x p", "B", "T", "ghost", "FGC", "Hutchinson", "Hutch++"], rows)


def fit_table(fits: Sequence[dict]) -> str:
    rows = [
        [
            f["method"], f"{f['d']}x{f['p']}", str(f["batch"]),
            f"{f['slope_loglog']:.2f}", f"{f['slope_loglog_upper']:.2f}",
            f"{f['linear_bytes_per_token']:.4g}", f"{f['linear_intercept_bytes'] / MiB:.3g}",
            f"{100 * f['linear_max_rel_residual']:.1f}%",
        ]
        for f in sorted(fits, key=lambda f: (f["d"], f["p"], f["method"]))
    ]
    header = ["method", "d x p", "B", "log-log slope", "slope (upper half of T)",
              "bytes / token", "intercept MiB", "max linear-fit residual"]
    return _table(header, rows)


def step_table(steps: Sequence[dict], ratios: Sequence[dict]) -> str:
    """Median step time and memory per config, as multiples of non-private training."""
    ratio = {(r["shape"], r["config"]): r for r in ratios}
    rows = []
    for s in steps:
        r = ratio.get((s["shape"], s["config"]), {})
        ph = s["phases_s"]
        rows.append(
            [
                s["shape"], s["config"], f"{s['time_s']:.2f}",
                _fmt(r.get("time_ratio"), ".2f", "x"),
                _fmt(r.get("time_ratio_min"), ".2f", "x"),
                f"{s['peak_bytes'] / MiB:.0f}", _fmt(r.get("peak_ratio"), ".2f", "x"),
                _fmt(None if s.get("rss_growth_bytes") is None else s["rss_growth_bytes"] / MiB, ".0f"),
                _fmt(r.get("rss_growth_ratio"), ".2f", "x"),
                " / ".join(
                    _fmt(ph.get(k), ".2f") for k in ("forward", "backward1", "norms", "backward2", "optimizer")
                ) if "backward1" in ph else
                f"{ph['forward']:.2f} / {ph['backward']:.2f} / - / - / {ph['optimizer']:.2f}",
            ]
        )
    header = ["shape", "config", "step s", "time", "time (min)", "peak MiB", "peak", "RSS growth MiB",
              "RSS growth", "fwd / bwd1 / norms / bwd2 / opt (s)"]
    return _table(header, rows)


def check_targets(record: dict) -> List[dict]:
    """Whether each target of the speed work holds in this run's figures."""
    out: List[dict] = []
    layers = record.get("layers", [])
    t = FLOP_TARGET
    pick = {
        r["method"]: r for r in layers
        if (r["seq_len"], r["d"], r["p"], r["sketch_size"]) == (t["seq_len"], t["d"], t["p"], t["sketch_size"])
    }
    if "ghost" in pick:
        for m in ("hutchinson", "hutchpp"):
            if m in pick:
                ratio = pick[m]["flops"] / pick["ghost"]["flops"]
                out.append({
                    "target": f"norm FLOPs {m} / ghost at T=4096, k=32, d=p=1024 <= 1/100",
                    "value": ratio, "holds": ratio <= t["max_ratio"],
                })
    for f in record.get("layer_fits", []):
        if f["method"] in ("hutchinson", "hutchpp"):
            out.append({
                "target": f"{f['method']} peak memory linear in T ({f['d']}x{f['p']}, B={f['batch']}): "
                          f"log-log slope <= {SLOPE_TARGET}",
                "value": f["slope_loglog"], "holds": f["slope_loglog"] <= SLOPE_TARGET,
            })
    for r in record.get("step_ratios", []):
        if r["shape"] not in STEP_TARGET_SHAPES or r["config"] not in STEP_TARGETS:
            continue
        time_target, memory_target = STEP_TARGETS[r["config"]]
        out.append({
            "target": f"{r['config']} step time {r['shape']} <= {time_target}x non-private",
            "value": r["time_ratio"], "holds": r["time_ratio"] <= time_target,
        })
        for key, what in (("rss_growth_ratio", "peak-RSS growth"), ("peak_ratio", "peak live bytes")):
            if r.get(key) is not None:
                out.append({
                    "target": f"{r['config']} {what} {r['shape']} <= {memory_target}x non-private",
                    "value": r[key], "holds": r[key] <= memory_target,
                })
    return out


def target_table(targets: Sequence[dict]) -> str:
    rows = [[t["target"], f"{t['value']:.4g}", "yes" if t["holds"] else "**no**"] for t in targets]
    return _table(["target", "measured", "holds"], rows)


def markdown(record: dict) -> str:
    """All tables of a run as Markdown."""
    parts = []
    if record.get("layers"):
        parts += ["### Per layer: norm computation (meta device, FLOPs of matrix products, peak extra bytes)",
                  layer_table(record["layers"])]
    if record.get("layer_fits"):
        parts += ["### Peak memory against T (fits)", fit_table(record["layer_fits"])]
    if record.get("layer_times"):
        parts += ["### Per layer: CPU time of the norm computation (median, interleaved)",
                  layer_time_table(record["layer_times"])]
    if record.get("steps"):
        parts += ["### Per step (medians; ratios to non-private training on the same shape)",
                  step_table(record["steps"], record.get("step_ratios", []))]
    targets = check_targets(record)
    if targets:
        parts += ["### Targets", target_table(targets)]
    return "\n\n".join(parts) + "\n"


def plot(record: dict, path: str) -> None:
    """Three panels: norm FLOPs and peak memory against T (log-log), step-time ratios."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    layers = record.get("layers", [])
    shapes = sorted({(r["d"], r["p"]) for r in layers})
    for ax, key, label in ((axes[0], "flops", "norm FLOPs"), (axes[1], "peak_bytes", "peak extra bytes")):
        for (d, p), style in zip(shapes, ("-", "--", ":", "-.")):
            for method, color in zip(("ghost", "fgc", "hutchinson", "hutchpp"), ("C0", "C1", "C2", "C3")):
                pts = sorted((r["seq_len"], r[key]) for r in layers
                             if (r["d"], r["p"], r["method"]) == (d, p, method))
                if pts:
                    ax.loglog(*zip(*pts), style, color=color, marker="o", ms=3,
                              label=f"{method} {d}x{p}")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel(label)
        ax.set_title(f"per layer, B={layers[0]['batch'] if layers else 1}: {label}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=6, ncol=2)
    ratios = [r for r in record.get("step_ratios", []) if r["config"] != "nonprivate"]
    labels = list(dict.fromkeys(r["shape"] for r in ratios))
    configs = list(dict.fromkeys(r["config"] for r in ratios))
    width = 0.8 / max(1, len(configs))
    for j, config in enumerate(configs):
        vals = [next((r["time_ratio"] for r in ratios if r["shape"] == s and r["config"] == config), 0)
                for s in labels]
        axes[2].bar([i + j * width for i in range(len(labels))], vals, width, label=config)
    axes[2].axhline(1.0, color="k", lw=0.8)
    axes[2].axhline(STEP_TIME_TARGET, color="r", lw=0.8, ls="--", label="target 1.5x")
    axes[2].set_xticks([i + width * (len(configs) - 1) / 2 for i in range(len(labels))])
    axes[2].set_xticklabels(labels, rotation=20, fontsize=7)
    axes[2].set_ylabel("step time / non-private")
    axes[2].set_title("per step (2-block decoder, CPU)")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
