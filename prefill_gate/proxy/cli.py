"""prefill-gate: keep streaming answers smooth on vLLM while long prompts prefill.

Commands: serve (the proxy), sim (the engine simulator), bench (overlap, mixed, defaults,
mixed-report, agent, overhead), demo (simulator and proxy side by side), hash-key.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import socket
import sys
import typing

from . import collector
from .settings import GROUPS, Settings, SettingsError, load_settings

log = logging.getLogger("prefill_gate")


# ------------------------------------------------------------------------ serve
def _add_settings_flags(p: argparse.ArgumentParser) -> None:
    """One flag per setting, generated from the model so that none is forgotten, in the
    groups of ``settings.GROUPS`` (docs/configuration.md lists them alike)."""
    p.add_argument("--config", help="YAML file with settings (flags > PREFILL_GATE_* env > file > defaults)")
    for title, (blurb, names) in GROUPS.items():
        group = p.add_argument_group(title.lower(), blurb)
        for name in names:
            field = Settings.model_fields[name]
            flag = "--" + name.replace("_", "-")
            help_ = field.description
            if name == "upstreams":
                group.add_argument("--upstream", dest="upstreams", action="append", metavar="URL", help=help_)
            elif field.annotation is bool:
                group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_)
            else:
                choices = (typing.get_args(field.annotation) if typing.get_origin(field.annotation) is typing.Literal
                           else None)
                group.add_argument(flag, dest=name, default=None, metavar=name.upper() if choices is None else None,
                                   choices=choices, help=f"{help_} (default: {field.default})")


class CliError(Exception):
    """A command cannot run as asked: one line on stderr, exit code 2."""


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _free_socket(host: str = "127.0.0.1") -> socket.socket:
    return _bind(host, 0)


async def _serve(settings: Settings) -> None:
    import uvicorn

    from .app import build_state, create_app
    from .listener import server_config

    try:
        listen = _bind(settings.host, settings.port)
    except OSError as exc:
        raise CliError(f"cannot listen on {settings.host}:{settings.port}: {exc.strerror}") from None
    servers = []
    if not settings.upstreams:
        from .sim import build_engine
        from .sim.server import create_sim_app

        engine, preset = build_engine(settings.sim_preset)
        sock = _free_socket()
        url = "http://127.0.0.1:%d" % sock.getsockname()[1]
        log.warning("no --upstream given: running the built-in engine simulator (preset %s) at %s as the upstream",
                    preset.name, url)
        sim = uvicorn.Server(uvicorn.Config(create_sim_app(engine), log_level="warning", lifespan="on"))
        servers.append(sim.serve(sockets=[sock]))
        settings = settings.model_copy(update={"upstreams": [url]})
    state = build_state(settings)
    app = create_app(state, start_workers=True)
    log.info("prefill-gate on http://%s:%d -> %s (large prefill >= %d tokens, max queue wait %g s, %s relay core)",
             settings.host, settings.port, ", ".join(settings.upstreams), settings.large_prefill_tokens,
             settings.max_queue_wait, state.relay_core)
    # uvicorn stops accepting on SIGTERM/SIGINT and waits for open requests; ours end them
    # with an error once shutdown_grace has passed, a little before uvicorn would cut them.
    proxy = uvicorn.Server(server_config(app, settings, host=settings.host, port=settings.port,
                                         log_level=settings.log_level, lifespan="on",
                                         timeout_graceful_shutdown=settings.shutdown_grace + 5))
    servers.append(proxy.serve(sockets=[listen]))
    if settings.metrics_port is not None:
        from .app import create_metrics_app

        metrics = uvicorn.Server(uvicorn.Config(create_metrics_app(state), host=settings.metrics_host,
                                                port=settings.metrics_port, log_level="warning", lifespan="off"))
        servers.append(metrics.serve())
    # What exists now (modules, settings, the app) lives as long as the process: out of the
    # cycle collector's sight, a full collection scans only what requests made. With 512
    # streams, full collections over the startup heap stalled every stream 36-106 ms
    # (bench/relay_router.py; the old docs/RESULTS.md (in git history) section 3). And full collections run only
    # while no request is in progress (at most every 10 s), or every few minutes under load
    # that never pauses (prefill_gate/proxy/collector.py).
    busy = lambda: bool(state.exchanges)  # noqa: E731 (requests in progress)
    stop_collector = collector.manage(busy)
    state.metrics.watch_gc(busy=busy)
    drain = asyncio.create_task(_drain_on_exit(proxy, state, settings.shutdown_grace))
    try:
        await asyncio.gather(*servers)
    finally:
        drain.cancel()
        stop_collector()


async def _drain_on_exit(server, state, grace: float) -> None:
    """After SIGTERM: let requests in progress finish for ``grace`` seconds, then end them."""
    loop = asyncio.get_running_loop()
    while not server.should_exit:
        await asyncio.sleep(0.1)
    log.info("shutting down: %d requests in progress get %g s to finish", len(state.exchanges), grace)
    deadline = loop.time() + grace
    while state.exchanges and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if state.exchanges:
        log.warning("shutdown grace over: ending %d requests with an error", state.end_exchanges())


def _strip_query(record: logging.LogRecord) -> bool:
    """Access-log lines without query strings: a key sent as ``?api_key=...`` stays out of logs."""
    args = record.args
    if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
        record.args = args[:2] + (args[2].split("?", 1)[0] + "?...",) + args[3:]
    return True


def _one_line_for_bad_http(record: logging.LogRecord) -> bool:
    """A malformed request from a client is one warning line, not a traceback per request."""
    if record.getMessage().startswith("Invalid HTTP request"):
        record.exc_info = record.exc_text = None
    return True


def cmd_serve(args: argparse.Namespace) -> int:
    flags = {name: getattr(args, name, None) for name in Settings.model_fields}
    try:
        settings = load_settings(flags, config_file=args.config)
    except SettingsError as exc:
        print(f"prefill-gate: {exc}", file=sys.stderr)
        return 2
    if settings.api_keys_file:
        from .auth import KeyCheck, KeysFileError

        try:
            KeyCheck.from_file(settings.api_keys_file)
        except KeysFileError as exc:
            print(f"prefill-gate: {exc}", file=sys.stderr)
            return 2
    from .relaycore import CoreMissing, relay_factory

    try:
        relay_factory(settings.relay_core)
    except CoreMissing as exc:
        print(f"prefill-gate: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from prometheus_client import disable_created_metrics

    disable_created_metrics()  # half of /metrics was *_created series nobody graphs
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream request is noise
    logging.getLogger("uvicorn.access").addFilter(_strip_query)
    logging.getLogger("uvicorn.error").addFilter(_one_line_for_bad_http)
    run_loop(_serve(settings))
    return 0


def run_loop(coro) -> None:
    """Run on uvloop when it is installed (uvicorn[standard]); it relays chunks with
    less CPU than asyncio's selector loop."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)


