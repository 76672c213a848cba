"""Filler text for kvc eval's synthetic tasks: varied sentences generated from a seed.

The long-context tasks (runtime/eval/tasks.py, described in docs/accuracy.md) hide a few facts in
a haystack of irrelevant prose. The prose here is built from templates and word lists, so it needs
no download and no copied essay, and it is deterministic given the seed. No sentence repeats
within one stream (a repeated sentence is a known blind spot of eviction methods; the one task
that wants it, `passkey_repeat`, says so by name), and the prose holds no digits, so no filler
number can be mistaken for an answer.

`token_units` turns sentences into token ids (one unit per sentence, paragraph breaks included),
and `fit` picks units that fill a token budget exactly: tasks need prompts of an exact length.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence

# Word lists: everyday, concrete, and free of the words the tasks' needles use (key, pass, magic,
# number, value, code, special, remember) so that a needle stands out only by its content.
SUBJECTS = (
    "baker", "farmer", "teacher", "sailor", "painter", "gardener", "doctor", "tailor", "fisherman",
    "carpenter", "poet", "merchant", "student", "traveller", "shepherd", "weaver", "potter", "miner",
    "librarian", "musician", "cook", "nurse", "pilot", "builder", "hunter", "singer", "clerk",
    "blacksmith", "astronomer", "beekeeper", "courier", "dancer", "engineer", "juggler", "mapmaker",
)
NAMES = (
    "Amelia", "Bruno", "Clara", "Dmitri", "Elena", "Felix", "Greta", "Hugo", "Ingrid", "Jonas",
    "Katya", "Leon", "Marta", "Nils", "Olga", "Pablo", "Quentin", "Rosa", "Stefan", "Tilda",
    "Ursula", "Viktor", "Wanda", "Xavier", "Yara", "Zeno", "Beatrix", "Caspar", "Delia", "Emil",
)
OBJECTS = (
    "basket", "lantern", "kettle", "blanket", "ladder", "wagon", "violin", "umbrella", "compass",
    "bucket", "letter", "ribbon", "mirror", "hammer", "rope", "teapot", "saddle", "candle", "barrel",
    "notebook", "scarf", "bicycle", "clock", "drum", "shovel", "banner", "pillow", "chair", "cart",
    "telescope", "bell", "jar", "net", "quilt", "sack", "spoon", "tent", "whistle", "cabinet", "rug",
)
PLACES = (
    "harbour", "market", "valley", "orchard", "village", "library", "bakery", "meadow", "forest",
    "bridge", "station", "garden", "river bank", "hillside", "workshop", "courtyard", "square",
    "mill", "lighthouse", "vineyard", "barn", "chapel", "tavern", "quarry", "pier", "cellar",
    "greenhouse", "schoolhouse", "canal", "island", "plateau", "cottage", "museum", "monastery",
)
ADJECTIVES = (
    "old", "quiet", "bright", "heavy", "narrow", "gentle", "dusty", "crowded", "cheerful", "distant",
    "tiny", "enormous", "wooden", "silver", "muddy", "golden", "patient", "careful", "stubborn",
    "curious", "sleepy", "noisy", "elegant", "rusty", "fragile", "warm", "chilly", "faded", "polished",
    "crooked", "peaceful", "busy", "lonely", "clever", "humble", "rough", "smooth", "tidy", "wild",
)
ADVERBS = (
    "slowly", "quickly", "carefully", "happily", "quietly", "eagerly", "patiently", "loudly",
    "gracefully", "reluctantly", "cheerfully", "gently", "boldly", "calmly", "clumsily", "proudly",
)
# (base, past, third person singular)
VERBS = (
    ("carry", "carried", "carries"), ("paint", "painted", "paints"), ("repair", "repaired", "repairs"),
    ("polish", "polished", "polishes"), ("move", "moved", "moves"), ("inspect", "inspected", "inspects"),
    ("wrap", "wrapped", "wraps"), ("clean", "cleaned", "cleans"), ("borrow", "borrowed", "borrows"),
    ("sell", "sold", "sells"), ("build", "built", "builds"), ("find", "found", "finds"),
    ("hide", "hid", "hides"), ("lift", "lifted", "lifts"), ("admire", "admired", "admires"),
    ("describe", "described", "describes"), ("deliver", "delivered", "delivers"),
    ("decorate", "decorated", "decorates"), ("measure", "measured", "measures"),
    ("examine", "examined", "examines"), ("fold", "folded", "folds"), ("lend", "lent", "lends"),
    ("sketch", "sketched", "sketches"), ("guard", "guarded", "guards"), ("pack", "packed", "packs"),
)
TIMES = (
    "at dawn", "before noon", "in the evening", "at midnight", "after lunch", "on a rainy morning",
    "late in the afternoon", "during the storm", "on market day", "before the harvest",
    "after the festival", "at sunset", "on a foggy night", "early in spring", "in the middle of winter",
)
SEASONS = ("spring", "summer", "autumn", "winter")
PERIODS = ("morning", "week", "month", "season", "year", "evening", "day")
COUNTS = (
    "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
    "a few", "several", "many", "a dozen", "countless",
)
ACTIVITIES = (
    "fishing", "reading", "singing", "walking", "gardening", "painting", "cooking", "sailing",
    "dancing", "knitting", "climbing", "baking", "riding", "writing", "carving", "weaving",
)
WEATHER = ("windy", "calm", "rainy", "sunny", "misty", "cold", "humid", "clear", "stormy", "mild")
TOPICS = (
    "the price of bread", "the old songs", "the new road", "the weather", "the river",
    "the coming winter", "the lost sheep", "the town clock", "the autumn fair", "the broken bridge",
    "the tides", "the stars", "the harvest", "the visiting merchants", "the long journey",
)


def _plural(noun: str) -> str:
    if noun.endswith(("s", "sh", "ch", "x")):
        return noun + "es"
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    if noun == "fisherman":
        return "fishermen"
    return noun + "s"


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _sentence(r: random.Random) -> str:
    """One sentence from a random template; lengths vary from a few words to a long clause, so
    that `fit` can always close a budget with whole sentences."""
    c = r.choice
    subject, obj, place, adj, name = c(SUBJECTS), c(OBJECTS), c(PLACES), c(ADJECTIVES), c(NAMES)
    base, past, third = c(VERBS)
    templates = (
        lambda: f"The {adj} {subject} {past} the {obj} near the {place} {c(TIMES)}.",
        lambda: f"In the {place}, {_a(subject)} {past} {c(COUNTS)} {_plural(obj)} {c(TIMES)}.",
        lambda: f"Every {c(PERIODS)}, the {_plural(subject)} of the {place} {base} {_a(adj)} {obj}.",
        lambda: f"{name} said that the {obj} in the {place} was {adj}.",
        lambda: f"Nobody expected the {subject} to {base} the {obj} so {c(ADVERBS)}.",
        lambda: f"It was {c(TIMES)} when {name} reached the {place} with {_a(adj)} {obj}.",
        lambda: f"According to {name}, the {place} is {c(WEATHER)} in {c(SEASONS)}.",
        lambda: f"Some {_plural(subject)} prefer {c(ACTIVITIES)} to {c(ACTIVITIES)}, especially in {c(SEASONS)}.",
        lambda: f"The {obj} that {name} {past} had been {adj} for {c(COUNTS)} {c(PERIODS)}s.",
        lambda: f"{name} {past} {_a(obj)}.",
        lambda: f"The {place} was {adj}.",
        lambda: f"{name} {c(ADVERBS)} {third} the {obj} whenever the weather is {c(WEATHER)}.",
        lambda: f"At the {place}, people talked about {c(TOPICS)} for hours.",
        lambda: f"The {subject} and {name} argued about {c(TOPICS)} {c(TIMES)}.",
        lambda: f"A {adj} {obj} stood in the corner of the {place}, and no one knew who owned it.",
        lambda: f"{name} wondered whether the {subject} would {base} the {obj} before {c(SEASONS)}.",
        lambda: f"Later, {name} went {c(ACTIVITIES)} by the {place}.",
        lambda: f"The {_plural(subject)} were {adj} that {c(PERIODS)}.",
    )
    return c(templates)()


def sentences(seed: int) -> Iterator[str]:
    """An endless stream of distinct filler sentences, the same for the same seed."""
    r = random.Random(seed)
    seen: set[str] = set()
    while True:
        s = _sentence(r)
        if s not in seen:
            seen.add(s)
            yield s


def token_units(tokenizer, seed: int, paragraph: tuple[int, int] = (4, 8)) -> Iterator[tuple[int, ...]]:
    """The stream of `sentences(seed)` as token ids, one unit per sentence: a sentence inside a
    paragraph starts with a space, the first of a paragraph with a blank line. Tokenizing sentence by
    sentence (rather than the joined text) keeps every unit boundary a sentence boundary, where a
    needle may go."""
    r = random.Random(seed ^ 0x5EED)
    left = r.randint(*paragraph)
    first = True
    for s in sentences(seed):
        lead = "" if first else (" " if left else "\n\n")
        if not left:
            left = r.randint(*paragraph)
        left -= 1
        first = False
        yield tuple(tokenizer.encode(lead + s, add_special_tokens=False))


class Exhausted(ValueError):
    """A finite unit stream ran out before the budget was filled."""


def fit(units: Iterable[Sequence[int]], budget: int, max_skips: int = 5_000) -> list[tuple[int, ...]]:
    """Whole units from the stream that add up to exactly `budget` tokens.

    A unit is taken when it fits and the room it leaves can still be closed by units of the lengths
    common in the stream's first 256 units (a small subset-sum table); other units are skipped, so
    only the last few units are chosen by length. Skipped units are dropped, never reordered, so the
    result is deterministic. Should the stream not close the gap within `max_skips` skips (a budget
    smaller than any unit, say), units are taken as they come and the last is cut to fit."""
    if budget < 0:
        raise ValueError(f"negative filler budget {budget}")
    it = iter(units)
    head = [tuple(u) for u in itertools.islice(it, 256)]
    # Lengths common in the stream (2% of its head or more): a rare length would promise a gap
    # the stream may never close.
    counts = Counter(len(u) for u in head if u)
    lengths = sorted(n for n, c in counts.items() if c >= max(1, len(head) // 50))
    closable = [True] + [False] * budget  # closable[g]: g tokens can be made of `lengths`
    for g in range(1, budget + 1):
        closable[g] = any(n <= g and closable[g - n] for n in lengths)
    it = itertools.chain(head, it)
    chosen: list[tuple[int, ...]] = []
    left, skips = budget, 0
    while left > 0:
        unit = next(it, None)
        if unit is None:
            raise Exhausted(f"the filler stream ended {left} tokens short of {budget}")
        unit = tuple(unit)
        n = len(unit)
        if 0 < n <= left and closable[left - n]:
            chosen.append(unit)
            left -= n
        elif skips < max_skips:
            skips += 1
        elif n:
            chosen.append(unit[:left])
            left -= len(chosen[-1])
    return chosen
