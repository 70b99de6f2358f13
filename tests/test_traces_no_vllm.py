"""Reading, converting and inspecting traces never imports vLLM or torch."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers_traces import make_trace_dir

_IMPORTS = (
    "import sys, json\n"
    "import traces, traces.scenarios.compile, traces.importers.mooncake, traces.materialize\n"
    "import traces.trace, traces.model.validate, traces.model.tokens, traces.goldens.outcomes, traces.model.engine_spec\n"
    "print(json.dumps(sorted(m for m in sys.modules\n"
    "                        if m.split('.')[0] in ('vllm', 'torch'))))\n"
)


def _heavy_modules(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_traces_imports_no_vllm():
    assert _heavy_modules(_IMPORTS) == []


def test_info_reads_a_trace_without_vllm(tmp_path):
    trace = make_trace_dir(tmp_path)
    code = (
        "import sys, json, io, contextlib\n"
        "from replayer.cli.main import main\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf):\n"
        f"    rc = main(['info', {str(trace)!r}])\n"
        "assert rc == 0, rc\n"
        "assert 'requests: 3 rows' in buf.getvalue(), buf.getvalue()\n"
        "print(json.dumps(sorted(m for m in sys.modules\n"
        "                        if m.split('.')[0] in ('vllm', 'torch'))))\n"
    )
    assert _heavy_modules(code) == []
