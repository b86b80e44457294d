"""Tasks and rewards: strict parsing, deterministic disjoint splits, lookup by name and by dotted path."""

from __future__ import annotations

import random

import pytest

from trustscope.train.tasks import (
    Problem,
    Task,
    exact_number_reward,
    get_task,
    list_tasks,
)


@pytest.mark.parametrize(
    ("response", "answer", "finish", "reward"),
    [
        ("19", "19", "stop", 1.0),
        ("-12", "-12", "stop", 1.0),
        ("0", "0", "stop", 1.0),
        ("19", "19", "length", 0.0),  # no EOS: cut off by the token limit
        ("18", "19", "stop", 0.0),
        (" 19", "19", "stop", 0.0),
        ("19 ", "19", "stop", 0.0),
        ("019", "19", "stop", 0.0),
        ("19.", "19", "stop", 0.0),
        ("-0", "0", "stop", 0.0),
        ("", "0", "stop", 0.0),
        ("+19", "19", "stop", 0.0),
        ("1919", "19", "stop", 0.0),
    ],
)
def test_exact_number_reward_is_strict(response, answer, finish, reward):
    assert exact_number_reward(response, answer, finish) == reward


@pytest.mark.parametrize("name", ["add1", "add2", "sub2", "addsub2", "arith"])
def test_answers_are_right(name):
    task = get_task(name)
    for p in task.problems:
        a, op, b = p.prompt[:-1].partition("+") if "+" in p.prompt else p.prompt[:-1].partition("-")
        assert p.prompt.endswith("=")
        assert int(p.answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        assert exact_number_reward(p.answer, p.answer, "stop") == 1.0


def test_problem_counts():
    assert len(get_task("add1").problems) == 100
    assert len(get_task("add2").problems) == 10_000
    assert len(get_task("sub2").problems) == 10_000
    assert len(get_task("addsub2").problems) == 20_000
    assert any(p.answer.startswith("-") for p in get_task("sub2").problems)


@pytest.mark.parametrize("name", ["add1", "add2", "sub2", "addsub2", "arith"])
def test_splits_disjoint_deterministic(name):
    task = get_task(name)
    train, held_out = task.split("train", seed=0), task.split("eval", seed=0)
    assert set(train).isdisjoint(held_out)
    assert set(train) | set(held_out) == set(task.problems)
    assert task.split("eval", seed=0) == held_out
    assert get_task(name).split("train", seed=0) == train
    assert set(task.split("eval", seed=1)) != set(held_out)


def test_split_sizes():
    assert len(get_task("add1").split("eval")) == 20
    assert len(get_task("add1").split("train")) == 80
    assert len(get_task("arith").split("eval")) == 20 + 500 + 500


def test_mixture_draws_components_equally():
    train = get_task("arith").split("train")
    counts = {name: sum(p.task == name for p in train) for name in ("add1", "add2", "sub2")}
    assert counts["add1"] == counts["add2"] == counts["sub2"] == 9500
    rng = random.Random(0)
    drawn = get_task("arith").sample(rng, 3000)
    for name in counts:
        assert 850 < sum(p.task == name for p in drawn) < 1150


def test_accuracy_balances_mixture_components():
    task = get_task("arith")
    problems = [Problem("1+1=", "2", "add1")] + [Problem("10+10=", "20", "add2")] * 9
    assert task.accuracy([1.0] + [0.0] * 9, problems) == pytest.approx(0.5)
    assert get_task("add2").accuracy([1.0, 0.0, 0.0, 0.0], problems[:4]) == pytest.approx(0.25)


def test_score():
    task = get_task("add1")
    probs = [Problem("1+2=", "3", "add1"), Problem("4+5=", "9", "add1")]
    assert task.score(probs, ["3", "8"], ["stop", "stop"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="same length"):
        task.score(probs, ["3"], ["stop", "stop"])


def test_get_task_by_dotted_path():
    assert get_task("trustscope.train.tasks:ADD2") is get_task("add2")
    assert get_task("trustscope.train.tasks.ADD1") is get_task("add1")


def test_get_task_factory_by_dotted_path(tmp_path, monkeypatch):
    (tmp_path / "my_tasks.py").write_text(
        "from trustscope.train.tasks import Problem, Task\n"
        "def double():\n"
        "    return Task('double', 'x doubled', make_problems=lambda: "
        "[Problem(f'2*{x}=', str(2 * x), 'double') for x in range(50)], eval_size=10)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    task = get_task("my_tasks:double")
    assert task.name == "double" and len(task.split("eval")) == 10


def test_get_task_errors():
    with pytest.raises(ValueError, match=r"unknown task 'nope'.*add1"):
        get_task("nope")
    with pytest.raises(ValueError, match="cannot import"):
        get_task("trustscope.train.tasks:NOPE")
    with pytest.raises(ValueError, match="expected a trustscope Task"):
        get_task("trustscope.train.tasks:SPLITS")
    with pytest.raises(ValueError, match="split must be one of"):
        get_task("add1").split("test")
    assert {"add1", "add2", "sub2", "addsub2", "arith"} <= set(list_tasks())


def test_task_definition_errors():
    with pytest.raises(ValueError, match="exactly one of"):
        Task("empty", "no problems")
    bad = Task("bad", "eval too big", make_problems=lambda: [Problem("1=", "1", "bad")], eval_size=5)
    with pytest.raises(ValueError, match="eval_size"):
        bad.split("eval")
