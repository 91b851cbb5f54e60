"""`jitney bench --plot FILE.png`: the run's table as a picture (matplotlib, the `bench` extra)."""

from __future__ import annotations


def plot(report: dict, path: str) -> None:
    """Bars of output tok/s per mode, each labelled with its ratio to transformers' modes and its share of
    the measured matmul roofline; the roofline's own tok/s as a line."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'jitney[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    rates = [r["output_tok_s"] for r in rows]
    fig, ax = plt.subplots(figsize=(1.6 * len(rows) + 3, 4.5))
    bars = ax.bar([r["mode"] for r in rows], rates, color=["#2b6cb0" if r["mode"].startswith("jitney") else "#a0aec0" for r in rows])
    for bar, row in zip(bars, rows):
        ratios = [f"{row[k]:.2f}x {k[3:]}" for k in ("vs_hf-cb", "vs_hf-static") if k in row and not row["mode"].startswith("hf")]
        label = "\n".join([f"{row['output_tok_s']:.1f} tok/s", *ratios, f"{row['roofline_share']:.0%} roofline"])
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                    fontsize=8, xytext=(0, 3), textcoords="offset points")
    roofline = rows[0]["output_tok_s"] / rows[0]["roofline_share"]
    ax.axhline(roofline, color="#c53030", linestyle="--", linewidth=1)
    ax.annotate(f"fp32 matmul roofline {roofline:.0f} tok/s ({report['matmul_peak_gflops']:.0f} GFLOP/s measured)",
                (0, roofline), xytext=(2, 3), textcoords="offset points", fontsize=8, color="#c53030")
    ax.set_ylim(0, max(roofline, *rates) * 1.3)
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"jitney bench: {report['workload']} ({report['requests']} requests, {report['output_tokens']} output tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
