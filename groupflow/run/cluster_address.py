"""The one cluster address of every command, and the two addresses derived from it
(docs/jobs.md, "The cluster address").

A command that reaches a Ray cluster takes one address: --address, else $RAY_ADDRESS, else the
dashboard of a cluster on this machine (DEFAULT_ADDRESS). It may be any of Ray's forms: the
dashboard's URL (http://HOST:8265, what Ray's docs tell `ray job` users to put in RAY_ADDRESS),
the GCS address (HOST:6379, what `ray start --head` prints), a Ray Client address
(ray://HOST:10001) or `auto` (the cluster `ray start` started on this machine).

Two addresses come of it. The Jobs API's (the dashboard: submit, status, logs, stop, list) is
the URL itself, or for the other forms what the cluster recorded of its dashboard, which Ray's
JobSubmissionClient looks up itself. The one a Ray driver joins (ray.init: scale, the live part
of status, train) is the address itself, or for a dashboard URL the GCS address the dashboard
reports (every node's raylet runs with --gcs-address, in the node summary the dashboard
serves), tried as reported, then on the dashboard's host, then the head's Ray Client port.

Ray reads RAY_ADDRESS (and RAY_API_SERVER_ADDRESS) itself: ray.init where it is given no
address or `auto`, and JobSubmissionClient over any address it is given. So while Ray is handed
an address resolved here, those variables are hidden from it (`ray_env_hidden`): a dashboard
URL there would otherwise reach ray.init, which refuses it.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import urlparse

from groupflow.core.errors import UserError, first_line

ADDRESS_ENV = "RAY_ADDRESS"
DEFAULT_ADDRESS = "http://127.0.0.1:8265"
DOCS = "docs/jobs.md, 'The cluster address'"
# Variables Ray reads for an address of its own accord (ray.init, JobSubmissionClient).
_RAY_READS = (ADDRESS_ENV, "RAY_API_SERVER_ADDRESS")
RAY_CLIENT_PORT = 10001  # `ray start --head`'s default Ray Client port
CONNECT_TIMEOUT_S = 5.0  # for an address to accept a connection before Ray waits on it
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}
NODE_SUMMARY = "/nodes?view=summary"  # the dashboard's nodes, with each node's command lines
GCS_FLAG = "--gcs-address="


class AddressError(UserError, RuntimeError):
    """No cluster answers at an address, said in one line naming it."""

    exit_code = 1


def is_dashboard_url(address: str) -> bool:
    return address.strip().lower().startswith(("http://", "https://"))


@dataclass(frozen=True)
class ClusterAddress:
    """The address a command was given, and where it came from (for its error lines)."""

    text: str
    origin: str  # "--address", "$RAY_ADDRESS" or "default"

    @classmethod
    def given(cls, flag: str | None) -> ClusterAddress:
        """--address, else $RAY_ADDRESS, else the local dashboard."""
        if flag:
            return cls(flag, "--address")
        if os.environ.get(ADDRESS_ENV):
            return cls(os.environ[ADDRESS_ENV], f"${ADDRESS_ENV}")
        return cls(DEFAULT_ADDRESS, "default")

    @property
    def is_dashboard(self) -> bool:
        return is_dashboard_url(self.text)

    def __str__(self) -> str:
        return self.text if self.origin == "--address" else f"{self.text} ({self.origin})"


@contextmanager
def ray_env_hidden() -> Iterator[None]:
    """RAY_ADDRESS and RAY_API_SERVER_ADDRESS out of this process's environment while Ray is
    handed an address of ours (Ray would read them over it), put back after."""
    saved = {name: os.environ.pop(name) for name in _RAY_READS if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


# ----- is a cluster there ----------------------------------------------------------------------
def probe(address: str) -> None:
    """Refuse, within CONNECT_TIMEOUT_S, an address where no Ray cluster answers: ray.init
    would retry it for about half a minute, the Jobs client's lookup of a GCS 20 times, and a
    GcsClient waits 20 s for a server that answers but is no GCS before its own read."""
    parsed = urlparse(address if "://" in address else f"gcs://{address}")
    try:
        host, port = parsed.hostname, parsed.port
    except ValueError:
        raise AddressError(f"Ray address {address}: not HOST:PORT") from None
    if host is None or port is None:  # "auto", "local": Ray finds the cluster itself
        return
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S) as connection:
            if parsed.scheme == "gcs" and not _tls():  # something answers: is it gRPC?
                _speaks_grpc(connection, deadline)
        if parsed.scheme == "gcs":  # then ask it as Ray's GCS
            _ask_gcs(address, deadline)
    except OSError as err:
        reason = "no answer" if isinstance(err, TimeoutError) else err.strerror or str(err)
        raise AddressError(f"no Ray cluster answers at {address} ({reason})") from None


# A Ray GCS is a gRPC server: HTTP/2 without TLS, which answers a client's connection preface
# (RFC 9113 section 3.4) with a SETTINGS frame (its 4th byte, the frame's type, is 4).
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_SETTINGS = 4


def _tls() -> bool:
    """Whether Ray's gRPC runs over TLS here (then the preface would go unanswered)."""
    return os.environ.get("RAY_USE_TLS", "0").strip().lower() in ("1", "true")


