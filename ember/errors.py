"""Errors raised while finding or reading model files, by the loader and the quantized checkpoint readers."""


class ModelLoadError(ValueError):
    """A model file is missing, corrupt or unsupported.

    Subclasses ValueError so callers that validate user input can catch one type.
    The message always names the offending file.
    """

    def __init__(self, path: object, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem
