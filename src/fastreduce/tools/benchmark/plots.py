"""--plot: latency, algbw and busbw against message size, one line per column.

matplotlib is imported inside the functions: an optional, heavy dependency that only
--plot needs."""

from __future__ import annotations

import math

from ...sizes import format_size
from .collectives import COLLECTIVES, bus_factor


def _columns(meta: dict, rows: list[dict], peers, group_size: int) -> list[tuple]:
    """(label, latency in us per row, busbw factor, is fastreduce) for every column."""
    def factor(p):
        return bus_factor(meta.get("collective", "allreduce"), p)

    modes = meta.get("gpu_modes") or [None]
    first = modes[0] or (meta.get("gpu_paths") or {}).get("mode")
    label = f"fastreduce ({first})" if len(modes) > 1 and first else "fastreduce"
    out = [(label, [r["avg_us"] for r in rows], factor(group_size), True)]
    for mode in modes[1:]:
        out.append((f"fastreduce ({mode})", [r["modes"][mode]["avg_us"] for r in rows],
                    factor(group_size), True))
    whole = meta.get("communicator", "all ranks") == "all ranks"
    for name in peers:
        if name.startswith("torch") and not whole:  # torch.distributed: the whole world
            out.append((f"{name} (all {meta['ranks']} ranks)",
                        [r["peers"][name] for r in rows], factor(meta["ranks"]), False))
        else:
            out.append((name, [r["peers"][name] for r in rows], factor(group_size),
                        name == "unsegmented"))
    return out


def _size_ticks(lo: float, hi: float) -> list[int]:
    """Powers of two from about lo to hi, evenly spaced in doublings: 4 to 6 from the
    smallest size to the largest where the spacing allows, else at most 5 from the smallest."""
    first, last = math.ceil(math.log2(lo) - 0.01), math.floor(math.log2(hi) + 0.01)
    if first > last:  # no power of two in range (one size, not a power of two): the sizes
        return sorted({int(lo), int(hi)})
    first, span = max(first, 0), max(last - max(first, 0), 0)
    step = next((s for s in range(1, span + 1) if span % s == 0 and 3 <= span // s <= 5),
                None) or next(s for s in range(1, span + 2) if span // s <= 4)
    return [1 << e for e in range(first, first + span + 1, step)]


def _log_y(ax, values) -> None:
    """Log y axis with plain numbers (0.5, 1, 2, 5, 10), enough of them to read a value."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # optional dep

    good = [v for v in values if v > 0 and math.isfinite(v)]
    decades = math.log10(max(good) / min(good)) if good else 0
    subs = (1.0, 2.0, 5.0) if decades < 2.5 else (1.0, 3.0) if decades < 4 else (1.0,)
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def plot(path: str, meta: dict, rows: list[dict], peers=(), group_size: int | None = None):
    """Latency, algbw and busbw against message size, log axes, one line per column (the
    same colour and marker in each panel), the legend below the panels. Returns the figure."""
    import matplotlib  # here, not at the top: optional, heavy, needed by --plot alone

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter

    group_size = group_size or meta["ranks"]
    sizes = [r["bytes"] for r in rows]
    columns = _columns(meta, rows, peers, group_size)
    fig, (lat, alg, bus) = plt.subplots(1, 3, figsize=(13, 4.6), sharex=True)
    markers = "osD^vP*Xhp"
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    nan = float("nan")
    values = {lat: [], alg: [], bus: []}
    for i, (label, us, factor, ours) in enumerate(columns):
        style = dict(color=colours[i % len(colours)], marker=markers[i % len(markers)],
                     markersize=4.5, linewidth=2.2 if i == 0 else 1.4,
                     linestyle="-" if ours else "--", label=label)
        us = [u if u > 0 and math.isfinite(u) else nan for u in us]
        algbw = [n / (u * 1e-6) / 1e9 for n, u in zip(sizes, us, strict=True)]
        busbw = [a * factor if factor else nan for a in algbw]
        for ax, ys in ((lat, us), (alg, algbw), (bus, busbw)):
            ax.plot(sizes, ys, **style)
            values[ax] += ys
    collective = meta.get("collective", "allreduce")
    formula = COLLECTIVES[collective].factor.replace("p-1", "p\u22121")
    what = "all-reduce" if collective == "allreduce" else collective
    lat.set_title("latency (lower is better)", fontsize=10)
    alg.set_title("algbw = size / time", fontsize=10)
    bus.set_title(f"busbw = algbw \u00b7 {formula}  (nccl-tests)", fontsize=10)
    lat.set_ylabel(f"time per {what} (\u00b5s)")
    alg.set_ylabel("algbw (GB/s, 10\u2079 bytes/s)")
    bus.set_ylabel("busbw (GB/s, 10\u2079 bytes/s)")
    ticks = _size_ticks(min(sizes), max(sizes))
    for ax in (lat, alg, bus):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: format_size(v, exact=False)))
        ax.tick_params(axis="x", labelsize=9)
        ax.xaxis.set_minor_locator(LogLocator(base=2, subs=(1.0,), numticks=64))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("message size")
        ax.set_xlim(min(sizes) / 1.3, max(sizes) * 1.3)
        ax.grid(True, which="major", alpha=0.35)
        ax.grid(True, which="minor", axis="y", alpha=0.12)
        if any(v == v for v in values[ax]):
            _log_y(ax, values[ax])
        else:
            ax.set_yticks([])
            ax.text(0.5, 0.5, "busbw is 0 with 1 rank", ha="center", va="center",
                    transform=ax.transAxes, color="0.4")
    mpi = " ".join(meta["mpi"].split(",")[0].split())
    wrong = sum(1 for r in rows if r.get("wrong"))
    op = f" ({meta['op']})" if meta["op"] != "none" else ""
    fig.text(0.5, 0.985, f"{what} of {meta['dtype']}{op}, {meta['ranks']} "
             f"ranks on {meta['nodes']} node(s), {meta['communicator']}"
             + (f" \u2014 WRONG RESULTS at {wrong} size(s)" if wrong else ""),
             ha="center", va="top", fontsize=11, color="red" if wrong else "black")
    fig.text(0.5, 0.935, f"{mpi}; fastreduce {meta['fastreduce']}, torch {meta['torch']}; "
             f"{meta['device']}, {meta['buffers']} buffers, {meta['mode']}",
             ha="center", va="top", fontsize=8.5, color="0.3")
    handles, labels = lat.get_legend_handles_labels()
    legend_rows = math.ceil(len(labels) / 6)
    fig.legend(handles, labels, loc="lower center", ncol=math.ceil(len(labels) / legend_rows),
               frameon=False, fontsize=9.5, bbox_to_anchor=(0.5, 0.0))
    fig.tight_layout(rect=(0, 0.02 + 0.055 * legend_rows, 1, 0.9))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig
