"""Full precision vs quantized, side by side: a changed token changes later inputs, made visible."""

from __future__ import annotations

import html

from PySide6.QtWidgets import QDialog, QDialogButtonBox, QGridLayout, QLabel, QTextBrowser, QVBoxLayout

from .outside_text import plain, rich
from .panel_parts import GapChart


def _tokens_html(tokens: list[str], diverge: int | None) -> str:
    out = []
    for i, t in enumerate(tokens):
        piece = html.escape(t).replace("\n", "<br>")
        if diverge is not None and i == diverge:
            piece = f"<span style='background:#f0c05a;color:#111'>{piece or '&#8203;'}</span>"
        elif diverge is not None and i > diverge:
            piece = f"<span style='color:#f0a35a'>{piece}</span>"
        out.append(piece)
    return "".join(out)


class CompareDialog(QDialog):
    def __init__(self, result: dict, parent=None):
        super().__init__(parent)
        self.setObjectName("compareDialog")
        self.setWindowTitle("Compare with full precision")
        self.resize(980, 560)
        lay = QVBoxLayout(self)
        if "error" in result:
            lay.addWidget(plain(QLabel(f"The comparison failed: {result['error']}")))
            return
        quant_name = f"weights {result['weights']} · KV {result['kv']}"
        d = result.get("first_divergence")
        grid = QGridLayout()
        for col, head in enumerate(("<b>Full precision</b>", f"<b>Quantized</b> ({html.escape(quant_name)})")):
            grid.addWidget(rich(QLabel(head)), 0, col)
        self.fullText = QTextBrowser()
        self.fullText.setObjectName("fullReply")
        self.fullText.setHtml(_tokens_html(result["full_tokens"], d))
        self.quantText = QTextBrowser()
        self.quantText.setObjectName("quantReply")
        self.quantText.setHtml(_tokens_html(result["quant_tokens"], d))
        grid.addWidget(self.fullText, 1, 0)
        grid.addWidget(self.quantText, 1, 1)
        lay.addLayout(grid)
        if d is None:
            first = "The greedy replies are identical."
        else:
            a = result["full_tokens"][d] if d < len(result["full_tokens"]) else "(end)"
            b = result["quant_tokens"][d] if d < len(result["quant_tokens"]) else "(end)"
            first = (
                f"First differing token: reply position {d}, {a!r} vs {b!r}; every later token is computed "
                f"from different inputs."
            )
        self.summary = rich(
            QLabel(
                f"{html.escape(first)}<br>Teacher-forced on the full-precision reply: top-1 agreement "
                f"{100 * result['top1_agreement']:.1f}%, mean KL {result['mean_kl']:.5f} nats, "
                f"near-tie flips {result['near_tie_flips']}."
            )
        )
        self.summary.setObjectName("compareSummary")
        self.summary.setWordWrap(True)
        lay.addWidget(self.summary)
        lay.addWidget(plain(QLabel("KL divergence per reply token (full ‖ quantized)")))
        self.klChart = GapChart("each reply token's KL divergence, full against quantized", "nats", 3)
        self.klChart.set_gaps(result["kl_per_token"])
        lay.addWidget(self.klChart)
        buttons = QDialogButtonBox(QDialogButtonBox.Close)
        buttons.rejected.connect(self.reject)
        buttons.accepted.connect(self.accept)
        lay.addWidget(buttons)
