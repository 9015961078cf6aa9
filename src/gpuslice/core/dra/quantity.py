"""Resource quantities as the API server reads and writes them (``k8s.io/apimachinery``'s
resource.Quantity), and ResourceSlice specs compared by value."""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from gpuslice.core.errors import ValidationError

# -- quantities ----------------------------------------------------------------------------

_QUANTITY = re.compile(r"^([+-]?[0-9]+(?:\.[0-9]*)?|[+-]?\.[0-9]+)"
                       r"(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?$")
_SUFFIX = {None: Decimal(1), "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"),
           "k": Decimal(10) ** 3, "M": Decimal(10) ** 6, "G": Decimal(10) ** 9,
           "T": Decimal(10) ** 12, "P": Decimal(10) ** 15, "E": Decimal(10) ** 18,
           "Ki": Decimal(2) ** 10, "Mi": Decimal(2) ** 20, "Gi": Decimal(2) ** 30,
           "Ti": Decimal(2) ** 40, "Pi": Decimal(2) ** 50, "Ei": Decimal(2) ** 60}
_MAX_QUANTITY = Decimal(2) ** 63 - 1


def parse_quantity(value: object, fieldname: str) -> Decimal:
    """A Kubernetes quantity (``"16Gi"``, ``"25"``, ``"500m"``, ``"1e3"`` or a number),
    exactly, as a Decimal; a :class:`ValidationError` naming ``fieldname`` otherwise."""
    if isinstance(value, bool):
        raise ValidationError(fieldname, "a Kubernetes quantity", value)
    if isinstance(value, int):
        number = Decimal(value)
    elif not isinstance(value, str):
        raise ValidationError(fieldname, "a Kubernetes quantity such as 16Gi or 25", value)
    else:
        m = _QUANTITY.match(value.strip())
        if not m:
            raise ValidationError(fieldname, "a Kubernetes quantity such as 16Gi or 25", value)
        suffix = m.group(2)
        try:
            number = Decimal(m.group(1))
            if suffix not in _SUFFIX:  # an exponent (e3, E-2); "E" and "Ei" are suffixes
                number *= Decimal(10) ** int(suffix[1:])
            else:
                number *= _SUFFIX[suffix]
        except (ArithmeticError, ValueError):  # an exponent past Decimal's (or int's) range
            raise ValidationError(fieldname, "a Kubernetes quantity", value) from None
    if abs(number) > _MAX_QUANTITY:  # and arithmetic on it stays exact
        raise ValidationError(fieldname, "a quantity of at most 2^63-1 (an int64, as "
                              "Kubernetes holds it)", value)
    return number


def mib_quantity(mib: int) -> str:
    return f"{mib}Mi"


_BINARY = (("Ei", 60), ("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10))
_DECIMAL = (("E", 18), ("P", 15), ("T", 12), ("G", 9), ("M", 6), ("k", 3))


def canonical_quantity(value: object, fieldname: str = "quantity") -> str:
    """A quantity as kube-apiserver stores it (apimachinery ``Quantity.String`` of a parsed
    value): a binary-suffixed input keeps the largest binary suffix that leaves an integer
    (``81920Mi`` -> ``80Gi``), a decimal one the largest decimal suffix (``1000`` -> ``1k``),
    fractions in milli units (``0.5`` -> ``500m``)."""
    number = parse_quantity(value, fieldname)
    text = value.strip() if isinstance(value, str) else ""
    binary = text.endswith("i")
    if number == 0:
        return "0"
    if number != number.to_integral_value():
        milli = number * 1000
        if milli == milli.to_integral_value():
            return f"{int(milli)}m"
        return f"{int(-(-number * 10 ** 9 // 1))}n"
    n = int(number)
    for suffix, exp in (_BINARY if binary else ()):
        if n % (1 << exp) == 0:
            return f"{n >> exp}{suffix}"
    for suffix, exp in (() if binary else _DECIMAL):
        if n % 10 ** exp == 0:
            return f"{n // 10 ** exp}{suffix}"
    return str(n)


# where quantities sit in a ResourceSlice spec (compared by value, as apiequality.Semantic does)
def semantic_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A ResourceSlice spec with every quantity replaced by its exact value and the taints'
    ``timeAdded`` (set by the API server when missing) left out: two specs the API server
    treats as equal compare equal (the resourceslice controller's ``DevicesDeepEqual``)."""

    def q(v: object) -> str:
        try:
            return str(parse_quantity(v, "quantity").normalize())
        except ValidationError:
            return f"invalid:{v!r}"

    def counters(cs: Mapping[str, Any]) -> dict[str, Any]:
        return {k: q((c or {}).get("value")) for k, c in (cs or {}).items()}

    out = {k: v for k, v in spec.items() if k not in ("devices", "sharedCounters")}
    if "sharedCounters" in spec:
        out["sharedCounters"] = [{"name": s.get("name"), "counters": counters(
            s.get("counters") or {})} for s in spec.get("sharedCounters") or []]
    if "devices" in spec:
        devices = []
        for d in spec.get("devices") or []:
            dd = {k: v for k, v in d.items()
                  if k not in ("capacity", "taints", "consumesCounters")}
            caps = {}
            for name, c in (d.get("capacity") or {}).items():
                cc: dict[str, Any] = {"value": q((c or {}).get("value"))}
                pol = (c or {}).get("requestPolicy")
                if pol is not None:
                    rng = pol.get("validRange")
                    cc["requestPolicy"] = {
                        "default": q(pol["default"]) if "default" in pol else None,
                        "validValues": [q(v) for v in pol.get("validValues") or []],
                        "validRange": None if rng is None else {
                            k: q(rng[k]) for k in ("min", "max", "step") if k in rng}}
                caps[name] = cc
            if caps:
                dd["capacity"] = caps
            if d.get("taints"):
                dd["taints"] = [{k: v for k, v in t.items() if k != "timeAdded"}
                                for t in d["taints"]]
            if d.get("consumesCounters"):
                dd["consumesCounters"] = [{"counterSet": c.get("counterSet"),
                                           "counters": counters(c.get("counters") or {})}
                                          for c in d["consumesCounters"]]
            devices.append(dd)
        out["devices"] = devices
    return out
