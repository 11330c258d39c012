"""One checker per kind of quantity, for every public boundary: the Python API, the CLI's
options (`option` turns a checker into a click callback) and the web app alike.

Each returns the value (as int or float) or raises `ShardwiseError` naming the argument, the
value and the valid range, e.g. "n must be an integer ≥ 1, got 2.5". They are cheap (a type
test and two comparisons): call them once at the top of a public function, never in an inner
loop (the planner's vectorised search checks its inputs once, not per layout).

Caps (`MAX_*`) keep an absurd request from allocating or looping for minutes before anything
is printed; each is far above any real cluster or schedule.
"""

from __future__ import annotations

import math
import numbers
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import fields, is_dataclass
from typing import Any

from shardwise.errors import ShardwiseError

__all__ = [
    "MAX_BYTES",
    "MAX_DEGREE",
    "MAX_FACTOR",
    "MAX_LAYERS",
    "MAX_SCHEDULE_ACTIONS",
    "MAX_SCHEDULE_ACTIONS_API",
    "MAX_SEED",
    "MAX_SEQUENCES",
    "MAX_TIME",
    "MIN_TIME",
    "clean",
    "degree",
    "duration",
    "finite",
    "finite_result",
    "fraction",
    "hf_config",
    "instance",
    "integer",
    "known",
    "label",
    "layout_items",
    "nonfinite",
    "option",
    "positive",
    "positive_int",
    "schedule_shape",
    "seed",
    "size",
    "walk",
]

MAX_DEGREE = 2**20  # ranks on one axis or in one collective: a million GPUs
MAX_SEQUENCES = 2**40  # sequences in a global batch
MAX_BYTES = 1e24  # a yottabyte: more than any tensor, checkpoint or cluster holds
MAX_SEED = 2**63 - 1  # torch.manual_seed takes a 64-bit seed
MAX_LAYERS = 100_000  # Transformer layers (the deepest published models have a few hundred)
MAX_WIDTH = 2**24  # hidden, FFN and head widths, heads, experts (16M)
MAX_VOCAB = 2**32
MAX_FACTOR = 1e6  # a capacity factor (any cf ≥ E/k keeps every routed token)
# Times of a pipeline schedule (any unit): a span of 10^18 keeps every start and end, and the
# drawing's slot (makespan / width), a normal float.
MIN_TIME, MAX_TIME = 1e-9, 1e9
# 3·p·m·v actions of a pipeline schedule: the CLI draws up to 200,000 (~8 s to simulate);
# the API generates up to 2,000,000 (measured: 83 s and 0.8 GB to simulate, zb-h1 p=100
# m=6666, on a loaded 2-core machine).
MAX_SCHEDULE_ACTIONS = 200_000
MAX_SCHEDULE_ACTIONS_API = 2_000_000


def _is_int(value: Any) -> bool:
    return type(value) is int or (isinstance(value, numbers.Integral)
                                  and not isinstance(value, bool))


def _is_real(value: Any) -> bool:
    return type(value) in (float, int) or (isinstance(value, numbers.Real)
                                           and not isinstance(value, bool))


def _num(x: float) -> str:
    return f"{x:,}" if isinstance(x, int) else f"{x:g}"


