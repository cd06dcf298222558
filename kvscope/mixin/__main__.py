"""``python -m kvscope.mixin``: write grafana/ from the generator, check it, or print a
PrometheusRule manifest. Exit code 1 from ``--check`` when committed files differ, or files the
generator does not make sit beside its own."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from kvscope.files import write_atomic
from kvscope.mixin.config import MixinConfigError, load_config

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "grafana"


def stale(out: Path, files: dict[str, str]) -> list[str]:
    """Generated files whose committed text differs (or that are missing)."""
    return [rel for rel, text in files.items()
            if not (out / rel).is_file() or (out / rel).read_text(encoding="utf-8") != text]


def strays(out: Path, files: dict[str, str]) -> list[str]:
    """Files beside the generated ones, of their kinds, that the generator does not make (a
    board renamed away): Grafana's and Prometheus' provisioning would load them too."""
    made = set(files)
    kinds = {(Path(rel).parent, Path(rel).suffix) for rel in files}
    return sorted(str(folder / path.name) for folder, suffix in kinds
                  for path in (out / folder).glob(f"*{suffix}")
                  if str(folder / path.name) not in made)


def _namespace(value: str) -> str:
    """A Kubernetes namespace: an RFC 1123 label (lowercase letters, digits and '-', at most 63
    characters, a letter or digit at each end); argparse reports the flag otherwise."""
    if not re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?", value):
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a Kubernetes namespace (lowercase letters, digits and '-', at "
            "most 63 characters)")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvscope.mixin",
        description="Write grafana/'s recording rules, alerts and dashboards from the "
                    "generator, check them, or print a PrometheusRule manifest (grafana/tests, "
                    "the promtool tests, and grafana/provisioning are written by hand). Exit "
                    "code 1 from --check when committed files differ, or files the generator "
                    "does not make sit beside its own.")
    parser.add_argument("--config", metavar="FILE", help="TOML file of MixinConfig overrides")
    parser.add_argument("--output", metavar="DIR", default=str(DEFAULT_OUT),
                        help="mixin directory to write (default: the repository's grafana/)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; fail when committed files differ from the generator")
    parser.add_argument("--prometheus-rule", action="store_true",
                        help="print a Prometheus Operator PrometheusRule to stdout instead")
    parser.add_argument("--namespace", type=_namespace,
                        help="PrometheusRule namespace (with --prometheus-rule; default "
                             "monitoring)")
    args = parser.parse_args(argv)
    # flags one mode reads and the other ignores: said, not silently dropped
    if args.prometheus_rule and args.check:
        parser.error("--check checks the files in --output; --prometheus-rule prints a "
                     "manifest to stdout: give one")
    if args.namespace is not None and not args.prometheus_rule:
        parser.error("--namespace names the PrometheusRule's namespace: give it with "
                     "--prometheus-rule")
    try:  # after parsing: --help needs none of the generator's packages
        from kvscope.mixin.render import prometheus_rule, render
    except ImportError as exc:
        print(f"kvscope.mixin: error: {exc}: the generator needs the mixin extra "
              "(pip install -e '.[mixin]')", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config)
    except OSError as exc:  # as the agent says it: [Errno 2] and a repr read as a crash
        print(f"kvscope.mixin: error: cannot read config {args.config}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return 2
    except (MixinConfigError, ValueError) as exc:
        print(f"kvscope.mixin: error: {exc}", file=sys.stderr)
        return 2
    if args.prometheus_rule:
        sys.stdout.write(prometheus_rule(cfg, namespace=args.namespace or "monitoring"))
        return 0
    out, files = Path(args.output), render(cfg)
    extra = strays(out, files)
    for rel in extra:
        print(f"not generated: {out / rel} (provisioning would load it too; remove it)",
              file=sys.stderr)
    if args.check:
        diff = stale(out, files)
        again = ("python -m kvscope.mixin" + (f" --config {args.config}" if args.config else "")
                 + (f" --output {args.output}" if args.output != str(DEFAULT_OUT) else ""))
        for rel in diff:
            said = "stale" if (out / rel).is_file() else "missing"
            print(f"{said}: {out / rel} (run {again})", file=sys.stderr)
        if not (diff or extra):  # silence read as "did it run?" (a tryout's)
            print(f"up to date: the {len(files)} generated files in {out}")
        return 1 if diff or extra else 0
    # every directory first: a file in the way of the third left the first two files written
    for folder in sorted({(out / rel).parent for rel in files}):
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # e.g. --output, or a folder in it, names a file
            blocking = next((p for p in (folder, *folder.parents)
                             if p.exists() and not p.is_dir()), None)
            why = (f"{blocking} is a file, not a directory" if blocking is not None
                   else exc.strerror or str(exc))
            print(f"kvscope.mixin: error: cannot create {folder}: {why} (--output is the "
                  "directory to write the mixin into); nothing written", file=sys.stderr)
            return 2
    for rel, text in files.items():
        path = out / rel
        try:
            write_atomic(path, text)
        except OSError as exc:
            print(f"kvscope.mixin: error: cannot write {path}: {exc.strerror or exc}",
                  file=sys.stderr)
            return 2
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
