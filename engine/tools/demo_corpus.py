"""A seeded generator of travel-planning chats: the bundled demo model's whole training corpus.

The traveller states a city, nights, a group size, a budget with its currency and a liking; the
assistant answers with a short plan that repeats those facts, answers questions about them, and
keeps to the latest value when one is changed. Replies are a function of the facts (no random
filler), so the model's loss goes to what matters: copying the facts right.

Budgets are split by a hash into training and held-out values, so the evaluation asks for
numbers the model never saw in training.
"""

from __future__ import annotations

import dataclasses
import random

CITIES = [
    "Chengdu",
    "Beijing",
    "Shanghai",
    "Xi'an",
    "Hangzhou",
    "Kyoto",
    "Tokyo",
    "Osaka",
    "Seoul",
    "Busan",
    "Bangkok",
    "Hanoi",
    "Singapore",
    "Bali",
    "Sydney",
    "Auckland",
    "Delhi",
    "Mumbai",
    "Dubai",
    "Istanbul",
    "Athens",
    "Rome",
    "Florence",
    "Venice",
    "Paris",
    "Lyon",
    "Nice",
    "Barcelona",
    "Madrid",
    "Seville",
    "Lisbon",
    "Porto",
    "London",
    "Edinburgh",
    "Dublin",
    "Amsterdam",
    "Berlin",
    "Munich",
    "Vienna",
    "Prague",
    "Budapest",
    "Krakow",
    "Copenhagen",
    "Stockholm",
    "Oslo",
    "Reykjavik",
    "Zurich",
    "Geneva",
    "Cairo",
    "Marrakech",
    "Cape Town",
    "Nairobi",
    "New York",
    "Boston",
    "Chicago",
    "San Francisco",
    "Vancouver",
    "Mexico City",
    "Lima",
    "Buenos Aires",
    "Rio de Janeiro",
    "Havana",
    "Hong Kong",
    "Taipei",
    "Kuala Lumpur",
]
CURRENCIES = [
    "yuan",
    "euros",
    "dollars",
    "pounds",
    "yen",
    "francs",
    "rupees",
    "baht",
    "pesos",
    "won",
    "kronor",
    "dirhams",
    "rand",
    "reais",
]
LIKES = {
    "food": ("local food", "a street food tour and a cooking class"),
    "museums": ("museums", "the main museums and one gallery"),
    "nature": ("nature", "a park walk and a day hike"),
    "history": ("history", "the old town and a historic site"),
    "nightlife": ("nightlife", "an evening bar walk and live music"),
    "shopping": ("shopping", "the markets and a shopping street"),
    "beaches": ("beaches", "a beach day and a boat trip"),
    "quiet": ("quiet places", "slow mornings, gardens and a spa"),
    "art": ("art", "galleries and a street art walk"),
    "photography": ("photography", "sunrise viewpoints and a photo walk"),
}
SYSTEM_PROMPTS = [
    "You are a helpful travel planning assistant.",
    "You are kvchat's travel assistant. Keep plans short.",
    "You help people plan trips within their budget.",
]


def _is_heldout(value: int) -> bool:
    """One budget in five, chosen by a fixed hash, never appears in training."""
    return (value * 2654435761) % 4294967296 % 5 == 0


