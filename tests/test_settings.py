"""Settings: flags > env > file > defaults, and errors that name the setting."""

import pytest

from prefill_gate.proxy.cli import build_parser
from prefill_gate.proxy.settings import SettingsError, load_settings


def test_defaults():
    s = load_settings({}, environ={})
    assert s.upstreams == [] and s.large_prefill_tokens == 2048 and s.on_queue_timeout == "admit"
    # In front of stock vLLM: slice where it can be sliced; a paced engine: let long prompts go.
    assert s.slicing == "auto" and s.paced_admission == "admit"


def test_precedence_flags_over_env_over_file(tmp_path):
    cfg = tmp_path / "gate.yaml"
    cfg.write_text("large_prefill_tokens: 1000\nmax_queue_wait: 5\nupstreams: http://file:8000\nport: 9000\n")
    env = {"PREFILL_GATE_LARGE_PREFILL_TOKENS": "2000", "PREFILL_GATE_MAX_QUEUE_WAIT": "7",
           "PREFILL_GATE_PROTECT_NON_STREAMING": "true"}
    s = load_settings({"large_prefill_tokens": 3000}, config_file=cfg, environ=env)
    assert s.large_prefill_tokens == 3000  # flag
    assert s.max_queue_wait == 7.0  # env over file
    assert s.port == 9000  # file over default
    assert s.upstreams == ["http://file:8000"]
    assert s.protect_non_streaming is True


def test_config_file_from_env(tmp_path):
    cfg = tmp_path / "g.yaml"
    cfg.write_text("max_queue: 3\n")
    assert load_settings({}, environ={"PREFILL_GATE_CONFIG": str(cfg)}).max_queue == 3


def test_env_upstreams_are_comma_separated_and_normalised():
    s = load_settings({}, environ={"PREFILL_GATE_UPSTREAMS": "http://a:1/, http://b:2"})
    assert s.upstreams == ["http://a:1", "http://b:2"]


@pytest.mark.parametrize(
    "flags, env, message",
    [
        ({"large_prefill_tokens": 0}, {}, "setting large_prefill_tokens (from flag)"),
        ({}, {"PREFILL_GATE_MAX_QUEUE_WAIT": "soon"}, "setting max_queue_wait (from environment)"),
        ({"on_queue_timeout": "drop"}, {}, "setting on_queue_timeout (from flag)"),
        ({"upstreams": ["localhost:8000"]}, {}, "not an http(s) URL"),
        ({"upstreams": ["http://a", "http://a/"]}, {}, "listed twice"),
    ],
)
def test_bad_values_name_the_setting_and_source(flags, env, message):
    with pytest.raises(SettingsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_settings(flags, environ=env)


def test_unknown_key_in_file(tmp_path):
    cfg = tmp_path / "g.yaml"
    cfg.write_text("large_prefil_tokens: 10\n")
    with pytest.raises(SettingsError, match="unknown setting 'large_prefil_tokens' \\(from config file\\)"):
        load_settings({}, config_file=cfg, environ={})


@pytest.mark.parametrize("text, message", [("[1, 2]", "must hold a mapping"), ("a: [", "not valid YAML")])
def test_bad_file(tmp_path, text, message):
    cfg = tmp_path / "g.yaml"
    cfg.write_text(text)
    with pytest.raises(SettingsError, match=message):
        load_settings({}, config_file=cfg, environ={})


def test_missing_file():
    with pytest.raises(SettingsError, match="cannot read config file"):
        load_settings({}, config_file="/nonexistent/gate.yaml", environ={})


def test_cli_has_the_required_flags_and_one_per_setting():
    args = build_parser().parse_args(["serve", "--upstream", "http://a:1", "--upstream", "http://b:2",
                                      "--large-prefill-tokens", "4096", "--max-queue-wait", "12",
                                      "--no-protect-non-streaming"])
    assert args.upstreams == ["http://a:1", "http://b:2"]
    s = load_settings({k: getattr(args, k) for k in vars(args) if k not in ("func", "command", "config")},
                      environ={})
    assert s.large_prefill_tokens == 4096 and s.max_queue_wait == 12.0 and s.protect_non_streaming is False


def test_serve_exits_2_with_a_clear_message(capsys):
    from prefill_gate.proxy.cli import main

    assert main(["serve", "--large-prefill-tokens", "-5"]) == 2
    assert "setting large_prefill_tokens (from flag)" in capsys.readouterr().err


def test_cli_errors_are_one_line_and_exit_2(capsys):
    import socket

    from prefill_gate.proxy.cli import main

    cases = [["serve", "--sim-preset", "nope"], ["demo", "--preset", "nope"], ["demo", "--runs", "0"],
             ["bench", "overlap", "--runs", "0", "--base-url", "http://127.0.0.1:9"], ["sim", "--preset", "nope"]]
    for argv in cases:
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's own errors
            code = exc.code
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err, (argv, err)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = str(taken.getsockname()[1])
    for argv in (["sim", "--port", port], ["serve", "--port", port, "--upstream", "http://127.0.0.1:9"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "cannot listen" in err and "Traceback" not in err, err
    taken.close()


def test_help_lists_only_public_commands_and_every_option_says_what_it_does(capsys):
    from prefill_gate.proxy.cli import build_parser

    top = build_parser().format_help()
    assert "SUPPRESS" not in top and "``" not in top and "bench-upstream" not in top
    parser = build_parser()
    for argv in (["sim"], ["demo"], ["bench", "overlap"]):
        sub = parser
        for word in argv:
            sub = next(a for a in sub._actions if isinstance(a, __import__("argparse")._SubParsersAction)).choices[word]
        for action in sub._actions:
            assert action.help, (argv, action.dest)


def test_an_upstream_given_as_an_openai_base_url_is_accepted(caplog):
    from prefill_gate.proxy.settings import load_settings

    s = load_settings({"upstreams": ["http://127.0.0.1:8000/v1/", "http://h:1"]}, environ={})
    assert s.upstreams == ["http://127.0.0.1:8000", "http://h:1"]
    assert "adds /v1" in caplog.text
