"""The one cluster address (groupflow/run/cluster_address.py): where it comes from, the Jobs API's
and a driver's address derived from each other, and Ray kept from reading $RAY_ADDRESS over
it. No cluster runs here: the dashboard is a stand-in, and a refused loopback port is a cluster
that is not there."""

from __future__ import annotations

import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import ray
import ray.job_submission

from groupflow.run import cluster_address, live
from groupflow.run.cluster_address import (
    DEFAULT_ADDRESS,
    AddressError,
    ClusterAddress,
    jobs_client,
    join_address,
    join_candidates,
    told_gcs_address,
)
from tests.integration.ray_nodes import free_port

# The shape of the dashboard's /nodes?view=summary (Ray 2.60, trimmed): every node's `cmdline`
# is its raylet's, which runs with --gcs-address; the head's comes with isHeadNode.
WORKER = {
    "raylet": {"isHeadNode": False, "nodeManagerAddress": "10.0.0.9"},
    "cmdline": ["/ray/raylet", "--node-ip-address=10.0.0.9", "--gcs-address=10.0.0.5:6380"],
}
HEAD = {
    "raylet": {"isHeadNode": True, "nodeManagerAddress": "10.0.0.5"},
    "cmdline": ["/ray/raylet", "--gcs-address=10.0.0.5:6379", "--node-ip-address=10.0.0.5"],
}


