"""The one exception type for mistakes a user can fix.

A ``UserError`` names the config field (or input) at fault and the fix; the
entry point prints it as one line and exits with status 2, without a traceback.
Anything else that escapes is a bug in mergeval and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    def __init__(self, field: str, problem: str, fix: str):
        self.field, self.problem, self.fix = field, problem, fix
        super().__init__(f"{field}: {problem}; {fix}")

    def line(self) -> str:
        return f"mergeval: error: {self}"
