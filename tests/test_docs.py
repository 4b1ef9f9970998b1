"""Every command in README.md, docs/**/*.md and scripts/README.md is checked against the program it names, fast (one subprocess).

Commands are taken from every fenced code block tagged bash / sh / shell / console (backslash continuations
joined, `# comments` dropped, `NAME=value` lines kept as variables for later lines of the block, `$(...)`
checked as a command of its own and replaced by a placeholder path) and from every inline code span that
starts like a command (`python -m ...`, `bash scripts/...`, `pip ...`, `sglang serve ...`). Each segment of a
line (`&&`, `||`, `;`, `|`) is checked by its program:

- `python -m sglang.launch_server`, `sglang serve`, `python -m mfd_sglang.cpu.launch_server`: SGLang 0.5.23's own
  `prepare_server_args` (its real parser, `ServerArgs.add_cli_args`, with the plugin's `--mfd-*` flags added
  by `load_plugins()`, and `from_cli_args`, which refuses `--mfd-*` flags on a server without MFD); the CPU
  launcher's defaults applied first, as it does;
- `python -m mfd_sglang SUBCOMMAND` (and `mfd-sglang`): `mfd_sglang.cli.build_parser()`;
- `python benchmarks/X.py`, `python scripts/X.py` and the modules of `MODULES` (`python -m
  sglang.benchmark.serving`): the script or module run as `__main__` until its own
  `ArgumentParser.parse_args`, which is stopped right after parsing (nothing else of it runs);
- `bash scripts/X.sh`: the script exists; `demo.sh`'s arguments through `mfd_sglang demo`'s parser,
  `gpu_check.sh`'s through `benchmarks/gpu_check.py`'s, `test.sh`'s as pytest paths; any other script's
  options and words must be ones its text handles, and an environment variable set before it one it reads;
- `pip`, `hf`: the subcommand's own `--help` must list every option given; `pytest`: the paths exist.

Every `--flag` must be spelled out in full (argparse would accept an abbreviation). Programs not checked are in
ALLOWED below, each with its reason; anything else fails. Besides: inline code spans that are flags
(`--mfd-auto-budget`) must be flags that some parser or script of the project knows; every relative Markdown
link must resolve (file and heading anchor); the README stays short and carries the test command `.ci/run` runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), REPO / "scripts" / "README.md"]
PLACEHOLDER = "/tmp/mfd-docs-placeholder"
SHELL_LANGS = {"bash", "sh", "shell", "console"}
PYTHONS = {"python", "python3", ".venv/bin/python"}
COMMAND_START = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:python3?|\.venv/bin/python|sglang|bash|pip|mfd-sglang|hf|pytest)\s")

# Modules run with `python -m` whose own argparse parser checks their arguments, and why they are documented.
MODULES = {
    "sglang.benchmark.serving": "SGLang's serving benchmark, the README's A/B against DFLASH",
}

# Programs a documented command may run that this test does not parse, and why.
ALLOWED = {
    "git": "git clone of this repository (the URL is the reader's; nothing to parse)",
    "cd": "shell builtin",
    "python -m sglang_router.launch_router": "sglang-router is not installed here (a separate package, "
                                             "`pip install sglang-router`); its flags are its own",
}


@dataclass
class Command:
    doc: Path
    line: int
    text: str  # as written (continuations joined)
    argv: list[str] = field(default_factory=list)
    env: dict = field(default_factory=dict)
    partial: bool = False  # "..." stands for arguments left out (the same flags as above)
    inline: bool = False  # an inline code span in prose

    def where(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}: {' '.join(self.text.split())}"


# --- extraction --------------------------------------------------------------------------------------------
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")


def fenced_blocks(text: str):
    """(language, [(line number, line)]) of every fenced block; the rest of the text as (None, lines)."""
    blocks, current, lang, outside = [], None, None, []
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m and current is None:
            current, lang = [], m.group(2)
            blocks.append((lang, current, number))
        elif m and current is not None:
            current = None
        elif current is not None:
            current.append((number, line))
        else:
            outside.append((number, line))
    assert current is None, "a fenced block is not closed"
    return blocks, outside


def inline_spans(lines):
    """(line number, text) of every inline code span outside fenced blocks; a span may run over a line break
    inside its paragraph (joined with a space)."""
    text = "\n".join(line for _, line in lines)
    numbers = [number for number, _ in lines]
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", text):
        if "\n\n" in m.group(1):
            continue
        yield numbers[text.count("\n", 0, m.start())], " ".join(m.group(1).split()).replace("\\|", "|")


def logical_lines(lines):
    """Backslash continuations joined: (first line number, text)."""
    out, buf, start = [], "", None
    for number, line in lines:
        if start is None:
            start = number
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        out.append((start, buf + line))
        buf, start = "", None
    if buf:
        out.append((start, buf))
    return out


def expand(text: str, variables: dict, found: list, doc: Path, number: int) -> str:
    """$(...) -> checked as a command and replaced by a placeholder; $NAME / ${NAME...} -> its value."""
    def substitution(m):
        found.extend(commands_of_line(m.group(1), variables, doc, number))
        return PLACEHOLDER

    text = re.sub(r"\$\(([^()]*)\)", substitution, text)
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)[^}\s\"']*\}?",
                  lambda m: variables.get(m.group(1), PLACEHOLDER), text)


def split_words(text: str) -> list[str]:
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


def commands_of_line(text: str, variables: dict, doc: Path, number: int) -> list[Command]:
    found: list[Command] = []
    words = split_words(expand(text, variables, found, doc, number))
    segments, current = [], []
    for w in words:
        if w in ("&&", "||", ";", "|", "&"):
            segments.append(current)
            current = []
        else:
            current.append(w)
    segments.append(current)
    for seg in segments:
        env = {}
        while seg and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", seg[0]):
            name, value = seg.pop(0).split("=", 1)
            env[name] = value
        if seg:
            found.append(Command(doc, number, text.strip(), [w for w in seg if w != "..."], env, "..." in seg))
        elif env:  # a variable assignment: later lines of the block see it
            variables.update(env)
    return found


def documented_commands() -> list[Command]:
    commands = []
    for doc in DOCS:
        blocks, outside = fenced_blocks(doc.read_text())
        for lang, lines, start in blocks:
            assert lang, f"{doc.relative_to(REPO)}:{start}: tag the fenced block with its language (bash, text, json...)"
            variables: dict = {}
            if lang in SHELL_LANGS:
                for number, text in logical_lines(lines):
                    commands += commands_of_line(text, variables, doc, number)
            else:  # a command written in a text block is still a command
                for number, text in logical_lines(lines):
                    if COMMAND_START.match(text.strip() + " "):
                        commands += commands_of_line(text, variables, doc, number)
        for number, span in inline_spans(outside):
            if COMMAND_START.match(span + " "):
                for cmd in commands_of_line(span, {}, doc, number):
                    cmd.inline = True
                    commands.append(cmd)
    return commands


def program_name_only(cmd: Command) -> bool:
    """An inline span that names a program without arguments (`python -m mfd_sglang.cpu.launch_server`,
    `mfd-sglang`, `python -m`): a name in prose, not a command to parse."""
    argv = cmd.argv
    if argv[0] in PYTHONS and argv[1:2] == ["-m"]:
        return len(argv) <= 3
    return len(argv) <= 1


# --- the checks that run in one subprocess (SGLang's parser, the project's parsers, the scripts' parsers) ----
PROBE = r"""
import argparse, contextlib, io, json, os, runpy, sys
from pathlib import Path

