"""`bench.load --modes` names: scheduler modes, `treeN` (fixed trees) and `MODE+treeN`."""

from __future__ import annotations

import pytest

from dspark_jax.bench.load import engine_mode


def test_tree_mode_names():
    assert engine_mode("adaptive") == ("adaptive", 0)
    assert engine_mode("tree32") == ("fixed", 32)
    assert engine_mode("algorithm1+tree16") == ("algorithm1", 16)
    with pytest.raises(ValueError, match="adaptive\\+tree32"):
        engine_mode("treeX")
