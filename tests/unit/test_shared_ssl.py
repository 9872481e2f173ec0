"""An engine's httpx clients share one SSL context (rollout/shared_ssl.py): each harness
trajectory builds several, and loading the CA bundle for each held the engine's event loop."""

from __future__ import annotations

import ssl

import httpx

import groupflow.rollout.harness  # noqa: F401 (installs the shared context, as in an engine)
from groupflow.rollout.shared_ssl import share_default_ssl_context


def _context(client: httpx.AsyncClient) -> ssl.SSLContext:
    return client._transport._pool._ssl_context


def test_default_clients_share_one_context_and_others_keep_their_own(tmp_path, monkeypatch):
    share_default_ssl_context()  # a second install changes nothing
    first, second = httpx.AsyncClient(), httpx.AsyncClient()
    assert _context(first) is _context(second)
    unverified = httpx.AsyncClient(verify=False)
    assert _context(unverified) is not _context(first)
    assert _context(unverified).verify_mode == ssl.CERT_NONE
    own = ssl.create_default_context()
    assert _context(httpx.AsyncClient(verify=own)) is own
    # the CA environment picks the context, as it picks httpx's own
    import certifi

    monkeypatch.setenv("SSL_CERT_FILE", certifi.where())
    assert _context(httpx.AsyncClient()) is not _context(first)