def _speaks_grpc(connection: socket.socket, deadline: float) -> None:
    """ConnectionError unless the server at the other end of `connection` answers as an
    HTTP/2 server before `deadline`."""
    try:
        connection.settimeout(max(deadline - time.monotonic(), 0.1))
        connection.sendall(_HTTP2_PREFACE)
        reply = b""
        while len(reply) < 9:
            chunk = connection.recv(9 - len(reply))
            if not chunk:
                break
            reply += chunk
    except TimeoutError:
        raise ConnectionError("not a Ray GCS: no answer to a gRPC client") from None
    if len(reply) < 9 or reply[3] != _SETTINGS:
        said = reply.split(b"\r\n", 1)[0][:40].decode("ascii", "backslashreplace")
        raise ConnectionError(
            f"not a Ray GCS: it does not speak gRPC (it answered {said!r})"
            if said
            else "not a Ray GCS: it closed the connection of a gRPC client"
        )


def _no_silent_host(url: str) -> None:
    """Refuse a dashboard whose host drops the connection unanswered: the Jobs client asks
    it with no timeout, and would hold the command for minutes. (A refusal or an unknown
    name is left to the client, which says so at once.)"""
    parsed = urlparse(url.strip())
    try:
        port = parsed.port or (443 if parsed.scheme.lower() == "https" else 80)
        socket.create_connection((parsed.hostname, port), timeout=CONNECT_TIMEOUT_S).close()
    except TimeoutError:
        raise AddressError(f"no Ray cluster answers at {url} (no answer)") from None
    except (OSError, ValueError):
        return


def _ask_gcs(address: str, deadline: float) -> None:
    """One read from the GCS at `address`, done by `deadline`; ConnectionError if no GCS is
    there. The GcsClient is made and read in a thread of its own, since its constructor waits
    on its own clock; one that misses the deadline is left to end with the process."""
    from ray._raylet import GcsClient
    from ray.exceptions import AuthenticationError, RayError

    outcome: list[BaseException | None] = []

    def ask() -> None:
        try:
            GcsClient(address=address).internal_kv_get(
                b"groupflow_probe", None, timeout=CONNECT_TIMEOUT_S
            )
            outcome.append(None)
        except BaseException as err:  # handed to the caller's thread
            outcome.append(err)

    asking = threading.Thread(target=ask, name="groupflow-gcs-probe", daemon=True)
    asking.start()
    asking.join(max(deadline - time.monotonic(), 0.1))
    if not outcome:
        raise ConnectionError(f"not a Ray GCS: no answer as one within {CONNECT_TIMEOUT_S:g}s")
    err = outcome[0]
    if isinstance(err, AuthenticationError):
        raise err  # a cluster is there; it wants the token (groupflow/core/errors.py: AUTH_HINT)
    if isinstance(err, RayError):
        raise ConnectionError(f"not a Ray GCS: {first_line(err)}") from None
    if err is not None:
        raise err


