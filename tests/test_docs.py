"""The documents cannot go stale: every python block in README.md, docs/, benchmarks/ and seeds/ runs, every path and
module name they mention exists, and every command-line flag says what it does.

- Each markdown file's fenced python blocks run in order, in one namespace, in a fresh interpreter
  (time-bounded), from the repository root (a fence left open, which would end them unseen, is an
  error); a text block whose paragraph before it says "prints" is found, line for line, in what they
  print. A block that must not run (it needs a GPU, a checkpoint, a server, or minutes) is preceded
  by the line `<!-- docs: no-run (why) -->`, the reason given.
- A backticked path under one of the repository's top folders (`orca_torch/core/engine.py`,
  `docs/tour.md`, `experiments/`), or ending in `.py` or `.md`, must exist; so must the target of
  every relative markdown link.
- A backticked dotted name `orca_torch.x.y` must import: the longest importable module prefix, then
  attributes for the rest.
- A backticked `Class.member` (or `Class.member(...)`), where Class is a class of `orca_torch/` or
  `clipper/`, must name a member of it: a method or attribute, a dataclass field, or an attribute its
  code sets on `self`.
- A backticked snake_case name (`fits_together`, `decode_runs.decode_grow`, `name(...)`) must be one
  the project's code uses (an identifier, or a word of its strings) or the page's own python defines.
- Each page of docs/experiments/ names its command, `python3 experiments/<script>.py`, and its
  "Flags:" list is exactly the script's options (`--seed`, `--quick` and `--json` among them).
- The figures a page of docs/experiments/ quotes from its script are checked against the script's
  `--json` by that experiment's own tests, on the `--quick` run they already make, where `--quick`
  runs the same simulation as the full form (`table_row` and `page_text` read the page for them).
- The prompt lengths the README quotes for a few torch-executed chat requests are those the workload draws;
  the step count architecture.md quotes for the fast engine's first call is the one its block asserts;
  docs/paper-gpu.md's A100 table and the figures beside its `gpu_calculator` commands are what those
  tools print now; a python block sizes `make_workload` by name (`n_requests=`, `rate=`), never by place.
- Every command a document prints (a line of a bash block, or a backticked `python3 ...` / `torchrun ...`)
  that runs a script or `-m` module of the project names one that exists, and each `--flag` it gives is
  one that tool's parser takes, spelled in full.
- Every option of every command-line tool (the scripts of experiments/, benchmarks/ and examples/, and
  the package's modules run with `-m`) has help text in `--help`, which says its default where it
  has one. Each tool runs in this process up to its `parse_args`, which stops it and hands over the
  parser: no tool's work runs, and a parser built anywhere (in a function, at module level, through
  `report.run_experiment`) is the one checked. An experiment's `--help` prints its docstring, which
  says what each `--demos` number runs.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import os
import re
import runpy
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), ROOT / "benchmarks" / "README.md",
               ROOT / "seeds" / "README.md"])
NO_RUN = re.compile(r"<!-- docs: no-run \((.+)\) -->")
TOP = ("orca_torch", "clipper", "docs", "experiments", "benchmarks", "tests", "examples", "seeds", ".ci")
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
TICKED = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
DOTTED = re.compile(r"^orca_torch(\.\w+)+$")
BLOCK_TIMEOUT_S = 60


def rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def python_blocks(text: str) -> tuple[list[str], int]:
    """The file's python blocks to run, and how many carry the no-run marker; a fence left open
    (its block, and every one after it, would never run) is an error."""
    fences = [i + 1 for i, line in enumerate(text.splitlines()) if line.startswith("```")]
    assert len(fences) % 2 == 0, f"the fence at line {fences[-1]} is never closed: the blocks from it on do not run"
    run, skipped = [], 0
    for m in FENCE.finditer(text):
        if m.group(1) != "python":
            continue
        before = text[:m.start()].rstrip().splitlines()
        if before and NO_RUN.fullmatch(before[-1].strip()):
            skipped += 1
        else:
            run.append(m.group(2))
    return run, skipped


def printed_outputs(text: str) -> list[str]:
    """The text blocks a document gives as what its python prints: each ```text block whose paragraph
    before it says "prints"."""
    return [m.group(2) for m in FENCE.finditer(text)
            if m.group(1) == "text" and "prints" in text[:m.start()].rstrip().split("\n\n")[-1]]


def prose(text: str) -> str:
    """The text outside fenced blocks (commands inside bash blocks name output files, not paths)."""
    return FENCE.sub("", text)


def test_the_documents_exist():
    names = {rel(p) for p in DOCS}
    assert {"README.md", "docs/architecture.md", "docs/tour.md", "benchmarks/README.md"} <= names
    pages = sorted(p.name for p in (ROOT / "docs" / "experiments").glob("*.md"))
    scripts = sorted(p.stem for p in (ROOT / "experiments").glob("*.py"))
    assert [p[:-3].replace("-", "_") for p in pages] == scripts, "one page per experiment script"


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines"
    head = "\n".join(lines[:40])
    ci = (ROOT / ".ci" / "run").read_text()
    for install in re.findall(r"python3 -m pip install -q (.+?)\s+#", ci):
        assert install.strip() in head, f"the README's first 40 lines lack .ci/run's install {install!r}"
    assert "python3 -m pytest -q" in ci and "python3 -m pytest -q" in head
    assert "python3 experiments/03_continuous_batching.py" in head


def readme_names(label: str) -> list[str]:
    """The backticked names of the README's `label:` sentence (up to its first full stop)."""
    text = " ".join((ROOT / "README.md").read_text().split())
    m = re.search(rf"{label}: (.*?)\.(?: |$)", text)
    assert m, f"README.md has no {label}: sentence"
    return [n for n in TICKED.findall(m.group(1)) if "." not in n]


def test_readme_lists_every_system_and_workload():
    """A new user picks a system or a workload by name from these lists: each must be whole."""
    from orca_torch.lab.api import SYSTEMS
    from orca_torch.lab.workload import WORKLOADS

    assert readme_names("Systems") == list(SYSTEMS)
    assert readme_names("Workloads") == list(WORKLOADS)


def test_architecture_quotes_the_fast_engines_bulk_call(monkeypatch):
    """Step 9 of docs/architecture.md says how many steps the trace example's first call of
    `FastEngine.step()` covers, and that the run never enters `Scheduler.complete`: the count is the
    one the page's block asserts, and the run is that block's."""
    from orca_torch.core.scheduler import Scheduler
    from orca_torch.lab.api import RunSettings

    quoted = int(re.search(r"The first covers all ([\d,]+) steps", page_text("docs/architecture.md"))
                 .group(1).replace(",", ""))
    blocks, _ = python_blocks((ROOT / "docs" / "architecture.md").read_text())
    assert any(f"engine.last_run.n_steps == res.n_steps == {quoted} " in b for b in blocks), \
        f"docs/architecture.md quotes {quoted} steps in step 9, not the number its block asserts"
    monkeypatch.setattr(Scheduler, "complete", lambda *a, **k: pytest.fail("the bulk run entered Scheduler.complete"))
    settings = RunSettings(workload="chat", rate=16, n_requests=20, system="orca-oracle")
    reqs = settings.requests()
    engine = settings.engine(reqs)
    engine.start(reqs)
    engine.step()
    assert engine.last_run.n_steps == quoted and engine.step() is None


def test_serving_lists_every_parameter_taken_only_at_its_no_op_value():
    """docs/serving.md's table of the parameters the server takes only at a value that changes
    nothing is the server's own list (`serve.bodies.NO_OP`), each with the values it takes."""
    pytest.importorskip("fastapi")
    import json

    from orca_torch.serve.bodies import NO_OP

    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \|$", (ROOT / "docs" / "serving.md").read_text(), re.M)
    assert {name: sorted(TICKED.findall(values)) for name, values in rows} == \
           {name: sorted(json.dumps(v) for v in ok if v is not None) for name, ok in NO_OP.items()}


def test_serving_lists_every_flag_with_its_default(monkeypatch):
    """docs/serving.md's table of the server's flags holds every flag `python3 -m orca_torch.serve`
    takes, each with the default its parser has (a default the parser leaves unset, None or off, is
    said in words there; a default of 0, which equals False, is checked)."""
    p = tool_parser(ROOT / "orca_torch" / "serve" / "__main__.py", monkeypatch)
    defaults = {o: a.default for a in p._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    rows = re.findall(r"^\| (`--[^|]+) \| ([^|]+) \|", (ROOT / "docs" / "serving.md").read_text(), re.M)
    listed = {}
    for flags, cell in rows:
        names, values = TICKED.findall(flags), [v.strip().strip("`") for v in cell.split(", ")]
        listed.update(zip(names, values * len(names) if len(values) == 1 else values))
    assert set(listed) == set(defaults), (f"docs/serving.md's flag table: missing "
                                          f"{sorted(set(defaults) - set(listed))}, not a flag "
                                          f"{sorted(set(listed) - set(defaults))}")
    wrong = {f: (listed[f], d) for f, d in defaults.items()
             if d is not None and d is not False and listed[f] != (f"{d:g}" if isinstance(d, float) else str(d))}
    assert not wrong, f"docs/serving.md's flag table gives defaults the parser does not have (table, parser): {wrong}"


