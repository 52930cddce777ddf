"""Invoice arithmetic in whole cents."""
from .money import format_cents, split_evenly, total_with_tax

__all__ = ["format_cents", "split_evenly", "total_with_tax"]
