"""Tasks and rewards: strict parsing, deterministic disjoint splits, lookup by name and by dotted path."""

from __future__ import annotations

import random

import pytest

from trustscope.train.tasks import (
    Problem,
    Task,
    column_addition_reward,
    exact_number_reward,
    get_task,
    list_tasks,
    parse_column_addition,
    worked_column_addition,
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
    assert {"add1", "add2", "sub2", "addsub2", "arith", "addcol2", "addcol3"} <= set(list_tasks())


def test_task_definition_errors():
    with pytest.raises(ValueError, match="exactly one of"):
        Task("empty", "no problems")
    bad = Task("bad", "eval too big", make_problems=lambda: [Problem("1=", "1", "bad")], eval_size=5)
    with pytest.raises(ValueError, match="eval_size"):
        bad.split("eval")


# --- worked column addition (addcol2, addcol3) --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b", "worked"),
    [
        (47, 38, "7+8=15 c1,4+3+1=8,=85"),
        (12, 34, "2+4=6,1+3=4,=46"),
        (95, 17, "5+7=12 c1,9+1+1=11 c1,=112"),
        (473, 958, "3+8=11 c1,7+5+1=13 c1,4+9+1=14 c1,=1431"),
        (999, 1, "9+1=10 c1,9+0+1=10 c1,9+0+1=10 c1,=1000"),
        (0, 0, "0+0=0,=0"),
    ],
)
def test_worked_column_addition(a, b, worked):
    assert worked_column_addition(a, b) == worked
    assert column_addition_reward(worked, worked, "stop") == 1.0


REF = "7+8=15 c1,4+3+1=8,=85"  # 47+38=


@pytest.mark.parametrize(
    ("response", "reward"),
    [
        ("7+8=15 c1,4+3+1=8,=85", 1.0),
        ("8+7=15 c1,3+4+1=8,=85", 1.0),  # another valid working of the same sum
        ("7+8=15 c1,4+3+1=8,=86", 0.0),  # wrong total
        ("7+8=15 c1,4+3+1=8,=085", 0.0),  # not canonical
        ("=85", 0.0),  # no working
        ("7+8=15 c1,=85", 0.0),  # a column missing
        ("7+8=15 c1,4+3+1=8,0+0=0,=85", 0.0),  # a column too many
        ("7+8=15,4+3+1=8,=85", 0.0),  # carry out not marked
        ("7+8=15 c1,4+3=8,=85", 0.0),  # carry in not added
        ("7+8=15 c1,4+3+1=9,=85", 0.0),  # false step
        ("7+8=16 c1,4+3+1=8,=86", 0.0),  # false step, consistent total
        ("7+1=8,4+3+1=8,=85", 0.0),  # carry in without a carry out before it
        ("7+8=15 c1,4+4=8,=85", 0.0),  # the steps spell 85 but drop the carry
        ("6+9=15 c1,4+3+1=8,=85", 1.0),  # operands are not checked against the prompt; arithmetic and total are
        ("7+8=15 c1, 4+3+1=8,=85", 0.0),  # a space
        ("7+8=15 c1,4+3+1=8,=85 ", 0.0),  # trailing space
        ("7+8=15 c1,4+3+1=8,85", 0.0),  # no '=' before the total
        ("85", 0.0),
        ("", 0.0),
    ],
)
def test_column_addition_reward_hand_computed(response, reward):
    assert column_addition_reward(response, REF, "stop") == reward


def test_column_addition_reward_needs_eos():
    assert column_addition_reward(REF, REF, "length") == 0.0


def test_parse_column_addition():
    assert parse_column_addition(REF) == ([(7, 8, False, 15, True), (4, 3, True, 8, False)], 85)
    assert parse_column_addition("7+8=15 c1") is None
    assert parse_column_addition("12+3=15,=15") is None  # one digit per operand and column


def test_column_addition_tasks():
    two = get_task("addcol2")
    assert len(two.problems) == 90 * 90 and len(two.split("eval")) == 200
    three = get_task("addcol3")
    assert len(three.problems) == len(set(three.problems)) == 20_000
    for task in (two, three):
        for p in task.problems[::97]:
            a, b = p.prompt[:-1].split("+")
            assert p.prompt.endswith("=") and p.answer == worked_column_addition(int(a), int(b))
            assert p.answer.endswith(f",={int(a) + int(b)}")
            assert task.reward(p.answer, p.answer, "stop") == 1.0
    lengths = [len(p.answer) for p in two.problems]
    assert (min(lengths), max(lengths)) == (15, 26)
    assert max(len(p.answer) for p in three.problems) == 39


def test_column_addition_generator_is_deterministic():
    from trustscope.train.tasks import _column_addition

    make = _column_addition("addcol3", 3, 20_000)
    first = make()
    assert first == make() == list(get_task("addcol3").problems)
    assert first[:2] == [Problem("100+100=", "0+0=0,0+0=0,1+1=2,=200", "addcol3"),
                         Problem("100+168=", "0+8=8,0+6=6,1+1=2,=268", "addcol3")]
    other = _column_addition("other", 3, 20_000)()  # the sample is seeded by the task's name
    assert [p.prompt for p in other] != [p.prompt for p in first]
    assert get_task("addcol3").split("eval", seed=0) == get_task("addcol3").split("eval", seed=0)


def test_worked_column_addition_rejects_negative():
    with pytest.raises(ValueError, match="non-negative"):
        worked_column_addition(-1, 2)