# ----- the Jobs API's address --------------------------------------------------------------------
def jobs_client(address: ClusterAddress):
    """A Ray JobSubmissionClient of the cluster at `address`, whatever its form; one line
    naming the address when no cluster answers there."""
    from ray.job_submission import JobSubmissionClient

    try:
        if address.is_dashboard:
            _no_silent_host(address.text)
        else:  # Ray would retry a GCS or Ray Client address for long
            probe(address.text)
    except AddressError as err:
        raise AddressError(f"{err} ({address.origin}; see {DOCS})") from None
    from ray.exceptions import AuthenticationError

    try:
        with ray_env_hidden():
            return JobSubmissionClient(address.text)
    except ConnectionError as err:
        raise AddressError(
            f"no Ray cluster answers at {address} ({first_line(err)}); see {DOCS}"
        ) from None
    except AuthenticationError:
        raise  # a cluster is there; it wants the token (groupflow/core/errors.py: AUTH_HINT)
    except Exception as err:
        # Something answered, but not as a Ray dashboard: the client's version check read a
        # page that is no JSON ("Expecting value: line 1 column 1"), an error status, or JSON
        # without Ray's version in it, and said so naming neither the address nor the cause.
        raise AddressError(
            f"no Ray dashboard answers at {address}: its /api/version is not Ray's "
            f"({type(err).__name__}: {first_line(err, 120)}); see {DOCS}"
        ) from None


# ----- the address a driver joins ----------------------------------------------------------------
def told_gcs_address(nodes: list) -> str | None:
    """The GCS address in the dashboard's node summary: every node's raylet is started with
    --gcs-address=HOST:PORT (the head's first); None when the summary has none."""
    ordered = sorted(
        (n for n in nodes if isinstance(n, dict)),
        key=lambda n: not (n.get("raylet") or {}).get("isHeadNode", False),
    )
    for node in ordered:
        for arg in node.get("cmdline") or []:
            if isinstance(arg, str) and arg.startswith(GCS_FLAG) and len(arg) > len(GCS_FLAG):
                return arg[len(GCS_FLAG) :]
    return None


def join_candidates(dashboard: str, told: str | None) -> list[str]:
    """Where a driver may join the cluster of `dashboard`, in order: the GCS address it told,
    the same port on the dashboard's own host (the name this machine reaches it by), the head's
    Ray Client port there (what KubeRay's head service exposes)."""
    host = urlparse(dashboard.strip()).hostname or ""
    found = []
    if told is not None:
        found.append(told)
        port = told.rsplit(":", 1)[-1]
        if host and host not in LOCAL_HOSTS:
            found.append(f"{host}:{port}")
    if host:
        found.append(f"ray://{host}:{RAY_CLIENT_PORT}")
    return list(dict.fromkeys(found))


def _node_summary(client) -> list:
    """The dashboard's nodes; [] when it does not serve them as expected."""
    try:
        reply = client._do_request("GET", NODE_SUMMARY, timeout=CONNECT_TIMEOUT_S * 2)
        return reply.json()["data"]["summary"] if reply.status_code == 200 else []
    except (OSError, ValueError, KeyError, TypeError):
        return []


def join_address(address: ClusterAddress, client=None) -> str:
    """What ray.init joins for the cluster at `address`: the address itself, or for a
    dashboard URL the first of its join candidates that answers."""
    if not address.is_dashboard:
        return address.text
    client = client if client is not None else jobs_client(address)
    tried = []
    for candidate in join_candidates(address.text, told_gcs_address(_node_summary(client))):
        try:
            probe(candidate)
            return candidate
        except AddressError as err:
            tried.append(str(err).removeprefix("no Ray cluster answers at "))
    raise AddressError(
        f"cannot join the cluster of the dashboard {address}: nothing answers at "
        f"{'; '.join(tried) or 'any address it reports'}; give its GCS address instead "
        f"(--address HOST:6379; see {DOCS})"
    )
