"""The documents a user decides from: the README fits a few screens and opens with the two
commands; every result it or a page of docs/ cites exists and records the commit it measured;
the settings reference is written from the code; every metric is documented."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RESULTS = ROOT / "bench" / "results"
_FULL = re.compile(r"bench/results/[\w./-]+?\.(?:json|png|txt|log|tar\.gz|md)\b")
_BARE = re.compile(r"(?<![\w/.-])([\w.-]+\.json)\b")


def _commit(path: Path) -> str | None:
    """The commit a result file records (``git_commit``; a merged file: every part's)."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        return None
    if data.get("git_commit"):
        return data["git_commit"]
    parts = data.get("parts")
    if isinstance(parts, list) and parts and all(isinstance(p, dict) and p.get("git_commit") for p in parts):
        return parts[0]["git_commit"]
    return None


def _folder_records_a_commit(folder: Path) -> bool:
    return any(_commit(f) for f in folder.glob("*.json"))


def test_the_readme_opens_with_the_two_commands_and_fits_a_few_screens():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```\n(.*?)```", text, re.S)
    assert "prefill-gate demo" in blocks[0] and blocks[1].strip() == "bash scripts/test.sh"
    assert (ROOT / ".ci" / "run").read_text().strip().endswith("bash scripts/test.sh")
    assert len(text.splitlines()) <= 250


def test_every_cited_result_exists_and_records_its_commit():
    cited: dict[str, set[str]] = {}
    for doc in DOCS:
        text = doc.read_text()
        for path in _FULL.findall(text):
            cited.setdefault(path, set()).add(doc.name)
        for name in _BARE.findall(text):
            cited.setdefault(name, set()).add(doc.name)
    problems = []
    for ref, where in sorted(cited.items()):
        if ref.startswith("bench/results/"):
            path = ROOT / ref
            if not path.exists():
                problems.append(f"{ref} (cited in {sorted(where)}) does not exist")
            elif path.suffix == ".json" and not _commit(path):
                problems.append(f"{ref} (cited in {sorted(where)}) records no commit")
            elif path.suffix != ".json" and path.name != "README.md" and not _folder_records_a_commit(path.parent):
                problems.append(f"{ref} (cited in {sorted(where)}): nothing in its folder records a commit")
        else:  # a result named by its file name alone: every file of that name must record one
            matches = list(RESULTS.rglob(ref))
            if not matches:
                continue  # not a result file (a config, a schema): nothing to check
            problems += [f"{m.relative_to(ROOT)} (cited as {ref} in {sorted(where)}) records no commit"
                         for m in matches if not _commit(m)]
    assert not problems, "\n".join(problems)


def test_the_check_can_fail():
    """(The checks above read real files: one without a commit is caught.)"""
    assert _commit(RESULTS / "h200" / "direct-8192.json") is None
    assert _commit(RESULTS / "defaults" / "h200" / "defaults.json")


def test_the_configuration_reference_is_written_from_the_settings():
    from prefill_gate.proxy.settings import GROUPS, Settings
    from prefill_gate.proxy.settings_doc import markdown

    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == markdown(), "run: python -m prefill_gate.proxy.settings_doc > docs/configuration.md"
    grouped = [name for _, names in GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(Settings.model_fields) and len(grouped) == len(set(grouped))
    essentials = GROUPS["Essentials"][1]
    readme = (ROOT / "README.md").read_text()
    for name in essentials:  # the README's six, by their flags
        flag = "--upstream" if name == "upstreams" else "--" + name.replace("_", "-")
        assert f"`{flag}" in readme, name


def test_every_metric_is_documented_with_its_labels():
    from prometheus_client import CollectorRegistry

    from prefill_gate.proxy.metrics import Metrics

    page = (ROOT / "docs" / "metrics.md").read_text()
    section = page[page.index("## The proxy's metrics"):page.index("## Dashboards")]
    registry = CollectorRegistry()
    m = Metrics(registry, ["u"])
    m.slice_settle_seconds.labels("u").inc(0)  # (labels appear once used)
    for family in registry.collect():
        name = family.name.removeprefix("prefill_gate_") + ("_total" if family.type == "counter" else "")
        labels = sorted({k for s in family.samples for k in s.labels} - {"le"})
        assert f"`{name}" in section, name
        for label in labels:
            assert label in section[section.index(f"`{name}"):].split("`")[1], (name, label)


def test_the_docs_link_to_pages_that_exist():
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)} links to {target}"
