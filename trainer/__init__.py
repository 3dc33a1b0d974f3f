"""Plain torch library behind tessera: model, parallelisms, backends, data, checkpoints, planner.

Nothing here imports Prefect: every module runs under ``torchrun`` alone and is testable without an
orchestrator (see ``python -m trainer.train --help``).
"""
