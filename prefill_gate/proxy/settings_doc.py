"""docs/configuration.md, written from the settings model so that it cannot drift from it.

    python -m prefill_gate.proxy.settings_doc > docs/configuration.md

Every setting, by the task it serves (``settings.GROUPS``), with its flag, environment
variable, default and meaning; ``tests/test_settings.py`` checks the committed file is this
output.
"""

from __future__ import annotations

import typing

from .settings import ENV_PREFIX, GROUPS, Settings

HEADER = """# Configuration

Every setting of `prefill-gate serve`, by the task it serves. Each one has the same name in
three places: a flag (`--large-prefill-tokens`), an environment variable
(`PREFILL_GATE_LARGE_PREFILL_TOKENS`) and a key of a YAML file given with `--config FILE` (or
`PREFILL_GATE_CONFIG`). Flags win over the environment, the environment over the file, the
file over the defaults; a bad value stops the start with a message that names the setting and
where it came from. In Docker Compose every `PREFILL_GATE_*` line of `.env` reaches the proxy.

(Written by `python -m prefill_gate.proxy.settings_doc`; `prefill-gate serve --help` lists the
same settings in the same groups.)
"""


def _default(name: str) -> str:
    field = Settings.model_fields[name]
    if name == "upstreams":
        return "none: the built-in simulator"
    value = field.get_default(call_default_factory=True)
    return "unset" if value is None else f"`{value}`"


def _flag(name: str) -> str:
    if name == "upstreams":
        return "`--upstream URL` (repeat)"
    field = Settings.model_fields[name]
    flag = "--" + name.replace("_", "-")
    if field.annotation is bool:
        return f"`{flag}` / `--no-{flag[2:]}`"
    choices = typing.get_args(field.annotation) if typing.get_origin(field.annotation) is typing.Literal else ()
    return f"`{flag} {{{','.join(choices)}}}`" if choices else f"`{flag} {name.upper()}`"


def _env(name: str) -> str:
    suffix = " (comma-separated)" if name == "upstreams" else ""
    return f"`{ENV_PREFIX}{name.upper()}`{suffix}"


def markdown() -> str:
    out = [HEADER]
    for title, (blurb, names) in GROUPS.items():
        out.append(f"\n## {title}\n\n{blurb}\n\n| setting | flag | environment | default | meaning |\n|---|---|---|---|---|")
        for name in names:
            meaning = Settings.model_fields[name].description.replace("|", "\\|")
            out.append(f"| `{name}` | {_flag(name)} | {_env(name)} | {_default(name)} | {meaning} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
