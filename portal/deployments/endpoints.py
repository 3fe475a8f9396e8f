"""Where an adopted endpoint may live: never at a link-local or cloud-metadata address.

The gateway relays members' request bodies to an adopted server and passes its answers back, so
an endpoint registered at the instance-metadata service (169.254.169.254 on AWS, GCP, Azure and
most clouds; fd00:ec2::254 on AWS over IPv6; `metadata.google.internal` on GCP) or anywhere in
the link-local ranges (169.254.0.0/16, fe80::/10) would turn the gateway into a path to the host's
credentials. A name is resolved when it is registered and refused if any of its addresses is such
a one. `ADOPTED_ENDPOINT_ALLOWED_NETWORKS` (CIDR networks) lets an operator who really runs an
engine on a link-local address adopt it.
"""

from __future__ import annotations

import ipaddress
import socket

from django.conf import settings

from portal.core.errors import ApplicationError

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

REFUSED_NETWORKS: tuple[IpNetwork, ...] = (
    # IPv4 link-local, the metadata service's 169.254.169.254 included
    ipaddress.ip_network("169.254.0.0/16"),
    ipaddress.ip_network("fe80::/10"),  # IPv6 link-local
    ipaddress.ip_network("fd00:ec2::254/128"),  # AWS's instance metadata over IPv6
)
# Names of the metadata service that may not resolve from where the portal runs but do on a node.
METADATA_NAMES = frozenset({"metadata.google.internal", "metadata.google.internal."})


def _refused(address: IpAddress) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # ::ffff:169.254.169.254 is the same host
    if any(address in network for network in settings.ADOPTED_ENDPOINT_ALLOWED_NETWORKS):
        return False
    return any(address in network for network in REFUSED_NETWORKS)


def _addresses(host: str, port: int) -> list[IpAddress]:
    """`host`'s addresses: itself when it is one, else what it resolves to now (none when it does
    not resolve: the engine may not be up yet, and the gateway cannot reach it either)."""
    try:
        return [ipaddress.ip_address(host.strip("[]").split("%")[0])]
    except ValueError:
        pass
    try:
        found = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return []
    addresses = []
    for *_, sockaddr in found:
        try:
            addresses.append(ipaddress.ip_address(str(sockaddr[0]).split("%")[0]))
        except ValueError:
            continue
    return addresses


def check_adoptable_host(host: str, port: int) -> None:
    """Raise (a 400 naming `url`) when `host` is, or resolves to, a link-local or metadata address
    that ADOPTED_ENDPOINT_ALLOWED_NETWORKS does not allow."""
    name = host.lower()
    if name in METADATA_NAMES and not any(
        ipaddress.ip_address("169.254.169.254") in network
        for network in settings.ADOPTED_ENDPOINT_ALLOWED_NETWORKS
    ):
        raise ApplicationError(f"{host} is the cloud metadata service: not an engine to adopt", field="url")
    for address in _addresses(host, port):
        if _refused(address):
            shown = host if str(address) == host.strip("[]") else f"{host} ({address})"
            raise ApplicationError(
                f"{shown} is a link-local or cloud-metadata address: the gateway would relay members' "
                "requests there. Adopt an engine on a routable address, or allow its network with "
                "ADOPTED_ENDPOINT_ALLOWED_NETWORKS",
                field="url",
            )
