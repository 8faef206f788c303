"""The package's exception classes (importable without torch)."""

from __future__ import annotations


class ManifestError(ValueError):
    """A manifest that does not follow docs/export.md.

    ``file`` is the manifest's path, ``path`` the JSON path of the offending value (for example
    ``forward[2].steps[1].args[3]``) and ``expected`` what the format asks for there.
    """

    def __init__(self, file: str, path: str, expected: str):
        self.file = file
        self.path = path
        self.expected = expected
        super().__init__(f"{file}: {path}: {expected}")


class CudaError(RuntimeError):
    """A CUDA driver call that returned an error: ``function`` (e.g. ``cuLaunchKernelEx``), the
    ``CUresult`` ``code`` and its ``name`` (e.g. ``CUDA_ERROR_INVALID_VALUE``)."""

    def __init__(self, function: str, code: int, name: str, description: str = "", detail: str = ""):
        self.function = function
        self.code = code
        self.name = name
        self.description = description
        self.detail = detail
        text = f"{function} failed: {name} ({code})"
        if description:
            text += f": {description}"
        if detail:
            text += f" [{detail}]"
        super().__init__(text)


class MegaMoEStatusError(RuntimeError):
    """The kernels' watchdog reported a wait that never completed, or the device failed.

    ``words`` holds the status buffer's int32 words (word 0 the wait's code, word 1 the block, words 2-3
    what it waited for), or is None when the synchronization itself failed (``cause`` then says why).
    """

    def __init__(self, message: str, words=None, cause: str = ""):
        self.words = None if words is None else tuple(words)
        self.cause = cause
        super().__init__(message)