def test_readme_quotes_the_prompts_a_torch_run_draws():
    """The README's torch example quotes the prompt lengths `n_requests=5` of `chat` draws for each
    preset (drawn to fit its context); a change to the workload or a preset shows here."""
    from orca_torch.lab.api import RunSettings

    text = page_text("README.md")
    for model in ("tiny", "mini"):
        lens = [r.prompt_len for r in RunSettings(workload="chat", rate=16, n_requests=5, system="orca-max",
                                                  executor="torch", model=model).requests()]
        assert f"{min(lens):,}–{max(lens):,} tokens" in text, f"README.md: {model}'s prompts are {sorted(lens)}"


def runs_python(doc: Path) -> bool:
    """Whether `doc` has a python block to run (a fence left open counts: the test then names it)."""
    try:
        return bool(python_blocks(doc.read_text())[0])
    except AssertionError:
        return True


@pytest.mark.parametrize("doc", [d for d in DOCS if runs_python(d)], ids=rel)
def test_python_blocks_run(doc: Path, tmp_path: Path):
    blocks, _ = python_blocks(doc.read_text())
    script = tmp_path / "blocks.py"
    script.write_text("\n\n".join(f"# ---- block {i + 1}\n{b}" for i, b in enumerate(blocks)))
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "MPLBACKEND": "Agg"}
    p = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=BLOCK_TIMEOUT_S)
    assert p.returncode == 0, f"{rel(doc)}'s python blocks failed:\n{p.stderr[-3000:]}"
    stale = [out for out in printed_outputs(doc.read_text()) if out not in p.stdout]
    assert not stale, f"{rel(doc)} quotes output its python blocks do not print:\n{stale}\nthey print:\n{p.stdout}"


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_no_run_markers_give_a_reason(doc: Path):
    bad = [line for line in doc.read_text().splitlines()
           if line.strip().startswith("<!-- docs:") and not NO_RUN.fullmatch(line.strip())]
    assert not bad, f"{rel(doc)}: a no-run marker is written `<!-- docs: no-run (why) -->`, got {bad}"


