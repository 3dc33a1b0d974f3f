"""The one exception type data preparation and loading raise for bad inputs."""


class DataError(ValueError):
    """A user-fixable problem with the corpus, the tokenizer, the output URL or a prepared dataset.

    The message names the offending input and the fix; callers (the Prefect task, the CLI) show it
    without a traceback and do not retry it.
    """
