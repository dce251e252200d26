"""UsageError: a user's mistake on the command line, said in one line; and the checks several
commands share.

Contract: a command's handler (or the parser) raises ``UsageError(flag, value, message)`` for
anything the person typing the command can fix; ``cli.main.main`` catches it once and prints
``firsttoken <cmd>: <flag> <value>: <message>`` on stderr, exit status 2 (as argparse's own usage
errors). Anything else is a bug or an outage: ``main`` prints one line and the exit status is 1; the
traceback only with ``firsttoken --debug`` (or ``serve --log-level debug``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from firsttoken.models.model_config import ModelConfig

EXIT_USAGE = 2  # argparse's status for usage errors; ours match it
EXIT_FAILURE = 1
MAX_VALUE_CHARS = 200  # a quoted value is cut here: a pasted blob must not flood the terminal


class UsageError(Exception):
    """``flag`` as typed (``--model``) or None for a positional; ``value`` as the user gave it
    (None: no value)."""

    def __init__(self, flag: str | None, value: object, message: str) -> None:
        super().__init__(message)
        self.flag = flag
        self.value = value
        self.message = message

    def line(self, command: str) -> str:
        """``firsttoken serve: --model /x: no such directory`` (flag and value left out when
        absent)."""
        subject = " ".join(p for p in (self.flag, _shown(self.value)) if p)
        return f"firsttoken {command}: {subject + ': ' if subject else ''}{self.message}"


def _shown(value: object) -> str | None:
    if value is None:
        return None
    text = str(value)
    return text if len(text) <= MAX_VALUE_CHARS else text[:MAX_VALUE_CHARS] + "..."


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line that points at --help instead of the whole usage
    block."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def from_config_error(
    exc: ValueError, args: argparse.Namespace, renamed: dict[str, str] | None = None
) -> UsageError | None:
    """A config dataclass's ``ValueError("<field> must ...")`` as the flag that set the field; None
    when the message does not start with a field that one of ``args``' flags sets.

    Config classes name the offending field first (STYLE rule 12); the flag is that name with
    dashes, or ``renamed[field]`` where the flag is spelled differently.
    """
    message = str(exc)
    field, _, rest = message.partition(" ")
    flag = (renamed or {}).get(field) or "--" + field.replace("_", "-")
    dest = flag.lstrip("-").replace("-", "_")
    if rest and hasattr(args, dest):
        return UsageError(flag, getattr(args, dest), rest)
    return None


def existing_dir(flag: str, path: str | Path) -> Path:
    p = Path(path)
    if not p.exists():
        raise UsageError(flag, path, "no such directory")
    if not p.is_dir():
        raise UsageError(flag, path, "not a directory")
    return p


def existing_file(flag: str | None, path: str | Path) -> Path:
    p = Path(path)
    if not p.exists():
        raise UsageError(flag, path, "no such file")
    if p.is_dir():
        raise UsageError(flag, path, "is a directory, not a file")
    return p


def read_config_json(flag: str, path: str | Path, allow_file: bool = False) -> dict[str, Any]:
    """The checkpoint's config.json as a dict: ``path`` is its directory (or, with allow_file, the
    file)."""
    p = Path(path)
    if allow_file and p.is_file():
        config_path = p
    else:
        config_path = existing_dir(flag, path) / "config.json"
        if not config_path.is_file():
            raise UsageError(
                flag,
                path,
                "no config.json in this directory; point it at a Hugging Face checkpoint "
                "directory (config.json, *.safetensors, tokenizer files)",
            )
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UsageError(flag, path, f"cannot read {config_path.name} as JSON ({exc})") from None
    if not isinstance(config, dict):
        raise UsageError(flag, path, f"{config_path.name} is not a JSON object")
    return config


def parse_model_config(
    flag: str,
    path: str | Path,
    config_json: dict[str, Any],
    preprocessor: dict[str, Any] | None = None,
) -> "ModelConfig":
    """config.json's ModelConfig; a missing or malformed field is a sentence naming it, never a bare
    KeyError."""
    from firsttoken.models.registry import model_config_from_dict

    try:
        return model_config_from_dict(config_json, preprocessor)
    except KeyError as exc:
        raise UsageError(
            flag, path, f"config.json has no {exc.args[0]!s}, which the model needs"
        ) from None
    except (ValueError, TypeError) as exc:
        raise UsageError(flag, path, f"config.json: {exc}") from None


def first_line(text: str) -> str:
    """An exception's message as one bounded line (some libraries put a whole report in it)."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= 2 * MAX_VALUE_CHARS else line[: 2 * MAX_VALUE_CHARS] + "..."


def unreachable(flag: str, url: str, exc: Exception) -> UsageError:
    """An httpx failure to reach ``url`` as the UsageError of the flag that named it."""
    import httpx

    if isinstance(exc, (httpx.UnsupportedProtocol, httpx.InvalidURL)):
        return UsageError(flag, url, "not an http(s) URL; use e.g. http://127.0.0.1:8000")
    if isinstance(exc, httpx.TimeoutException):
        return UsageError(flag, url, "no answer in time; is the server up and reachable from here?")
    reason = first_line(str(exc)) or type(exc).__name__
    return UsageError(
        flag, url, f"cannot connect ({reason}); is the server running at this address?"
    )


def check_reachable(flag: str, url: str, timeout_s: float = 10.0) -> None:
    """One GET of the server root's /health before real work starts: any HTTP answer will do, none
    is an error."""
    import httpx

    try:
        httpx.get(url.rstrip("/") + "/health", timeout=timeout_s)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise unreachable(flag, url, exc) from None
