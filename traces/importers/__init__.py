"""Importers turn public trace formats into prefix-replayer traces (above
:mod:`traces.trace`, which they write)."""
