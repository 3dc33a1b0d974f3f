"""No hub at run time, the user's own stores always.

tessera never loads a model or a data set from the Hugging Face Hub: tokenizers are trained here and
corpora are the user's files. ``datasets`` ties two things to one switch, though: with
``HF_DATASETS_OFFLINE`` or ``HF_HUB_OFFLINE`` set, datasets ≥ 5 also refuses every fsspec URL handed
to ``load_dataset`` (``s3://``, ``gs://``: "Offline mode is enabled"). So the hub is shut at its
client instead: huggingface_hub checks ``HF_HUB_OFFLINE`` in a hook on every request it makes and
raises ``OfflineModeIsEnabled`` before anything leaves the process, while datasets' own switch stays
off so that it reads the user's URLs through fsspec. Hub URLs in ``data.paths`` are refused by the
spec (:data:`HUB_URL_PREFIXES`), since plain HTTP to the hub would not pass through that client.
"""

from __future__ import annotations

import os
import sys

HUB_URL_PREFIXES = ("hf://", "https://huggingface.co/", "http://huggingface.co/")
HUB_ENVIRONMENT = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1"}


def keep_hub_out() -> None:
    """Shut the hub and open fsspec, in this process and in the processes it starts.

    Overrides whatever the user exported: a stale ``HF_DATASETS_OFFLINE=1`` would otherwise break
    ``s3://`` corpora. Both libraries read the variables once, at import, so a process that has
    imported them already gets the same settings on their live flags.
    """
    os.environ.update(HUB_ENVIRONMENT)
    if (hub := sys.modules.get("huggingface_hub.constants")) is not None:
        hub.HF_HUB_OFFLINE = True
        hub.HF_HUB_DISABLE_TELEMETRY = True
    if (config := sys.modules.get("datasets.config")) is not None:
        config.HF_HUB_OFFLINE = config.HF_DATASETS_OFFLINE = False
