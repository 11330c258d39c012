"""The demos run real gloo worlds: they need torch."""

import pytest

pytest.importorskip("torch")
