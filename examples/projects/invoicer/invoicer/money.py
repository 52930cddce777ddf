"""Money as integer cents: no floats, so totals always add up."""


def format_cents(cents: int) -> str:
    """1999 -> '19.99'; negative amounts keep their sign."""
    sign = "-" if cents < 0 else ""
    whole, frac = divmod(abs(cents), 100)
    return f"{sign}{whole}.{frac:02d}"


def total_with_tax(lines: list[tuple[int, int]], rate_percent: int) -> int:
    """Sum of quantity * unit price, plus tax rounded half up to the cent."""
    net = sum(qty * unit for qty, unit in lines)
    return net + (net * rate_percent + 50) // 100


def split_evenly(total_cents: int, parts: int) -> list[int]:
    """Splits a total into `parts` shares that differ by at most one cent and sum to the total."""
    if parts <= 0:
        raise ValueError("parts must be positive")
    share = total_cents // parts
    return [share] * parts
