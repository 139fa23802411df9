"""Package-level promises: lazy optional backends, the public surface."""
from __future__ import annotations

import subprocess
import sys


def test_import_stpipe_never_imports_cupy_or_numba():
    code = (
        "import sys, stpipe, stpipe.compat.speedtorch\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'numba'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"import stpipe imported {out.stdout.strip()}"


def test_public_names_resolve():
    import stpipe

    for name in stpipe.__all__:
        assert getattr(stpipe, name) is not None, name
    assert {"HostTable", "HostEmbedding", "Pipeline", "prefetch", "plan", "overlap"} <= set(stpipe.__all__)