def mentioned_paths(doc: Path) -> list[str]:
    out = []
    for tok in TICKED.findall(prose(doc.read_text())):
        tok = tok.strip()
        if not re.fullmatch(r"[\w./-]+", tok) or "/" not in tok or "://" in tok:
            continue
        if tok.split("/")[0] in TOP or tok.endswith((".py", ".md")):
            out.append(tok)
    return out


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_backticked_paths_exist(doc: Path):
    missing = [p for p in mentioned_paths(doc) if not (ROOT / p).exists()]
    assert not missing, f"{rel(doc)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_links_resolve(doc: Path):
    missing = []
    for target in LINK.findall(prose(doc.read_text())):
        if "://" in target or target.startswith(("#", "mailto:")):
            continue
        path = target.split("#")[0]
        if path and not (doc.parent / path).resolve().exists():
            missing.append(target)
    assert not missing, f"{rel(doc)} links to files that do not exist: {missing}"


def resolve(name: str):
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_dotted_names_import(doc: Path):
    names = {t.split("(")[0] for t in TICKED.findall(doc.read_text())}
    bad = []
    for n in sorted(x for x in names if DOTTED.match(x)):
        try:
            resolve(n)
        except (ImportError, AttributeError) as e:
            bad.append(f"{n}: {e}")
    assert not bad, f"{rel(doc)} names what does not import: {bad}"


