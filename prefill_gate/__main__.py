"""``python -m prefill_gate``: the ``prefill-gate`` command."""

from prefill_gate.proxy.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
