"""`python -m dspark_jax.train --config configs/NAME.py [--config.train.lr=3e-4 ...]`
(the DeepSpec training recipe end to end; see dspark_jax/train/cli.py)."""

from dspark_jax.train.cli import entry

if __name__ == "__main__":
    entry()
