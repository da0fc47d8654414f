"""`python -m engine.tools.eval_demo`: the demo model's acceptance figures on held-out chats.

For each held-out chat (a seed and budgets never used in training) the model replies greedily;
then the budget in the earlier user message is edited and the reply regenerated through the
same session, so the engine reuses the cache up to the edited token.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys

from ..events import Finished, PrefillStarted
from ..session import Request, Session
from ..weights.loading import load_model
from . import demo_corpus


def _reply(session: Session, messages, max_new_tokens: int):
    start = fin = None
    for ev in session.generate(Request(messages=messages, max_new_tokens=max_new_tokens)):
        if isinstance(ev, PrefillStarted):
            start = ev
        elif isinstance(ev, Finished):
            fin = ev
        elif type(ev).__name__ == "Failed":
            raise RuntimeError(ev.error)
    return start, fin


def evaluate(
    model=None,
    n: int = 200,
    seed: int = 20261129,
    max_new_tokens: int = 80,
    device=None,
    dtype=None,
    progress=None,
    weights: str = "none",
    kv: str = "none",
    group_size: int = 64,
) -> dict:
    loaded = load_model(model, device=device, dtype=dtype, weights=weights, group_size=group_size)
    session = Session(loaded, capacity=1024, kv=kv)
    rng = random.Random(seed)
    counts = dict(
        budget_exact=0, budget_with_currency=0, city=0, edit_follows=0, edit_reuse_at_token=0, edit_old_value_gone=0
    )
    reused = recomputed = 0
    failures = []
    for i in range(n):
        msgs, trip, at = demo_corpus.heldout_case(rng)
        _, first = _reply(session, msgs, max_new_tokens)
        text = first.text
        counts["budget_exact"] += re.search(rf"(?<!\d){trip.budget}(?!\d)", text) is not None
        ok_money = trip.money in text
        counts["budget_with_currency"] += ok_money
        counts["city"] += trip.city in text
        # Edit the budget in the earlier user message to another held-out value, and regenerate.
        new_budget = trip.budget
        while new_budget == trip.budget:
            new_budget = demo_corpus.draw_budget(rng, heldout=True)
        new_money = f"{new_budget} {trip.currency}"
        edited = [dict(m) for m in msgs]
        edited[at]["content"] = edited[at]["content"].replace(trip.money, new_money, 1)
        old_prompt = loaded.tokenizer.apply_chat_template(msgs)
        start, second = _reply(session, edited, max_new_tokens)
        new_prompt = list(start.prompt_token_ids)
        diff = next(k for k, (a, b) in enumerate(zip(old_prompt, new_prompt)) if a != b)
        r = start.reuse
        # The edited token: the first token of the new value that differs (a digit, or the currency word
        # where one number is a prefix of the other, as in 50 -> 5000).
        edited_texts = set(str(new_budget)) | set(str(trip.budget)) | {trip.currency}
        at_token = (
            r.first_invalidated_position == diff
            and r.reused == diff
            and r.cached_token["id"] == old_prompt[diff]
            and r.new_token["id"] == new_prompt[diff]
            and r.new_token["text"].strip() in edited_texts
            and r.cached_token["text"].strip() in edited_texts
        )
        counts["edit_reuse_at_token"] += at_token
        counts["edit_follows"] += new_money in second.text
        counts["edit_old_value_gone"] += trip.money not in second.text
        reused += r.reused
        recomputed += r.computed
        if not at_token:
            failures.append(
                {
                    "case": i,
                    "reuse_not_at_edit": r.to_dict(),
                    "edited_at": diff,
                    "budget": trip.money,
                    "edited_to": new_money,
                }
            )
        if not ok_money or new_money not in second.text:
            failures.append(
                {"case": i, "budget": trip.money, "reply": text, "edited_to": new_money, "edited_reply": second.text}
            )
        if progress:
            progress(i + 1, n)
    pct = {k: round(100.0 * v / n, 1) for k, v in counts.items()}
    return {
        "model": str(loaded.path),
        "weights": loaded.quantization,
        "kv": kv,
        "cases": n,
        "seed": seed,
        "percent": pct,
        "counts": counts,
        "mean_reused_positions": round(reused / n, 1),
        "mean_recomputed_positions": round(recomputed / n, 1),
        "failures": failures[:10],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.tools.eval_demo", description=__doc__)
    ap.add_argument("--model", default=None, help="default: the bundled demo model")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--seed", type=int, default=20261129)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--weights", default="none", choices=["none", "int8", "int4"])
    ap.add_argument("--kv", default="none", choices=["none", "int8", "int4"])
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    ns = ap.parse_args(argv)

    def progress(i, n):
        if not ns.json and i % 20 == 0:
            print(f"  {i}/{n}", file=sys.stderr)

    res = evaluate(
        ns.model,
        ns.n,
        ns.seed,
        device=ns.device,
        dtype=ns.dtype,
        progress=progress,
        weights=ns.weights,
        kv=ns.kv,
        group_size=ns.group_size,
    )
    if ns.json:
        print(json.dumps(res, ensure_ascii=False, indent=2))
        return 0
    p = res["percent"]
    print(
        f"held-out chats: {res['cases']} (seed {res['seed']}, budgets never seen in training) · "
        f"weights {res['weights']} · KV {res['kv']}"
    )
    print(f"  reply states the budget with its currency   {p['budget_with_currency']:5.1f}%")
    print(f"  reply states the budget's digits            {p['budget_exact']:5.1f}%")
    print(f"  reply states the city                       {p['city']:5.1f}%")
    print(f"  after the edit, reply uses the new budget   {p['edit_follows']:5.1f}%")
    print(f"  after the edit, the old budget is gone      {p['edit_old_value_gone']:5.1f}%")
    print(f"  reuse stopped exactly at the edited token   {p['edit_reuse_at_token']:5.1f}%")
    print(
        f"  mean positions reused / recomputed on edit  {res['mean_reused_positions']} / "
        f"{res['mean_recomputed_positions']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
