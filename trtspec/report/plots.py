"""The report's figures: speedup vs D with CI bars, AL per category, TTFT/TPOT CDFs and
predicted vs measured speedup, as base64 PNGs for the self-contained report.html."""

from __future__ import annotations

from typing import Any

from trtspec.analysis.decide import Verdict
from trtspec.analysis.extract import tpot
from trtspec.analysis.records import condition_parts


def plots(verdicts: list[Verdict], decision: dict[str, Any], records: list[dict[str, Any]],
          summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(title, base64 PNG) for: speedup vs D with CI bars per concurrency; AL per category;
    TTFT and TPOT CDFs baseline vs spec; predicted vs measured speedup."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    series: dict[tuple[str, str, bool], list[tuple[float, Verdict]]] = {}
    chosen = decision.get("draft_lengths") or {}
    for v in verdicts:
        if v.category == "all" and v.speedup == v.speedup:
            method, d, _ = condition_parts(v.condition)
            c = v.condition.split("/")[2]
            if isinstance(d, int):
                series.setdefault((method, c, False), []).append((d, v))
            elif v.condition in chosen:  # adaptive: a point at its mean chosen D
                series.setdefault((method, c, True), []).append((chosen[v.condition]["mean"], v))
    for (method, c, adaptive), points in sorted(series.items()):
        points.sort(key=lambda p: p[0])
        xs = [x for x, _ in points]
        ys = [v.speedup for _, v in points]
        # no interval (too few independent units): a point without a bar
        err = [[y - v.ci[0] if v.ci[0] == v.ci[0] else 0.0 for y, (_, v) in
                zip(ys, points, strict=True)],
               [v.ci[1] - y if v.ci[1] == v.ci[1] else 0.0 for y, (_, v) in
                zip(ys, points, strict=True)]]
        ax.errorbar(xs, ys, yerr=err, marker="*" if adaptive else "o", capsize=4,
                    markersize=11 if adaptive else 6, linestyle="none" if adaptive else "-",
                    label=f"{method} {c}" + (" adaptive (at mean D)" if adaptive else ""))
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xlabel="D (draft length)", ylabel="speedup (baseline / spec)",
           title="Speedup vs D, 95 % CI")
    _legend(ax, 8)
    out.append(("Speedup vs D per concurrency (95 % paired-bootstrap CI)", _png(fig)))

    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    conditions = [k for k in summary if summary[k].get("spec", {}).get("categories")]
    cats = sorted({c for k in conditions for c in summary[k]["spec"]["categories"]})
    width = 0.8 / max(len(conditions), 1)
    for i, key in enumerate(conditions):
        values = [summary[key]["spec"]["categories"].get(c, {}).get("al_pooled", 0) for c in cats]
        ax.bar([j + i * width for j in range(len(cats))], values, width, label=key)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cats))], cats, rotation=45,
                  ha="right", fontsize=7)
    ax.set(ylabel="AL (pooled)", title="Acceptance length per category")
    _legend(ax, 7)
    out.append(("AL (pooled) per category", _png(fig)))

    fig, axes = plt.subplots(1, 2, figsize=(8.5, 3.4))
    keys = sorted({r["condition"] for r in records})
    for ax, (label, value) in zip(axes, (("TTFT ms", lambda r: r["ttft_s"]),
                                         ("TPOT ms", tpot)), strict=True):
        for i, key in enumerate(keys):
            for arm, style in (("baseline", "--"), ("spec", "-")):
                xs = sorted(1e3 * x for r in records if r["condition"] == key and
                            r["arm"] == arm and (x := value(r)) is not None)
                if xs:
                    ax.plot(xs, [(j + 1) / len(xs) for j in range(len(xs))], style,
                            color=f"C{i}", label=f"{key} {arm}")
        ax.set(xlabel=label, ylabel="fraction of requests", title=f"{label} CDF")
        _arm_legend(ax, keys)
    out.append(("TTFT and TPOT CDFs, baseline (dashed) vs spec (solid)", _png(fig)))

    fig, ax = plt.subplots(figsize=(4.2, 3.6))
    for key, m in decision["cost_model"].items():
        ax.scatter(m["predicted_speedup"], m["measured_speedup"], label=key)
    top = max([1.5] + [max(m["predicted_speedup"], m["measured_speedup"])
                       for m in decision["cost_model"].values()])
    ax.plot([0, top], [0, top], color="grey", lw=0.8)
    ax.set(xlabel="predicted (Leviathan)", ylabel="measured", title="Predicted vs measured")
    _legend(ax, 7)
    out.append(("Cost model: predicted vs measured speedup", _png(fig)))
    return out


def _legend(ax: Any, size: int) -> None:
    if ax.get_legend_handles_labels()[0]:  # nothing plotted: no empty-legend warning
        ax.legend(fontsize=size)


def _arm_legend(ax: Any, keys: list[str]) -> None:
    """One entry per condition (its colour) and one per arm (dashed baseline, solid spec):
    readable where a "condition arm" entry per line would be twice as long."""
    from matplotlib.lines import Line2D

    if not ax.get_lines():
        return
    handles = [Line2D([], [], color=f"C{i}", label=key) for i, key in enumerate(keys)]
    handles += [Line2D([], [], color="grey", linestyle="--", label="baseline"),
                Line2D([], [], color="grey", linestyle="-", label="spec")]
    ax.legend(handles=handles, fontsize=6, loc="lower right")


def _png(fig: Any) -> str:
    import base64
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()
