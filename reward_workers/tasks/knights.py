"""Knights and knaves: logic puzzles with a unique solution, in the style of the K&K benchmark.

Knights always tell the truth, knaves always lie. Each inhabitant makes one statement built
from "X is a knight/knave" with not / and / or / if-then / if-and-only-if, nested up to
`depth`. A puzzle is kept only if exactly one assignment of roles makes every knight's
statement true and every knave's false (checked by brute force over all 2^n assignments).
The verifier reads the model's assignment ("A is a knight, B is a knave" and variants).
"""

from __future__ import annotations

import hashlib
import itertools
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from groupflow.core.records import Prompt, Verdict
from groupflow.reward_workers.format_reward import (
    MAX_EXTRACTION_CHARS,
    blend_format,
    check_format_weight,
    disguised_tag,
    last_tagged_block,
)
from groupflow.reward_workers.tasks.base import GeneratedTask
from groupflow.reward_workers.tasks.options import check_int

NAMES = (
    "Zoey", "Oliver", "Ethan", "Mia", "Liam", "Ava", "Noah", "Emma", "Lucas", "Sofia",
    "Henry", "Chloe", "Jack", "Grace", "Owen", "Ruby", "Leo", "Ella", "Isaac", "Nora",
    "Caleb", "Hazel", "Felix", "Ivy", "Jasper", "Luna", "Miles", "Aria", "Oscar", "Stella",
)  # fmt: skip
VERBS = ("said", "stated", "claimed", "remarked", "told you")
ROLES = ("knight", "knave")

# A statement is a tree: ("is", person, is_knight) | ("not", s) | (op, s, s) for op in
# "and", "or", "implies", "iff".
Statement = tuple


@dataclass(frozen=True)
class Puzzle:
    names: tuple[str, ...]
    statements: tuple[Statement, ...]  # statements[i] is what names[i] says
    solution: tuple[bool, ...]  # True = knight


def holds(statement: Statement, knights: tuple[bool, ...]) -> bool:
    kind = statement[0]
    if kind == "is":
        return knights[statement[1]] == statement[2]
    if kind == "not":
        return not holds(statement[1], knights)
    a, b = holds(statement[1], knights), holds(statement[2], knights)
    return {"and": a and b, "or": a or b, "implies": (not a) or b, "iff": a == b}[kind]


def solutions(statements: tuple[Statement, ...]) -> list[tuple[bool, ...]]:
    """Every assignment in which each speaker's statement is true exactly when they are a knight."""
    n = len(statements)
    return [
        knights
        for knights in itertools.product((True, False), repeat=n)
        if all(holds(s, knights) == knights[i] for i, s in enumerate(statements))
    ]


def random_statement(rng: random.Random, people: int, depth: int) -> Statement:
    if depth <= 1 or rng.random() < 0.25:
        return ("is", rng.randrange(people), rng.random() < 0.5)
    kind = rng.choice(("not", "and", "or", "implies", "iff"))
    if kind == "not":
        inner = random_statement(rng, people, depth - 1)
        # "X is not a knave" reads better as a negated atom than as a nested clause
        return ("not", inner) if inner[0] != "not" else inner[1]
    left = random_statement(rng, people, depth - 1)
    right = random_statement(rng, people, depth - 1)
    while right == left:  # "if A is a knave then A is a knave" says nothing
        right = random_statement(rng, people, depth - 1)
    return (kind, left, right)


def make_puzzle(rng: random.Random, people: int, depth: int, max_tries: int = 10_000) -> Puzzle:
    names = tuple(rng.sample(NAMES, people))
    for _ in range(max_tries):
        statements = tuple(random_statement(rng, people, depth) for _ in range(people))
        found = solutions(statements)
        if len(found) == 1:
            return Puzzle(names, statements, found[0])
    raise RuntimeError(
        f"no unique puzzle for {people} people at depth {depth} in {max_tries} tries"
    )


def render(statement: Statement, names: tuple[str, ...], nested: bool = False) -> str:
    kind = statement[0]
    if kind == "is":
        return f"{names[statement[1]]} is a {ROLES[not statement[2]]}"
    if kind == "not":
        inner = statement[1]
        if inner[0] == "is":
            return f"{names[inner[1]]} is not a {ROLES[not inner[2]]}"
        text = f"it is not the case that {render(inner, names, nested=True)}"
    else:
        a, b = render(statement[1], names, nested=True), render(statement[2], names, nested=True)
        text = {
            "and": f"{a} and {b}",
            "or": f"{a} or {b}",
            "implies": f"if {a} then {b}",
            "iff": f"{a} if and only if {b}",
        }[kind]
    return f"({text})" if nested else text


