"""Who may open the dashboard and which captures it reads (kvscope/dashboard/access.py): on a
real directory tree with a symbolic link out of it, and through the Flask server of a real
Dash app."""

from __future__ import annotations

import os

import pytest

from kvscope.dashboard.access import COOKIE, outside_roots, resolve_roots, under_roots
from kvscope.dashboard.app import create_app
from kvscope.dashboard.pages import compare


@pytest.fixture
def tree(tmp_path):
    """root/ holding run1/ and a link escape -> outside/; outside/ holding secret.parquet."""
    (tmp_path / "root" / "run1").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.parquet").write_bytes(b"PAR1")
    os.symlink(tmp_path / "outside", tmp_path / "root" / "escape")
    return tmp_path


def test_paths_under_a_root_are_read_and_no_other(tree):
    roots = resolve_roots([tree / "root"])
    assert outside_roots(str(tree / "root" / "run1"), roots) == ""
    assert outside_roots(f"{tree / 'root' / 'run1'},{tree / 'root'}", roots) == ""
    assert outside_roots(str(tree / "root" / "not-yet"), roots) == ""  # inside: its own errors
    assert outside_roots("", roots) == outside_roots(None, roots) == ""
    for escape in (tree / "outside", tree / "root" / "escape", tree / "root" / ".." / "outside",
                   tree / "root" / "escape" / "secret.parquet", "/etc/passwd"):
        assert "is not under a directory this dashboard may read" in outside_roots(
            str(escape), roots), escape
    # one outside path among several refuses the lot
    assert outside_roots(f"{tree / 'root' / 'run1'},/etc", roots)


def test_the_refusal_says_nothing_about_what_exists(tree):
    """An existing file and a missing one outside the roots give the same line, up to the path
    typed (which the visitor knows already)."""
    roots = resolve_roots([tree / "root"])
    there = str(tree / "outside" / "secret.parquet")
    missing = str(tree / "outside" / "nothing.parquet")
    assert (outside_roots(there, roots).replace(there, "P")
            == outside_roots(missing, roots).replace(missing, "P"))


def test_without_roots_the_page_reads_nothing(tree):
    assert "kvscope dashboard --capture-root DIR" in outside_roots(str(tree / "root"), ())


def test_the_compare_page_refuses_before_reading(tree):
    """A link or the form naming a path outside the roots gets the refusal as its status,
    without reading: not even whether a rollout report is there."""
    roots = resolve_roots([tree / "root"])
    for out in (compare.respond(False, f"?baseline={tree / 'outside'}&candidate=/etc", None,
                                None, None, roots=roots),
                compare.respond(True, "", str(tree / "root" / "run1"), "/etc/shadow", None,
                                roots=roots)):
        status = out[len(compare.GRAPHS) + 1]
        assert "is not under a directory this dashboard may read" in status, status


def test_a_relative_path_is_taken_under_the_roots_not_the_working_directory(tree, tmp_path,
                                                                            monkeypatch):
    """Typed on the page, ``run1`` meant the dashboard's working directory and was refused as
    outside the roots although root/run1 is there. It is read under the root holding it (of
    two roots, the second here); a relative path out of a root is still refused."""
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.chdir(other)
    roots = resolve_roots([other, tree / "root"])
    assert under_roots("run1, /abs/x", roots) == f"{tree / 'root' / 'run1'},/abs/x"
    assert under_roots("nowhere", roots) == str(other / "nowhere")
    assert under_roots("run1", ()) == "run1" and under_roots(None, roots) is None
    out = compare.respond(True, "", "run1", "run1", None, roots=roots)
    status = out[len(compare.GRAPHS) + 1]
    assert "not under a directory" not in status and str(tree / "root" / "run1") in status
    out = compare.respond(True, "", "../outside", "run1", None, roots=roots)
    assert "'" + str(other / "../outside") + "' is not under a directory" in out[
        len(compare.GRAPHS) + 1]


