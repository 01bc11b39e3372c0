"""What the server refuses before any work (client/serve/policy.py), as rules and through the real
ASGI app in-process (httpx's ASGI transport, a scripted service standing in for the worker): the
browser-forgeable requests a red team sent (DNS rebinding Hosts, ``text/plain`` bodies, foreign
Origins), CORS for an allowed origin, and ``/metrics`` behind an admin key."""

from __future__ import annotations

import httpx
import pytest
import trio
from helpers.serve_fakes import ScriptedService

from muxworker.serve.app import AppConfig, create_app
from muxworker.serve.metrics import ServerMetrics
from muxworker.serve.openai_api import ServedModel
from muxworker.serve.policy import HttpPolicy, startup_problem

LOCAL = ("127.0.0.1", 8000)


@pytest.mark.parametrize(
    ("host", "server", "allowed"),
    [
        ("127.0.0.1:8000", LOCAL, True),
        ("localhost:8000", LOCAL, True),
        ("[::1]:8000", LOCAL, True),
        ("LOCALHOST:8000", LOCAL, True),
        ("localhost:8001", LOCAL, False),  # another port is another server
        ("evil.example:8000", LOCAL, False),  # DNS rebinding: a name that resolves to 127.0.0.1
        ("evil.example", LOCAL, False),
        ("127.0.0.1", LOCAL, False),  # port 80 implied
        ("", LOCAL, False),
        (None, LOCAL, False),
        ("127.0.0.1:8000:1", LOCAL, False),
        ("[::1", LOCAL, False),
        ("192.168.1.5:8000", ("192.168.1.5", 8000), True),  # the address the connection came in on
        ("localhost:8000", ("192.168.1.5", 8000), False),  # loopback names only for a loopback bind
        ("testserver", ("testserver", 80), True),
    ],
)
def test_host_is_the_bound_address_or_a_loopback_name(host, server, allowed):
    assert HttpPolicy().host_allowed(host, server) is allowed


def test_allowed_hosts_by_name_or_name_and_port():
    policy = HttpPolicy(allowed_hosts=("api.example", "box.lan:9000"))
    assert policy.host_allowed("api.example:1234", LOCAL)
    assert policy.host_allowed("API.example", LOCAL)
    assert policy.host_allowed("box.lan:9000", LOCAL) and not policy.host_allowed("box.lan:9001", LOCAL)
    assert HttpPolicy(allowed_hosts=("*",)).host_allowed("anything", None)
    with pytest.raises(ValueError, match="allowed-host"):
        HttpPolicy(allowed_hosts=("a:b:c",))
    with pytest.raises(ValueError, match="cors-origin"):
        HttpPolicy(cors_origins=("app.example",))


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({"content-type": "application/json", "content-length": "2"}, None),
        ({"content-type": "application/json; charset=utf-8", "content-length": "2"}, None),
        ({"content-type": "text/plain", "content-length": "2"}, 415),  # a page's simple request
        ({"content-type": "application/x-www-form-urlencoded", "content-length": "2"}, 415),
        ({"content-type": "multipart/form-data; boundary=x", "content-length": "2"}, 415),
        ({"content-length": "2"}, 415),
        ({"content-length": "0"}, None),
        ({}, None),
        ({"content-type": "application/json", "content-length": str(5 << 20)}, 413),
        ({"content-type": "text/plain", "content-length": str(5 << 20)}, 413),
        ({"content-type": "application/json", "content-length": "many"}, 400),
    ],
)
def test_bodies_must_be_json_and_within_the_limit(headers, status):
    err = HttpPolicy().refusal("POST", {"host": "127.0.0.1:8000", **headers}, LOCAL)
    assert (err.status if err is not None else None) == status


def test_startup_refuses_an_open_bind_without_keys_or_names():
    assert startup_problem("127.0.0.1", HttpPolicy()) is None
    assert startup_problem("::1", HttpPolicy()) is None
    assert "every interface" in startup_problem("0.0.0.0", HttpPolicy())
    assert "192.168.1.5" in startup_problem("192.168.1.5", HttpPolicy())
    assert startup_problem("0.0.0.0", HttpPolicy(api_keys=("k",))) is None
    assert startup_problem("0.0.0.0", HttpPolicy(allowed_hosts=("box.lan",))) is None


