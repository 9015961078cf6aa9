"""Resource names as Kubernetes validates them, before a device plugin registers one.

The kubelet refuses to register a device plugin whose resource name is not an *extended*
resource name (``IsExtendedResourceName`` in ``pkg/apis/core/v1/helper``): it must carry a
domain prefix (no ``/``: a native resource), the prefix must not be in the ``kubernetes.io/``
namespace, the name must not start with ``requests.``, and ``requests.<name>`` (its quota name)
must be a qualified name (``IsQualifiedName`` in apimachinery ``pkg/util/validation``): an
optional DNS-1123 subdomain prefix of at most 253 characters, ``/``, and a name of at most 63
characters of letters, digits, ``-``, ``_`` and ``.`` that starts and ends with a letter or
digit.
"""

from __future__ import annotations

import re

from gpuslice.core.errors import ValidationError

_QNAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = re.compile(rf"^{_LABEL}(\.{_LABEL})*$")
QUALIFIED_NAME_MAX = 63
SUBDOMAIN_MAX = 253
REQUESTS_PREFIX = "requests."
NATIVE_NAMESPACE = "kubernetes.io/"


def qualified_name_problems(value: str) -> list[str]:
    """Why ``value`` is not a qualified name (empty when it is one)."""
    parts = value.split("/")
    problems: list[str] = []
    if len(parts) == 1:
        name = parts[0]
    elif len(parts) == 2:
        prefix, name = parts
        if not prefix:
            problems.append("prefix part must be non-empty")
        else:
            if len(prefix) > SUBDOMAIN_MAX:
                problems.append(f"prefix part must be no more than {SUBDOMAIN_MAX} characters")
            if not _DNS1123_SUBDOMAIN.match(prefix):
                problems.append("prefix part must be a lowercase DNS-1123 subdomain")
    else:
        return ["a qualified name has at most one '/'"]
    if not name:
        problems.append("name part must be non-empty")
    elif len(name) > QUALIFIED_NAME_MAX:
        problems.append(f"name part must be no more than {QUALIFIED_NAME_MAX} characters")
    if name and not _QNAME.match(name):
        problems.append("name part must consist of alphanumeric characters, '-', '_' or '.', "
                        "and must start and end with an alphanumeric character")
    return problems


def extended_resource_name_problems(name: str) -> list[str]:
    """Why ``name`` is not an extended resource name the kubelet would register."""
    if "/" not in name:
        return ["it has no domain prefix (a name without '/' is a native resource)"]
    if NATIVE_NAMESPACE in name:
        return [f"names in the {NATIVE_NAMESPACE} namespace are native resources"]
    if name.startswith(REQUESTS_PREFIX):
        return [f"it must not start with {REQUESTS_PREFIX!r}"]
    return qualified_name_problems(REQUESTS_PREFIX + name)


def check_extended_resource_name(name: str, field: str = "resource name") -> str:
    """``name`` when the kubelet would accept it as a device plugin's resource; else a
    :class:`ValidationError` that says why."""
    problems = extended_resource_name_problems(name)
    if problems:
        raise ValidationError(field, "an extended resource name (domain/name, a qualified "
                              "name): " + "; ".join(problems), name)
    return name