# -------------------------------------------------------------------------- sim
def cmd_sim(args: argparse.Namespace) -> int:
    import uvicorn

    from .sim import build_engine
    from .sim.server import create_sim_app

    overrides = {k: getattr(args, k) for k in ("max_num_batched_tokens", "max_num_seqs", "long_prefill_token_threshold",
                                                "block_size", "pacing_cap", "pacing_short_tokens",
                                                "pacing_long_min_share") if getattr(args, k) is not None}
    if args.pacing_sub_block:
        overrides["pacing_sub_block"] = True
    if args.pacing_short_when_idle:
        overrides["pacing_short_when_idle"] = True
    if args.no_prefix_caching:
        overrides["enable_prefix_caching"] = False
    cost = {f.name: getattr(args, "cost_" + f.name) for f in _cost_fields() if getattr(args, "cost_" + f.name) is not None}
    try:
        engine, preset = build_engine(args.preset, engine=overrides, cost=cost, time_scale=args.time_scale,
                                      seed=args.seed)
    except ValueError as exc:
        print(f"prefill-gate sim: {exc}", file=sys.stderr)
        return 2
    try:
        sock = _bind(args.host, args.port)
    except OSError as exc:
        raise CliError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}") from None
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("simulator preset %s (%s), %s, %s", preset.name, preset.source, engine.config, engine.cost)
    host, port = sock.getsockname()[:2]
    log.info("simulator listening on http://%s:%d (model %r)", f"[{host}]" if ":" in host else host, port,
             args.served_model_name)
    server = uvicorn.Server(uvicorn.Config(create_sim_app(engine, model=args.served_model_name), log_level="warning"))
    asyncio.run(server.serve(sockets=[sock]))
    return 0


