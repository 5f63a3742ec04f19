"""The config base ships in the package (`dspark_jax/train/config_base.py`): an experiment file
anywhere on disk builds on it, so an installed package trains without the repo's `configs/`."""

import ast
import pathlib
import sys

from dspark_jax.train import config_base, job_config

PACKAGE = pathlib.Path(config_base.__file__).resolve().parents[1]


class _HideConfigs:
    """A meta-path finder that makes the repo's `configs` package unimportable."""

    def find_spec(self, name, path=None, target=None):
        if name == "configs" or name.startswith("configs."):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)")
        return None


def test_a_config_file_outside_the_repo_parses(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "configs" or m.startswith("configs.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_HideConfigs(), *sys.meta_path])
    monkeypatch.setattr(sys, "path", list(sys.path))   # parse_config adds the file's grandparent
    exp = tmp_path / "experiments" / "mine.py"
    exp.parent.mkdir()
    exp.write_text(
        "from dspark_jax.train.config_base import apply_deepspec_recipe, get_base_config\n\n\n"
        "def get_config():\n"
        "    c = get_base_config()\n"
        "    c.name = 'mine'\n"
        "    apply_deepspec_recipe(c.draft, 'dflash', draft_layers=1, markov_rank=0,\n"
        "                          num_anchors=8)\n"
        "    c.train.global_batch_size = 4\n"
        "    return c\n")
    c = job_config.parse_config(["p", f"--config={exp}", "--config.target=some/target",
                                 "--config.mesh.preset=v5e:2x2", "--config.train.lr=0.01"])
    assert (c.name, c.draft.model_type, c.draft.num_draft_layers) == ("mine", "dflash", 1)
    assert c.train.lr == 0.01 and c.train.global_batch_size == 4
    assert c.eval.deepspec_check_samples == 4            # the base's defaults are all there
    config_base.apply_mesh_preset(c, c.mesh.preset)
    assert (c.mesh.fsdp, c.train.micro_batches) == (4, 1)
    assert not any(m == "configs" or m.startswith("configs.") for m in sys.modules)


def test_the_package_never_imports_the_repo_configs():
    offenders = []
    for f in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            offenders += [f"{f.relative_to(PACKAGE)}: {n}" for n in names
                          if n == "configs" or n.startswith("configs.")]
    assert offenders == []
