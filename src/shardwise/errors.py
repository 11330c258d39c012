"""The one exception type the API raises for bad input.

The CLI turns a `ShardwiseError` into a single line on stderr and exit code 2.
"""

from __future__ import annotations


class ShardwiseError(ValueError):
    """Bad input: the message says what is wrong and what would be valid."""


class LayoutError(ShardwiseError):
    """A layout that cannot run on the given model and cluster; one message per problem."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))
