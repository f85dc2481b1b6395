"""A call's path through the modules of `jobs`, recorded as the code runs (issue 43, D363).

`CallPath(root)` profiles the current thread (sys.setprofile) while a function whose code
object is `root` runs. The path starts with the root's module; then each call that a
function of one `jobs` module makes directly (its own frame is the caller) to a function
of another appends the caller's module, then the callee's, and consecutive repeats
collapse. Not on the path:

- calls within one module;
- calls Django, DRF, psycopg or the standard library make into `jobs` on their own
  (the body parser, the database router, type loaders, on-commit callbacks): the code of
  `jobs` does not make them, so a reader following it does not either;
- `__getattr__`: `settings.X` (jobs.conf) reads a setting, it is not a call in the source.

A module is therefore on the path when a call enters it and again when, control having
come back to it, it calls another module: it asks the next thing. A return that only
unwinds is no step. `modules` counts the distinct modules of the path; `returns` the
steps to a module already on it earlier: a return to a module already left.

`stages()` is the same path without the modules of the lowest layers of
tests/test_architecture.py (up to "model caches": settings, registries, helpers,
drivers, models), which answer a lookup and lead nowhere else.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from types import CodeType, FrameType
from typing import Any

PACKAGE = "jobs"
NOT_CALLS = frozenset({"__getattr__"})


def _is_ours(name: str) -> bool:
    return name == PACKAGE or name.startswith(PACKAGE + ".")


class Path:
    """A path of modules, consecutive repeats collapsed."""

    def __init__(self, steps: Iterable[str] = ()) -> None:
        self.steps: list[str] = []
        for step in steps:
            self.add(step)

    def add(self, module: str) -> None:
        if not self.steps or self.steps[-1] != module:
            self.steps.append(module)

    @property
    def modules(self) -> int:
        return len(set(self.steps))

    @property
    def returns(self) -> int:
        return sum(1 for n, m in enumerate(self.steps) if m in self.steps[:n])

    def shown(self) -> str:
        """As docs/architecture.md writes a path: `jobs.` dropped, returns in bold."""
        out = []
        for n, module in enumerate(self.steps):
            name = module.removeprefix(PACKAGE + ".") or PACKAGE
            out.append(f"**`{name}`**" if module in self.steps[:n] else f"`{name}`")
        return " → ".join(out)

    def summary(self) -> str:
        return f"{self.modules} modules, {self.returns} returns: {self.shown()}"


class CallPath(Path):
    def __init__(self, root: CodeType) -> None:
        super().__init__()
        self.root = root
        self._running = 0  # frames of `root` running

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if frame.f_code is self.root:
            if event == "call":
                self._running += 1
                self.add(frame.f_globals["__name__"])
            elif event == "return":
                self._running -= 1
            return
        if event != "call" or not self._running or frame.f_code.co_name in NOT_CALLS:
            return
        callee = frame.f_globals.get("__name__", "")
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back else ""
        if caller != callee and _is_ours(callee) and _is_ours(caller):
            self.add(caller)
            self.add(callee)

    def run(self, call: Callable[[], Any]) -> Any:
        previous = sys.getprofile()
        sys.setprofile(self._profile)
        try:
            return call()
        finally:
            sys.setprofile(previous)

    def stages(self, lowest: Callable[[str], bool]) -> Path:
        """The path without the modules `lowest` names."""
        return Path(m for m in self.steps if not lowest(m))
