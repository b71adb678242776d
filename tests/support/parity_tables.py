"""Reading the README's parity table back (tests/distributed/test_parity.py holds it to the suite's run)."""
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


_NUMBER = re.compile(r"-?\d+\.(\d+)(?:e([-+]\d+))?")


def table_mismatches(readme_table: str, rows) -> list:
    """Where a README parity table disagrees with the suite's JSON rows: layouts and their order,
    which modes ran, the verdict markers, and every number beyond one unit of its last printed
    digit (so run-to-run noise at a rounding boundary passes, any real change does not)."""
    fresh = markdown_table(rows)
    problems = []
    names = lambda table: [tuple(c.strip() for c in line.split("|")[1:3])  # noqa: E731
                           for line in table.strip().splitlines()[2:]]
    if names(readme_table) != names(fresh):
        problems.append(f"layouts differ: README {names(readme_table)} vs suite {names(fresh)}")
    want, got = _cells(readme_table), _cells(fresh)
    for key in sorted(set(want) & set(got)):
        a, b = want[key], got[key]
        if _NUMBER.sub("#", a) != _NUMBER.sub("#", b):
            problems.append(f"{key}: README {a!r} vs suite {b!r}")
            continue
        for x, y in zip(_NUMBER.finditer(a), _NUMBER.finditer(b)):
            unit = 10.0 ** (-len(x.group(1)) + int(x.group(2) or 0))
            if abs(float(x.group(0)) - float(y.group(0))) > unit * 1.01:
                problems.append(f"{key}: README {a!r} vs suite {b!r}")
                break
    return problems