# -- the app in-process -----------------------------------------------------------------------------


def _call(policy: HttpPolicy, method: str, path: str, **kw) -> tuple[httpx.Response, ScriptedService]:
    service = ScriptedService()
    app = create_app(service, ServerMetrics(), AppConfig(ServedModel(("m",)), policy=policy))  # type: ignore[arg-type]

    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)  # scope["server"] is the URL's host and port
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as http:
            return await http.request(method, path, **kw)

    return trio.run(main), service


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def test_a_rebinding_page_is_refused_before_anything_runs():
    r, service = _call(HttpPolicy(), "POST", "/v1/chat/completions", json=CHAT, headers={"host": "evil.example:8000"})
    assert r.status_code == 421 and r.json()["error"]["code"] == "host_not_allowed"
    assert "--allowed-host" in r.json()["error"]["message"] and service.generated == 0
    for method, path in [("GET", "/v1/sessions"), ("DELETE", "/v1/sessions/s"), ("GET", "/v1/models")]:
        r, _ = _call(HttpPolicy(), method, path, headers={"host": "evil.example:8000"})
        assert r.status_code == 421, (method, path)
    r, service = _call(HttpPolicy(), "POST", "/v1/chat/completions", json=CHAT, headers={"host": "localhost:8000"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello there"


def test_a_text_plain_post_is_refused_without_running_a_turn():
    r, service = _call(
        HttpPolicy(),
        "POST",
        "/v1/chat/completions",
        content=b'{"messages": []}',
        headers={"content-type": "text/plain"},
    )
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    assert service.generated == 0


def test_a_foreign_origin_is_refused_and_an_allowed_one_gets_cors():
    page = {"origin": "https://evil.example"}
    r, service = _call(HttpPolicy(), "POST", "/v1/chat/completions", json=CHAT, headers=page)
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed" and service.generated == 0
    r, _ = _call(HttpPolicy(), "GET", "/v1/sessions", headers=page)
    assert r.status_code == 403
    # The server's own origin is same-origin.
    r, _ = _call(HttpPolicy(), "GET", "/v1/models", headers={"origin": "http://127.0.0.1:8000"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers

    allowed = HttpPolicy(cors_origins=("https://app.example",))
    preflight = {
        "origin": "https://app.example",
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type",
    }
    r, _ = _call(allowed, "OPTIONS", "/v1/chat/completions", headers=preflight)
    assert r.status_code == 204 and r.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "content-type" in r.headers["access-control-allow-headers"]
    r, _ = _call(allowed, "OPTIONS", "/v1/chat/completions", headers={**preflight, "origin": "https://evil.example"})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    r, _ = _call(allowed, "POST", "/v1/chat/completions", json=CHAT, headers={"origin": "https://app.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    assert "x-session-id" in r.headers["access-control-expose-headers"]
    r, _ = _call(allowed, "POST", "/v1/chat/completions", json=CHAT, headers={"origin": "https://evil.example"})
    assert r.status_code == 403


def test_metrics_need_an_admin_key_when_tenants_have_keys():
    assert _call(HttpPolicy(), "GET", "/metrics")[0].status_code == 200  # one tenant: its own figures
    keyed = HttpPolicy(api_keys=("tenant-a", "tenant-b"), admin_keys=("ops",))
    r, _ = _call(keyed, "GET", "/metrics", headers={"authorization": "Bearer tenant-a"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
    assert _call(keyed, "GET", "/metrics")[0].status_code == 401
    r, _ = _call(keyed, "GET", "/metrics", headers={"authorization": "Bearer ops"})
    assert r.status_code == 200 and b"muxworker_http_requests_total" in r.content
    # An admin key is not a tenant's key.
    r, _ = _call(keyed, "GET", "/v1/sessions", headers={"authorization": "Bearer ops"})
    assert r.status_code == 401
    # Without an admin key, nobody reads them.
    no_admin = HttpPolicy(api_keys=("tenant-a",))
    assert _call(no_admin, "GET", "/metrics", headers={"authorization": "Bearer tenant-a"})[0].status_code == 403
