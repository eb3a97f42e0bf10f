"""The serving picture (as in the Punica and S-LoRA papers): throughput and p99 latencies against offered load,
one line per system, from a ``bench_serving.py`` JSON file.

    python benchmarks/serving_plot.py benchmarks/results/bench_serving.json   # writes bench_serving.png beside it
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PANELS = (("tokens_per_second", "throughput (tokens/s)", 1), ("ttft_p99", "p99 time to first token (s)", 1),
          ("tpot_p99", "p99 time per output token (ms)", 1e3))


def plot(json_path: Path) -> Path:
    """Draw the picture of one benchmark run; returns the PNG's path (the JSON's, with .png)."""
    import matplotlib  # optional: imported here so the module imports without it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads(Path(json_path).read_text())
    figure, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4), constrained_layout=True)
    for name, system in report["systems"].items():
        if not system.get("runs"):
            continue  # the engine on the static subset: a single offline point, used for the ratio only
        rates = [run["offered_requests_per_second"] for run in system["runs"]]
        for ax, (key, _, scale) in zip(axes, PANELS):
            (line,) = ax.plot(rates, [run[key] * scale for run in system["runs"]], marker="o", label=name)
            if key == "tokens_per_second":  # every request at once: the saturation throughput
                ax.axhline(system["saturation"][key], color=line.get_color(), linestyle=":", linewidth=1)
    for key, style, label in (("static_generate", "--", "static generate() (offline)"),
                              ("transformers_continuous_batching", "-.", "transformers CB, base, defaults (offline)")):
        if report.get(key):
            axes[0].axhline(report[key]["tokens_per_second"], color="black", linestyle=style, label=label)
    for ax, (_, label, _) in zip(axes, PANELS):
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)  # from zero: latencies a few milliseconds apart must not look twice as large
        ax.grid(alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=8)
    figure.suptitle(f"punica-hf serving on {report['device']} (dotted: every request at once)", fontsize=10)
    png = Path(json_path).with_suffix(".png")
    figure.savefig(png, dpi=120)
    plt.close(figure)
    return png


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", type=Path, help="a bench_serving.py result")
    print(f"wrote {plot(parser.parse_args().json)}")