def _cost_fields():
    from .sim.engine import CostModel

    return dataclasses.fields(CostModel)


# ------------------------------------------------------------------------ bench
def cmd_bench_overlap(args: argparse.Namespace) -> int:
    from .bench.overlap import Shape, run_overlap
    from .bench.report import OVERLAP_COLUMNS, environment, plot_overlap, table, write_json

    shape = Shape(long_tokens=args.long_tokens, b_tokens=args.b_tokens, a_tokens=args.a_tokens,
                  a_after_b_tokens=args.a_after)
    try:
        result = asyncio.run(run_overlap(args.base_url, args.model, shape, runs=args.runs, seed=args.seed))
    except Exception as exc:  # a failed run is reported, not a traceback
        print(f"prefill-gate bench overlap: {exc}", file=sys.stderr)
        return 1
    result["config"] = args.label or args.base_url
    result.update(environment())
    print(table([result], OVERLAP_COLUMNS))
    if args.json:
        write_json(args.json, result)
    if args.plot:
        plot_overlap([result], args.plot)
    return 0


def cmd_bench_mixed(args: argparse.Namespace) -> int:
    from .bench.mixed_report import main as mixed_main

    return mixed_main(args)


def cmd_bench_mixed_report(args: argparse.Namespace) -> int:
    from .bench.mixed_report import main_report

    return main_report(args)


def cmd_bench_defaults(args: argparse.Namespace) -> int:
    from .bench.defaults import main as defaults_main

    return defaults_main(args)


def cmd_bench_short(args: argparse.Namespace) -> int:
    from .bench.short import main as short_main

    return short_main(args)


def cmd_bench_agent(args: argparse.Namespace) -> int:
    from .bench.agent import main as agent_main

    return agent_main(args)


def cmd_bench_overhead(args: argparse.Namespace) -> int:
    from .bench.overhead import main as overhead_main

    return overhead_main(args)


def cmd_bench_upstream(args: argparse.Namespace) -> int:
    from .bench.overhead import serve_stamp

    serve_stamp(args.port, args.procs)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .bench.demo import main as demo_main

    return demo_main(args)


