"""The caller's identity as a service mesh states it: Envoy's ``x-forwarded-client-cert`` and Istio's SPIFFE ids.

With ``mesh_mtls`` (Istio STRICT), a server's own sidecar appends an element
``By=<the server's SPIFFE id>;URI=<the client's SPIFFE id>`` to the header of
every call it passes on. :func:`mesh_peer` reads the last element and
accepts a client in the server's own trust domain and namespace only;
:func:`aiworks.security.callers.mesh_caller` then names the caller from its
service account.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiworks.core.errors import Unauthenticated


def parse_xfcc(value: str) -> list[dict[str, str]]:
    """Envoy's ``x-forwarded-client-cert``: elements split on ``,``, pairs on ``;``, ``"``-quoted values
    (``\\``-escaped inside); keys lower-cased. The last element is the one the nearest proxy added."""
    elements: list[dict[str, str]] = []
    pairs: dict[str, str] = {}
    token: list[str] = []
    key: str | None = None
    quoted = escaped = False

    def end_pair() -> None:
        nonlocal key
        text = "".join(token)
        if key is not None:
            pairs[key.strip().lower()] = text
        token.clear()
        key = None

    for ch in value:
        if escaped:
            token.append(ch)
            escaped = False
        elif quoted:
            if ch == "\\":
                escaped = True
            elif ch == '"':
                quoted = False
            else:
                token.append(ch)
        elif ch == '"':
            quoted = True
        elif ch == "=" and key is None:
            key, token[:] = "".join(token), []
        elif ch == ";":
            end_pair()
        elif ch == ",":
            end_pair()
            elements.append(pairs)
            pairs = {}
        else:
            token.append(ch)
    end_pair()
    elements.append(pairs)
    return [e for e in elements if e]


@dataclass(frozen=True)
class SpiffeId:
    trust_domain: str
    namespace: str
    service_account: str


def parse_spiffe(uri: str | None) -> SpiffeId | None:
    """``spiffe://<domain>/ns/<namespace>/sa/<account>`` (Istio's workload identities), else ``None``."""
    if not uri or not uri.startswith("spiffe://"):
        return None
    domain, _, path = uri[len("spiffe://") :].partition("/")
    parts = path.split("/")
    if len(parts) != 4 or parts[0] != "ns" or parts[2] != "sa" or not all(parts) or not domain:
        return None
    return SpiffeId(domain, parts[1], parts[3])


def mesh_peer(xfcc: str) -> SpiffeId:
    """The client's SPIFFE id in the last ``x-forwarded-client-cert`` element, checked to be in the server's own
    trust domain and namespace (its ``By=``); UNAUTHENTICATED otherwise."""
    elements = parse_xfcc(xfcc)
    last = elements[-1] if elements else {}
    peer, own = parse_spiffe(last.get("uri")), parse_spiffe(last.get("by"))
    if peer is None or own is None:
        raise Unauthenticated("the mesh's x-forwarded-client-cert names no SPIFFE identities (By= and URI=)")
    if (peer.trust_domain, peer.namespace) != (own.trust_domain, own.namespace):
        raise Unauthenticated(
            f"service account {peer.service_account!r} of namespace {peer.namespace!r} ({peer.trust_domain}) "
            f"is outside this installation's namespace {own.namespace!r}"
        )
    return peer