def puzzle_text(puzzle: Puzzle, rng: random.Random) -> str:
    names = puzzle.names
    listed = ", ".join(names[:-1]) + f" and {names[-1]}"
    lines = [
        "A very special island is inhabited only by knights and knaves. Knights always tell "
        "the truth, and knaves always lie.",
        f"You meet {len(names)} inhabitants: {listed}.",
    ]
    for name, statement in zip(names, puzzle.statements, strict=True):
        said = render(statement, names)
        lines.append(f'{name} {rng.choice(VERBS)}, "{said[0].upper()}{said[1:]}."')
    example = "\n".join(f"({i}) {n} is a ..." for i, n in enumerate(names, start=1))
    lines.append(
        "So who is a knight and who is a knave? Give your final answer in <answer> </answer> "
        f"tags, one line per inhabitant:\n<answer>\n{example}\n</answer>"
    )
    return "\n".join(lines)


_ROLE = r"(?:knights?|knaves?|truth[- ]?tellers?|liars?)"
_EMPHASIS = r"[*_]*"  # markdown bold/italics around names and roles
_NOT = r"(?:n['’]t\b|\s+not\b)"  # "isn't", "is not", "aren't"
# Words that make a claim a guess rather than an answer.
_HEDGE = r"(?:maybe|perhaps|probably|possibly|likely|either|might\s+be|could\s+be|may\s+be)"
_HEDGE_BEFORE = re.compile(r"\b(?:maybe|perhaps|probably|possibly|either|or|nor)\W*$", re.I)
# "... a knight or a knave", "knight/knave", "knight (or knave)", "a knight and a knave",
# "a knight?"
_ALTERNATIVE = rf"{_EMPHASIS}\s*(?:\(?\s*(?:or|and|/)\s*(?:an?\s+)?{_EMPHASIS}{_ROLE}\b|\?)"


@dataclass(frozen=True)
class _Patterns:
    # "Zoey is a knight", "Zoey: knave", "| Zoey | Knight |", "Zoey isn't a liar"
    person: re.Pattern
    # "Zoey, Oliver and Ethan" followed by group_role: "are (all) knights", "aren't knaves"
    names_run: re.Pattern
    group_role: re.Pattern
    neither: re.Pattern  # "neither Zoey nor Oliver is a knight"
    name: re.Pattern


def _claim_patterns(names: list[str]) -> _Patterns:
    name = "|".join(re.escape(n) for n in names)
    copula = rf"(?:(?:is|was)(?P<neg1>{_NOT})?|must\s+be|:|-|=|–|—|→|->|\|)"
    person = re.compile(
        rf"\b(?P<name>{name})\b{_EMPHASIS}\s*{copula}?{_EMPHASIS}\s*(?P<hedge>{_HEDGE}\s+)?"
        rf"(?:(?:definitely|certainly|clearly|indeed|also)\s+)?(?P<neg2>not\s+)?(?:an?\s+)?"
        rf"{_EMPHASIS}(?P<role>{_ROLE})\b(?P<alt>{_ALTERNATIVE})?",
        re.IGNORECASE,
    )
    # Possessive: each run of names is matched once, whole (no restart at every name in it).
    names_run = re.compile(
        rf"\b(?:{name})\b(?:(?:\s*,\s*(?:and\s+)?|\s+and\s+)(?:{name})\b)*+", re.IGNORECASE
    )
    group_role = re.compile(
        rf"\s+(?:are|were)(?P<neg1>{_NOT})?\s+(?P<hedge>{_HEDGE}\s+)?(?:both\s+|all\s+)?"
        rf"(?P<role>{_ROLE})\b(?P<alt>{_ALTERNATIVE})?",
        re.IGNORECASE,
    )
    neither = re.compile(
        rf"\bneither\s+(?P<names>(?:{name})\s*,?\s+nor\s+(?:{name}))\s+(?:is|are|was|were)\s+"
        rf"(?:an?\s+)?(?P<role>{_ROLE})\b",
        re.IGNORECASE,
    )
    return _Patterns(person, names_run, group_role, neither, re.compile(name, re.IGNORECASE))


def read_assignment(text: str, names: list[str]) -> dict[str, list[bool | None]]:
    """Every claim the text makes, per person, in order of appearance: True = knight,
    False = knave, None = a hedge ("a knight or a knave", "maybe a knight", "Zoey or Oliver
    is a knight"), which never counts as an answer."""
    patterns = _claim_patterns(names)
    canonical = {n.lower(): n for n in names}
    claims: list[tuple[int, str, bool | None]] = []
    covered: list[tuple[int, int]] = []  # group statements; a name inside one is not a claim
    for start, end, people, is_knight in _group_claims(text, patterns):
        covered.append((start, end))
        claims.extend((start, canonical[person.lower()], is_knight) for person in people)
    for match in patterns.person.finditer(text):
        if any(start <= match.start() < end for start, end in covered):
            continue
        hedged_before = _HEDGE_BEFORE.search(text, max(0, match.start() - 12), match.start())
        is_knight = None if hedged_before else _claimed_role(match)
        claims.append((match.start(), canonical[match.group("name").lower()], is_knight))
    found: dict[str, list[bool | None]] = {}
    for _, person, is_knight in sorted(claims, key=lambda c: c[0]):
        found.setdefault(person, []).append(is_knight)
    return found


def _group_claims(
    text: str, patterns: _Patterns
) -> Iterator[tuple[int, int, list[str], bool | None]]:
    """(start, end, people, role) of each statement about several people at once."""
    for run in patterns.names_run.finditer(text):
        people = patterns.name.findall(run.group())
        role = patterns.group_role.match(text, run.end()) if len(people) > 1 else None
        if role is not None:
            yield run.start(), role.end(), people, _claimed_role(role)
    for match in patterns.neither.finditer(text):
        people = patterns.name.findall(match.group("names"))
        yield match.start(), match.end(), people, _claimed_role(match, negated=True)


def _claimed_role(match: re.Match, negated: bool = False) -> bool | None:
    groups = match.groupdict()
    if groups.get("hedge") or groups.get("alt"):
        return None
    negated ^= bool(groups.get("neg1")) ^ bool(groups.get("neg2"))
    return match.group("role").lower().startswith(("knight", "truth")) != negated


class KnightsAndKnavesTask(GeneratedTask):
    """Puzzles with `people` inhabitants (2-8) and statements nested up to `depth` levels
    (2-4). Depth 1 (bare "X is a knight" claims) can never pin down a unique solution:
    flipping everyone's role preserves every such claim's consistency."""

    name = "knights_and_knaves"

    def __init__(self, people: int = 3, depth: int = 2, format_weight: float = 0.0):
        check_int(self.name, "people", people, 2, 8)
        check_int(self.name, "depth", depth, 2, 4)
        self.people, self.depth = people, depth
        self.format_weight = check_format_weight(self.name, format_weight)

    def _make(self, rng: random.Random) -> Prompt:
        puzzle = make_puzzle(rng, self.people, self.depth)
        text = puzzle_text(puzzle, rng)
        uid = "kk-" + hashlib.sha256(text.encode()).hexdigest()[:16]
        answer = {n: ROLES[not k] for n, k in zip(puzzle.names, puzzle.solution, strict=True)}
        return Prompt(uid=uid, text=text, answer=answer)

    def parse_answer(self, raw: Any) -> dict[str, str]:
        if not isinstance(raw, dict) or not raw:
            raise ValueError('expected {"Name": "knight" | "knave", ...}')
        if not all(isinstance(k, str) and v in ROLES for k, v in raw.items()):
            raise ValueError('every role must be "knight" or "knave"')
        return dict(raw)

    def verify(self, prompt: Prompt, response: str) -> Verdict:
        response = response[-MAX_EXTRACTION_CHARS:]  # the claim patterns are not linear
        if refused := disguised_tag(response):
            return refused
        block = last_tagged_block(response)
        verdict = self._check(
            prompt.answer, response if block is None else block, strict=block is not None
        )
        return blend_format(verdict, block is not None, self.format_weight)

    def _check(self, answer: dict[str, str], text: str, strict: bool) -> Verdict:
        """Inside an answer block every person needs one consistent role; in free text (no
        block) the last claim about each person counts, as reasoning usually precedes it."""
        claims = read_assignment(text, list(answer))
        missing = [name for name in answer if name not in claims]
        if missing:
            return Verdict(0.0, f"no role given for {', '.join(missing)}")
        wrong = []
        for name, role in answer.items():
            said = claims[name]
            if None in (said if strict else said[-1:]):
                return Verdict(0.0, f"hedged role for {name}")
            if strict and len(set(said)) > 1:
                return Verdict(0.0, f"contradictory roles for {name}")
            if said[-1] != (role == "knight"):
                wrong.append(name)
        if wrong:
            return Verdict(0.0, f"wrong role for {', '.join(wrong)}")
        return Verdict(1.0, f"correct: all {len(answer)} roles")