MEMBER = re.compile(r"^([A-Z]\w*)\.(\w+)(\(.*\))?$")


def project_classes() -> dict[str, list[str]]:
    """Each class defined at the top of a module of `orca_torch/` or `clipper/`: the modules defining it."""
    found: dict[str, list[str]] = {}
    for p in sorted([*(ROOT / "orca_torch").rglob("*.py"), *(ROOT / "clipper").rglob("*.py")]):
        parts = p.relative_to(ROOT).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for node in ast.parse(p.read_text()).body:
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(module)
    return found


def has_member(cls: type, name: str) -> bool:
    if hasattr(cls, name):
        return True
    sets_it = re.compile(rf"\bself\.{name}\b\s*(:[^=\n]*)?=[^=]")
    for k in cls.__mro__:
        if name in getattr(k, "__dataclass_fields__", {}) or name in vars(k).get("__annotations__", {}):
            return True
        try:
            if sets_it.search(inspect.getsource(k)):
                return True
        except (OSError, TypeError):
            continue
    return False


def missing_members(text: str, classes: dict[str, list[str]]) -> list[str]:
    """The backticked `Class.member` names of `text` whose class is the project's and lacks the member."""
    bad = []
    for tok in sorted(set(TICKED.findall(prose(text)))):
        m = MEMBER.match(tok.strip())
        if not m or m.group(1) not in classes:
            continue
        owners = [getattr(importlib.import_module(mod), m.group(1)) for mod in classes[m.group(1)]]
        if not any(has_member(c, m.group(2)) for c in owners):
            bad.append(tok)
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_backticked_members_exist(doc: Path):
    bad = missing_members(doc.read_text(), project_classes())
    assert not bad, f"{rel(doc)} names members that do not exist: {bad}"


SNAKE = re.compile(r"[a-z]\w*_\w*")


@pytest.fixture(scope="module")
def code_words() -> frozenset[str]:
    """Every identifier the project's code uses (a definition, name, attribute or argument) and every
    word of its strings (a JSON key, a field named in a message): what a document may name."""
    words: set[str] = set()
    for d in ("orca_torch", "clipper", "experiments", "benchmarks", "examples", "tests"):
        for p in sorted(set((ROOT / d).rglob("*.py")) - {Path(__file__).resolve()}):   # (not the names below)
            for node in ast.walk(ast.parse(p.read_text())):
                words.update(v for f in ("name", "attr", "id", "arg") if isinstance(v := getattr(node, f, None), str))
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    words.update(re.findall(r"\w+", node.value))
    return frozenset(words)


def unknown_names(text: str, words: frozenset[str]) -> list[str]:
    """The backticked names of `text`'s prose (`name`, `name(...)`, `module.name`; `orca_torch.x` must
    import instead) with a snake_case part that neither the code nor the text's own python uses."""
    own = set(re.findall(r"\w+", " ".join(m.group(2) for m in FENCE.finditer(text))))
    bad = []
    for tok in sorted(set(TICKED.findall(prose(text)))):
        name = tok.strip().split("(")[0]
        if (re.fullmatch(r"[A-Za-z_][\w.]*", name) and not name.startswith("orca_torch.")
                and any(SNAKE.fullmatch(part) and part not in words and part not in own for part in name.split("."))):
            bad.append(tok)
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_backticked_names_are_the_codes(doc: Path, code_words: frozenset[str]):
    """A function, method, field or key a page names in snake_case (`fits_together`,
    `decode_runs.decode_grow`) is one the code still uses: a rename shows here."""
    bad = unknown_names(doc.read_text(), code_words)
    assert not bad, f"{rel(doc)} names what no code of the project uses (renamed or removed?): {bad}"


