"""Importers turn public trace formats into prefix-replayer traces."""
