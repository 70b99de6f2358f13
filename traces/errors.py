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


def require_int(path: object, where: str, value: object, minimum: int) -> int:
    """``value`` if it is an integer (not a bool) of at least ``minimum``, else bad input."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceError(path, f"{where} must be an integer >= {minimum}, got {value!r}")
    return value