def test_a_protected_dashboard_wants_its_token_once(tree):
    """Without the token: 401 saying how to open it. With ?token=: a redirect to the page
    without it, and a cookie (HttpOnly, SameSite=Strict) that lets the browser's later
    requests in; a bearer header works too; a wrong token does not."""
    app = create_app("http://127.0.0.1:9", require_token="s3cret-tok")
    client = app.server.test_client()
    refused = client.get("/")
    assert refused.status_code == 401 and "/?token=TOKEN" in refused.get_data(as_text=True)
    assert client.get("/?token=wrong").status_code == 401
    opened = client.get("/?token=s3cret-tok")
    # the token leaves the address bar (and the browser's history) at once
    assert opened.status_code == 303 and opened.headers["Location"] == "/"
    cookie = opened.headers["Set-Cookie"]
    assert cookie.startswith(f"{COOKIE}=s3cret-tok") and "HttpOnly" in cookie
    assert "SameSite=Strict" in cookie
    assert client.get("/").status_code == 200  # the cookie, sent back
    assert client.get("/_dash-layout").status_code == 200
    stale = client.get("/?token=an-old-one")  # a stale link: the cookie opens it
    assert stale.status_code == 303 and stale.headers["Location"] == "/"
    # a deep link keeps its own parameters
    deep = app.server.test_client().get("/requests?id=r%201&token=s3cret-tok&source=vllm")
    assert deep.status_code == 303
    assert deep.headers["Location"] == "/requests?id=r+1&source=vllm"
    other = app.server.test_client()
    assert other.get("/_dash-layout").status_code == 401
    assert other.get("/_dash-layout",
                     headers={"Authorization": "Bearer s3cret-tok"}).status_code == 200


def test_an_open_dashboard_stays_open():
    app = create_app("http://127.0.0.1:9")
    assert app.server.test_client().get("/").status_code == 200


def test_with_two_roots_the_refusal_does_not_tell_which_holds_a_path_next_to_it(tmp_path):
    """Roots a/root1 and b/root2; b/secret exists, a/secret does not. ``../secret`` was placed
    under root2, where it exists, and the refusal named root2's path: with two roots it told
    what exists outside them. Now both read the same, under the first root; and a path with a
    NUL byte, which raised out of the page's callback, is refused like any other."""
    for root in ("a/root1", "b/root2"):
        (tmp_path / root).mkdir(parents=True)
    (tmp_path / "b" / "secret").mkdir()
    roots = resolve_roots([tmp_path / "a" / "root1", tmp_path / "b" / "root2"])
    said = {name: outside_roots(under_roots(f"../{name}", roots), roots)
            for name in ("secret", "nothing")}
    assert said["secret"].replace("secret", "P") == said["nothing"].replace("nothing", "P")
    assert str(tmp_path / "a" / "root1" / ".." / "secret") in said["secret"]
    for out in (compare.respond(False, "?baseline=a%00&candidate=c", None, None, None,
                                roots=roots),
                compare.respond(True, "", "x\x00y", "c", None, roots=roots)):
        assert "is not under a directory this dashboard may read" in out[
            len(compare.GRAPHS) + 1]


def test_the_dashboard_server_bounds_bodies_and_connections():
    """A callback body past MAX_BODY is refused (413) before it is read (40 MiB was read and
    parsed); past ``max_connections`` a new connection gets 503 and is closed; a client that
    sends half a request is let go after READ_TIMEOUT (10 s; 200 such clients held 200
    threads for good). Over a real socket, on loopback."""
    import socket

    from kvscope.dashboard.app import MAX_BODY, serve

    app = create_app("http://127.0.0.1:9")
    big = app.server.test_client().post("/_dash-update-component", data=b"x" * (MAX_BODY + 1),
                                        content_type="application/json")
    assert big.status_code == 413
    handle = serve(app, "127.0.0.1", 0, max_connections=2)
    stalled = [socket.create_connection(("127.0.0.1", handle.port)) for _ in range(2)]
    try:
        for s in stalled:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        extra = socket.create_connection(("127.0.0.1", handle.port), timeout=60)
        with extra:
            extra.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert extra.recv(64).startswith(b"HTTP/1.1 503")
        for s in stalled:  # let go by the server: end of stream, no answer
            s.settimeout(60)
            assert s.recv(64) == b""
    finally:
        for s in stalled:
            s.close()
        handle.shutdown()
