"""Reading a user's JSON file (a Hugging Face config, a calibration) with one-line errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardwise.errors import ShardwiseError


def read_json(path: str | Path, what: str) -> Any:
    """The parsed JSON of `path`; a missing or malformed file is a `ShardwiseError` naming
    `what` ("config file", "calibration file") and the path."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ShardwiseError(f"{what} {str(path)!r} not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ShardwiseError(f"{what} {str(path)!r} is not valid JSON: {exc}") from None