def test_the_address_is_the_flag_else_ray_address_else_the_local_dashboard(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265")
    assert ClusterAddress.given("10.0.0.5:6379") == ClusterAddress("10.0.0.5:6379", "--address")
    assert ClusterAddress.given(None) == ClusterAddress("http://head:8265", "$RAY_ADDRESS")
    monkeypatch.delenv("RAY_ADDRESS")
    assert ClusterAddress.given(None) == ClusterAddress(DEFAULT_ADDRESS, "default")
    assert str(ClusterAddress.given(None)) == f"{DEFAULT_ADDRESS} (default)"


def test_the_gcs_address_is_what_the_dashboards_nodes_run_with():
    assert told_gcs_address([WORKER, HEAD]) == "10.0.0.5:6379"  # the head's first
    assert told_gcs_address([WORKER]) == "10.0.0.5:6380"
    assert told_gcs_address([{"cmdline": ["--gcs-address="]}, "junk", {}]) is None
    assert told_gcs_address([]) is None


def test_join_candidates_from_a_dashboard():
    told = "10.0.0.5:6379"
    assert join_candidates("http://127.0.0.1:8265", told) == [told, "ray://127.0.0.1:10001"]
    # a dashboard reached by another name: its GCS port on that name too
    assert join_candidates("http://head.example:8265", told) == [
        told,
        "head.example:6379",
        "ray://head.example:10001",
    ]
    assert join_candidates("https://head.example", None) == ["ray://head.example:10001"]


class Dashboard:
    """A Jobs client whose dashboard serves a node summary."""

    def __init__(self, nodes):
        self.nodes = nodes

    def _do_request(self, method, endpoint, **kwargs):
        assert (method, endpoint) == ("GET", "/nodes?view=summary")
        return SimpleNamespace(status_code=200, json=lambda: {"data": {"summary": self.nodes}})


def test_a_dashboard_url_joins_the_gcs_it_reports(monkeypatch):
    answering = {"head.example:6379"}  # the reported IP is not reachable from here

    def probe(address):
        if address not in answering:
            raise AddressError(f"no Ray cluster answers at {address} (Connection refused)")

    monkeypatch.setattr(cluster_address, "probe", probe)
    address = ClusterAddress("http://head.example:8265", "$RAY_ADDRESS")
    assert join_address(address, Dashboard([HEAD])) == "head.example:6379"
    answering.clear()
    with pytest.raises(AddressError) as refused:
        join_address(address, Dashboard([HEAD]))
    line = str(refused.value)
    assert "\n" not in line and "http://head.example:8265 ($RAY_ADDRESS)" in line
    assert "10.0.0.5:6379 (Connection refused)" in line and "ray://head.example:10001" in line
    # the other forms are what a driver joins as they are
    assert join_address(ClusterAddress("10.0.0.5:6379", "--address")) == "10.0.0.5:6379"


def test_the_jobs_client_gets_the_address_given_not_ray_address(monkeypatch):
    """Ray's JobSubmissionClient reads $RAY_ADDRESS over the address it is handed: --address
    must win (here both are refused loopback ports; the error names the one Ray tried)."""
    given, other = free_port(), free_port()
    monkeypatch.setenv("RAY_ADDRESS", f"http://127.0.0.1:{other}")
    with pytest.raises(AddressError) as refused:
        jobs_client(ClusterAddress(f"http://127.0.0.1:{given}", "--address"))
    assert f"127.0.0.1:{given}." in str(refused.value) and str(other) not in str(refused.value)
    assert os.environ["RAY_ADDRESS"] == f"http://127.0.0.1:{other}"  # put back


def test_a_gcs_address_that_does_not_answer_is_refused_before_ray_retries_it(monkeypatch):
    def not_asked(address):
        raise AssertionError("the Jobs client was made")

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", not_asked)
    port = free_port()
    with pytest.raises(AddressError, match=rf"^no Ray cluster answers at 127.0.0.1:{port} "):
        jobs_client(ClusterAddress(f"127.0.0.1:{port}", "--address"))


def test_train_with_ray_address_set_to_a_dashboard_joins_its_cluster(monkeypatch):
    """ray.init would read a dashboard URL in $RAY_ADDRESS and refuse it ("To fix this,
    either:"): the driver joins the GCS the dashboard reports, with the variable hidden."""
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")
    joined = {}

    def init(address=None, **kwargs):
        joined.update(address=address, env=os.environ.get("RAY_ADDRESS"))

    def derive(address, client=None):
        assert address == ClusterAddress("http://127.0.0.1:8265", "$RAY_ADDRESS")
        return "10.0.0.5:6379"

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(live, "join_address", derive)
    live.join_ray(None, num_cpus=1)
    assert joined == {"address": "10.0.0.5:6379", "env": None}
    assert os.environ["RAY_ADDRESS"] == "http://127.0.0.1:8265"


def test_a_dashboard_host_that_drops_connections_is_refused_in_seconds(monkeypatch):
    """The Jobs client asks with no timeout: a host that never answers would hold it."""

    def silent(address, timeout):
        assert address == ("head.example", 8265) and timeout == cluster_address.CONNECT_TIMEOUT_S
        raise TimeoutError

    def not_asked(address):
        raise AssertionError("the Jobs client was made")

    monkeypatch.setattr(cluster_address.socket, "create_connection", silent)
    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", not_asked)
    with pytest.raises(AddressError) as refused:
        jobs_client(ClusterAddress("http://head.example:8265", "$RAY_ADDRESS"))
    assert str(refused.value).startswith(
        "no Ray cluster answers at http://head.example:8265 (no answer) ($RAY_ADDRESS; see "
    )


# ----- a server that answers, but not as Ray ------------------------------------------------------
class _NotRay(BaseHTTPRequestHandler):
    """A web server of something else: pages, an error status, JSON without Ray's version."""

    def do_GET(self):
        reply = {
            "/api/version": (200, b"<!DOCTYPE html><html>a router</html>"),
        }.get(self.path, (404, b"not found"))
        if self.server.json_reply is not None:
            reply = (200, self.server.json_reply)
        self.send_response(reply[0])
        self.end_headers()
        self.wfile.write(reply[1])

    def log_message(self, *args):
        pass


@pytest.fixture
def web_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotRay)
    server.json_reply = None
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("reply", [None, b'{"version": "1"}', b"[1, 2]"])
def test_a_dashboard_address_at_a_server_that_is_not_ray_is_one_line_naming_it(web_server, reply):
    """`groupflow logs | submit | status --address` there said only "Expecting value: line 1
    column 1 (char 0)", the Jobs client's JSON error (issue 39)."""
    web_server.json_reply = reply
    url = f"http://127.0.0.1:{web_server.server_address[1]}"
    with pytest.raises(AddressError) as refused:
        jobs_client(ClusterAddress(url, "--address"))
    message = str(refused.value)
    assert message.startswith(f"no Ray dashboard answers at {url}: its /api/version is not Ray's (")
    assert "\n" not in message


def test_a_gcs_address_at_a_server_that_is_not_ray_is_refused_within_the_deadline(web_server):
    """A recorded GCS address that answers, but not as a GCS: GcsClient waited 20 s on its own
    before the bounded read, and `status` took 40 s to say so (issue 39)."""
    address = f"127.0.0.1:{web_server.server_address[1]}"
    started = time.monotonic()
    with pytest.raises(AddressError) as refused:
        cluster_address.probe(address)
    assert time.monotonic() - started < cluster_address.CONNECT_TIMEOUT_S
    assert str(refused.value).startswith(
        f"no Ray cluster answers at {address} (not a Ray GCS: it does not speak gRPC"
    )


def test_a_silent_server_at_a_gcs_address_is_refused_within_the_deadline(monkeypatch):
    """It accepts the connection and never says a word."""
    monkeypatch.setattr(cluster_address, "CONNECT_TIMEOUT_S", 1.0)
    with socket.create_server(("127.0.0.1", 0)) as server:
        address = f"127.0.0.1:{server.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(AddressError, match=r"\(not a Ray GCS: no answer to a gRPC client\)"):
            cluster_address.probe(address)
        assert time.monotonic() - started < 2.0
