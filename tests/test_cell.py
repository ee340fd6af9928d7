"""Which names a cell needs from the notebook: read before (or without) being assigned."""

from __future__ import annotations

import textwrap

import pytest

from nbshard.kernel.cell import free_names


def names(source: str) -> set[str]:
    return free_names(textwrap.dedent(source))


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("model = MyModel(cfg)\nlosses = train_loop(model, data)", {"MyModel", "cfg", "train_loop", "data"}),
        ("x = 1\ny = x + 1", set()),
        ("x = x + 1", {"x"}),
        ("total += step", {"total", "step"}),
        ("for item in items:\n    seen = item\nprint(seen)", {"items"}),
        ("with open(path) as f:\n    text = f.read()", {"path"}),
        ("squares = [n * n for n in numbers if n > limit]", {"numbers", "limit"}),
        ("table = {k: v for k, v in pairs}", {"pairs"}),
        ("f = lambda a, b=default: a + b + offset", {"default", "offset"}),
        ("def train(lr):\n    local = lr * scale\n    return helper(local)", {"scale", "helper"}),
        ("def train():\n    global counter\n    counter = 1", set()),
        ("class Net(Base):\n    size = width\n    def forward(self, x):\n        return act(x)", {"Base", "width", "act"}),
        ("import numpy as np\narr = np.zeros(3)", set()),
        ("from torch import nn\nlayer = nn.Linear(2, 2)", set()),
        ("try:\n    risky()\nexcept ValueError as err:\n    print(err)", {"risky"}),
        ("if flag:\n    value = 1\nelse:\n    value = fallback", {"flag", "fallback"}),
        ("print(len(range(3)))", set()),  # builtins are not shipped
        ("def outer():\n    def inner():\n        return hidden\n    return inner", {"hidden"}),
        ("data[index] = new_value", {"data", "index", "new_value"}),
        ("result = helper()\ndef helper():\n    return 1", {"helper"}),
    ],
)
def test_free_names(source, expected):
    assert names(source) == expected


def test_a_syntax_error_is_raised_as_is():
    with pytest.raises(SyntaxError):
        free_names("def broken(:\n")
