"""One SSL context for the httpx clients of an engine's harness trajectories.

Why: every harness trajectory builds httpx clients (its endpoint's openai client,
rollout/harness.py; the harness's own; verifiers' program builds two more), and httpx loads
certifi's whole CA bundle for each: 0.1-0.2 s of CPU each, on the engine's event loop. At 64
concurrent trajectories the endpoint ran at 0.40x the built-in trajectory loop's tokens/s,
0.70x with one shared context (bench/endpoint.py); a verifiers taskset's step of 256
trajectories had half its calls time out on the openai SDK's 5 s connect limit. One context
serves many connections, as httpx advises for many clients. Clients that ask for their own
verification (another bundle, a client certificate, verification off, the environment
ignored) still get their own; SSL_CERT_FILE / SSL_CERT_DIR pick the shared context as they
pick httpx's own.
"""

from __future__ import annotations

import os
from typing import Any


def share_default_ssl_context() -> None:
    """Make every httpx client of this process that verifies with the default CA bundle share
    one SSL context (httpx 0.28 builds one per client, in its transport)."""
    import httpx._transports.default as transports

    build = transports.create_ssl_context
    if getattr(build, "shared", False):  # installed already
        return
    built: dict[tuple[str | None, str | None], Any] = {}

    def shared(verify: Any = True, cert: Any = None, trust_env: bool = True) -> Any:
        if verify is not True or cert is not None or not trust_env:
            return build(verify=verify, cert=cert, trust_env=trust_env)
        key = (os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        if key not in built:
            built[key] = build()
        return built[key]

    shared.shared = True
    transports.create_ssl_context = shared