class _Parsed(BaseException):
    """Raised in place of parsing the command line: carries the parser out of the tool (a
    BaseException, so no tool's `except Exception` keeps it)."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


MAIN_GUARD = re.compile(r'^if __name__ == ["\']__main__["\']:', re.M)
PARSES = re.compile(r"\b(parse_args|parse_known_args|run_experiment)\(")


def command_line_tools() -> list[Path]:
    """The scripts and `-m` modules that parse a command line."""
    scripts = [p for d in ("experiments", "benchmarks", "examples") for p in sorted((ROOT / d).glob("*.py"))]
    modules = [p for p in sorted((ROOT / "orca_torch").rglob("*.py"))
               if p.name == "__main__.py" or MAIN_GUARD.search(p.read_text())]
    return [p for p in scripts + modules if PARSES.search(p.read_text())]


def undocumented(parser: argparse.ArgumentParser) -> list[str]:
    """The options and positionals of `parser` whose help is missing, blank or suppressed (-h aside)."""
    return [(a.option_strings or [a.dest])[-1] for a in parser._actions
            if not isinstance(a, argparse._HelpAction)
            and (a.help is None or a.help == argparse.SUPPRESS or not a.help.strip())]


def tool_parser(tool: Path, monkeypatch) -> argparse.ArgumentParser:
    """The parser `tool` builds, taken at its first parse (the tool does nothing past it)."""
    def hand_over(self, args=None, namespace=None):
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", hand_over)
    monkeypatch.setattr(sys, "argv", [str(tool)])
    monkeypatch.setattr(sys, "path", list(sys.path))         # (some scripts put the repository on it)
    try:
        if tool.is_relative_to(ROOT / "orca_torch"):
            name = ".".join(tool.relative_to(ROOT).with_suffix("").parts)
            with warnings.catch_warnings():     # (-m of a module its package imported already)
                warnings.filterwarnings("ignore", ".*found in sys.modules", RuntimeWarning)
                runpy.run_module(name, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(str(tool), run_name="__main__")
    except _Parsed as parsed:
        return parsed.parser
    raise AssertionError(f"{rel(tool)} ran to its end without parsing a command line")


def unsaid_defaults(parser: argparse.ArgumentParser) -> list[str]:
    """The options of `parser` that take a value with a default (not None) whose help does not say it."""
    return [a.option_strings[-1] for a in parser._actions
            if a.option_strings and a.nargs != 0 and a.default is not None and "default" not in (a.help or "")]


@pytest.mark.parametrize("tool", command_line_tools(), ids=rel)
def test_every_flag_has_help(tool: Path, monkeypatch):
    p = tool_parser(tool, monkeypatch)
    assert p.format_help()                                    # (a help text argparse cannot format fails here)
    assert not undocumented(p), f"{rel(tool)}: --help says nothing of {', '.join(undocumented(p))}"
    assert not unsaid_defaults(p), f"{rel(tool)}: --help does not say the default of {', '.join(unsaid_defaults(p))}"


def demo_count(p: argparse.ArgumentParser) -> int:
    """How many demos a parser's `--demos` takes (0: it has no such flag)."""
    demos = next((a for a in p._actions if "--demos" in a.option_strings), None)
    n = 0
    while demos is not None:
        try:
            demos.type(str(n + 1))
        except argparse.ArgumentTypeError:
            break
        n += 1
    return n


@pytest.mark.parametrize("script", sorted((ROOT / "experiments").glob("[0-9][0-9]_*.py")), ids=rel)
def test_an_experiments_help_says_what_each_demo_runs(script: Path, monkeypatch):
    """`--demos 1,3` picks demos by number: `--help` prints the script's docstring whole, which says
    what each number runs (04_scheduling's numbers are not the lecture's demos it runs)."""
    p = tool_parser(script, monkeypatch)
    assert p.description == ast.get_docstring(ast.parse(script.read_text()), clean=False), \
        f"{rel(script)}: --help prints not its docstring"
    n = demo_count(p)
    unsaid = [k for k in range(1, n + 1) if n > 1 and not re.search(rf"(?i)(\bdemo|--demos) {k}\b", p.description)]
    assert not unsaid, f"{rel(script)}: its docstring, --help's description, does not say what demo {unsaid} runs"


EXPERIMENT_PAGES = sorted((ROOT / "docs" / "experiments").glob("*.md"))
FLAGS_LIST = re.compile(r"Flags: (.*?)(?:\n\n|\Z)", re.S)


def page_flags(text: str) -> set[str]:
    """The options a page's "Flags:" paragraph lists."""
    m = FLAGS_LIST.search(text)
    return set(re.findall(r"`(--[\w-]+)", m.group(1))) if m else set()


def parser_flags(p: argparse.ArgumentParser) -> set[str]:
    return {o for a in p._actions if not isinstance(a, argparse._HelpAction) for o in a.option_strings
            if o.startswith("--")}


