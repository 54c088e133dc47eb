"""`dllm trace plot`: the decoding-order figure of one or more trace files."""
from __future__ import annotations

import sys
from pathlib import Path

from ..core.checks import check_int
from ..engine.trace import plot_orders, read_trace
from .flags import check_writable_file


def trace_plot_command(args) -> int:
    check_int("--rows", args.rows, 1)
    check_writable_file(args.output, "-o")
    columns = [read_trace(path)[:args.rows] for path in args.traces]
    plot_orders(columns, [Path(p).stem for p in args.traces], args.output)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0