# ------------------------------------------------------------------------- main
def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _presets() -> list[str]:
    from .sim.presets import PRESETS

    return sorted(PRESETS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefill-gate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    defaults = argparse.ArgumentDefaultsHelpFormatter

    p = sub.add_parser("serve", help="run the proxy (with no --upstream: in front of the built-in simulator)")
    _add_settings_flags(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("sim", help="run the vLLM-like engine simulator", formatter_class=defaults)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free one, logged)")
    p.add_argument("--preset", default="h200-qwen3-8b", choices=_presets(), help="cost model and engine settings")
    p.add_argument("--served-model-name", default="sim", help="the model name it answers to")
    p.add_argument("--max-num-batched-tokens", type=positive_int, help="tokens per step (vLLM's flag; "
                   "default: the preset's)")
    p.add_argument("--max-num-seqs", type=positive_int, help="requests running at once (default: the preset's)")
    p.add_argument("--long-prefill-token-threshold", type=int, help="vLLM's flag: cap a long prompt's chunk "
                   "(0: off; default: the preset's)")
    p.add_argument("--pacing-cap", type=int, help="act like engine_patches' cap mode: at most N prefill "
                                                  "tokens per step while a request decodes")
    p.add_argument("--pacing-short-tokens", type=int, metavar="N",
                   help="with --pacing-cap: prompts with at most N uncached tokens left go before longer "
                        "ones in a capped step, as engine_patches' PREFILL_GATE_PACING_SHORT_TOKENS "
                        "(0: arrival order; default 1024)")
    p.add_argument("--pacing-long-min-share", type=float, metavar="X",
                   help="with --pacing-cap: the least share of a capped step a long prompt keeps "
                        "(PREFILL_GATE_PACING_LONG_MIN_SHARE; default 0.5)")
    p.add_argument("--pacing-sub-block", action="store_true",
                   help="with --pacing-cap on an align-mode preset (a hybrid): a capped step may end a "
                        "chunk inside a KV block, as PREFILL_GATE_PACING_SUB_BLOCK=1")
    p.add_argument("--pacing-short-when-idle", action="store_true",
                   help="with --pacing-cap: with nothing decoding, a short prompt beside a long prefill caps "
                        "the step short-first too, as PREFILL_GATE_PACING_SHORT_WHEN_IDLE=1")
    p.add_argument("--block-size", type=positive_int, help="KV block size in tokens (default: the preset's)")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn automatic prefix caching off")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply every step time (2: twice as slow)")
    p.add_argument("--seed", type=int, default=0, help="seed of the step-time jitter and answer text")
    for f in _cost_fields():
        p.add_argument("--cost-" + f.name.replace("_", "-"), dest="cost_" + f.name, type=float,
                       help=f"override the preset's cost-model field {f.name} (seconds; jitter: a log sigma, "
                       "eager_tail: a share)")
    p.set_defaults(func=cmd_sim)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    p = bench.add_parser("overlap", help="decode ITL while a long prompt prefills (the seed shape)",
                         formatter_class=defaults,
                         description="The seed pair: stream B decodes; when B has streamed --a-after tokens, "
                         "long prompt A arrives. Measures B's gaps and A's time, each also alone.")
    p.add_argument("--base-url", required=True, help="an OpenAI-compatible server (with or without /v1)")
    p.add_argument("--model", help="model name (default: the first of /v1/models)")
    p.add_argument("--long-tokens", type=positive_int, default=28600, help="A's prompt tokens")
    p.add_argument("--b-tokens", type=positive_int, default=512, help="tokens B streams")
    p.add_argument("--a-tokens", type=positive_int, default=58, help="tokens A's answer streams")
    p.add_argument("--a-after", type=positive_int, default=64, help="send A when B has streamed this many tokens")
    p.add_argument("--runs", type=positive_int, default=1, help="repetitions (reported as a range)")
    p.add_argument("--seed", type=int, default=None, help="prompt text seed (default: fresh each call)")
    p.add_argument("--label", help="config name recorded in the JSON (default: the base URL)")
    p.add_argument("--json", help="write the result here")
    p.add_argument("--plot", help="write B's gaps over time here (PNG)")
    p.set_defaults(func=cmd_bench_overlap)

    p = bench.add_parser("mixed", help="steady load: desynchronised interactive users + long prompts at random, "
                                       "per-class latency and goodput")
    from .bench.mixed_report import add_arguments as mixed_arguments

    mixed_arguments(p)
    p.set_defaults(func=cmd_bench_mixed)
    p = bench.add_parser("mixed-report", help="tables and plot of saved bench mixed results, merged")
    p.add_argument("files", nargs="+", metavar="F.json")
    p.add_argument("--json", help="write the merged result here")
    p.add_argument("--plot", help="write the CDFs here (PNG)")
    p.set_defaults(func=cmd_bench_mixed_report)

    p = bench.add_parser("defaults", help="what the defaults give: vLLM direct, holding, the proxy's and the "
                                          "stack's defaults, on the seed pair, sparse users and steady load",
                         formatter_class=defaults)
    from .bench.defaults import add_arguments as defaults_arguments

    defaults_arguments(p)
    p.set_defaults(func=cmd_bench_defaults)

    p = bench.add_parser("short", help="what one new short prompt costs the live streams (a hybrid model's "
                                       "hard case)", formatter_class=defaults)
    from .bench.short import add_arguments as short_arguments

    short_arguments(p)
    p.set_defaults(func=cmd_bench_short)

    p = bench.add_parser("agent", help="agent workloads: a growing conversation, two upstreams, a paced engine",
                         formatter_class=defaults)
    p.add_argument("--preset", default="h200-qwen3-8b", choices=_presets(), help="the simulator preset")
    p.add_argument("--time-scale", type=float, default=1.0, help="run the simulator this many times slower")
    p.add_argument("--pacing-cap", type=int, default=256, help="the paced engine's prefill cap (scenario 3)")
    p.add_argument("--slo-ms", type=float, default=25.0, help="the closed loop's ITL SLO (scenario 3)")
    p.add_argument("--json", help="write the result here")
    p.set_defaults(func=cmd_bench_agent)
    p = bench.add_parser("overhead", help="the proxy's own added latency and relay rate")
    p.add_argument("--streams", default="1,100,500", help="concurrent streams, comma-separated")
    p.add_argument("--tokens", type=int, default=128, help="chunks per stream")
    p.add_argument("--proxy-cpu", type=int, default=None, metavar="N",
                   help="pin the proxy to CPU N and the upstream and load generator to the others "
                        "(a machine with spare cores: the proxy's own rate, not the machine's)")
    p.add_argument("--load-procs", type=int, default=1, metavar="N",
                   help="load-generator processes (one tops out near 5,000 chunks/s)")
    p.add_argument("--upstream-procs", type=int, default=1, metavar="N", help="stamping upstream processes")
    p.add_argument("--ramp", default=None, metavar="RATES",
                   help="total chunk rates for the 100-stream ramp, comma-separated (default 2,000 to "
                        "30,000); it stops at the first one not kept up")
    p.add_argument("--json")
    p.set_defaults(func=cmd_bench_overhead)

    p = sub.add_parser("demo", help="simulator + proxy: the starvation and the fix, side by side",
                       formatter_class=defaults)
    p.add_argument("--preset", default="h200-qwen3-8b", choices=_presets(), help="the simulator preset")
    p.add_argument("--runs", type=positive_int, default=1, help="runs of the seed pair each way")
    p.add_argument("--out", default="out/demo", help="folder for demo.json and demo.png")
    p.add_argument("--time-scale", type=float, default=1.0, help="run the simulator this many times slower")
    p.add_argument("--compare", metavar="DIR", help="also compare with measured direct-8192/proxy-8192 JSON in DIR")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("hash-key", help="read an API key on stdin, print its line for api_keys_file")
    p.set_defaults(func=cmd_hash_key)
    return parser


def cmd_hash_key(args: argparse.Namespace) -> int:
    from .auth import hash_key

    key = sys.stdin.read().strip()
    if not key:
        print("prefill-gate hash-key: no key on stdin", file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0


def main(argv: typing.Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench-upstream"]:  # the overhead bench's stamping upstream: internal, unlisted
        p = argparse.ArgumentParser(prog="prefill-gate bench-upstream")
        p.add_argument("--port", type=int, required=True)
        p.add_argument("--procs", type=int, default=1)
        return cmd_bench_upstream(p.parse_args(argv[1:]))
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except CliError as exc:
        print(f"prefill-gate {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