from sglang.srt.plugins import load_plugins
from sglang.srt.server_args import ServerArgs, prepare_server_args

load_plugins()  # the plugin's entry point, then its hooks: MFD's flags on SGLang's parser
sglang_parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(sglang_parser)
SGLANG_FLAGS = set(sglang_parser._option_string_actions)

from mfd_sglang.cli import build_parser
from mfd_sglang.cpu.launch_server import apply_cpu_defaults

cli = build_parser()
subparsers = next(a for a in cli._actions if isinstance(a, argparse._SubParsersAction)).choices


class Parsed(Exception):
    def __init__(self, parser):
        self.parser = parser


original_parse_args = argparse.ArgumentParser.parse_args
MODULE_FLAGS = set()


def stop_after_parsing(self, args=None, namespace=None):
    original_parse_args(self, args, namespace)
    raise Parsed(self)


def unabbreviated(argv, flags):
    wrong = [a.split("=", 1)[0] for a in argv if a.startswith("--") and a.split("=", 1)[0] not in flags]
    return f"not a flag of the program (or abbreviated): {', '.join(wrong)}" if wrong else None


def check(job):
    kind, argv = job["kind"], job["argv"]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if kind in ("sglang", "cpu_launcher"):
                if kind == "cpu_launcher":
                    argv = apply_cpu_defaults(argv)[0]
                prepare_server_args(list(argv))
                return unabbreviated(argv, SGLANG_FLAGS)
            if kind == "mfd_cli":
                cli.parse_args(argv)
                if argv and argv[0] in subparsers:
                    return unabbreviated(argv[1:], set(subparsers[argv[0]]._option_string_actions))
                return None
            if kind in ("script", "module"):
                script = Path(job["path"]).resolve() if kind == "script" else None
                sys.argv = [str(script) if script else job["module"], *argv]
                if script:
                    sys.path.insert(0, str(script.parent))
                argparse.ArgumentParser.parse_args = stop_after_parsing
                try:
                    if script:
                        runpy.run_path(str(script), run_name="__main__")
                    else:
                        runpy.run_module(job["module"], run_name="__main__", alter_sys=True)
                except Parsed as done:
                    if not script:  # inline flags of the module's (`--max-concurrency 8`) are known flags too
                        MODULE_FLAGS.update(done.parser._option_string_actions)
                    return unabbreviated(argv, set(done.parser._option_string_actions))
                finally:
                    argparse.ArgumentParser.parse_args = original_parse_args
                    if script:
                        sys.path.remove(str(script.parent))
                return f"the {kind} ended without parsing its arguments with argparse"
            return f"unknown kind {kind}"
    except SystemExit as e:
        if e.code in (0, None):  # --help
            return None
        return f"rejected (exit {e.code}): {err.getvalue().strip()[-600:]}"
    except Exception as e:
        return f"{type(e).__name__}: {e}"