def draw_budget(rng: random.Random, heldout: bool) -> int:
    while True:
        digits = rng.choices([2, 3, 4, 5], weights=[1, 5, 4, 1])[0]
        lo, hi = 10 ** (digits - 1), 10**digits - 1
        value = rng.randint(max(lo, 20), hi)
        if rng.random() < 0.4:  # people often say round numbers: 600, 750, 1200
            step = 10 ** (digits - 2) if digits > 2 else 10
            step *= rng.choice([1, 5])
            value = max(step, value // step * step)
        if _is_heldout(value) == heldout:
            return value


@dataclasses.dataclass
class Trip:
    city: str
    nights: int
    people: int
    budget: int
    currency: str
    like: str

    @property
    def money(self) -> str:
        return f"{self.budget} {self.currency}"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def plan(t: Trip, updated: bool = False) -> str:
    like_text, activities = LIKES[t.like]
    head = "Updated plan" if updated else "Here is a plan"
    group = "you alone" if t.people == 1 else f"{t.people} people"
    return (
        f"{head} for {t.city}: {_plural(t.nights, 'night')} for {group}, budget {t.money}.\n"
        f"- Stay: a simple hotel in central {t.city}.\n"
        f"- Do: {activities}, since you like {like_text}.\n"
        f"- Money: keep the whole trip within {t.money}."
    )


# --- what the traveller says -------------------------------------------------------------


def _city_clause(rng, t):
    return rng.choice(
        [
            f"I want to visit {t.city}.",
            f"I am planning a trip to {t.city}.",
            f"We are going to {t.city}.",
            f"Help me plan a trip to {t.city}.",
            f"Plan a trip to {t.city} for me.",
            f"Destination: {t.city}.",
            f"I'd like to go to {t.city}.",
            f"Can you plan a trip to {t.city}?",
        ]
    )


def _nights_clause(rng, t):
    n = _plural(t.nights, "night")
    return rng.choice(
        [
            f"We will stay {n}.",
            f"I have {n}.",
            f"The trip is {n}.",
            f"For {n}.",
            f"I want to stay {n}.",
            f"Nights: {t.nights}.",
        ]
    )


def _people_clause(rng, t):
    if t.people == 1:
        return rng.choice(["I am traveling alone.", "Just me.", "It is a solo trip.", "People: 1."])
    return rng.choice(
        [
            f"There are {t.people} of us.",
            f"We are {t.people} people.",
            f"It is for {t.people} people.",
            f"People: {t.people}.",
            f"A group of {t.people}.",
        ]
    )


def _budget_clause(rng, t):
    m = t.money
    return rng.choice(
        [
            f"My budget is {m}.",
            f"I can spend {m}.",
            f"The budget is {m} in total.",
            f"We have {m} to spend.",
            f"Keep it under {m}.",
            f"Budget: {m}.",
            f"Our budget is {m}.",
            f"I have {m} for the whole trip.",
        ]
    )


def _like_clause(rng, t):
    like_text = LIKES[t.like][0]
    return rng.choice(
        [
            f"I love {like_text}.",
            f"We like {like_text}.",
            f"Something with {like_text}, please.",
            f"We are into {like_text}.",
            f"I enjoy {like_text}.",
        ]
    )


def _request(rng, t, parts) -> str:
    makers = {
        "city": _city_clause,
        "nights": _nights_clause,
        "people": _people_clause,
        "budget": _budget_clause,
        "like": _like_clause,
    }
    order = list(parts)
    if order and order[0] == "city":
        rest = order[1:]
        rng.shuffle(rest)
        order = ["city"] + rest
    else:
        rng.shuffle(order)
    clauses = [makers[p](rng, t) for p in order]
    if rng.random() < 0.15:  # people don't always capitalise
        clauses = [c[0].lower() + c[1:] for c in clauses]
    return " ".join(clauses)


GREETINGS = [
    ("Hi", "Hello! Where would you like to travel?"),
    ("Hello!", "Hello! Where would you like to travel?"),
    ("Good morning", "Good morning! Where would you like to travel?"),
    ("Hey there", "Hello! Where would you like to travel?"),
    ("How are you?", "I am doing well, thank you! Where would you like to go?"),
    (
        "Who are you?",
        "I am kvchat's demo travel assistant. Tell me a city, nights, group size "
        "and budget, and I will plan your trip.",
    ),
    ("What can you do?", "I plan short trips. Tell me a city, nights, group size and budget."),
]

DECLINES = [
    ("Can you book the hotel for me?", "I can't book anything, but I can help you plan your trip to {city}."),
    ("Book the flights please.", "I can't book anything, but I can help you plan your trip to {city}."),
    ("What will the weather be like?", "I don't have weather data. I can help with your plan for {city}."),
    ("Write me a poem.", "I only help with travel plans. Ask me anything about your trip to {city}."),
    ("What is 17 times 23?", "I only help with travel plans. Ask me anything about your trip to {city}."),
    ("Tell me a joke.", "I only help with travel plans. Ask me anything about your trip to {city}."),
]


def _followup(rng, t: Trip, currency_questions: bool = True) -> tuple[str, str, Trip]:
    """One follow-up turn: (user text, assistant reply, trip after the turn)."""
    if currency_questions:
        kind = rng.choices(
            [
                "budget_q",
                "currency_q",
                "city_q",
                "nights_q",
                "people_q",
                "update_budget",
                "update_nights",
                "update_city",
                "again",
                "thanks",
                "decline",
            ],
            weights=[3, 2, 2, 2, 1, 5, 2, 2, 2, 2, 2],
        )[0]
    else:  # the first training stage's mix
        kind = rng.choices(
            [
                "budget_q",
                "city_q",
                "nights_q",
                "people_q",
                "update_budget",
                "update_nights",
                "update_city",
                "again",
                "thanks",
                "decline",
            ],
            weights=[3, 2, 2, 1, 5, 2, 2, 2, 2, 2],
        )[0]
    if kind == "currency_q":
        q = rng.choice(["Which currency is my budget in?", "What currency did I say?", "In which currency?"])
        return q, f"Your budget is in {t.currency}: {t.money}.", t
    if kind == "budget_q":
        q = rng.choice(
            [
                "What is my budget?",
                "How much can I spend?",
                "Remind me of the budget.",
                "what's our budget again?",
                "What budget did I give you?",
            ]
        )
        return q, f"Your budget is {t.money}.", t
    if kind == "city_q":
        q = rng.choice(["Which city are we going to?", "Where am I going?", "Remind me of the city."])
        return q, f"You are going to {t.city}.", t
    if kind == "nights_q":
        q = rng.choice(["How many nights?", "How long is the trip?"])
        return q, f"{_plural(t.nights, 'night')} in {t.city}.", t
    if kind == "people_q":
        q = rng.choice(["How many people is it for?", "How many of us are going?"])
        return q, ("Just you." if t.people == 1 else f"{t.people} people."), t
    if kind == "update_budget":
        new = dataclasses.replace(t, budget=draw_budget(rng, heldout=False))
        if rng.random() < 0.2:
            new.currency = rng.choice(CURRENCIES)
        q = rng.choice(
            [
                f"Actually, my budget is {new.money} now.",
                f"Change the budget to {new.money}.",
                f"Make it {new.money} instead.",
                f"Sorry, the budget is {new.money}.",
                f"Can we do it for {new.money}?",
                f"New budget: {new.money}.",
            ]
        )
        return q, plan(new, updated=True), new
    if kind == "update_nights":
        new = dataclasses.replace(t, nights=rng.randint(1, 14))
        q = rng.choice(
            [f"Let's make it {_plural(new.nights, 'night')}.", f"Change it to {_plural(new.nights, 'night')}."]
        )
        return q, plan(new, updated=True), new
    if kind == "update_city":
        new = dataclasses.replace(t, city=rng.choice(CITIES))
        q = rng.choice([f"Let's go to {new.city} instead.", f"Change the city to {new.city}."])
        return q, plan(new, updated=True), new
    if kind == "again":
        q = rng.choice(["Can you show the plan again?", "Repeat the plan please.", "Give me the plan once more."])
        return q, plan(t), t
    if kind == "thanks":
        q = rng.choice(["Thank you!", "Thanks a lot.", "Great, thanks!", "Perfect, thank you."])
        return q, f"You're welcome! Enjoy {t.city}.", t
    q, a = rng.choice(DECLINES)
    return q, a.format(city=t.city), t


def new_trip(rng: random.Random, heldout: bool = False) -> Trip:
    return Trip(
        city=rng.choice(CITIES),
        nights=rng.randint(1, 14),
        people=rng.choice([1, 1, 2, 2, 2, 3, 4, 5, 6]),
        budget=draw_budget(rng, heldout),
        currency=rng.choice(CURRENCIES),
        like=rng.choice(list(LIKES)),
    )


def opening(rng: random.Random, t: Trip) -> list[dict]:
    """The turns up to and including the first plan: (optional system), greeting, the request."""
    msgs: list[dict] = []
    if rng.random() < 0.3:
        msgs.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    if rng.random() < 0.25:
        q, a = rng.choice(GREETINGS)
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    style = rng.random()
    if style < 0.7:  # everything in one message
        msgs.append({"role": "user", "content": _request(rng, t, ["city", "nights", "people", "budget", "like"])})
    elif style < 0.85:  # the budget comes when asked
        msgs += [
            {"role": "user", "content": _request(rng, t, ["city", "nights", "people", "like"])},
            {"role": "assistant", "content": f"Sounds good! What is your budget for {t.city}?"},
            {"role": "user", "content": rng.choice([f"{t.money}.", f"About {t.money}.", _budget_clause(rng, t)])},
        ]
    else:  # the city first, the rest when asked
        msgs += [
            {"role": "user", "content": _city_clause(rng, t)},
            {
                "role": "assistant",
                "content": f"{t.city} is a great choice! How many nights, how many people, and what is your budget?",
            },
            {"role": "user", "content": _request(rng, t, ["nights", "people", "budget", "like"])},
        ]
    msgs.append({"role": "assistant", "content": plan(t)})
    return msgs


def conversation(rng: random.Random, max_followups: int = 3, currency_questions: bool = True) -> list[dict]:
    t = new_trip(rng)
    msgs = opening(rng, t)
    for _ in range(rng.randint(0, max_followups)):
        q, a, t = _followup(rng, t, currency_questions)
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return msgs


def heldout_case(rng: random.Random) -> tuple[list[dict], Trip, int]:
    """A held-out chat ending in a user turn that asks for a plan: (messages, trip, index of the
    user message stating the budget). The reply must state the trip's city and budget."""
    t = new_trip(rng, heldout=True)
    msgs = opening(rng, t)[:-1]
    budget_msg = max(i for i, m in enumerate(msgs) if m["role"] == "user" and t.money in m["content"])
    return msgs, t, budget_msg
