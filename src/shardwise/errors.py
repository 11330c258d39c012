"""The one exception type the API raises for bad input.

The CLI turns a `ShardwiseError` into a single line on stderr and exit code 2 (`one_line`
keeps it one line whatever text it carries: an exception's message, a rank's report).
"""

from __future__ import annotations


class ShardwiseError(ValueError):
    """Bad input: the message says what is wrong and what would be valid."""


class LayoutError(ShardwiseError):
    """A layout that cannot run on the given model and cluster; one message per problem."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


def one_line(text: object) -> str:
    """`text` on one line: its non-blank lines joined with " | " (a message that quotes
    another error may carry newlines; the CLI and the web app print one line)."""
    return " | ".join(line.strip() for line in str(text).splitlines() if line.strip())