@pytest.mark.parametrize("page", EXPERIMENT_PAGES, ids=rel)
def test_experiment_pages_name_their_command_and_flags(page: Path, monkeypatch):
    script = f"experiments/{page.stem.replace('-', '_')}.py"
    text = page.read_text()
    assert f"`python3 {script}" in text, f"{rel(page)} does not name its command, python3 {script}"
    flags = parser_flags(tool_parser(ROOT / script, monkeypatch))
    assert {"--seed", "--quick", "--json"} <= flags, f"{script} lacks a shared flag"
    listed = page_flags(text)
    assert listed == flags, (f"{rel(page)}'s Flags: list differs from {script}'s options: "
                             f"listed only {sorted(listed - flags)}, not listed {sorted(flags - listed)}")


COMMAND = re.compile(r"`((?:python3?|torchrun) [^`]+)`")


def printed_commands(text: str) -> list[str]:
    """The command lines a document prints: each command of its bash blocks (a backslash continuation
    joined, `a && b` two commands) and each backticked `python3 ...` or `torchrun ...` of its prose."""
    lines = [line for m in FENCE.finditer(text) if m.group(1) == "bash"
             for line in m.group(2).replace("\\\n", " ").splitlines()]
    lines += COMMAND.findall(prose(text))
    return [" ".join(c.split()) for line in lines for c in line.split("&&") if c.strip()]


def command_tool(command: str) -> tuple[Path, list[str]] | None:
    """The project's tool a command runs (a script, or a module given to `-m`) and the words it passes
    it; None where the command runs another program (pip, pytest, pdb, curl)."""
    words = [w.strip("[]") for w in shlex.split(command, comments=True)]   # (`[--flag x]`: an optional part)
    if not words or words[0] not in ("python", "python3", "torchrun"):
        return None
    if "-m" in words:
        module = words[words.index("-m") + 1]
        if module.split(".")[0] not in ("orca_torch", "clipper"):
            return None
        path = ROOT / module.replace(".", "/")
        tool = path.with_suffix(".py") if path.with_suffix(".py").exists() else path / "__main__.py"
        return tool, words[words.index("-m") + 2:]
    scripts = [i for i, w in enumerate(words) if w.endswith(".py")]
    return (ROOT / words[scripts[0]], words[scripts[0] + 1:]) if scripts else None


def command_problem(command: str, monkeypatch) -> str | None:
    """What a printed command gets wrong, short of running it: a tool that does not exist, or a flag
    its parser does not take by that name (a page spells each flag in full). None when neither."""
    found = command_tool(command)
    if found is None:
        return None
    tool, words = found
    if not tool.exists():
        return f"{command!r}: there is no {rel(tool)}"
    flags = parser_flags(tool_parser(tool, monkeypatch))
    monkeypatch.undo()
    unknown = [w for w in words if w.startswith("--") and w.split("=")[0] not in flags | {"--help"}]
    return f"{command!r}: {rel(tool)} takes no {', '.join(unknown)}" if unknown else None


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_printed_commands_name_a_tool_and_its_flags(doc: Path, monkeypatch):
    """A command a reader copies from a page runs a script or module that exists, with flags it takes."""
    bad = [p for c in printed_commands(doc.read_text()) if (p := command_problem(c, monkeypatch))]
    assert not bad, f"{rel(doc)} prints commands whose tool or flag does not exist: {bad}"


def page_text(page: str) -> str:
    """The text of `page` (a path from the repository root) with every run of white space one blank,
    so that a quoted phrase is found across the page's line breaks."""
    return " ".join((ROOT / page).read_text().split())


