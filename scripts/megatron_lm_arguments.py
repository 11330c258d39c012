"""Write Megatron-LM's command-line options, as its own parser builds them, to a data file.

Megatron-LM's training package is not on PyPI, so tests/integration/test_megatron_lm.py checks
`--emit megatron` against this table instead of importing it: every option `pretrain_gpt.py`
accepts (`megatron.training.arguments.add_megatron_arguments`, which also generates options
from megatron-core's config dataclasses), with its kind, type, choices, nargs and default.

Run with a Megatron-LM checkout on the path, from the repository root:

    PYTHONPATH=../Megatron-LM python scripts/megatron_lm_arguments.py COMMIT \\
        > tests/integration/data/megatron_lm_arguments.json

COMMIT is the checkout's `git rev-parse HEAD`, recorded in the file.
"""

from __future__ import annotations

import argparse
import enum
import json
import sys
import typing

KINDS = {"_StoreAction": "store", "_StoreTrueAction": "store_true",
         "_StoreFalseAction": "store_false", "BooleanOptionalAction": "boolean_optional"}
TYPES = {int: "int", float: "float", str: "str", bool: "bool"}


def _plain(value: object) -> object:
    """A default or choice as JSON: enums by name, other non-JSON values as None."""
    if isinstance(value, enum.Enum):
        return value.name
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (bool, int, float, str))
                                                for v in value):
        return list(value)
    return None


def _type(action: argparse.Action) -> str:
    """int, float, str, bool; "enum" (its choices are the names); "custom" (a parsing
    function of Megatron-LM's own, not reproduced); "none" for flags."""
    if action.type is None:
        return "str" if KINDS.get(type(action).__name__) == "store" else "none"
    if action.type in TYPES:
        return TYPES[action.type]
    if action.choices and all(isinstance(c, enum.Enum) for c in action.choices):
        return "enum"
    return "custom"


def table(commit: str) -> dict[str, object]:
    if not hasattr(typing, "override"):  # Megatron-LM main imports Python 3.12's
        import typing_extensions

        typing.override = typing_extensions.override  # type: ignore[attr-defined]
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    options = []
    for action in parser._actions:
        kind = KINDS.get(type(action).__name__)
        if kind is None:  # --help
            continue
        nargs = action.nargs if action.nargs not in (0,) else None
        options.append({"flags": action.option_strings, "dest": action.dest, "kind": kind,
                        "type": _type(action), "nargs": nargs,
                        "choices": None if action.choices is None
                        else [_plain(c) for c in action.choices],
                        "default": _plain(action.default)})
    return {"source": "NVIDIA/Megatron-LM megatron/training/arguments.py "
                      "add_megatron_arguments", "commit": commit, "options": options}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    data = table(sys.argv[1])
    options = data.pop("options")
    head = json.dumps(data)[:-1]  # one option a line
    sys.stdout.write(head + ', "options": [\n' + ",\n".join(json.dumps(o) for o in options)
                     + "\n]}\n")
