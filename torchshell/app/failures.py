"""How a coreshell error reaches the user: one block on stderr and an exit code."""

from __future__ import annotations

import sys

BAD_INPUT, FAILURE = 2, 1


def our_errors() -> tuple[type[BaseException], ...]:
    """The error classes of jaxcore, bridge and torchshell (and the recipes' data errors).

    Example:
        >>> import jaxcore
        >>> issubclass(jaxcore.MeshError, our_errors())
        True
    """
    import bridge
    import jaxcore
    from torchshell._errors import ShellError

    extra: list[type[BaseException]] = []
    speech = sys.modules.get("torchshell.data.spoken_digits")  # loaded only with its recipe
    if speech is not None:
        extra.append(speech.SpokenDigitsDataError)
    return (ShellError, jaxcore.JaxCoreError, bridge.BridgeError, *extra)


def exit_code(err: BaseException) -> int:
    """2 for bad input (the ``ValueError`` family: config, mesh, data, ...), 1 for a failure.

    Example:
        >>> import jaxcore
        >>> exit_code(jaxcore.MeshError("x")), exit_code(jaxcore.NonFiniteError("x", 3))
        (2, 1)
    """
    return BAD_INPUT if isinstance(err, ValueError | KeyError) else FAILURE


def report(command: str, err: BaseException) -> int:
    """Prints ``err`` as one block on stderr; returns its exit code.

    Example:
        >>> import jaxcore
        >>> report("train", jaxcore.MeshError("Mesh axes need 3 devices. Fix: ..."))
        2
    """
    print(f"coreshell {command}: {type(err).__name__}\n  {err}".rstrip(), file=sys.stderr)
    return exit_code(err)
