"""`replayer info`: a trace's header, table sizes and goldens."""

from __future__ import annotations

from replayer.cli.common import EXIT_OK
from traces import load_target


def add_parser(sub) -> None:
    info = sub.add_parser("info", help="print a trace's header and table sizes")
    info.add_argument("target")


def run(args) -> int:
    from traces.goldens.kind import label
    from traces.goldens.store import STORE
    from traces.io.parts import parts_on_disk
    from traces.model import schema

    trace = load_target(args.target)
    print(trace.header_json(), end="")
    for name in schema.TABLES:
        table = trace.table(name)
        if table is None:
            continue
        size = ""
        if trace.path is not None and trace.path.is_dir():
            f = trace.path / schema.TABLES[name].file
            if f.exists():
                size = f", {f.stat().st_size} bytes on disk"
            else:                                   # a recorded table: a folder of parts
                nbytes, parts = parts_on_disk(trace.path / name)
                size = f", {nbytes} bytes on disk in {parts} part(s)"
        print(f"{name}: {table.num_rows} rows, {table.num_columns} columns{size}")
    rq = trace.requests
    print(f"prompt tokens: {sum(rq['num_prompt_tokens'].to_pylist())}")
    for part in trace.skipped_parts:
        print(f"skipped half-written part: {part}")
    for note in trace.notes:
        print(f"note: {note}")
    for key, expect in sorted(trace.goldens.items()):
        print(f"goldens for {label(key)}: {len(expect)} requests")
    for key, expect in sorted(trace.store_goldens.items()):
        puts, lookups = STORE.count(expect)
        print(f"store goldens for {label(key)}: {puts} keys, {lookups} lookups")
    from traces.goldens.events import EVENTS

    for key, expect in sorted(trace.event_goldens.items()):
        stored, skipped, removed, cleared = EVENTS.count(expect)
        print(f"kv event goldens for {label(key)}: {stored} stored, {skipped} skipped, "
              f"{removed} removed, {cleared} cleared")
    return EXIT_OK