def _interval(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return (f"in {'(' if low_open else '['}{_num(low)}, {_num(high)}"
                f"{')' if high_open else ']'}")
    if low is not None:
        return f"{'>' if low_open else '≥'} {_num(low)}"
    if high is not None:
        return f"{'<' if high_open else '≤'} {_num(high)}"
    return ""


def integer(value: Any, name: str, *, low: int | None = None, high: int | None = None) -> int:
    """An integer (not a bool, float or string) in [low, high]."""
    if not _is_int(value):
        raise ShardwiseError(f"{_want_integer(name, low, high)}, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        shown = repr(value) if len(str(value)) <= 30 else f"a {len(str(value))}-digit number"
        raise ShardwiseError(f"{_want_integer(name, low, high)}, got {shown}")
    return int(value)


def _want_integer(name: str, low: int | None, high: int | None) -> str:
    return f"{name} must be an integer {_interval(low, high, False, False)}".rstrip()


def finite(value: Any, name: str, *, low: float | None = None, high: float | None = None,
           low_open: bool = False, high_open: bool = False) -> float:
    """A finite real number (not nan or ±inf, not a bool or string) in the given interval."""
    def want() -> str:  # the message, built only when it is raised
        return (f"{name} must be a finite number "
                f"{_interval(low, high, low_open, high_open)}").rstrip()

    if not _is_real(value):
        raise ShardwiseError(f"{want()}, got {value!r}")
    try:
        x = float(value)
    except OverflowError:  # an int beyond a float
        raise ShardwiseError(f"{want()}, got a {len(str(value))}-digit number") from None
    if (not math.isfinite(x) or (low is not None and (x <= low if low_open else x < low))
            or (high is not None and (x >= high if high_open else x > high))):
        raise ShardwiseError(f"{want()}, got {value!r}")
    return x


def instance(value: Any, kind: type | tuple[type, ...], name: str, hint: str = "") -> Any:
    """`value` when it is a `kind` (e.g. a `ModelSpec`); else one line naming what it is."""
    if not isinstance(value, kind):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        want = " or ".join(k.__name__ for k in kinds)
        shown = repr(value) if len(repr(value)) <= 60 else f"a {type(value).__name__}"
        raise ShardwiseError(f"{name} must be a {want}{hint}, got {shown}")
    return value


def positive_int(value: Any, name: str, high: int | None = None) -> int:
    """An integer ≥ 1 (and ≤ `high` when given)."""
    return integer(value, name, low=1, high=high)


def degree(value: Any, name: str) -> int:
    """A parallel degree or rank count: an integer in [1, MAX_DEGREE]."""
    return integer(value, name, low=1, high=MAX_DEGREE)


def positive(value: Any, name: str, high: float | None = None) -> float:
    """A finite number > 0 (a time, a rate, a learning rate)."""
    return finite(value, name, low=0, low_open=True, high=high)


def fraction(value: Any, name: str) -> float:
    """A fraction in (0, 1] (e.g. the usable share of memory)."""
    return finite(value, name, low=0, low_open=True, high=1)


def size(value: Any, name: str) -> float:
    """A byte count: finite, in [0, MAX_BYTES]."""
    return finite(value, name, low=0, high=MAX_BYTES)


def duration(value: Any, name: str) -> float:
    """A time of a schedule's action: finite, in [MIN_TIME, MAX_TIME]."""
    return finite(value, name, low=MIN_TIME, high=MAX_TIME)


def seed(value: Any, name: str = "seed") -> int:
    """A random seed: an integer in [0, 2⁶³−1]."""
    return integer(value, name, low=0, high=MAX_SEED)


def schedule_shape(p: Any, m: Any, v: Any = 1, limit: int = MAX_SCHEDULE_ACTIONS_API
                   ) -> tuple[int, int, int]:
    """Stages, micro-batches and chunks of a pipeline schedule: integers ≥ 1 whose schedule
    (3·p·m·v actions at most) stays under `limit`, checked before allocating."""
    p, m, v = (positive_int(x, n) for x, n in ((p, "p (stages)"), (m, "m (micro-batches)"),
                                               (v, "v (chunks)")))
    if 3 * p * m * v > limit:
        raise ShardwiseError(
            f"a schedule of p={p} stages × m={m} micro-batches × v={v} chunks has up to "
            f"{3 * p * m * v:,} actions; at most {limit:,} are generated here")
    return p, m, v


def walk(obj: Any, where: str = "") -> Iterator[tuple[str, Any, int]]:
    """(where, value, depth) of every node of a nest of dicts, lists, tuples and dataclasses
    ("stages[1].total"), containers included, without recursion."""
    todo: list[tuple[Any, str, int]] = [(obj, where, 0)]
    while todo:
        value, at, depth = todo.pop()
        yield at, value, depth
        if isinstance(value, dict):
            todo += [(v, f"{at}.{k}" if at else str(k), depth + 1) for k, v in value.items()]
        elif isinstance(value, list | tuple):
            todo += [(v, f"{at}[{i}]", depth + 1) for i, v in enumerate(value)]
        elif is_dataclass(value) and not isinstance(value, type):
            todo += [(getattr(value, f.name), f"{at}.{f.name}" if at else f.name, depth + 1)
                     for f in fields(value)]


def nonfinite(obj: Any) -> tuple[str, float] | None:
    """(where, value) of the first number in `obj` (`walk`) that is nan or ±inf, or None."""
    for at, value, _ in walk(obj):
        if _is_real(value) and not isinstance(value, numbers.Integral) and not math.isfinite(
                value):
            return at, float(value)
    return None


def finite_result(result: Any, what: str = "the result") -> Any:
    """`result` when every number in it is finite; else `ShardwiseError` naming the first
    figure that is not ("plan: training.seconds is inf"), so nan or inf is never printed or
    served as an answer. Call it on a payload before it is rendered or returned."""
    bad = nonfinite(result)
    if bad is not None:
        raise ShardwiseError(f"{what}: {bad[0] or 'the value'} is {bad[1]}, not a finite "
                             "number; the inputs are beyond what can be computed (use smaller "
                             "or less extreme values)")
    return result


def clean(text: str, limit: int = 200) -> str:
    """`text` safe to print on a terminal or a page: every control or format character
    (newlines, ESC of an ANSI/OSC sequence, BEL, bidi overrides, Unicode category C*) shown as
    its escape (`\\x1b`), and at most `limit` characters (then "…")."""
    out = "".join(ch if unicodedata.category(ch)[0] != "C" else ascii(ch)[1:-1]
                  for ch in text[:limit])
    return out + ("…" if len(text) > limit else "")


def label(value: Any, name: str, limit: int = 64) -> str:
    """A name from a user's file (an accelerator's, a link's): a non-empty string of at most
    `limit` printable characters; a control character (an ANSI/OSC escape, a newline that
    could forge an `error:` line) is refused, shown escaped."""
    if not isinstance(value, str) or not value:
        raise ShardwiseError(f"{name} must be a non-empty string, got {clean(repr(value))}")
    if value != value.strip() or any(unicodedata.category(ch)[0] in "CZ" and ch != " "
                                     for ch in value):
        raise ShardwiseError(f"{name} must be printable text without control characters, "
                             f"leading or trailing blanks, got {clean(repr(value))}")
    if len(value) > limit:
        raise ShardwiseError(f"{name} must be at most {limit} characters, got {len(value)}")
    return value


def known(given: Any, valid: Any, what: str) -> None:
    """Every name in `given` is one of `valid`; else one line naming the unknown ones and the
    valid ones (a typo in a file is refused, not ignored)."""
    valid = list(valid)
    unknown = [str(g) for g in given if g not in valid]
    if unknown:
        raise ShardwiseError(f"{what}: unknown {', '.join(clean(u, 60) for u in unknown[:5])}"
                             f"{' …' if len(unknown) > 5 else ''}; valid: {', '.join(valid)}")


def layout_items(value: str | None, option: str) -> str | None:
    """`--layout`/`--fix`/`--max` text (CLI and web alike): refused in one line when an item
    is empty (`tp=8,,pp=2`, a trailing comma), which `Layout.parse_fields` would skip."""
    if value is not None and any(not item.strip() for item in value.split(",")):
        raise ShardwiseError(f"{option} {clean(value)!r}: an item is empty; write key=value "
                             "items separated by single commas, e.g. tp=8,pp=2")
    return value


def option(check: Callable[..., Any], **bounds: Any) -> Callable[[Any, Any, Any], Any]:
    """A click callback applying `check(value, "--option", **bounds)`; None passes (an
    option not given). Its `ShardwiseError` reaches `cli.main`: one line, exit code 2."""

    def callback(ctx: Any, param: Any, value: Any) -> Any:
        if value is None:
            return None
        return check(value, max(param.opts, key=len), **bounds)

    return callback


# The types of the Hugging Face config.json fields `arch.from_hf_dict` reads or fixes (by
# name, whatever the model_type); those marked nullable fall back to a default when null.
_HF_INTS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
            "vocab_size", "max_position_embeddings", "num_local_experts", "n_embd", "n_layer",
            "n_head", "n_positions", "n_embed", "seq_length", "moe_intermediate_size",
            "n_routed_experts", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim")
_HF_NULLABLE = ("num_key_value_heads", "n_inner", "head_dim", "sliding_window",
                "num_experts_per_tok", "q_lora_rank", "n_group", "topk_group", "qk_head_dim")
_HF_COUNTS = ("max_window_layers", "first_k_dense_replace", "n_shared_experts",
              "num_nextn_predict_layers")  # integers ≥ 0
_HF_FRACTIONS = ("resid_pdrop", "attn_pdrop", "embd_pdrop", "hidden_dropout",
                 "attention_dropout", "router_jitter_noise", "rotary_pct")
_HF_POSITIVE = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "rope_theta",
                "rotary_emb_base", "routed_scaling_factor")
_HF_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window",
             "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "add_cross_attention",
             "norm_topk_prob", "rope_interleave", "use_parallel_residual")
