"""Draw docs/figures/layouts.png: one batch laid out padded, ragged and packed.

Run from the repository root (matplotlib, Agg backend; nothing is fetched):

    python docs/figures/layouts.py [OUT.png]

The packed rows are the ones polyexec would use: `buckets.first_fit` of the batch's lengths
into rows of the bucket's length.
"""

from __future__ import annotations

import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import buckets  # noqa: E402

LENGTHS = [7, 3, 5, 2, 6, 4]          # one batch of six sequences, a..f
BUCKET = 8                            # T's bucket; the longest sequence is 7
NAMES = "abcdef"
COLOURS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860"]
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "layouts.png")


def cell(ax, row, col, *, colour=None, text="", hatch=None, dashed=False):
    face = colour if colour is not None else ("#e6e6e6" if hatch else "white")
    ax.add_patch(Rectangle((col, -row - 1), 1, 1, facecolor=face, hatch=hatch,
                           edgecolor="#999999" if dashed else "white",
                           linestyle=":" if dashed else "-", linewidth=1.2))
    if text:
        ax.text(col + 0.5, -row - 0.5, text, ha="center", va="center", fontsize=9,
                color="white", fontweight="bold")


def frame(ax, rows, title, note):
    ax.set_xlim(-0.9, BUCKET + 0.1)
    ax.set_ylim(-6.4, 0.9)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title, fontsize=11, loc="left")
    ax.text(0, -6.25, note, fontsize=8, va="top", wrap=True)
    for r in range(rows):
        ax.text(-0.2, -r - 0.5, str(r), ha="right", va="center", fontsize=8, color="#555555")
    for c in range(BUCKET):
        ax.text(c + 0.5, 0.35, str(c), ha="center", va="center", fontsize=8, color="#555555")


def one_sequence_a_row(ax, title, text, **tail):
    """Each sequence in its own row of the bucket's length, the cells past it drawn ``tail``."""
    frame(ax, len(LENGTHS), title, text)
    for r, n in enumerate(LENGTHS):
        for c in range(BUCKET):
            if c < n:
                cell(ax, r, c, colour=COLOURS[r], text=NAMES[r])
            else:
                cell(ax, r, c, **tail)


def padded(ax):
    one_sequence_a_row(ax, "padded  (layout=\"pad\")",
                       "One sequence a row, every row the\nbucket's length: the array a padded\n"
                       "program runs on. Grey: padding,\nkept out of every result.", hatch="///")


def ragged(ax):
    one_sequence_a_row(ax, "ragged  (a lengths_of input)",
                       "The same rows, each its own length:\npast a row's length nothing exists\n"
                       "(means divide by the real count,\nx.shape[0] is the row's length).",
                       dashed=True)


def packed(ax):
    p = buckets.first_fit(LENGTHS, BUCKET)
    frame(ax, p.rows, "packed  (layout=\"pack\")",
          f"Sequences end to end, {p.rows} rows of {BUCKET}\n(first-fit): {p.rows * BUCKET} cells "
          f"against {len(LENGTHS) * BUCKET}.\nNothing crosses a sequence's edge;\n"
          "the code is the same.")
    used = set()
    for i, n in enumerate(LENGTHS):
        for c in range(int(p.start[i]), int(p.start[i]) + n):
            cell(ax, int(p.row[i]), c, colour=COLOURS[i], text=NAMES[i])
            used.add((int(p.row[i]), c))
    for r in range(p.rows):
        for c in range(BUCKET):
            if (r, c) not in used:
                cell(ax, r, c, hatch="///")


def main(out: str = OUT) -> str:
    fig, axes = plt.subplots(1, 3, figsize=(11, 4.2))
    padded(axes[0])
    ragged(axes[1])
    packed(axes[2])
    fig.suptitle(f"One batch, lengths {LENGTHS}, T's bucket {BUCKET}", fontsize=12)
    fig.tight_layout()
    fig.savefig(out, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return out


if __name__ == "__main__":
    print(main(*sys.argv[1:2]))
