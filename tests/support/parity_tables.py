"""Reading docs/parity.md's parity table back (tests/distributed/test_parity.py holds it to the
suite's run)."""
import re

from megatron_pg_agg.parity import MODES, markdown_table


def _cells(table: str) -> dict:
    """{(layout, policy loss, mode): cell text} of a markdown parity table (header and rule
    skipped)."""
    out = {}
    for line in table.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        for mode, cell in zip(MODES, cells[2:]):
            out[(cells[0], cells[1], mode)] = cell
    return out


_NUMBER = re.compile(r"-?\d+\.\d+(?:e[-+]\d+)?")
REFERENCE_RTOL = 1e-5
"""How far a reference objective J may move between machines (float32 sums in another order) and
still be the same number; a real change of the model, data or loss moves it far more."""


def _numbers(cell: str) -> list:
    return [float(m.group(0)) for m in _NUMBER.finditer(cell)]


def table_mismatches(docs_table: str, rows) -> list:
    """Where the parity table of docs/parity.md disagrees with the suite's JSON rows in what is
    stable across machines: the layouts and policy losses and their order, which modes ran, each
    verdict marker, every parity error below its tolerance in both (objective OBJECTIVE_RTOL,
    gradient GRAD_RTOL), every control's gradient error far outside it (> 100 x GRAD_RTOL) in both,
    and each reference objective J to REFERENCE_RTOL. The printed digits of float32 noise (1.6e-08 here, 1.8e-08 on
    another machine) are not compared."""
    from megatron_pg_agg.parity import GRAD_RTOL, OBJECTIVE_RTOL

    fresh = markdown_table(rows)
    problems = []
    names = lambda table: [tuple(c.strip() for c in line.split("|")[1:3])  # noqa: E731
                           for line in table.strip().splitlines()[2:]]
    if names(docs_table) != names(fresh):
        problems.append(f"layouts differ: docs {names(docs_table)} vs suite {names(fresh)}")
    want, got = _cells(docs_table), _cells(fresh)
    for key in sorted(set(want) & set(got)):
        a, b = want[key], got[key]
        if _NUMBER.sub("#", a) != _NUMBER.sub("#", b):
            problems.append(f"{key}: docs {a!r} vs suite {b!r} (another verdict or another set of modes)")
            continue
        if a == "-":
            continue
        if a.startswith("J = "):
            (x,), (y,) = _numbers(a), _numbers(b)
            if abs(x - y) > REFERENCE_RTOL * max(abs(x), abs(y)):
                problems.append(f"{key}: reference docs {a!r} vs suite {b!r}")
            continue
        for where, cell in (("docs", a), ("suite", b)):
            obj, grad = _numbers(cell)
            if "as it must" in cell:
                if grad <= 100 * GRAD_RTOL:
                    problems.append(f"{key}: {where} control {cell!r} is not far outside the tolerance")
            elif "FAIL" not in cell and (obj > OBJECTIVE_RTOL or grad > GRAD_RTOL):
                problems.append(f"{key}: {where} {cell!r} is outside the tolerances "
                                f"({OBJECTIVE_RTOL:g} / {GRAD_RTOL:g})")
    return problems
