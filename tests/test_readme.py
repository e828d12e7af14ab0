"""The README is executable documentation: every code block in it is checked or run here.

* Python blocks are the files under ``examples/``, copied verbatim after a ``<!-- file: PATH -->`` marker: the
  copy must equal the file, and each file runs on 2 CPU ranks with the launch command on its first line.
* Shell commands (bash blocks, and inline commands that start a recipe) must name scripts that exist, ``pip``
  extras that ``pyproject.toml`` defines and flags that the script's ``--help`` lists (a ``bash`` script:
  that it exists); the same goes for the commands in ``docs/*.md``.
* The toy demo's table in ``docs/reproducibility.md`` must be what ``recipes/toy_demo.py`` prints now: bytes
  and collectives exactly, the mean losses within the spread the table itself measured.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
MARKER = re.compile(r"<!-- file: (\S+)[^>]*-->\n```python\n(.*?)^```$", re.S | re.M)
LAUNCHERS = ("python", "torchrun", "accelerate", "pip")


def _python_blocks() -> list[str]:
    return [body for lang, body in BLOCK.findall(README) if lang == "python"]


def _embedded() -> list[tuple[str, str]]:
    return MARKER.findall(README)


def test_every_python_block_is_an_embedded_example_and_matches_its_file():
    embedded = _embedded()
    assert len(embedded) == len(_python_blocks()) >= 3, "a python block without a <!-- file: ... --> marker"
    for path, body in embedded:
        assert (REPO / path).read_text() == body, f"README's copy of {path} differs from the file"
        first = body.splitlines()[0]
        assert first.startswith("# ") and path in first, f"{path}: the first line should be its launch command"


def _launch(command: str) -> tuple[list[str], dict[str, str]]:
    """``# CMD`` -> argv with this interpreter, plus the environment assignments in front of it."""
    words = shlex.split(command)
    env = {}
    while "=" in words[0]:
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if words[0] == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", *words[1:]]
    elif words[:2] == ["accelerate", "launch"]:
        extra = ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]  # quiets the notice
        argv = [sys.executable, "-m", "accelerate.commands.launch", *extra, *words[2:]]
    else:
        raise AssertionError(f"unknown launcher in {command!r}")
    return [str(REPO / w) if w.startswith("examples/") else w for w in argv], env


