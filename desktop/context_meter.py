"""The context meter by the message box: the cache positions the next Send would need against the
capacity, with a warning near the limit, so the wall is seen before it is hit."""

from __future__ import annotations

from PySide6.QtWidgets import QLabel

from engine.session import OVERFLOW_POLICIES, positions_needed

from .core.panel_words import messages
from .outside_text import plain, plain_tooltip

NEAR = 0.85  # from this share of the capacity on, the meter warns


def reading(seen: dict | None, capacity: int | None, max_new_tokens: int) -> tuple[str, str, str]:
    """(the meter's text, its level: ok | near | over | unknown, the tooltip) for a probe's answer. Under an
    overflow policy the count is the prompt Send would build with turns left out, and the meter says so."""
    seen = seen or {}
    prompt = seen.get("next_positions")
    policy = seen.get("next_overflow", "stop")
    if seen.get("next_error_images"):  # the draft's images, for a model without a vision tower
        return "Next Send: this model does not see images: Send will be refused", "over", seen["next_error"]
    if seen.get("next_error"):  # a policy that cannot make it fit: only the last turn is already too long
        return "Next Send: over the capacity even with turns left out: Send will be refused", "over", seen["next_error"]
    if not isinstance(prompt, int):
        why = seen.get("error") or "counted once a model is loaded"
        return "Context: —", "unknown", f"The positions the next Send would need: {why}."
    total = positions_needed(prompt, max_new_tokens)  # the engine's own rule
    formula = (
        f"the prompt as the template writes it ({prompt:,} positions: the conversation, your message and the "
        f"template's own tokens) + up to {max_new_tokens:,} new tokens − 1 (the last is never consumed)"
    )
    if not capacity:
        return f"Next Send: {total:,} positions", "unknown", f"{formula}. This server does not report its capacity."
    text = f"Next Send: {total:,} / {capacity:,} positions"
    dropped = seen.get("next_dropped")
    if dropped:
        level = "near"
        text += f" · {messages(dropped)} left out ({OVERFLOW_POLICIES[policy]})"
        gone = seen.get("next_dropped_positions", 0)
        advice = (
            f"The conversation no longer fits: Send leaves {messages(dropped)} out ({gone:,} "
            f"positions), as the conversation's setting says ({OVERFLOW_POLICIES[policy]}); the transcript marks "
            "them after the reply. Settings, This conversation, When the cache is full: another policy."
        )
    elif total > capacity:
        level = "over"
        text += " · over the capacity: Send will be refused"
        advice = (
            "Send will be refused with the reason (the policy is: stop at the limit). Shorten the "
            "conversation or your message, lower max new tokens, or raise the capacity in Settings."
        )
    elif total >= NEAR * capacity:
        level = "near"
        text += f" · {100 * total / capacity:.0f}%: near the limit"
        after = "Send will be refused" if policy == "stop" else f"turns will be left out ({OVERFLOW_POLICIES[policy]})"
        advice = f"Near the capacity: a few more turns and {after}."
    else:
        level, advice = "ok", ""
    return text, level, f"{formula} = {total:,}, against a capacity of {capacity:,} positions. {advice}".strip()


def refusal(seen: dict | None, capacity: int | None, max_new_tokens: int) -> str:
    """Why Send refuses the draft a probe's answer describes, before anything is stored ("" when it fits, or
    when the engine will leave turns out to make it fit)."""
    seen = seen or {}
    if seen.get("next_error"):
        said = seen["next_error"].rstrip()
        return f"Not sent: {said}{'' if said.endswith(('.', '!', '?')) else '.'} Your message is still in the box."
    prompt = seen.get("next_positions")
    if not capacity or not isinstance(prompt, int) or seen.get("next_dropped"):
        return ""
    total = positions_needed(prompt, max_new_tokens)
    if total <= capacity:
        return ""
    return (
        f"Not sent: the conversation with your message needs {total:,} cache positions (a prompt of {prompt:,} and "
        f"up to {max_new_tokens:,} new tokens), over the capacity of {capacity:,}; this conversation stops at the "
        "limit. Your message is still in the box: shorten it or the conversation, lower max new tokens, raise the "
        "capacity, or choose another policy in Settings (When the cache is full)."
    )


class ContextMeter(QLabel):
    """One line under the message box; its `level` property colours it (the style sheets)."""

    def __init__(self):
        super().__init__()
        plain(self)
        self.setObjectName("contextMeter")
        self.setAccessibleName("Context meter")
        self.level = "unknown"
        self.show_reading(None, None, 1)

    def show_reading(self, seen: dict | None, capacity: int | None, max_new_tokens: int) -> None:
        text, level, tip = reading(seen, capacity, max_new_tokens)
        self.setText(text)
        self.setToolTip(plain_tooltip(tip))  # rich text: wrapped, not one line across the screen
        self.setAccessibleDescription(tip)
        if level != self.level:
            self.level = level
            self.setProperty("level", level)
            self.style().unpolish(self)
            self.style().polish(self)
