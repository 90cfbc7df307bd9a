"""``specdec bench``: end-to-end workloads on the bundled model, a table, JSON and a PNG dashboard.

:mod:`specdec.bench.workloads` (prompt sets, method specs, :class:`RandomDrafter`, the workloads),
:mod:`specdec.bench.run` (the interleaved run, its summary, the table and the command line; its
docstring is ``specdec bench --help``), :mod:`specdec.bench.dashboard` (the PNG) and
:mod:`specdec.bench.record` (what a result records about the machine; the scripts under
benchmarks/ use it too).
"""
from specdec.bench.dashboard import write_dashboard
from specdec.bench.record import cpu_name, git_commit, loadavg, record_path
from specdec.bench.run import build_parser, format_table, main, run_bench, summarize
from specdec.bench.workloads import (CODE, CSV, DEFAULT_K, DRAFTERS, EMAIL, PASSAGE, PROMPT_SETS, RandomDrafter,
                                     method_name, parse_method, parse_runs)

__all__ = ["RandomDrafter", "PROMPT_SETS", "parse_method", "parse_runs", "method_name", "run_bench", "summarize",
           "format_table", "write_dashboard", "build_parser", "main", "PASSAGE", "CODE", "EMAIL", "CSV", "DRAFTERS",
           "DEFAULT_K", "git_commit", "record_path", "cpu_name", "loadavg"]
