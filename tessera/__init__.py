"""The ``tessera`` command: the top layer, above flows, tasks, deployments and the trainer.

It sits in a package of its own so that every import in the repository points one way:
``trainer`` ← ``deployments`` ← ``tasks`` ← ``flows`` ← ``tessera`` (see ``tests/test_layers.py``).
"""
