"""The trainer's adapters for the five systems: each registers its strategies by name.

They live above the systems (a system never imports the trainer): `dp` wraps a model in
DDP with a compressor's comm hook, `kfac` adds a K-FAC preconditioner over any of those,
`parallel` applies an n-D `Plan`. `plait.train.strategy.make_strategy` imports them on
first use.
"""