jobs = json.loads(sys.argv[1])
errors = [check(job) for job in jobs]
print("RESULTS " + json.dumps({"errors": errors, "sglang_flags": sorted(SGLANG_FLAGS), "module_flags": sorted(MODULE_FLAGS),
                                "cli_flags": sorted({f for p in subparsers.values() for f in p._option_string_actions})}))
"""


@lru_cache(maxsize=None)
def help_text(*program: str) -> str:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_UPDATE_CHECK="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    proc = subprocess.run([*program, "--help"], capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert proc.returncode == 0, f"{' '.join(program)} --help failed: {proc.stderr[-1000:]}"
    return proc.stdout


def venv_bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def options_listed(argv: list[str], help_out: str) -> str | None:
    wrong = [a.split("=", 1)[0] for a in argv if a.startswith("-")
             and not re.search(r"(?<![\w-])" + re.escape(a.split("=", 1)[0]) + r"(?![\w-])", help_out)]
    return f"not in its --help: {', '.join(wrong)}" if wrong else None


def check_pytest_args(args: list[str]) -> str | None:
    missing = [a for a in args if not a.startswith("-") and "/" in a and not (REPO / a.split("::")[0]).exists()]
    return f"no such test path: {', '.join(missing)}" if missing else None


def local_check(cmd: Command, jobs: list) -> str | None:
    """Checks done here; those for the subprocess are appended to `jobs` as (command, job). None: fine."""
    argv = cmd.argv
    program = argv[0]
    if cmd.inline and program_name_only(cmd):
        if argv[0] in PYTHONS and len(argv) == 3 and importlib.util.find_spec(argv[2]) is None:
            return f"no such module: {argv[2]}"
        return None
    if program in PYTHONS and argv[1:2] == ["-m"] and len(argv) > 2:
        module, args = argv[2], argv[3:]
        if f"python -m {module}" in ALLOWED:
            return None
        if module in ("sglang.launch_server", "mfd_sglang.cpu.launch_server"):
            if cmd.partial and not {"--model-path", "--model"} & set(args):
                args = ["--model-path", PLACEHOLDER, *args]  # "..." stands for the launch flags shown above
            kind = "sglang" if module == "sglang.launch_server" else "cpu_launcher"
            jobs.append((cmd, {"kind": kind, "argv": args}))
        elif module == "mfd_sglang":
            jobs.append((cmd, {"kind": "mfd_cli", "argv": args}))
        elif module == "pytest":
            return check_pytest_args(args)
        elif module == "pip":
            return check_pip(args)
        elif module in MODULES:
            jobs.append((cmd, {"kind": "module", "module": module, "argv": args}))
        else:
            return f"python -m {module}: no check for this module (add one, or add it to ALLOWED with the reason)"
        return None
    if program in PYTHONS and len(argv) > 1 and re.match(r"^(benchmarks|scripts)/[\w-]+\.py$", argv[1]):
        if not (REPO / argv[1]).is_file():
            return f"no such script: {argv[1]}"
        jobs.append((cmd, {"kind": "script", "path": str(REPO / argv[1]), "argv": argv[2:]}))
        return None
    if program == "mfd-sglang":
        jobs.append((cmd, {"kind": "mfd_cli", "argv": argv[1:]}))
        return None
    if program == "sglang":
        if argv[1:2] != ["serve"]:
            return "only `sglang serve` is checked"
        args = argv[2:]
        if args and not args[0].startswith("-"):  # `sglang serve MODEL ...`, as SGLang's CLI normalises it
            args = ["--model-path", *args]
        jobs.append((cmd, {"kind": "sglang", "argv": args}))
        return None
    if program == "bash":
        return check_bash_script(cmd, argv[1:], jobs)
    if program == "pip":
        return check_pip(argv[1:])
    if program == "hf":
        sub = [a for a in argv[1:] if not a.startswith("-")][:1]
        return options_listed(argv[1:], help_text(venv_bin("hf"), *sub))
    if program == "pytest":
        return check_pytest_args(argv[1:])
    if program in ALLOWED:
        return None
    return f"{program}: no check for this program (add one, or add it to ALLOWED with the reason)"


def check_pip(args: list[str]) -> str | None:
    sub = next((a for a in args if not a.startswith("-")), None)
    sub = sub if sub in ("install", "wheel", "show", "download", "uninstall", "list") else "install"
    return options_listed(args, help_text(sys.executable, "-m", "pip", sub))


def check_bash_script(cmd: Command, args: list[str], jobs: list) -> str | None:
    if not args or not re.match(r"^scripts/[\w-]+\.sh$", args[0]):
        return "only `bash scripts/X.sh` is checked"
    script, args = REPO / args[0], args[1:]
    if not script.is_file():
        return f"no such script: {script.relative_to(REPO)}"
    text = script.read_text()
    unread = [name for name in cmd.env if f"${{{name}" not in text and f"${name}" not in text]
    if unread:
        return f"{script.name} does not read {', '.join(unread)}"
    if script.name == "demo.sh":  # extra arguments go to `python -m mfd_sglang demo`
        jobs.append((cmd, {"kind": "mfd_cli", "argv": ["demo", *args]}))
        return None
    if script.name == "gpu_check.sh":
        if args[:1] == ["prepare"]:
            return None if len(args) == 1 else "gpu_check.sh prepare takes no arguments"
        jobs.append((cmd, {"kind": "script", "path": str(REPO / "benchmarks" / "gpu_check.py"),
                           "argv": ["--out-dir", PLACEHOLDER, "--pair", PLACEHOLDER, *args]}))
        return None
    if script.name == "test.sh":  # extra arguments go to pytest
        return check_pytest_args(args)
    unknown = [a for a in args if not re.search(r"(?<![\w-])" + re.escape(a.split("=", 1)[0]) + r"(?![\w-])", text)]
    return f"{script.name} does not handle {', '.join(unknown)}" if unknown else None


@lru_cache(maxsize=1)
def checked() -> tuple[list[tuple[Command, str]], set[str]]:
    """(every failing command with why, every flag SGLang's parser, the project's CLI and the checked modules
    know)."""
    failures, jobs = [], []
    for cmd in documented_commands():
        problem = local_check(cmd, jobs)
        if problem:
            failures.append((cmd, problem))
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps([job for _, job in jobs])], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")), None)
    assert proc.returncode == 0 and line, f"the parsing probe failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    results = json.loads(line[len("RESULTS "):])
    failures += [(cmd, error) for (cmd, _), error in zip(jobs, results["errors"]) if error]
    return failures, set(results["sglang_flags"]) | set(results["cli_flags"]) | set(results["module_flags"])


# --- tests -------------------------------------------------------------------------------------------------
def test_the_docs_hold_commands_of_every_kind():
    """The extraction finds what the checks are for (a broken extraction would check nothing)."""
    commands = documented_commands()
    texts = [" ".join(c.argv) for c in commands]
    assert len(commands) >= 60, len(commands)
    for needle in ("python -m sglang.launch_server", "sglang serve", "python -m mfd_sglang.cpu.launch_server",
                   "python -m mfd_sglang inspect", "python -m mfd_sglang train", "python benchmarks/closed_loop.py",
                   "bash scripts/demo.sh", "bash scripts/test.sh", "bash scripts/gpu_check.sh", "pip install ."):
        assert any(t.startswith(needle) for t in texts), needle


def test_every_documented_command_parses():
    failures, _ = checked()
    assert not failures, "documented commands that do not parse:\n" + "\n".join(
        f"- {cmd.where()}\n    {why}" for cmd, why in failures)


def test_every_documented_flag_exists():
    """Inline flags in prose and tables (`--mfd-auto-budget`, `--tp-size 2`) are flags SGLang's parser, the
    project's CLI or one of its scripts knows."""
    _, flags = checked()
    sources = [*REPO.glob("benchmarks/*.py"), *REPO.glob("scripts/*"), *REPO.glob("mfd_sglang/**/*.py"),
               *REPO.glob("patches/*.py")]
    known = flags | {f for p in sources if p.is_file() for f in re.findall(r"--[a-z0-9][a-z0-9-]*", p.read_text())}
    unknown = []
    for doc in DOCS:
        _, outside = fenced_blocks(doc.read_text())
        for number, span in inline_spans(outside):
            if span.startswith("--"):
                for word in span.split():
                    flag = word.split("=", 1)[0]
                    if re.match(r"^--[a-z0-9]", flag) and flag not in known:
                        unknown.append(f"{doc.relative_to(REPO)}:{number}: {flag} (in `{span}`)")
    assert not unknown, "flags no parser or script of the project knows:\n" + "\n".join(unknown)


