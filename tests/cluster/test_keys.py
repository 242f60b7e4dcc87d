"""Every Redis key is spelled in cluster/wire/keys.py and nowhere else."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from redis.crc import key_slot

from cluster.wire.keys import Keys

ROOT = Path(__file__).resolve().parents[2]
KEYS_MODULE = ROOT / "cluster" / "wire" / "keys.py"


def _product_modules() -> list[Path]:
    return [
        p
        for package in ("cluster", "gateway", "workers")
        for p in sorted((ROOT / package).rglob("*.py"))
        if p != KEYS_MODULE
    ]


def _names_namespace(node: ast.expr) -> bool:
    """True for an expression such as ``namespace`` or ``self._keys.namespace``."""
    if isinstance(node, ast.Name):
        return "namespace" in node.id
    if isinstance(node, ast.Attribute):
        return "namespace" in node.attr
    return False


def _spelled_keys(source: str) -> list[int]:
    """Lines that build a key from a namespace, or spell the default namespace's prefix."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.JoinedStr):
            values = [v.value for v in node.values if isinstance(v, ast.FormattedValue)]
            if any(_names_namespace(v) for v in values):
                found.append(node.lineno)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.startswith((f"{Keys().namespace}:", f"{{{Keys().namespace}}}:")):
                found.append(node.lineno)
    return found


def test_no_key_prefix_is_spelled_outside_keys_py() -> None:
    offenders = {
        str(p.relative_to(ROOT)): lines
        for p in _product_modules()
        if (lines := _spelled_keys(p.read_text()))
    }
    assert offenders == {}, f"Redis keys spelled outside {KEYS_MODULE.name}: {offenders}"


def test_the_check_finds_a_spelled_key() -> None:
    assert _spelled_keys('k = f"{self._keys.namespace}:session:{t}"\n') == [1]
    assert _spelled_keys('k = "charserve:queue"\n') == [1]
    assert _spelled_keys('k = "{charserve}:queue"\n') == [1]
    assert _spelled_keys("k = self._keys.session(t, s)\n") == []


def _every_key(keys: Keys) -> list[str]:
    out = []
    for name, member in inspect.getmembers(Keys):
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            out.append(getattr(keys, name))
        elif inspect.isfunction(member):
            params = list(inspect.signature(member).parameters)[1:]
            out.append(getattr(keys, name)(*(f"<{p}>" for p in params)))
    return out


def test_every_key_is_under_the_namespace_and_distinct() -> None:
    keys = _every_key(Keys("ns"))
    assert len(keys) > 30
    assert all(k.startswith("{ns}:") for k in keys), keys
    assert len(set(keys)) == len(keys), sorted(keys)


def test_every_key_of_a_deployment_is_in_one_cluster_slot() -> None:
    # Redis Cluster refuses a script whose keys span slots (CROSSSLOT): the namespace is
    # the hash tag, so the slot is the namespace's, and keys a script builds from a
    # prefix (the tenant queues) share it too.
    for namespace in ("charserve", "cell-7"):
        keys = Keys(namespace)
        slots = {key_slot(k.encode()) for k in _every_key(keys)}
        slots.add(key_slot(f"{keys.tenant_queue_prefix}interactive:alice".encode()))
        assert slots == {key_slot(namespace.encode())}
