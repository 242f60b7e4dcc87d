"""The documentation keeps up with the code: docs/configuration.md names every setting and
every Serve application arg (and nothing that is not one), the README stays short, and
every relative link in the README and docs/ leads to a file."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel

from cluster.runtime.settings import Settings
from workers.deployment import WorkerArgs
from workers.engines.config import EngineConfig
from workers.engines.simulated import SimulatedConfig

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
CONFIGURATION = ROOT / "docs" / "configuration.md"
README_MAX_LINES = 250
# CHARSERVE_ names that are not Settings fields, and what reads them.
OTHER_VARIABLES = {
    "CHARSERVE_LOG_TTL_S",  # reply_log_ttl_s's old name (cluster.runtime.settings)
    "CHARSERVE_API_KEY",  # the backfill CLI (cluster.backfill.cli)
    "CHARSERVE_BASE_URL",  # the backfill CLI
    "CHARSERVE_STEP_LOG",  # an engine core's step log (cluster.runtime.steplog)
}
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _quoted(path: Path) -> set[str]:
    """Everything in backticks in ``path``."""
    return set(re.findall(r"`([^`\n]+)`", path.read_text()))


def _missing(model: type[BaseModel], prefix: str, quoted: set[str]) -> list[str]:
    """Fields of ``model`` that do not appear as ```prefix + name``` in ``quoted``."""
    return [name for name in model.model_fields if prefix + name not in quoted]


def test_every_setting_and_arg_is_documented() -> None:
    quoted = _quoted(CONFIGURATION)
    assert not [n for n in Settings.model_fields if f"CHARSERVE_{n.upper()}" not in quoted]
    assert not _missing(WorkerArgs, "", quoted)
    assert not _missing(EngineConfig, "engine.", quoted)
    assert not _missing(SimulatedConfig, "simulated.", quoted)


def test_the_configuration_names_nothing_else() -> None:
    text = CONFIGURATION.read_text()
    known = {f"CHARSERVE_{n.upper()}" for n in Settings.model_fields} | OTHER_VARIABLES
    assert set(re.findall(r"CHARSERVE_[A-Z0-9_]*[A-Z0-9]", text)) <= known
    for prefix, model in (("engine", EngineConfig), ("simulated", SimulatedConfig)):
        named = set(re.findall(rf"`{prefix}\.(\w+)`", text))
        assert named <= set(model.model_fields), prefix


def test_the_readme_is_short() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    assert "make run" in text and "make test" in text


def test_relative_links_lead_to_files() -> None:
    broken = []
    for page in [README, *DOCS]:
        for target in LINK.findall(FENCE.sub("", page.read_text())):
            path = target.split("#", 1)[0]
            if path and "://" not in path and not path.startswith("mailto:"):
                if not (page.parent / path).exists():
                    broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken
