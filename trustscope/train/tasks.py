"""Verifiable tasks: problems with a known answer and a strict reward, found by name or dotted import path.

A task is a :class:`Task`: a deterministic problem set, a held-out split, and a reward function. Rewards are plain
callables ``reward(response, answer, finish_reason) -> float`` usable outside the trainer.

Built-in tasks (arithmetic, several difficulties)::

    add1     a+b=   a, b in 0..9            (100 problems)
    add2     a+b=   a, b in 0..99           (10,000 problems)
    sub2     a-b=   a, b in 0..99, answers may be negative (10,000 problems)
    addsub2  add2 and sub2 together          (20,000 problems)
    arith    add1, add2 and sub2 mixed, each drawn equally often in training
    addcol2  a+b=   a, b in 10..99, answered as worked column addition (8,100 problems)
    addcol3  a+b=   a, b in 100..999, the same, a fixed seeded sample of 20,000 problems

For add1 .. arith the response must the answer's digits (with a leading '-' when negative) followed by EOS: ``"12+7="`` ->
``"19"`` + EOS scores 1; ``" 19"``, ``"019"``, ``"19."`` or ``"19"`` cut off by the length limit score 0.
A user's task is any :class:`Task` (or a zero-argument callable returning one) importable by dotted path, e.g.
``get_task("mypkg.tasks:parity")`` or ``get_task("mypkg.tasks.parity")``.

The column-addition tasks (``addcol*``) have responses of tens of tokens: the sum worked out column by column, ones
first, each column ``x+y=s`` with ``+1`` when a carry comes in and `` c1`` when one goes out, then ``=`` and the
sum. ``"47+38="`` -> ``"7+8=15 c1,4+3+1=8,=85"``. A problem's ``answer`` is that canonical worked solution (what
the toy's warm start imitates); the reward, :func:`column_addition_reward`, parses the response and checks it.

A multi-turn task has a ``tool`` (:class:`ToolUse`): the model's turn ends when it closes a call, the environment's
answer is spliced in as tokens the model did not sample, and the model goes on in its next turn (the trainer's
:mod:`trustscope.train.multiturn`). Built in::

    multool  a*b+c=  a, b, c in 0..9, worked with a calculator (1,000 problems)

``"7*8+5="`` -> the model calls ``(7*8)``, the calculator answers ``=56,``, the model calls ``(56+5)``, the
calculator answers ``=61,``, the model answers ``61`` + EOS: the response is ``"(7*8)=56,(56+5)=61,61"``, of which
the model sampled 13 tokens over three turns (EOS included) and the environment inserted 8. The reward,
:func:`tool_answer_reward`, reads the text after the last tool answer.
"""

from __future__ import annotations

import importlib
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

RewardFn = Callable[[str, str, str], float]
"""``reward(response, answer, finish_reason) -> float``; ``response`` is the decoded text without the EOS token,
``finish_reason`` is "stop" when the response ended with EOS and "length" when it hit the token limit."""

SPLITS = ("train", "eval")

_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)")


def exact_number_reward(response: str, answer: str, finish_reason: str = "stop") -> float:
    """1.0 when ``response`` is exactly the integer ``answer`` (canonical form, nothing around it) and the response
    ended with EOS; 0.0 otherwise."""
    if finish_reason != "stop" or _NUMBER.fullmatch(response) is None:
        return 0.0
    return 1.0 if response == answer else 0.0


_STEP = re.compile(r"([0-9])\+([0-9])(\+1)?=(1?[0-9])( c1)?")
_SUM = re.compile(r"=(0|[1-9][0-9]*)")


def parse_column_addition(response: str) -> tuple[list[tuple[int, int, bool, int, bool]], int] | None:
    """The steps and the final sum of a worked column addition, or None when ``response`` is not exactly one.

    ``"7+8=15 c1,4+3+1=8,=85"`` -> ``([(7, 8, False, 15, True), (4, 3, True, 8, False)], 85)``: per step the two
    digits, whether a carry came in, the column sum, whether a carry goes out. Only the grammar is checked here
    (steps joined by ``,``, then ``=`` and a canonical non-negative integer; nothing before, between or after).
    """
    *steps, total = response.split(",")
    m = _SUM.fullmatch(total)
    if m is None or not steps:
        return None
    parsed = []
    for step in steps:
        s = _STEP.fullmatch(step)
        if s is None:
            return None
        parsed.append((int(s[1]), int(s[2]), s[3] is not None, int(s[4]), s[5] is not None))
    return parsed, int(m[1])


def column_addition_reward(response: str, answer: str, finish_reason: str = "stop") -> float:
    """1.0 when ``response`` is a valid worked column addition reaching the reference sum, else 0.0.

    ``answer`` is the reference worked solution (a problem's ``answer``). Valid means: it parses
    (:func:`parse_column_addition`), ended with EOS, has one step per column of the reference, every step is true
    arithmetic (``x+y(+1)=s``), a carry comes into a column exactly when the previous one sent one out, a column
    sends one out exactly when its sum is >= 10, and the final sum is the reference's and is spelled by the steps
    (their units digits, last carry first). The operand digits themselves are not compared with the prompt: a
    response that works a different sum correctly still ends on a wrong total and scores 0.
    """
    if finish_reason != "stop":
        return 0.0
    got, ref = parse_column_addition(response), parse_column_addition(answer)
    if got is None or ref is None:
        return 0.0
    steps, total = got
    if len(steps) != len(ref[0]) or total != ref[1]:
        return 0.0
    carry, digits = False, []
    for x, y, carry_in, s, carry_out in steps:
        if carry_in != carry or x + y + carry_in != s or carry_out != (s >= 10):
            return 0.0
        carry = carry_out
        digits.append(str(s % 10))
    spelled = ("1" if carry else "") + "".join(reversed(digits))
    return 1.0 if int(spelled) == total else 0.0


def worked_column_addition(a: int, b: int) -> str:
    """The canonical worked solution of ``a + b`` (non-negative), ones first: ``(47, 38)`` -> ``"7+8=15 c1,4+3+1=8,=85"``.

    Both numbers are written with the longer one's digit count (the shorter padded with zeros on the left)."""
    if a < 0 or b < 0:
        raise ValueError(f"column addition needs non-negative numbers, got a={a}, b={b}")
    width = max(len(str(a)), len(str(b)))
    xs, ys = str(a).zfill(width)[::-1], str(b).zfill(width)[::-1]
    steps, carry = [], 0
    for x, y in zip(xs, ys, strict=True):
        s = int(x) + int(y) + carry
        steps.append(f"{x}+{y}{'+1' if carry else ''}={s}{' c1' if s >= 10 else ''}")
        carry = int(s >= 10)
    return ",".join(steps) + f",={a + b}"


_CALL = re.compile(r"\((-?[0-9]{1,4})([+*-])(-?[0-9]{1,4})\)")


def calculator_reply(turn: str) -> str:
    """The calculator's answer to a model turn ending in a call ``(x+y)``, ``(x-y)`` or ``(x*y)`` (integers of up
    to four digits): ``"=<value>,"``; ``"=?,"`` when the turn ends in anything else (a malformed call still costs
    the model its turn, as a tool error does)."""
    start = turn.rfind("(")
    m = _CALL.fullmatch(turn[start:]) if start >= 0 else None
    if m is None:
        return "=?,"
    x, op, y = int(m[1]), m[2], int(m[3])
    return f"={x + y if op == '+' else x - y if op == '-' else x * y},"


@dataclass(frozen=True)
class ToolUse:
    """How a multi-turn task's environment takes part: a model turn that ends with ``call_end`` (a single
    character, one token of the toy tokenizer) is a tool call; ``reply(turn_text)`` is what the environment
    answers, spliced in as tokens (its ids from the tokenizer, never the history re-tokenized), after which the
    model's next turn starts. At most ``max_calls`` calls are answered; a turn ending otherwise (EOS, or the token
    budget) ends the response."""

    reply: Callable[[str], str] = calculator_reply
    call_end: str = ")"
    max_calls: int = 2

    def __post_init__(self) -> None:
        if len(self.call_end) != 1:
            raise ValueError(f"ToolUse.call_end must be one character, got {self.call_end!r}")
        if self.max_calls < 1:
            raise ValueError(f"ToolUse.max_calls must be >= 1, got {self.max_calls}")


def tool_answer_reward(response: str, answer: str, finish_reason: str = "stop") -> float:
    """1.0 when the text after the last tool answer (the last ``,``) of ``response`` is exactly the integer that
    ends ``answer`` (the reference trajectory) and the response ended with EOS; 0.0 otherwise. The calls
    themselves are not graded: a trajectory that reaches the right number another way scores too."""
    return exact_number_reward(response.rsplit(",", 1)[-1], answer.rsplit(",", 1)[-1], finish_reason)


def worked_with_calculator(a: int, b: int, c: int) -> str:
    """The reference trajectory of ``a*b+c`` with the calculator: ``(7, 8, 5)`` -> ``"(7*8)=56,(56+5)=61,61"``
    (the model's turns and the calculator's answers, as :func:`calculator_reply` writes them)."""
    first = f"({a}*{b})"
    second = f"({a * b}+{c})"
    return first + calculator_reply(first) + second + calculator_reply(second) + str(a * b + c)


def model_spans(task: Task, answer: str) -> list[bool]:
    """Per character of a reference trajectory ``answer``: True where the model writes it, False where the
    environment does (each tool answer, from the end of a call up to where the model's next turn starts); all
    True for a task without a tool."""
    if task.tool is None:
        return [True] * len(answer)
    out, pos, calls = [], 0, 0
    while pos < len(answer):
        end = answer.find(task.tool.call_end, pos)
        if end < 0 or calls == task.tool.max_calls:
            out += [True] * (len(answer) - pos)
            break
        out += [True] * (end + 1 - pos)
        reply = task.tool.reply(answer[pos : end + 1])
        if not answer.startswith(reply, end + 1):
            raise ValueError(f"task {task.name!r}: reference {answer!r} has no tool answer {reply!r} at {end + 1}")
        out += [False] * len(reply)
        pos, calls = end + 1 + len(reply), calls + 1
    return out


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer; ``task`` names the task it came from (for per-task accuracy)."""

    prompt: str
    answer: str
    task: str


@dataclass(frozen=True, eq=False)
class Task:
    """A verifiable task: a deterministic problem set split into train and held-out eval problems.

    ``make_problems`` returns the full problem set in a fixed order; ``eval_size`` problems are held out, chosen by
    a seeded shuffle, so ``split("train", seed)`` and ``split("eval", seed)`` are disjoint and reproducible.
    A mixture task (``components``) draws each component equally often in training and evaluates on the union of
    the components' eval splits.
    """

    name: str
    description: str
    reward: RewardFn = exact_number_reward
    make_problems: Callable[[], list[Problem]] | None = None
    eval_size: int = 0
    components: tuple[Task, ...] = ()
    tool: ToolUse | None = None
    """A multi-turn task's environment (:class:`ToolUse`); None: one model turn."""
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if (self.make_problems is None) == (not self.components):
            raise ValueError(f"task {self.name!r}: give exactly one of make_problems or components")

    @cached_property
    def problems(self) -> tuple[Problem, ...]:
        """The full problem set, in a fixed order (a mixture: its components' sets, one after another)."""
        if self.components:
            return tuple(p for c in self.components for p in c.problems)
        return tuple(self.make_problems())

    def split(self, which: str, seed: int = 0) -> list[Problem]:
        """The ``"train"`` or ``"eval"`` problems for ``seed``: disjoint, deterministic.

        For a mixture, the train list repeats shorter components' train problems so that every component appears
        equally often; sampling uniformly from it draws each component with equal probability.
        """
        if which not in SPLITS:
            raise ValueError(f"split must be one of {list(SPLITS)}, got {which!r}")
        key = (which, seed)
        if key not in self._cache:
            self._cache[key] = self._split(which, seed)
        return list(self._cache[key])

    def _split(self, which: str, seed: int) -> list[Problem]:
        if self.components:
            parts = [c.split(which, seed) for c in self.components]
            if which == "eval":
                return [p for part in parts for p in part]
            longest = max(len(part) for part in parts)
            return [part[i % len(part)] for part in parts for i in range(longest)]
        order = list(range(len(self.problems)))
        random.Random(f"{self.name}:{seed}").shuffle(order)
        if not 0 < self.eval_size < len(order):
            raise ValueError(f"task {self.name!r}: eval_size must be in (0, {len(order)}), got {self.eval_size}")
        picked = sorted(order[: self.eval_size]) if which == "eval" else sorted(order[self.eval_size :])
        return [self.problems[i] for i in picked]

    def accuracy(self, per_problem: Sequence[float], problems: Sequence[Problem]) -> float:
        """Mean of ``per_problem`` scores; a mixture averages per component first, so each counts equally."""
        if len(per_problem) != len(problems) or not problems:
            raise ValueError(f"need one score per problem, got {len(per_problem)} scores for {len(problems)} problems")
        groups: dict[str, list[float]] = {}
        for s, p in zip(per_problem, problems, strict=True):
            groups.setdefault(p.task if self.components else self.name, []).append(float(s))
        return sum(sum(g) / len(g) for g in groups.values()) / len(groups)

    def sample(self, rng: random.Random, count: int, which: str = "train", seed: int = 0) -> list[Problem]:
        """``count`` problems drawn uniformly with replacement from ``split(which, seed)`` using ``rng``."""
        pool = self.split(which, seed)
        return [pool[rng.randrange(len(pool))] for _ in range(count)]

    def score(self, problems: Sequence[Problem], responses: Sequence[str], finish_reasons: Sequence[str]) -> list[float]:
        """Rewards of ``responses`` to ``problems`` (aligned lists)."""
        if not len(problems) == len(responses) == len(finish_reasons):
            raise ValueError(
                f"problems, responses and finish_reasons must have the same length, got "
                f"{len(problems)}, {len(responses)}, {len(finish_reasons)}"
            )
        return [float(self.reward(r, p.answer, f)) for p, r, f in zip(problems, responses, finish_reasons, strict=True)]


_TASKS: dict[str, Task] = {}


def register_task(task: Task) -> Task:
    """Add ``task`` to the registry under ``task.name`` (a name can be registered once)."""
    if task.name in _TASKS:
        raise ValueError(f"task {task.name!r} is already registered")
    _TASKS[task.name] = task
    return task


def list_tasks() -> list[str]:
    """Names of the registered tasks."""
    return sorted(_TASKS)


def get_task(name: str) -> Task:
    """A registered task by name, or a :class:`Task` (or zero-argument factory of one) by dotted import path
    (``"pkg.module:attr"`` or ``"pkg.module.attr"``)."""
    if name in _TASKS:
        return _TASKS[name]
    if "." not in name and ":" not in name:
        raise ValueError(f"unknown task {name!r}; registered tasks: {list_tasks()} (or give a dotted import path)")
    module_name, _, attr = name.partition(":") if ":" in name else name.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"task {name!r}: cannot import {attr!r} from {module_name!r} ({e})") from e
    if not isinstance(obj, Task) and callable(obj):
        obj = obj()
    if not isinstance(obj, Task):
        raise ValueError(f"task {name!r} resolved to {type(obj).__name__}, expected a trustscope Task")
    return obj


def _binary(name: str, op: str, lo: int, hi: int) -> Callable[[], list[Problem]]:
    fn = {"+": lambda a, b: a + b, "-": lambda a, b: a - b}[op]

    def make() -> list[Problem]:
        return [Problem(f"{a}{op}{b}=", str(fn(a, b)), name) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]

    return make


def _column_addition(name: str, digits: int, count: int | None) -> Callable[[], list[Problem]]:
    """All ``digits``-digit sums (``count`` None), or ``count`` distinct ones drawn with a generator seeded by the
    task name, in a fixed order; each answered by :func:`worked_column_addition`."""
    lo, hi = 10 ** (digits - 1), 10**digits - 1

    def make() -> list[Problem]:
        if count is None:
            pairs = [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
        else:
            rng = random.Random(f"{name}:problems")
            n = hi - lo + 1
            pairs = [divmod(i, n) for i in sorted(rng.sample(range(n * n), count))]
            pairs = [(lo + a, lo + b) for a, b in pairs]
        return [Problem(f"{a}+{b}=", worked_column_addition(a, b), name) for a, b in pairs]

    return make


ADD1 = register_task(Task("add1", "a+b= with one-digit a, b", make_problems=_binary("add1", "+", 0, 9), eval_size=20))
ADD2 = register_task(
    Task("add2", "a+b= with a, b in 0..99", make_problems=_binary("add2", "+", 0, 99), eval_size=500)
)
SUB2 = register_task(
    Task("sub2", "a-b= with a, b in 0..99 (negative answers)", make_problems=_binary("sub2", "-", 0, 99), eval_size=500)
)
ADDSUB2 = register_task(Task("addsub2", "add2 and sub2 mixed", components=(ADD2, SUB2)))
ARITH = register_task(Task("arith", "add1, add2 and sub2, drawn equally often", components=(ADD1, ADD2, SUB2)))
ADDCOL2 = register_task(
    Task("addcol2", "a+b= with a, b in 10..99, worked column by column", reward=column_addition_reward,
         make_problems=_column_addition("addcol2", 2, None), eval_size=200)
)
ADDCOL3 = register_task(
    Task("addcol3", "a+b= with a, b in 100..999, worked column by column (20,000 of them)",
         reward=column_addition_reward, make_problems=_column_addition("addcol3", 3, 20_000), eval_size=500)
)
MULTOOL = register_task(
    Task("multool", "a*b+c= with a, b, c in 0..9, worked in three turns with a calculator tool",
         reward=tool_answer_reward, eval_size=100, tool=ToolUse(),
         make_problems=lambda: [Problem(f"{a}*{b}+{c}=", worked_with_calculator(a, b, c), "multool")
                                for a in range(10) for b in range(10) for c in range(10)])
)
