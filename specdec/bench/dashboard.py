"""The PNG dashboard of a ``specdec bench`` result (matplotlib, Agg backend): one panel per view of
the summary, plus a text panel naming the machine and the settings."""
from __future__ import annotations

from typing import Dict, List, Tuple

__all__ = ["write_dashboard"]


def write_dashboard(result: Dict[str, object], path) -> None:
    """PNG dashboard of a bench result (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]
    fig, axes = plt.subplots(2, 3, figsize=(18, 10))
    ax_acc, ax_k, ax_sp, ax_split, ax_trace, ax_txt = axes.flatten()
    _acceptance(ax_acc, summary)
    _tokens_per_second_vs_k(ax_k, summary)
    _speedup(ax_sp, summary)
    _time_split(ax_split, summary)
    _chosen_k(ax_trace, summary)
    _settings_text(ax_txt, result)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _acceptance(ax, summary) -> None:
    """Acceptance per position (fixed-k runs: every position is drafted every step)."""
    for wkey, rows in summary.items():
        for name, r in rows.items():
            app = r.get("accepted_per_position")
            if app and r["policy"] in ("fixed", "goodput") and r["drafter"] != "random":
                ax.plot(range(1, len(app) + 1), app, marker=".", label=f"{wkey} {name}")
    ax.set(title="acceptance per position", xlabel="draft position", ylabel="P(accepted | reached)", ylim=(0, 1))
    ax.legend(fontsize=6)


def _tokens_per_second_vs_k(ax, summary) -> None:
    """Tokens/s vs k (fixed sweeps) with goodput and plain as horizontal lines."""
    for wkey, rows in summary.items():
        by_drafter: Dict[str, List[Tuple[int, float]]] = {}
        for name, r in rows.items():
            if r["policy"] == "fixed":
                by_drafter.setdefault(r["drafter"], []).append((r["k"], r["tokens_per_second_median"]))
        for d, pts in by_drafter.items():
            pts.sort()
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{wkey} {d} fixed")
            g = [r for r in rows.values() if r["drafter"] == d and r["policy"] == "goodput"]
            if g:
                ax.axhline(g[0]["tokens_per_second_median"], color=line.get_color(), ls="--", lw=1,
                           label=f"{wkey} {d} goodput")
        if "plain" in rows:
            ax.axhline(rows["plain"]["tokens_per_second_median"], color="k", ls=":", lw=1)
    ax.set(title="tokens/s vs k (dotted: plain, dashed: goodput)", xlabel="k", ylabel="tokens/s")
    ax.legend(fontsize=6)


def _speedup(ax, summary) -> None:
    """Speedup vs plain (bars) and vs transformers (crosses) per configuration."""
    labels, vals, vals_hf = [], [], []
    for wkey, rows in summary.items():
        for name, r in rows.items():
            if name == "plain":
                continue
            labels.append(f"{wkey} {name}")
            vals.append(r.get("speedup_vs_plain_median") or 0.0)
            vals_hf.append(r.get("speedup_vs_hf_median") or 0.0)
    y = range(len(labels))
    ax.barh(list(y), vals, color=["tab:green" if v >= 1 else "tab:red" for v in vals])
    hf_pts = [(v, i) for i, v in enumerate(vals_hf) if v]
    if hf_pts:
        ax.scatter([p[0] for p in hf_pts], [p[1] for p in hf_pts], marker="x", color="k",
                   label="vs transformers generate", zorder=3)
        ax.legend(fontsize=6)
    ax.axvline(1.0, color="k", lw=1)
    ax.set_yticks(list(y))
    ax.set_yticklabels(labels, fontsize=5)
    ax.set(title="speedup vs plain (median per unit)", xlabel="x plain")


def _time_split(ax, summary) -> None:
    """Prefill / draft / verify / commit / other as fractions of the generate calls."""
    names, parts = [], {"prefill": [], "draft": [], "verify": [], "commit": [], "other": []}
    for wkey, rows in summary.items():
        for name, r in rows.items():
            if "total_seconds" not in r or not r["total_seconds"]:
                continue
            tot = r["total_seconds"]
            names.append(f"{wkey} {name}")
            for key in ("prefill", "draft", "verify", "commit"):
                parts[key].append(r[f"{key}_seconds"] / tot)
            parts["other"].append(max(0.0, 1 - sum(r[f"{key}_seconds"] for key in
                                                   ("prefill", "draft", "verify", "commit")) / tot))
    left = [0.0] * len(names)
    for key, vs in parts.items():
        ax.barh(range(len(names)), vs, left=left, label=key)
        left = [a + b for a, b in zip(left, vs)]
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=5)
    ax.set(title="time split (fraction of the call)", xlim=(0, 1))
    ax.legend(fontsize=6)


def _chosen_k(ax, summary) -> None:
    """The goodput policy's chosen k over steps (one traced run per configuration)."""
    for wkey, rows in summary.items():
        for name, r in rows.items():
            if r.get("trace_k_per_step"):
                ax.step(range(len(r["trace_k_per_step"])), r["trace_k_per_step"], where="post",
                        label=f"{wkey} {name}")
    ax.set(title="goodput policy: chosen k per step (one run)", xlabel="step", ylabel="k")
    ax.legend(fontsize=6)


def _settings_text(ax, result: Dict[str, object]) -> None:
    m = result.get("machine", {})
    s = result.get("settings", {})
    ax.axis("off")
    ax.text(0, 1, "\n".join([
        f"specdec bench  {result.get('date', '')}",
        f"commit {str(result.get('git_commit', ''))[:12]}",
        f"cpu {m.get('cpu', '')}, {m.get('torch_threads', '')} threads",
        f"load avg start {m.get('loadavg_start')}",
        f"load avg end   {m.get('loadavg_end')}",
        f"model {s.get('model', '')}, {s.get('max_new_tokens', '')} new tokens, greedy",
        f"rounds {s.get('rounds', '')}, batches {s.get('batches', '')}",
    ]), va="top", family="monospace", fontsize=8)