EXPECTED = {
    "examples/ddp_loop.py": ["exact", "onebit_gradient", "local", "onebit_sync"],
    "examples/trainer.py": ["'comm/bytes_total'", "'comm/compression_ratio'", "'comm/hook': 1"],
    "examples/accelerate_loop.py": ["epoch 2: ", " bytes sent", "replicas in sync: True"],
}


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(EXPECTED))
def test_example_runs_on_two_cpu_ranks_as_the_readme_says(path, tmp_path):
    body = dict(_embedded())[path]
    argv, env_extra = _launch(body.splitlines()[0].removeprefix("# "))
    env = dict(os.environ, OMP_NUM_THREADS="1", **env_extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{shlex.join(argv)} failed:\n{out[-6000:]}"
    for text in EXPECTED[path]:
        assert text in proc.stdout, f"{path}: {text!r} not in its output:\n{proc.stdout[-3000:]}"
    assert "SingleProcessWarning" not in out


# ------------------------------------------------------------------------------------------------ shell commands
def _commands(markdown: str) -> list[str]:
    """Command lines of bash blocks (continuations joined, comments dropped) and inline recipe commands."""
    lines = []
    for lang, body in BLOCK.findall(markdown):
        if lang in ("bash", "sh", "shell"):
            joined = body.replace("\\\n", " ").splitlines()
            lines += [line.split(" #")[0].strip() for line in joined if not line.lstrip().startswith("#")]
    lines += [c for c in re.findall(r"`([^`\n]+)`", markdown) if re.search(r"(recipes|examples)/\w+\.py ", c)]
    commands = []
    for line in filter(None, lines):
        commands += [c.strip() for c in line.split("&&") if c.strip()]
    return commands


@cache
def _help(script: str) -> str:
    target = ["-m", script] if not script.endswith(".py") else [script]  # a script, or a module of the package
    proc = subprocess.run(
        [sys.executable, *target, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )  # fmt: skip
    assert proc.returncode == 0, f"{script} --help failed:\n{proc.stderr[-3000:]}"
    return proc.stdout


def _check_command(command: str, extras: set[str]) -> None:
    words = [w for w in shlex.split(command) if not re.fullmatch(r"[A-Z_]+=\S*", w)]
    assert words and words[0] in (*LAUNCHERS, "ip", "bash"), f"unexpected command {command!r}"
    if words[0] == "bash":
        assert len(words) > 1 and words[1].endswith(".sh") and (REPO / words[1]).is_file(), command
        return
    if words[:2] == ["pip", "install"]:
        for extra in re.findall(r"\.\[(\w+)\]", command):
            assert extra in extras, f"{command!r}: no extra {extra!r} in pyproject.toml"
        return
    scripts = [w for w in words if w.endswith(".py")]
    for script in scripts:
        assert (REPO / script).is_file(), f"{command!r}: {script} does not exist"
    if "-m" in words and words[words.index("-m") + 1].startswith("hf_zeroone"):
        scripts = [words[words.index("-m") + 1]]  # python -m hf_zeroone.plan: its flags are checked too
    if not scripts or scripts[0].startswith("examples/"):
        return  # python -m pytest, or an example (they take no flags)
    listed = _help(scripts[0])
    after = words[words.index(scripts[0]) + 1 :]
    for flag in (w.split("=")[0] for w in after if w.startswith("--")):
        assert re.search(rf"{re.escape(flag)}\b", listed), f"{command!r}: {scripts[0]} has no flag {flag}"


@pytest.mark.slow
@pytest.mark.parametrize("doc", ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))])
def test_shell_commands_name_existing_scripts_extras_and_flags(doc):
    pyproject = (REPO / "pyproject.toml").read_text()  # no tomllib: Python 3.10 is supported
    section = pyproject.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = set(re.findall(r"^(\w+)\s*=", section, re.M))
    commands = _commands((REPO / doc).read_text())
    assert commands or doc != "README.md"  # a docs page may have none
    for command in commands:
        _check_command(command, extras)


def test_setup_commands_are_the_documented_ones():
    commands = _commands(README)
    assert 'pip install -e ".[recipes]"' in commands
    assert "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 recipes/pretrain.py" in commands
    assert 'pip install -e ".[test]"' in commands and "python -m pytest -q" in commands
    # the CPU-only torch comes before the first install command
    assert README.index("download.pytorch.org/whl/cpu") < README.index('pip install -e ".[recipes]"')


# ------------------------------------------------------------------------------------------------ figures
def _table_rows(text: str, header: str) -> dict[str, list[str]]:
    start = text.index(header)
    rows = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


@pytest.mark.slow
def test_toy_demo_table_is_what_the_demo_prints_now():
    """Bytes and collectives hold everywhere; a mean loss holds within the spread measured over its seeds.

    A 1-bit run takes signs of values near zero, so another machine's last-bit differences send it
    down another trajectory: on another machine each seed is a fresh draw. Two means of ``n`` draws
    then differ with a standard deviation of ``std * sqrt(2 / n)``; the check allows four of them.
    """
    doc = (REPO / "docs" / "reproducibility.md").read_text()
    section = doc[doc.index("## The toy demo") :]
    command = re.search(r"`(torchrun [^`]*recipes/toy_demo.py[^`]*)`", section).group(1)
    argv, _ = _launch(command)
    proc = subprocess.run(
        argv, cwd=REPO, capture_output=True, text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    header = "| method | held-out loss, mean of"
    documented, measured = _table_rows(section, header), _table_rows(proc.stdout, header)
    assert documented.keys() == measured.keys()
    seeds = int(re.search(r"mean of (\d+) seeds", section).group(1))
    for method, cells in documented.items():
        now = measured[method]
        mean, std = float(cells[0]), float(cells[1])
        allowed = 4 * std * (2 / seeds) ** 0.5 + 1e-3
        assert abs(mean - float(now[0])) <= allowed, (method, "mean held-out loss", cells[0], now[0], allowed)
        assert cells[2:5] == now[2:5], (method, "MB sent / ratio / collectives", cells[2:5], now[2:5])
