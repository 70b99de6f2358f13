"""One error type for every bad-input path, so the CLI can print one line and exit 2."""

from __future__ import annotations


class TraceError(ValueError):
    """Bad input: names the file and, where known, the column and row."""

    def __init__(self, path: object, message: str, *, column: str | None = None,
                 row: int | None = None) -> None:
        self.path = str(path)
        self.column = column
        self.row = row
        self.message = message
        where = self.path
        if column is not None:
            where += f": column {column!r}"
        if row is not None:
            where += f", row {row}"
        super().__init__(f"{where}: {message}")


def reject_unknown_keys(path: object, where: str, obj: object, known: tuple[str, ...]) -> None:
    """Bad input if mapping ``obj`` has a key outside ``known`` (every YAML block checks so)."""
    for key in obj:  # type: ignore[attr-defined]
        if key not in known:
            raise TraceError(path, f"unknown key {key!r} in {where} (known: {', '.join(known)})")


MAX_INT = 2**62     # any integer field (int64 columns, numpy positions); see traces.model.limits


def require_int(path: object, where: str, value: object, minimum: int,
                maximum: int = MAX_INT) -> int:
    """``value`` if it is an integer (not a bool) in ``[minimum, maximum]``, else bad input."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceError(path, f"{where} must be an integer >= {minimum}, got {short(value)}")
    if value > maximum:
        raise TraceError(path, f"{where} is {short(value)}, above the limit of {maximum}")
    return value


def short(value: object) -> str:
    """A value as an error line shows it: never thousands of digits or characters."""
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 200 else (
        f"an integer of {len(str(abs(value)))} digits")
    return text if len(text) <= 60 else text[:57] + "..."
