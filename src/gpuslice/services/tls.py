"""TLS for gpuslice's HTTPS servers (the extender, the admission webhook): the server context
from the flags, and a renewed certificate (cert-manager renews into the Secret, the kubelet
updates the mounted files) served from the next connection on."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Any

from gpuslice.core.errors import ValidationError

# how often the serving certificate's files are read for a renewal
TLS_RELOAD_S = 60.0


def tls_context(cert: str | None, key: str | None, client_ca: str | None) -> Any:
    """The server's TLS context (None for plain HTTP). With ``client_ca`` (mutual TLS): a
    client certificate that does not chain to it fails the handshake, and the scheduler's
    verbs answer 403 to a client that presented none (:func:`make_app`'s ``client_auth``;
    ``CERT_OPTIONAL`` rather than ``CERT_REQUIRED`` so that the kubelet's probes, which
    present none, still reach /healthz and /readyz). A client's certificate must allow client
    authentication (extendedKeyUsage clientAuth) when it names its uses."""
    import ssl

    if cert is None and key is None:
        if client_ca is not None:
            raise ValidationError("--client-ca", "--tls-cert and --tls-key as well", client_ca)
        return None
    if cert is None or key is None:
        given, other = ("--tls-cert", "--tls-key") if key is None else ("--tls-key",
                                                                        "--tls-cert")
        raise ValidationError(other, f"a PEM file to go with {given}", None)
    for flag, path in (("--tls-cert", cert), ("--tls-key", key), ("--client-ca", client_ca)):
        if path is None:
            continue
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise ValidationError(flag, "a readable PEM file", f"{path}: "
                                  f"{exc.strerror or exc}") from None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ValidationError("--tls-cert/--tls-key", "a PEM certificate and its private key",
                              f"{cert}, {key}: {exc}") from None
    if client_ca is not None:
        try:
            ctx.load_verify_locations(client_ca)
        except (OSError, ssl.SSLError) as exc:
            raise ValidationError("--client-ca", "a PEM file of CA certificates",
                                  f"{client_ca}: {exc}") from None
        ctx.verify_mode = ssl.CERT_OPTIONAL
    if client_ca is not None and not ctx.get_ca_certs():
        raise ValidationError("--client-ca", "a PEM file holding at least one CA certificate",
                              client_ca)
    return ctx


def verifies_clients(ssl_context: Any) -> bool:
    """Whether a context from :func:`tls_context` checks client certificates."""
    import ssl

    return ssl_context is not None and ssl_context.verify_mode != ssl.CERT_NONE


def certificate_digest(cert: str, key: str) -> bytes:
    """What :func:`reload_certificate` compares: the certificate and key files' contents."""
    with open(cert, "rb") as c, open(key, "rb") as k:
        return hashlib.sha256(c.read() + b"\0" + k.read()).digest()


def reload_certificate(ssl_context: Any, cert: str, key: str, seen: bytes) -> bytes:
    """Load ``cert`` and ``key`` into ``ssl_context`` again when their contents differ from
    ``seen`` (a :func:`certificate_digest`); returns the digest now served. Connections made
    from then on get the new certificate, those open keep theirs. A pair that does not load
    (a half-written renewal) raises, and the old certificate stays."""
    import ssl

    now = certificate_digest(cert, key)
    if now != seen:
        # first on a context of its own: a failed load can leave a context holding the new
        # certificate without its key, and then no handshake would succeed
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
        ssl_context.load_cert_chain(cert, key)
    return now


async def keep_renewed(ssl_context: Any, cert: str, key: str, log: logging.Logger,
                       every_s: float = TLS_RELOAD_S) -> None:
    """Every ``every_s``, load ``cert`` and ``key`` into ``ssl_context`` again when they
    changed (:func:`reload_certificate`); a pair that does not load is said and tried again
    the next time. Runs until cancelled."""
    import ssl

    try:
        seen = certificate_digest(cert, key)
    except OSError:  # loaded a moment ago: gone meanwhile, read again next time
        seen = b""
    while True:
        await asyncio.sleep(every_s)
        try:
            now = reload_certificate(ssl_context, cert, key, seen)
        except (OSError, ssl.SSLError) as exc:  # tried again next time
            log.warning("serving certificate %s not reloaded: %s", cert, exc,
                        extra={"event": "tls-reload-failed"})
            continue
        if now != seen:
            log.info("serving the renewed certificate %s", cert,
                     extra={"event": "tls-reloaded"})
        seen = now
