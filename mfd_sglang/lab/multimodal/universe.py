"""The multimodal universe (pure Python, exact): M coherent futures after every marker, drawn at random or fixed
by a cue two cycles back; its known answer (`Universe.next_token_distribution`, `continuations`, the covered
mass of a tree and of the best tree, the chimeras a product tree must hold). The package docstring says what
the universe is and for whom it is multimodal."""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass


HEADERS = ("random", "cued")
NO_CUE = "nocue"
FILLER = ("and", "so", "now")
FUTURES = (
    ("alpha", "bravo", "charlie", "then", "delta", "echo", "foxtrot"),
    ("one", "two", "three", "then", "four", "five", "six"),
    ("red", "green", "blue", "then", "cyan", "pink", "gray"),
    ("monday", "tuesday", "wednesday", "then", "thursday", "friday", "saturday"),
)
FUTURE_PROBS = (0.4, 0.3, 0.2, 0.1)
CUES = tuple(f"cue{j}" for j in range(len(FUTURES)))
FUTURE_LEN = len(FUTURES[0])
CYCLE = 1 + FUTURE_LEN + len(FILLER)  # a marker, a future, the filler
CUE_DISTANCE = 2 * CYCLE  # the future after marker i is cued by marker i - 2
BLOCK_SIZE = 8  # drafter block: root + 7 drafted tokens, one future's length
DRAFTER_WINDOW = 8  # the drafter's sliding window (>= BLOCK_SIZE: every block slot sees the root)

# A block that drafts a future token starts >= (BLOCK_SIZE - 2) before the future's marker and reaches
# DRAFTER_WINDOW - 1 tokens before its root: the cue must lie further back.
assert CUE_DISTANCE > (BLOCK_SIZE - 2) + (DRAFTER_WINDOW - 1)


def words() -> list[str]:
    """Every word of the universe (the tokenizer adds its special tokens before them)."""
    out = list(HEADERS) + [NO_CUE] + list(CUES) + list(FILLER)
    for future in FUTURES:
        out += [w for w in future if w not in out]
    return out


