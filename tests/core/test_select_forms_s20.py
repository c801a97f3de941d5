"""A selector of a form hookscope does not take was met by Python's own error, naming no
selector: a class that is not a module's (``int``: "'Sequential' object cannot be interpreted
as an integer") and a predicate of another arity (``lambda m: ...``: "takes 1 positional
argument but 2 were given"). Both are refused by name now, with the forms that select; the
forms that select are unchanged."""

from __future__ import annotations

import pytest
import torch.nn as nn

import hookscope as hs

NET = nn.Sequential(nn.Linear(2, 2), nn.ReLU())


@pytest.mark.parametrize("sel", [int, dict])
def test_a_class_that_is_no_module_s_is_refused(sel):
    with pytest.raises(TypeError, match=f"must be an nn.Module subclass.*got {sel.__name__}"):
        hs.find(NET, sel)


@pytest.mark.parametrize("sel", [lambda m: True, lambda name, m, x: True])
def test_a_predicate_of_another_arity_is_refused(sel):
    with pytest.raises(TypeError, match=r"called as predicate\(name, module\)"):
        hs.find(NET, sel)


def test_the_forms_that_select_are_unchanged():
    assert list(hs.find(NET, lambda name, m: isinstance(m, nn.ReLU))) == ["1"]
    assert list(hs.find(NET, lambda *a: a[0] == "0")) == ["0"]
    assert list(hs.find(NET, nn.Linear)) == ["0"]
