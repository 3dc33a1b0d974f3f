"""Code that runs inside a training rank, beside the model: optimizer, loss, watchdog, preemption, telemetry.

It never imports the host side (:mod:`trainer.runtime`) or reporting (:mod:`trainer.report`).
"""