@dataclass(frozen=True)
class Universe:
    """The universe over token ids (`ids`: word -> id of the tokenizer that encodes it).

    Layout: position 0 the header; then cycles of CYCLE tokens from position 1: a marker (phase 0),
    a future (phases 1..7) and the filler (phases 8..10). Markers are `nocue` in "random" sequences
    and a uniform `cue<j>` in "cued" ones; the marker CUE_DISTANCE before a future's marker decides
    that future (`cue<j>`: F_j; `nocue` or none: drawn with FUTURE_PROBS).
    """
    ids: dict

    def __post_init__(self):
        ids = self.ids
        object.__setattr__(self, "header_ids", tuple(ids[w] for w in HEADERS))
        object.__setattr__(self, "cue_ids", tuple(ids[w] for w in CUES))
        object.__setattr__(self, "future_ids", tuple(tuple(ids[w] for w in f) for f in FUTURES))
        # The first token of a future names it (the futures differ there).
        object.__setattr__(self, "future_of_first", {f[0]: j for j, f in enumerate(self.future_ids)})

    # --- layout ---------------------------------------------------------------------------------
    @staticmethod
    def phase(position: int) -> int:
        """Phase of a position inside its cycle: 0 a marker, 1..7 the future's tokens, 8.. the filler;
        -1 the header."""
        return -1 if position == 0 else (position - 1) % CYCLE

    @staticmethod
    def marker_positions(length: int) -> list[int]:
        return list(range(1, length, CYCLE))

    def fork_kind(self, prefix: list[int], marker: int) -> str:
        """"cued" when the marker CUE_DISTANCE before this one is a cue, else "random"."""
        cue = marker - CUE_DISTANCE
        return "cued" if 1 <= cue < len(prefix) and prefix[cue] in self.cue_ids else "random"

    # --- the true process -----------------------------------------------------------------------
    def next_token_distribution(self, prefix: list[int]) -> list[tuple[int, float]]:
        """The universe's distribution of the token after `prefix` [(id, prob)], exactly; [] when
        the prefix is off the universe (a token no rule allows), so every continuation has mass 0."""
        pos = len(prefix)
        if pos == 0:
            return [(h, 1.0 / len(HEADERS)) for h in self.header_ids]
        ph = self.phase(pos)
        if ph == 0:
            if prefix[0] == self.ids["cued"]:
                return [(c, 1.0 / len(CUES)) for c in self.cue_ids]
            return [(self.ids[NO_CUE], 1.0)] if prefix[0] == self.ids["random"] else []
        if ph == 1:
            if self.fork_kind(prefix, pos - 1) == "cued":
                j = self.cue_ids.index(prefix[pos - 1 - CUE_DISTANCE])
                return [(self.future_ids[j][0], 1.0)]
            return [(f[0], p) for f, p in zip(self.future_ids, FUTURE_PROBS)]
        if ph > FUTURE_LEN:
            return [(self.ids[FILLER[ph - FUTURE_LEN - 1]], 1.0)]
        j = self.future_of_first.get(prefix[pos - ph + 1])
        return [] if j is None else [(self.future_ids[j][ph - 1], 1.0)]

    def first_off_universe(self, sequence: list[int]) -> int | None:
        """The first position whose token the universe gives probability 0 (None: all possible)."""
        for i in range(len(sequence)):
            if all(t != sequence[i] for t, _ in self.next_token_distribution(sequence[:i])):
                return i
        return None

    def sample(self, rng: random.Random, kind: str, length: int) -> list[int]:
        """One sequence of `length` tokens with header `kind` ("random" or "cued")."""
        seq = [self.ids[kind]]
        while len(seq) < length:
            tokens, probs = zip(*self.next_token_distribution(seq))
            seq.append(rng.choices(tokens, probs)[0])
        return seq

    def continuations(self, prefix: list[int], depth: int, *, blind: bool = False) -> dict[tuple, float]:
        """Every continuation of `depth` tokens after `prefix` with its probability (those > 0).

        blind: as a drafter that cannot see the cue knows it: a cued future is any of the M futures
        (uniform). Its support is every continuation the universe can produce from what such a
        drafter sees.
        """
        out: dict[tuple, float] = {}

        def walk(seq: list[int], prob: float) -> None:
            if len(seq) == len(prefix) + depth:
                path = tuple(seq[len(prefix):])
                out[path] = out.get(path, 0.0) + prob
                return
            dist = self.next_token_distribution(seq)
            if blind and self.phase(len(seq)) == 1 and len(dist) == 1:
                dist = [(f[0], 1.0 / len(FUTURES)) for f in self.future_ids]
            for token, p in dist:
                walk(seq + [token], prob * p)

        walk(list(prefix), 1.0)
        return out


def prefix_masses(continuations: dict[tuple, float]) -> dict[tuple, float]:
    """P(the next tokens start with u) for every prefix u (depth >= 1) of the continuations."""
    mass: dict[tuple, float] = defaultdict(float)
    for path, p in continuations.items():
        for d in range(1, len(path) + 1):
            mass[path[:d]] += p
    return dict(mass)


def covered_mass(masses: dict[tuple, float], paths: list[tuple]) -> float:
    """Expected accepted draft tokens of a tree whose node paths are `paths` (prefix-closed): under
    tree verification a node is accepted iff the target's continuation starts with its path."""
    return sum(masses.get(tuple(p), 0.0) for p in paths)


def ideal_covered_mass(masses: dict[tuple, float], budget: int) -> float:
    """The largest covered mass of any tree of `budget` nodes: the sum of the `budget` largest prefix
    masses. Those form a tree: a prefix's mass is at least its extension's, so taking ties toward
    ancestors keeps the set prefix-closed."""
    return sum(sorted(masses.values(), reverse=True)[:budget])


def splice_chimeras(paths: list[tuple], a: tuple, b: tuple) -> int:
    """Tree nodes at depth len(a) that splice futures a and b: every token from a or b at its depth,
    neither a nor b itself (the chimeras of the 2^(m-1) - 1 bound)."""
    depth = len(a)
    return sum(1 for p in paths if len(p) == depth and tuple(p) not in (a, b)
               and all(t in (x, y) for t, x, y in zip(p, a, b)))


def chimera_bound(a: tuple, b: tuple) -> int:
    """2^(m-1) - 1 for two futures that differ in m positions (0 when they are equal)."""
    m = sum(x != y for x, y in zip(a, b))
    return 2 ** (m - 1) - 1 if m else 0


