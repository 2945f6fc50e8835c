"""Hand-written text the `repeat` workload asks a model to copy with one change: short Python functions and
paragraphs of prose, each with the renames or word swaps a prompt may ask for.

Agents and coding assistants often ask for their context back ("rewrite this code with one change", "quote
the passage"), and such answers are what prompt-lookup speculation predicts. The text lives here rather than
being read from the repository's own files, so the workload stays the same, byte for byte, as the
repository changes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Passage:
    """A text to copy and the changes a prompt may ask for."""

    text: str
    changes: tuple[tuple[str, str], ...]
    """(old, new) pairs: rename `old` to `new`; `old` occurs in `text`."""


CODE = (
    Passage(
        '''\
def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    averages = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            averages.append(total / window)
    return averages
''',
        (("moving_average", "rolling_mean"), ("total", "running_sum")),
    ),
    Passage(
        '''\
def parse_duration(text):
    """Seconds in a duration such as "1h30m" or "45s"."""
    units = {"h": 3600, "m": 60, "s": 1}
    seconds = 0
    number = ""
    for char in text.strip():
        if char.isdigit():
            number += char
        elif char in units and number:
            seconds += int(number) * units[char]
            number = ""
        else:
            raise ValueError(f"cannot read duration {text!r}")
    if number:
        raise ValueError(f"duration {text!r} ends without a unit")
    return seconds
''',
        (("parse_duration", "duration_seconds"), ("number", "digits")),
    ),
    Passage(
        '''\
def merge_intervals(intervals):
    """The union of closed intervals, as sorted disjoint intervals."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [tuple(interval) for interval in merged]
''',
        (("merge_intervals", "union_of_intervals"), ("merged", "result")),
    ),
    Passage(
        '''\
def word_counts(text, stop_words):
    """How often each word of `text` occurs, leaving out `stop_words`."""
    counts = {}
    for word in text.lower().split():
        word = word.strip(".,;:!?\\"'()")
        if not word or word in stop_words:
            continue
        counts[word] = counts.get(word, 0) + 1
    return sorted(counts.items(), key=lambda item: (-item[1], item[0]))
''',
        (("word_counts", "count_words"), ("counts", "frequencies")),
    ),
    Passage(
        '''\
def retry(call, attempts, delay_s):
    """Calls `call` until it succeeds, at most `attempts` times, waiting longer after each failure."""
    last_error = None
    for attempt in range(attempts):
        try:
            return call()
        except ConnectionError as error:
            last_error = error
            time.sleep(delay_s * 2**attempt)
    raise RuntimeError(f"gave up after {attempts} attempts") from last_error
''',
        (("retry", "call_with_retries"), ("last_error", "previous_error")),
    ),
    Passage(
        '''\
class Inventory:
    """Items in stock, by name."""

    def __init__(self):
        self.items = {}

    def add(self, name, quantity):
        if quantity <= 0:
            raise ValueError(f"quantity must be positive, got {quantity}")
        self.items[name] = self.items.get(name, 0) + quantity

    def remove(self, name, quantity):
        available = self.items.get(name, 0)
        if quantity > available:
            raise ValueError(f"only {available} of {name} in stock")
        self.items[name] = available - quantity
''',
        (("Inventory", "Stock"), ("quantity", "amount")),
    ),
)

PROSE = (
    Passage(
        (
            "The harbour town wakes before the sun. Fishing boats leave the quay at four, their lamps "
            "strung out across the bay like a second row of streetlights, and by six the first of them "
            "are back with crates of mackerel and crab. The market opens at seven in the old stone hall "
            "by the church, where the same families have kept the same stalls for three generations."
        ),
        (("town", "village"), ("market", "fair")),
    ),
    Passage(
        (
            "In the afternoon the tourists arrive on the coast road, park along the sea wall and walk the"
            " cliff path to the lighthouse. The path is narrow and the wind is strong, so the council put"
            " up a rope rail in the spring after a visitor slipped near the second bench. From the top "
            "you can see the islands on a clear day, and sometimes seals on the rocks below."
        ),
        (("council", "county"), ("tourists", "visitors")),
    ),
    Passage(
        (
            "Winter is quieter. Half the cafes close in October and the ferry to the islands runs only "
            "twice a week. The people who stay mend nets, paint their boats and fix the roofs the autumn "
            "storms have loosened. On Friday nights the pub by the harbour holds a music evening, and "
            "anyone who can play an instrument is welcome to join in."
        ),
        (("harbour", "port"), ("cafes", "shops")),
    ),
    Passage(
        (
            "The town's school has ninety pupils and four teachers. Each June the older children spend a "
            "week on the islands, counting birds for a survey that the university has run since 1987. "
            "Their counts of puffins and terns are published every year, and a teacher says the children "
            "check the new report before anyone else in town."
        ),
        (("pupils", "students"), ("puffins", "gulls")),
    ),
)
