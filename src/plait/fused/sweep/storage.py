"""Optuna storage URLs: where a sweep's study lives, and how the URL may be shown.

A storage URL may carry credentials (``postgresql://user:password@host/db``, or a
``?password=`` query parameter). They are needed to open the storage and nowhere else:
everything that shows or records a URL (log lines, printed summaries, results.json, the
Markdown report, the recorded command line) goes through `mask_url` or `mask_secrets`.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

DEFAULT_STORAGE = "sqlite:///runs/plait-sweeps.db"
MASK = "***"

_URL_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"]*")
_SECRET_PARAM_RE = re.compile(
    r"([?&;](?:password|passwd|pwd|pass|secret|token|api_key|apikey|access_key|"
    r"secret_key|sslpassword|auth)=)([^&;#]*)",
    re.IGNORECASE,
)


def mask_url(url: str) -> str:
    """`url` with its password (and any secret query parameter) replaced by ``***``.

    The user name and host stay, so the masked URL still says which storage is meant:
    ``postgresql://user:pass@host/db`` becomes ``postgresql://user:***@host/db``. Everything
    between the user name and the *last* ``@`` is masked, so a password holding an
    unescaped ``@`` or ``/`` is masked whole. Strings that are not URLs come back unchanged.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    userinfo, at, host = rest.rpartition("@")
    if at and ":" in userinfo:
        user = userinfo.partition(":")[0]
        rest = f"{user}:{MASK}@{host}"
    return f"{scheme}://" + _SECRET_PARAM_RE.sub(_mask_param, rest)


def _mask_param(match: re.Match[str]) -> str:
    return match.group(1) + MASK


def mask_secrets(text: str, *urls: str | None) -> str:
    """`text` with every URL in it masked (see `mask_url`), and the passwords of `urls`
    (raw and percent-decoded) masked wherever else they appear, as in an error message
    that quotes them on their own."""
    text = _URL_RE.sub(lambda m: mask_url(m.group()), text)
    for url in urls:
        for secret in _passwords(url or ""):
            text = text.replace(secret, MASK)
    return text


def _passwords(url: str) -> set[str]:
    _, sep, rest = url.partition("://")
    found: set[str] = set()
    if not sep:
        return found
    userinfo, at, _ = rest.rpartition("@")
    if at and ":" in userinfo:
        found.add(userinfo.partition(":")[2])
    found.update(m.group(2) for m in _SECRET_PARAM_RE.finditer(rest))
    # Very short strings would mask unrelated text and reveal little on their own.
    return {s for raw in found for s in (raw, unquote(raw)) if len(s) >= 4}


def storage_url(url: str | None) -> str:
    """`url`, or the default SQLite file; a SQLite file's folder is created."""
    url = url or DEFAULT_STORAGE
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    return url
