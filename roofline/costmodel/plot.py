"""The two-panel ``roofline cost --plot``: step lower bound vs batch, speculative speedup vs alpha.
matplotlib is imported only when a plot is drawn.
"""

from __future__ import annotations

from pathlib import Path

from roofline import costmodel as cm
from roofline.costmodel.artifact import Device


def write_plot(path: str | Path, shape: cm.ModelShape, hw: Device, formats: list[str], kv_dtype: str,
               context: int, batch: int, gamma: int, draft_cost: float) -> None:
    """Two panels: step lower bound vs batch per format (decode solid, verify of ``gamma + 1`` dashed,
    memory/compute crossover marked), and speculative speedup vs alpha per gamma (free verification)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p, bw, peak = shape.num_params, hw.memory_bandwidth, hw.peak("bf16")
    kv_seq = shape.kv_bytes_per_sequence(context, kv_dtype)
    batches = sorted({*range(1, 16), *(int(round(2 ** (i / 4))) for i in range(4, 45)), batch})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    never: list[str] = []
    for i, f in enumerate(cm.parse_weight_format(x) for x in formats):
        col = colors[i % len(colors)]
        w = cm.weight_bytes(p, f)
        for pos, style, label in ((1, "-", f"{f.name} decode"), (gamma + 1, "--", f"{f.name} verify {gamma + 1}")):
            ys = [cm.step_bound(p, w, kv_seq, b, bw, peak, pos).bound_s * 1e3 for b in batches]
            ax1.plot(batches, ys, style, color=col, label=label)
            cross = cm.min_compute_bound_batch(p, w, kv_seq, bw, peak, pos)
            if cross is not None and cross <= batches[-1]:
                y = cm.step_bound(p, w, kv_seq, cross, bw, peak, pos).bound_s * 1e3
                ax1.plot([cross], [y], "o", color=col, markersize=7)
                ax1.annotate(f"compute-bound\nfrom b={cross}", (cross, y), textcoords="offset points",
                             xytext=(6, -22), fontsize=7, color=col)
        if cm.min_compute_bound_batch(p, w, kv_seq, bw, peak, 1) is None:
            never.append(f.name)
    if never:
        ax1.text(0.02, 0.70, f"decode (1 position) never compute-bound for {', '.join(never)}:\n"
                 "KV bytes per sequence outgrow its FLOPs", transform=ax1.transAxes, ha="left",
                 va="top", fontsize=7)
    ax1.axvline(batch, color="grey", linewidth=0.8, linestyle=":")
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("batch (sequences)")
    ax1.set_ylabel("step time lower bound (ms)")
    ax1.set_title(f"{shape.name} on {hw.name}: step lower bound\n(context {context}, KV {kv_dtype}; "
                  "dots mark memory/compute crossover)", fontsize=9)
    ax1.legend(fontsize=7)
    ax1.grid(True, which="both", alpha=0.3)

    alphas = [i / 200 for i in range(0, 199)]
    for g in range(1, cm.MAX_GAMMA + 1):
        ax2.plot(alphas, [cm.speculative_speedup(a, g, draft_cost) for a in alphas], label=f"gamma {g}")
    ax2.axhline(1.0, color="black", linewidth=0.8)
    ax2.set_xlabel("acceptance rate alpha")
    ax2.set_ylabel("speedup over plain decoding")
    ax2.set_title(f"speculative speedup, free verification, c={draft_cost}\n(Leviathan et al. 2023)", fontsize=9)
    ax2.legend(fontsize=7, ncol=2)
    ax2.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
