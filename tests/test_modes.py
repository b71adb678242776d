"""Mode names: aliases resolve in one place, and the README's alias table says what the code does."""
import pathlib
import re

import pytest
import torch

from megatron_pg_agg import ALIASES, MODES, aggregate, resolve_mode

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_canonical_modes_resolve_to_themselves():
    for mode in MODES:
        divisor = 3.0 if mode == "constant" else None
        assert resolve_mode(mode, divisor) == (mode, divisor)


def test_readme_alias_table_matches_the_code():
    rows = {}
    for line in README.read_text().splitlines():
        m = re.match(r"\| `([a-z_-]+)` \| (\w+) \| `(\w+)`(, divisor (\w+))? \|", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3), m.group(5))
    assert set(rows) == set(ALIASES), "README alias table and ALIASES differ"
    for name, (source, mode, divisor) in rows.items():
        alias = ALIASES[name]
        assert alias.source == source and alias.mode == mode, name
        if divisor == "required":
            assert alias.divisor_required
            with pytest.raises(ValueError, match="divisor"):
                resolve_mode(name)
            assert resolve_mode(name, 512) == (mode, 512.0)
        elif divisor is not None:
            assert resolve_mode(name) == (mode, float(divisor))
        else:
            assert resolve_mode(name) == (mode, None)


def test_alias_gives_the_same_objective_as_its_mode():
    loss = torch.tensor([[1.0, 3, 0, 0], [2, 4, 6, 0], [10, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]])
    assert torch.equal(aggregate(loss, mask, mode="seq-mean-token-sum")[0],
                       aggregate(loss, mask, mode="constant", divisor=1)[0])
    assert torch.equal(aggregate(loss, mask, mode="dr_grpo", divisor=4)[0],
                       aggregate(loss, mask, mode="constant", divisor=4)[0])
    assert torch.equal(aggregate(loss, mask, mode="grpo")[0], aggregate(loss, mask, mode="seq_mean")[0])
