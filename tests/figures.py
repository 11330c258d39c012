"""Compare a computed value with a figure as printed (SPEC rounds half up)."""


def matches_figure(value: float, figure: float) -> bool:
    """True when `value` prints as `figure` at the figure's precision, half-up rounding."""
    text = repr(figure)
    decimals = len(text.split(".")[1]) if "." in text else 0
    return abs(value - figure) <= 0.5 * 10**-decimals + 1e-12
