"""Checkers: verdicts computed from a recorded history, never from a live server."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Verdict:
    """A checker's answer: ``ok`` and, when not, one line per problem found."""

    checker: str
    ok: bool = True
    problems: list[str] = field(default_factory=list)
    figures: dict[str, float] = field(default_factory=dict)

    def fail(self, problem: str) -> None:
        self.ok = False
        self.problems.append(problem)

    def __str__(self) -> str:
        if self.ok:
            return f"{self.checker}: ok"
        shown = "\n  ".join(self.problems[:12])
        more = f"\n  ... and {len(self.problems) - 12} more" if len(self.problems) > 12 else ""
        return f"{self.checker}: {len(self.problems)} problem(s)\n  {shown}{more}"
