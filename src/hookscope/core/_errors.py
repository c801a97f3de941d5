"""hookscope's exception and warning hierarchy.

Every error hookscope raises for a user mistake derives from :class:`HookscopeError`, so a caller
can catch them all in one place. Errors that are also lookups (an unknown layer) derive from
:class:`KeyError` too, so ``except KeyError`` keeps working.
"""

from __future__ import annotations

__all__ = [
    "HookConflictError",
    "HookscopeError",
    "HookscopeWarning",
    "InPlaceModifiedWarning",
    "LayerNotFoundError",
    "LayerNotRunError",
    "NoGradientError",
    "ScopeReusedError",
    "UnsupportedModelError",
    "UnsupportedTensorError",
    "enter_once",
    "some_names",
]


class HookscopeError(Exception):
    """Base class of every error hookscope raises."""


class _KeyErrorMixin(KeyError):
    # KeyError.__str__ quotes its argument (repr); we want the plain message.
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class LayerNotFoundError(_KeyErrorMixin, HookscopeError):
    """A layer name, glob, type or predicate matched nothing; the message lists the closest names."""


class LayerNotRunError(_KeyErrorMixin, HookscopeError):
    """A selected layer exists but was never called (so nothing was captured for it)."""


class NoGradientError(_KeyErrorMixin, HookscopeError):
    """No gradient reached a captured value (backward not run, no_grad, or not part of the loss)."""


class HookConflictError(HookscopeError):
    """A hook hookscope needs cannot coexist with hooks already on the module."""


class UnsupportedModelError(HookscopeError):
    """The model cannot carry Python hooks (TorchScript) or would silently ignore them (compiled)."""


class UnsupportedTensorError(UnsupportedModelError):
    """A parameter or activation is a tensor subclass hookscope does not handle (its hooks might
    never fire), or a ``DTensor`` layout it cannot reduce; raised when hooks are attached."""


class ScopeReusedError(HookscopeError, RuntimeError):
    """A scope object entered a second time (or after it was closed). Every hookscope scope is
    single-use: its hooks are placed when it is created and removed when its ``with`` block ends,
    so a second ``with`` on the same object would run the model without them."""


def enter_once(scope: object, what: str, active: bool) -> None:
    """Refuse a second ``with`` on ``scope`` (or one after it was closed): raise
    :class:`ScopeReusedError` naming ``what`` (the call that makes such a scope) and the fix."""
    if getattr(scope, "_entered", False) or not active:
        state = (
            "is already open in an outer `with`"
            if active
            else "was closed when its `with` block ended"
        )
        raise ScopeReusedError(
            f"this {what} scope {state}; a scope is used by one `with` block, so create a new one "
            f"for each block: `with hs.{what}(...) as ...:`"
        )
    object.__setattr__(scope, "_entered", True)


class HookscopeWarning(UserWarning):
    """Base class of hookscope's warnings."""


class InPlaceModifiedWarning(HookscopeWarning):
    """A captured tensor was modified in place by the model after it was captured."""


def some_names(names: list[str], n: int = 3) -> str:
    """The first ``n`` names for a message: ``"'a', 'b', 'c' ..."``."""
    return ", ".join(repr(x) for x in names[:n]) + (" ..." if len(names) > n else "")
