"""What every subcommand of the command line shares: the one-line user error, the parser that
prints it, and the argument types."""

from __future__ import annotations

import argparse

from hybridkv.errors import HybridKVError


class UserError(HybridKVError, ValueError):
    """Bad command-line input: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``prog: error: message (see prog --help)``), exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    """An argparse type: a whole number > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def number(text: str) -> float:
    """An argparse type: any number (the caller checks its range)."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


# HuggingFace repo ids whose config.json describes a preset's layers (hybridkv reads no hub): the id,
# lowercased -> the preset. Other ids of the same family map through _HF_NAME_SUFFIXES.
HF_REPO_PRESETS: dict[str, str] = {
    "minimaxai/minimax-m1-80k": "minimax-m1",
    "minimaxai/minimax-m1-40k": "minimax-m1",
    "minimaxai/minimax-text-01": "minimax-m1",
    "qwen/qwen3-next-80b-a3b-instruct": "qwen3-next-80b-a3b",
    "qwen/qwen3-next-80b-a3b-thinking": "qwen3-next-80b-a3b",
    "qwen/qwen3.5-27b": "qwen3.5-27b",
    "qwen/qwen3.5-35b-a3b": "qwen3.5-35b-a3b",
    "moonshotai/kimi-linear-48b-a3b-instruct": "kimi-linear-48b-a3b",
    "moonshotai/kimi-linear-48b-a3b-base": "kimi-linear-48b-a3b",
    "tiiuae/falcon-h1-7b-instruct": "falcon-h1-7b",
    "tiiuae/falcon-h1-7b-base": "falcon-h1-7b",
    "zyphra/zamba2-7b": "zamba2-7b",
    "zyphra/zamba2-7b-instruct": "zamba2-7b",
    "zyphra/zamba2-2.7b": "zamba2-2.7b",
    "zyphra/zamba2-2.7b-instruct": "zamba2-2.7b",
    "zyphra/zamba2-1.2b": "zamba2-1.2b",
    "zyphra/zamba2-1.2b-instruct": "zamba2-1.2b",
    "state-spaces/mamba2-2.7b": "mamba2-2.7b",
    "ai21labs/ai21-jamba-1.5-mini": "jamba-1.5-mini",
}


def _said(flag: str, text: str) -> str:
    """``--model X`` or ``--compare model=X``: the flag and the value as the user wrote them."""
    return f"{flag}{text}" if flag.endswith("=") else f"{flag} {text}"


def _looks_like_path(text: str) -> bool:
    return text.startswith((".", "~", "/")) or text.endswith((".json", ".toml")) or "\\" in text


def resolve_model_arg(text: str, flag: str = "--model") -> tuple[str, str | None]:
    """``--model TEXT`` as hybridkv reads it: ``(model, note)``. A preset name, alias or existing path
    comes back as given (``note`` None); a known HuggingFace repo id comes back as its preset with a
    note saying so. Raises :class:`UserError` (one line) for a path that does not exist, an unknown
    repo id (with what to do instead) and an unknown name (with difflib's closest presets)."""
    import difflib
    from pathlib import Path

    from hybridkv.models import presets as P

    if Path(text).expanduser().exists():
        return text, None
    key = text.strip().lower()
    if key in P.PRESET_NAMES or key in P._ALIASES:
        return text, None
    if key in HF_REPO_PRESETS:
        name = HF_REPO_PRESETS[key]
        return name, f"{text}: the preset {name} (its config.json's layers; hybridkv reads no hub)"
    if _looks_like_path(text):
        where = Path(text).expanduser()
        parent = next((p for p in where.parents if p.exists()), None)
        missing = where if parent is None else where.relative_to(parent).parts[0]
        raise UserError(f"{_said(flag, text)}: no such path ({missing} does not exist in {parent or '/'})")
    if key.count("/") == 1:
        close = difflib.get_close_matches(key, HF_REPO_PRESETS, n=1, cutoff=0.8)
        hint = f"did you mean {close[0]} (the preset {HF_REPO_PRESETS[close[0]]})? " if close else ""
        raise UserError(
            f"{_said(flag, text)}: not a preset, a known HuggingFace repo id or an existing path; {hint}"
            f"hybridkv reads no hub: download its config.json (huggingface-cli download {text} config.json "
            f"--local-dir DIR) and give {flag} DIR"
        )
    names = [*P.PRESET_NAMES, *P._ALIASES]
    close = difflib.get_close_matches(key, names, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    raise UserError(
        f"{_said(flag, text)}: unknown model; {hint}presets: {', '.join(P.PRESET_NAMES)}; or a spec file "
        "(.json/.toml), a config.json or a model directory"
    )


def size_arg(text: str, flag: str, allow_zero: bool = False) -> int:
    """A size flag's bytes (``80GiB``, ``141GB``, a byte count of at least 1 MiB). A bare number
    under 1 MiB is refused with the unit it probably lacks ("--gpu-memory 16: 16 bytes; did you mean
    16GiB?"); raises :class:`UserError` naming ``flag``."""
    from hybridkv.units import parse_bytes

    stripped = text.strip()
    if allow_zero and stripped in ("0", "0B", "0b"):
        return 0
    try:
        value = parse_bytes(stripped)
    except ValueError as e:
        raise UserError(f"{_said(flag, text)}: {e}") from None
    if stripped.isdigit() and value < 2**20:
        raise UserError(f"{_said(flag, text)}: {value} bytes, with no unit; did you mean {stripped}GiB?")
    return value
