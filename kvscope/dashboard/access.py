"""Who may open the dashboard, and which captures it may read.

- **Capture roots.** The Compare page reads capture and rollout directories that a visitor
  names. It reads only under the directories the operator allowed at start (``kvscope
  dashboard --capture-root DIR``; the demo's own capture directory): any other path, existing
  or not, gets one message that says nothing about it (:func:`outside_roots`). Paths are
  resolved first (``..`` and symbolic links), so none leads out of a root; a relative path is
  taken under the roots (:func:`under_roots`).
- **Token.** A dashboard listening beyond loopback demands the token (``KVSCOPE_TOKEN``, the
  agent's): from the address bar once (``?token=...``, then kept in an HttpOnly, SameSite=Strict
  cookie, and taken out of the address), or as a bearer token (:func:`protect`). Without one
  it does not start unless told ``--insecure`` (the CLI's rule).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from urllib.parse import urlencode

from flask import Flask, g, redirect, request
from werkzeug.wrappers import Response

COOKIE = "kvscope_token"


def resolve_roots(roots: Iterable[str | os.PathLike]) -> tuple[Path, ...]:
    """``roots`` as absolute, resolved directories (for :func:`outside_roots`)."""
    return tuple(Path(os.path.realpath(root)) for root in roots)


def under_roots(paths: str | None, roots: Sequence[Path]) -> str | None:
    """``paths`` (one directory, or several comma-separated) with each relative one taken
    under ``roots``, not the dashboard's working directory: under the first root that holds
    it, else the first root (where reading it says it is missing). Absolute paths, and all
    of them without roots, are left as they are; :func:`outside_roots` still checks the
    result (a relative ``..`` leads out of a root as any other path would). Only a place
    inside the roots is looked for: where ``../x`` exists outside them decides nothing (with
    two roots, the root named in the refusal told which held an ``x`` next to it)."""
    if not paths or not roots:
        return paths
    located = []
    for path in (p.strip() for p in paths.split(",")):
        if path and not os.path.isabs(path):
            path = str(next((root / path for root in roots
                             if _inside(str(root / path), roots) and _exists(root / path)),
                            roots[0] / path))
        located.append(path)
    return ",".join(located)


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):  # ValueError: a NUL byte in it
        return False


def _inside(path: str, roots: Sequence[Path]) -> bool:
    try:
        resolved = Path(os.path.realpath(path))
    except (OSError, ValueError):  # a NUL byte: refused as any path outside (it raised)
        return False
    return any(resolved == root or root in resolved.parents for root in roots)


def outside_roots(paths: str | None, roots: Sequence[Path]) -> str:
    """The status line refusing ``paths`` (one directory, or several comma-separated) when any
    is not under one of ``roots`` (resolved, see :func:`resolve_roots`); "" when all are, or
    none is named. The line depends only on what was typed, never on what exists."""
    named = [p.strip() for p in (paths or "").split(",") if p.strip()]
    if not named:
        return ""
    if not roots:
        return ("cannot compare: this dashboard reads no captures; give it a directory it may "
                "read (kvscope dashboard --capture-root DIR; the demo reads its --capture-dir and "
                "any --capture-root)")
    refused = next((p for p in named if not _inside(p, roots)), None)
    if refused is None:
        return ""
    shown = refused if len(refused) <= 200 else refused[:200] + "…"
    return (f"cannot compare: {shown!r} is not under a directory this dashboard may read "
            f"({', '.join(map(str, roots))})")


def protect(server: Flask, token: str) -> None:
    """Make every request to ``server`` (the Dash app's Flask server) present ``token``: as
    ``?token=`` (then remembered in a cookie for the browser's later requests), the cookie, or
    ``Authorization: Bearer``. Anything else gets 401 with a line saying how to open it.

    A page opened with ``?token=`` (a GET) is redirected (303) to the same address without it,
    its other parameters kept: the token leaves the address bar at once, so it is not kept in
    the browser's history or sent on in a ``Referer`` header. A stale ``?token=`` beside a
    good cookie goes the same way."""

    def matches(offered: str | None) -> bool:
        return offered is not None and hmac.compare_digest(offered.encode(), token.encode())

    @server.before_request
    def _check() -> Response | None:
        header = request.headers.get("Authorization", "")
        bearer = header.removeprefix("Bearer ") if header.startswith("Bearer ") else None
        in_query = matches(request.args.get("token"))
        if not (in_query or matches(request.cookies.get(COOKIE)) or matches(bearer)):
            return Response("this dashboard needs its token: open it as /?token=TOKEN (the "
                            "KVSCOPE_TOKEN it was started with)\n", 401,
                            {"Content-Type": "text/plain; charset=utf-8",
                             "WWW-Authenticate": "Bearer"})
        g.kvscope_remember = in_query
        if "token" in request.args and request.method in ("GET", "HEAD"):
            rest = [(k, v) for k, v in request.args.items(multi=True) if k != "token"]
            return redirect(request.path + ("?" + urlencode(rest) if rest else ""), 303)
        return None

    @server.after_request
    def _remember(response: Response) -> Response:
        if g.get("kvscope_remember"):
            response.set_cookie(COOKIE, token, httponly=True, samesite="Strict")
        return response