_HF_STRINGS = ("model_type", "hidden_act", "topk_method", "scoring_func")
_HF_OBJECTS = ("rope_scaling", "rope_parameters")  # null or {name: number or string}


def hf_config(cfg: dict[str, Any], source: str) -> None:
    """The values of a Hugging Face config.json that shardwise reads have the right types:
    integers ≥ 1 (capped), finite fractions and positive numbers, JSON booleans (the string
    "false" is not false), strings, RoPE objects of numbers and strings."""
    where = f"config file {source!r}:"
    for key in (*_HF_INTS, *_HF_NULLABLE):
        if key in cfg and not (key in _HF_NULLABLE and cfg[key] is None):
            positive_int(cfg[key], f"{where} {key}", high=2**40)
    for key in _HF_COUNTS:  # max_window_layers 0: every layer windowed
        if key in cfg:
            integer(cfg[key], f"{where} {key}", low=0, high=2**40)
    for key in _HF_FRACTIONS:
        if key in cfg:
            finite(cfg[key], f"{where} {key}", low=0, high=1)
    for key in _HF_POSITIVE:
        if key in cfg:
            positive(cfg[key], f"{where} {key}")
    for key in _HF_BOOLS:
        if key in cfg and not isinstance(cfg[key], bool):
            raise ShardwiseError(f"{where} {key} must be true or false (a JSON boolean), got "
                                 f"{cfg[key]!r}")
    for key in _HF_STRINGS:
        if key in cfg and not isinstance(cfg[key], str):
            raise ShardwiseError(f"{where} {key} must be a string, got {cfg[key]!r}")
    for key in _HF_OBJECTS:
        value = cfg.get(key)
        if value is None:
            continue
        if not isinstance(value, dict) or not all(
                isinstance(v, str) or (_is_real(v) and math.isfinite(v))
                for v in value.values()):
            raise ShardwiseError(f"{where} {key} must be null or an object of numbers and "
                                 f"strings, got {value!r}"[:300])
    layers = cfg.get("layer_types")
    if layers is not None and not (isinstance(layers, list)
                                   and all(isinstance(x, str) for x in layers)):
        raise ShardwiseError(f"{where} layer_types must be a list of strings"[:300])