def github_anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    blocks, outside = fenced_blocks(doc.read_text())
    seen, out = {}, set()
    for _, line in outside:
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if m:
            slug = github_anchor(m.group(1))
            out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return out


def test_every_relative_link_resolves():
    broken = []
    for doc in DOCS:
        _, outside = fenced_blocks(doc.read_text())
        for number, line in outside:
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"^[a-z]+://", target):
                    continue
                path, _, anchor = target.partition("#")
                dest = (doc.parent / path).resolve() if path else doc
                if not dest.exists():
                    broken.append(f"{doc.relative_to(REPO)}:{number}: {target} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    broken.append(f"{doc.relative_to(REPO)}:{number}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_readme_is_short_and_carries_the_ci_test_command():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 310  # the user guide: install, drafters, first GPU run, failures, memory
    ci = [ln.strip() for ln in (REPO / ".ci" / "run").read_text().splitlines() if ln.strip().startswith("bash scripts/")]
    readme_commands = {" ".join(c.argv) for c in documented_commands() if c.doc.name == "README.md"}
    assert ci and all(c in readme_commands for c in ci), (ci, sorted(readme_commands))


@pytest.mark.parametrize("text, argv", [
    ('T=$(python -m mfd_sglang prepare-target)\npython -m mfd_sglang train --target $T --out x  # c',
     [["python", "-m", "mfd_sglang", "prepare-target"], ["python", "-m", "mfd_sglang", "train", "--target",
                                                         PLACEHOLDER, "--out", "x"]]),
    ('SGLANG_CPU_OMP_THREADS_BIND="0|1" python -m mfd_sglang.cpu.launch_server ... --dp-size 2',
     [["python", "-m", "mfd_sglang.cpu.launch_server", "--dp-size", "2"]]),
    ("pip wheel --no-deps . -w dist && pip install dist/x.whl",
     [["pip", "wheel", "--no-deps", ".", "-w", "dist"], ["pip", "install", "dist/x.whl"]]),
])
def test_extraction(text, argv):
    variables: dict = {}
    found = [c for number, line in logical_lines(enumerate(text.splitlines(), 1))
             for c in commands_of_line(line, variables, REPO / "README.md", number)]
    assert [c.argv for c in found] == argv
