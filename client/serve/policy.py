"""What the server refuses before any work: foreign ``Host`` values, foreign ``Origin``\\ s, bodies
that are not JSON, oversized bodies, and callers without a key. Sans-I/O, over plain header maps,
so the app (:mod:`.app`) and a Ray replica (:mod:`.ray`, which checks before it reads a body and
streams it to its child server) apply the same rules.

Why each rule (docs/SERVER.md, "Security"):

- **Host.** A web page can point a DNS name it controls at 127.0.0.1 (DNS rebinding) and then
  talk to a local server as a same-origin page. Its requests carry that name in ``Host``, so only
  values naming the address and port the connection came in on (for a loopback bind also
  ``localhost``, ``127.0.0.1`` and ``[::1]``) and ``--allowed-host`` values are served: 421
  otherwise.
- **Content-Type.** A page may POST ``text/plain`` to any origin without a CORS preflight. A
  body must say ``application/json`` (415 otherwise), which a page can only send after a
  preflight this server answers with a refusal.
- **Origin.** Browsers send ``Origin`` on cross-origin requests. One that is not the server's own
  origin is refused (403) unless ``--cors-origin`` allows it; then the responses carry CORS
  headers and preflights (``OPTIONS``) are answered as browsers expect.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from . import openai_api as oa
from .tenants import Tenant

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "HttpPolicy", "LOOPBACK_NAMES", "is_loopback", "startup_problem"]

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024

#: Host names that always mean this machine's loopback interface.
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]", "::1"})
#: Headers a browser may send cross-origin once a preflight allowed it (lower case).
CORS_ALLOW_HEADERS = "authorization, content-type, x-session-id, openai-organization, openai-project"
CORS_EXPOSE_HEADERS = "x-session-id, x-muxworker-save-error, retry-after"
CORS_METHODS = "GET, POST, DELETE, OPTIONS"
CORS_MAX_AGE_S = 600


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``, brackets allowed) is this machine's loopback."""
    name = host.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    """Whether binding ``host`` listens on every interface (0.0.0.0, ::)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def _split_host(value: str) -> tuple[str, int | None] | None:
    """``host[:port]`` (IPv6 in brackets) -> (lower-case host without brackets, port or None);
    None when malformed."""
    value = value.strip().lower()
    if not value:
        return None
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        host, rest = value[1:end], value[end + 1 :]
        if rest and not rest.startswith(":"):
            return None
        port_text = rest[1:] if rest else None
    else:
        host, sep, port_text = value.partition(":")
        if not sep:
            port_text = None
        if ":" in (port_text or ""):
            return None
    if port_text is None:
        return host, None
    if not port_text.isdigit() or not 0 < int(port_text) <= 65535:
        return None
    return host, int(port_text)


def _host_text(host: str) -> str:
    return f"[{host}]" if ":" in host else host


@dataclass(frozen=True)
class HttpPolicy:
    """The refusals every request goes through (see the module docstring).

    ``allowed_hosts``: ``--allowed-host`` values, ``name`` (any port) or ``name:port``; ``*``
    serves any Host (only behind a proxy that checks it). ``cors_origins``: ``--cors-origin``
    values, full origins (``https://app.example``) or ``*``. ``admin_keys``: keys that may read
    ``/metrics`` when tenant keys are configured.
    """

    api_keys: tuple[str, ...] = ()
    admin_keys: tuple[str, ...] = ()
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    _keys: tuple[bytes, ...] = field(init=False, repr=False, compare=False)
    _admin: tuple[bytes, ...] = field(init=False, repr=False, compare=False)
    _hosts: frozenset[tuple[str, int | None]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_keys", tuple(k.encode() for k in self.api_keys))
        object.__setattr__(self, "_admin", tuple(k.encode() for k in self.admin_keys))
        hosts = set()
        for value in self.allowed_hosts:
            if value == "*":
                continue
            parsed = _split_host(value)
            if parsed is None:
                raise ValueError(f"--allowed-host {value!r} is not a host name or host:port")
            hosts.add(parsed)
        object.__setattr__(self, "_hosts", frozenset(hosts))
        for origin in self.cors_origins:
            if origin != "*" and (not origin.startswith(("http://", "https://")) or origin.endswith("/")):
                raise ValueError(f"--cors-origin {origin!r} must be * or an origin such as https://app.example")

    # -- Host and Origin -----------------------------------------------------------------------------

    def host_allowed(self, host_header: str | None, server: tuple[str, int] | None) -> bool:
        """Whether a request whose ``Host`` is ``host_header``, received on the local address
        ``server`` (ASGI's ``scope["server"]``), may be served."""
        if "*" in self.allowed_hosts:
            return True
        if host_header is None:
            return False  # HTTP/1.1 requires Host; HTTP/2's :authority arrives as Host in ASGI
        parsed = _split_host(host_header)
        if parsed is None:
            return False
        name, port = parsed
        if (name, port) in self._hosts or (name, None) in self._hosts:
            return True
        if server is None:
            return False
        bound_host, bound_port = server[0].lower().strip("[]"), server[1]
        if port is None:
            port = 80  # a browser omits the default port
        if port != bound_port:
            return False
        return name == bound_host or (is_loopback(bound_host) and name in LOOPBACK_NAMES)

    def origin_allowed(self, origin: str, host_header: str | None) -> bool:
        """Whether a request carrying ``Origin: origin`` may be served: the server's own origin
        (the Host it was sent to, already checked), or one ``--cors-origin`` allows."""
        if "*" in self.cors_origins or origin in self.cors_origins:
            return True
        if host_header is None:
            return False
        return origin.lower() in (f"http://{host_header.lower()}", f"https://{host_header.lower()}")

    def cors_headers(self, origin: str | None) -> list[tuple[bytes, bytes]]:
        """Headers that let a browser at ``origin`` read a response (none for same-origin or
        non-browser requests, or an origin ``--cors-origin`` does not name)."""
        if origin is None or not ("*" in self.cors_origins or origin in self.cors_origins):
            return []
        return [
            (b"access-control-allow-origin", origin.encode("latin-1")),
            (b"access-control-expose-headers", CORS_EXPOSE_HEADERS.encode()),
            (b"vary", b"Origin"),
        ]

    def preflight_headers(self, origin: str) -> list[tuple[bytes, bytes]]:
        return [
            *self.cors_headers(origin),
            (b"access-control-allow-methods", CORS_METHODS.encode()),
            (b"access-control-allow-headers", CORS_ALLOW_HEADERS.encode()),
            (b"access-control-max-age", str(CORS_MAX_AGE_S).encode()),
        ]

    def refusal(self, method: str, headers: Mapping[str, str], server: tuple[str, int] | None) -> oa.APIError | None:
        """The error a request is refused with before routing, or None: a foreign Host (421), a
        foreign Origin (403), a body that is not JSON (415) or too large by its Content-Length
        (413). Preflights (``OPTIONS``) are answered by the caller once this returns None."""
        host = headers.get("host")
        if not self.host_allowed(host, server):
            return oa.APIError(
                421,
                f"Host {host!r:.100} is not served here; start the server with --allowed-host NAME to serve it",
                code="host_not_allowed",
            )
        origin = headers.get("origin")
        if origin is not None and not self.origin_allowed(origin, host):
            return oa.APIError(
                403,
                f"requests from origin {origin!r:.100} are refused; start the server with --cors-origin ORIGIN "
                "to allow a web page there",
                type="permission_error",
                code="origin_not_allowed",
            )
        if method == "OPTIONS":
            return None
        if method in ("POST", "PUT", "PATCH"):
            return self.body_refusal(headers)
        return None

    def body_refusal(self, headers: Mapping[str, str]) -> oa.APIError | None:
        """A request body must be JSON (415) and, by its Content-Length, within the limit (413).
        An empty body (``Content-Length: 0``, or none and no Content-Type) needs no type."""
        declared = headers.get("content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                return oa.bad_request("Content-Length is not a number", code="invalid_request")
            if size > self.max_request_bytes:
                return oa.APIError(
                    413,
                    f"the request body has {size} bytes; the limit is {self.max_request_bytes}",
                    code="request_too_large",
                )
        ctype = headers.get("content-type")
        if ctype is None and declared in (None, "0"):
            return None
        media = (ctype or "").split(";", 1)[0].strip().lower()
        if media != "application/json":
            return oa.APIError(
                415,
                f"the request body must be application/json, got Content-Type {ctype!r:.100}",
                code="unsupported_media_type",
            )
        return None

    # -- keys ---------------------------------------------------------------------------------------

    @staticmethod
    def _bearer(headers: Mapping[str, str]) -> bytes | None:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return token.strip().encode()

    @staticmethod
    def _match(given: bytes, keys: Iterable[bytes]) -> bool:
        # Compare with every key in full, so the time taken does not say which prefix matched.
        return any([hmac.compare_digest(given, k) for k in keys])

    def tenant(self, headers: Mapping[str, str]) -> Tenant:
        """The caller's tenant; APIError 401 when keys are configured and the bearer is not one."""
        if not self._keys:
            return Tenant.of_key(None)
        given = self._bearer(headers)
        if given is None:
            raise oa.APIError(
                401,
                "missing API key: send Authorization: Bearer <key>",
                type="authentication_error",
                code="invalid_api_key",
            )
        if not self._match(given, self._keys):
            raise oa.APIError(401, "invalid API key", type="authentication_error", code="invalid_api_key")
        return Tenant.of_key(given.decode())

    def check_admin(self, headers: Mapping[str, str]) -> None:
        """Server-wide figures (``/metrics``): open without tenant keys (one tenant), else only for
        an ``--admin-key``: 401 without a valid key, 403 for a tenant's key."""
        if not self._keys:
            return
        given = self._bearer(headers)
        if given is not None and self._admin and self._match(given, self._admin):
            return
        if given is not None and self._match(given, self._keys):
            raise oa.APIError(
                403,
                "server-wide metrics need an admin key (--admin-key); a tenant's key cannot read them",
                type="permission_error",
                code="admin_key_required",
            )
        raise oa.APIError(
            401, "this endpoint needs an admin key (--admin-key)", type="authentication_error", code="invalid_api_key"
        )


def startup_problem(host: str, policy: HttpPolicy) -> str | None:
    """Why binding ``host`` with ``policy`` would leave the server open to any web page or
    network peer, or None. A loopback bind is served by its own names; any other bind needs
    keys or the names it is reached by (``--allowed-host``)."""
    if is_loopback(host) or policy.api_keys or policy.allowed_hosts:
        return None
    what = "every interface" if is_wildcard(host) else host
    return (
        f"binding {what} needs --api-key (each key a tenant) or --allowed-host NAME (the names clients "
        "use to reach this server); without either, anyone who can reach it can use it"
    )