def table_row(page: str, label: str) -> list[str]:
    """The cells after the first of the one table row of `page` whose first cell is `label`: where a
    test compares the figures a page quotes with its script's `--json`."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in (ROOT / page).read_text().splitlines() if line.lstrip().startswith("|")]
    found = [r[1:] for r in rows if r[0] == label]
    assert len(found) == 1, f"{page} has {len(found)} table rows whose first cell is {label!r}"
    return found[0]


def test_paper_gpu_quotes_the_a100_table(monkeypatch, capsys):
    """docs/paper-gpu.md's table of Llama-3-8B on the paper A100-80GB is what
    `benchmarks/bench_calibration.py --no-measure` prints (nothing measured: the cost models alone), and
    its last column is derived from the two deviations before it: a change to either cost model shows here."""
    monkeypatch.setattr(sys, "path", [str(ROOT), *sys.path])
    bench = runpy.run_path(str(ROOT / "benchmarks" / "bench_calibration.py"))
    steps = bench["main"](["--no-measure", "--json"])["a100_80gb"]
    capsys.readouterr()

    def signed(x: float, digits: int) -> str:
        return f"{x:+.{digits}%}".replace("-", "−") if round(x, digits + 2) else f"{0:.{digits}%}"

    for name, f in steps.items():
        kind, n = name.split()
        label = f"decode, batch {n}" if kind == "decode" else f"prefill of {int(n):,} tokens"
        profiled = f["roofline_vs_profiled_reference"]
        assert table_row("docs/paper-gpu.md", label) == [
            f"{f['roofline_ms']:.2f}", f"{f['refined_ms']:.2f}", signed(f["roofline_vs_refined"], 1),
            signed(profiled, 0), signed((1 + profiled) / (1 + f["roofline_vs_refined"]) - 1, 1)], label


def test_paper_gpu_calculator_comments_are_what_it_prints(capsys):
    """Each `gpu_calculator` command of docs/paper-gpu.md ends in a comment of what it prints (a step's
    milliseconds, `memory-bound`, requests of a reservation, sequences within a time, K/V slots): every
    number there is one of the figures the command gives now."""
    from orca_torch.lab import gpu_calculator

    commands = [c for c in printed_commands((ROOT / "docs" / "paper-gpu.md").read_text()) if "gpu_calculator" in c]
    assert len(commands) == 4, commands
    for command in commands:
        words, comment = command.split("#", 1)
        out = gpu_calculator.main([*shlex.split(words)[3:], "--json"])
        capsys.readouterr()
        mem = out["memory"]
        figures = ({f"{s['time_ms']:.2f}" for s in out["step"]}
                   | {str(w["max_batch"]) for w in out.get("max_batch_within", [])})
        figures |= {f"{mem['kv_capacity_tokens']:,}", str(mem["max_requests"]), str(mem["reserve_tokens"])}
        quoted = set(re.findall(r"\d[\d,.]*\d|\d", comment))
        assert quoted <= figures, f"docs/paper-gpu.md: `{command}` prints none of {sorted(quoted - figures)}"
        assert "memory-bound" not in comment or {s["bound"] for s in out["step"]} == {"memory"}, command


def test_the_exercise_index_quotes_its_pages():
    """docs/tour.md §7 gives each of the lecture's nine exercises the place that answers it and the
    project's figure. Each `; `-separated part of a row's project cell is quoted from the page its
    "answered in" cell links first (the tour above the index, for a link to one of its own sections),
    and those pages' figures are held to the scripts' `--json` by the experiments' tests: the index
    cannot drift from them."""
    above, index = (ROOT / "docs" / "tour.md").read_text().split("## 7. Every exercise", 1)
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in index.splitlines() if re.match(r"\| \d ", line)]
    assert [r[0].split()[0] for r in rows] == [str(i) for i in range(1, 10)], "one row per exercise, 1 to 9"
    for exercise, answered_in, _, project in rows:
        target = LINK.search(answered_in).group(1).split("#")[0]
        text = " ".join((above if not target else (ROOT / "docs" / target).read_text()).split())
        missing = [part for part in project.split("; ") if part not in text]
        assert not missing, f"docs/tour.md, exercise {exercise!r}: {missing} not found in {target or 'the tour'}"


def test_the_checks_can_fail(tmp_path: Path, monkeypatch, code_words: frozenset[str]):
    """The collectors find what a stale document would hold."""
    doc = tmp_path / "x.md"
    doc.write_text("See `orca_torch/core/nowhere.py` and `docs/tour.md`.\n\n<!-- docs: no-run (a test) -->\n"
                   "```python\n1/0\n```\n"
                   "```python\nx = 1\n```\n```bash\nls `orca_torch/nothing.py`\n```\n")
    assert mentioned_paths(doc) == ["orca_torch/core/nowhere.py", "docs/tour.md"]
    assert python_blocks(doc.read_text()) == (["x = 1\n"], 1)
    with pytest.raises(AssertionError, match="the fence at line 5 is never closed"):
        python_blocks("```python\nx = 1\n```\n\n```python\nassert x == 2\n")     # (no error: it never ran)
    assert printed_outputs("A diagram:\n\n```text\na -> b\n```\n\nIt prints:\n\n```text\n1\n```\n") == ["1\n"]
    with pytest.raises((ImportError, AttributeError)):
        resolve("orca_torch.core.engine.NoSuchThing")
    assert resolve("orca_torch.core.engine.Engine").__name__ == "Engine"
    p = argparse.ArgumentParser()
    p.add_argument("--said", help="what it does")
    for flag, said in (("--bare", None), ("--blank", " "), ("--hidden", argparse.SUPPRESS)):
        p.add_argument(flag, help=said)
    p.add_argument("where")
    assert undocumented(p) == ["--bare", "--blank", "--hidden", "where"]
    p.add_argument("--kept", default=3, help="how many (default 3)")
    p.add_argument("--lost", default=3, help="how many")
    p.add_argument("--flag", action="store_true", help="a switch")
    assert unsaid_defaults(p) == ["--lost"]
    names = {rel(t) for t in command_line_tools()}
    assert {"benchmarks/bench_scale.py", "experiments/03_continuous_batching.py", "examples/serve_llama.py",
            "orca_torch/serve/__main__.py", "orca_torch/serve/tokenizer.py", "orca_torch/distributed/__main__.py",
            "orca_torch/lab/gpu_calculator.py"} <= names
    assert "orca_torch/lab/report.py" not in names            # (its main guard is in its docstring)
    classes = project_classes()
    assert "orca_torch.core.engine" in classes["Engine"]
    assert missing_members("`Engine.step()`, `Engine.no_such_step`, `LiveEngine.requests`, `README.md`", classes) \
        == ["Engine.no_such_step"]
    assert missing_members("```python\n`Engine.no_such_step`\n```\n", classes) == []
    assert unknown_names("Call `fits_together(reqs)`, `decode_runs.no_such_grow` or `my_tally`; `Engine`.\n\n"
                         "```python\ndef my_tally():\n    pass\n```\n", code_words) == ["decode_runs.no_such_grow"]
    assert page_flags("`python3 experiments/x.py`. Flags: `--seed`, `--demos 1,2`,\n`--plot DIR` (writes `a.png`).\n\n"
                      "Later: `--other`.") == {"--seed", "--demos", "--plot"}
    p = argparse.ArgumentParser()
    p.add_argument("--seed", "-s", help="x")
    assert parser_flags(p) == {"--seed"}
    page = "docs/experiments/03-cost-models.md"
    assert table_row(page, "Orca (oracle)")[-1] == "−15%"
    with pytest.raises(AssertionError, match="0 table rows"):
        table_row(page, "no such row")
    assert "goodput search (to 30%) cannot tell" in page_text(page)
    text = ("Run `python3 benchmarks/bench_scale.py\n--no-such-flag` or `python3 -m pdb x.py`.\n\n```bash\n"
            "python3 -m pip install -q -e . && python3 -m orca_torch.lab.gpu_calculator --batch 1 \\\n"
            "  --context 2   # 5.99 ms\npython -m orca_torch.serve --port=8000\n```\n")
    commands = printed_commands(text)
    assert commands == ["python3 -m pip install -q -e .", "python3 -m orca_torch.lab.gpu_calculator --batch 1 --context 2 # 5.99 ms",
                        "python -m orca_torch.serve --port=8000", "python3 benchmarks/bench_scale.py --no-such-flag",
                        "python3 -m pdb x.py"]
    assert [command_tool(c) for c in (commands[0], commands[4])] == [None, None]
    assert command_tool(commands[1]) == (ROOT / "orca_torch/lab/gpu_calculator.py", ["--batch", "1", "--context", "2"])
    assert command_tool(commands[2]) == (ROOT / "orca_torch/serve/__main__.py", ["--port=8000"])
    assert [command_problem(c, monkeypatch) for c in commands[:3]] == [None, None, None]
    assert "takes no --no-such-flag" in command_problem(commands[3], monkeypatch)
    assert "there is no experiments/nowhere.py" in command_problem("python3 experiments/nowhere.py [--seed 1]", monkeypatch)
