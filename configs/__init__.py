"""One ml_collections config per command, `get_config(variant)` each.

This folder sits at the top of a checkout (`--config=configs/audit.py:smoke`,
as in Flax's and big_vision's examples) and is installed as the package
`stableattn.configs` (pyproject.toml's `package-dir`), so the wheel carries
the same files and `--config=smoke` finds them from anywhere.
"""
