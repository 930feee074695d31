"""The docs: figures generated from the committed results, a short README, and commands the CLIs accept."""
import importlib.util
import re
import shlex
import sys

import pytest
import report

from deepspeed_image_trainer.cli.options import parse_args

from conftest import ROOT

DOCUMENTS = report.DOCUMENTS
README_LIMIT = 12 * 1024


def test_the_docs_match_what_the_report_writes_from_the_results():
    stale = [str(path.relative_to(ROOT)) for path in DOCUMENTS if report.render(path.read_text()) != path.read_text()]
    assert not stale, f"run python benchmarks/report.py: {stale} differ from the results"


def test_every_report_table_names_its_machine_versions_commit_date_and_file():
    blocks = [(path, match) for path in DOCUMENTS for match in report.BLOCK.finditer(path.read_text())]
    assert {match[2] for _, match in blocks} == set(report.TABLES)  # every table is shown somewhere
    for path, match in blocks:
        assert re.match(r"\*(NVIDIA [^,]+|CPU \(\d+ cores\)), torch [^,]+, DeepSpeed [^,]+, "
                        r"(commit|results committed in) \w+, \d{4}-\d\d-\d\d; `benchmarks/results/[^`]+\.json`\*",
                        match[3]), (path, match[2])


def test_a_failed_measurement_shows_its_exception_line():
    traceback = ("Traceback (most recent call last):\n[rank0]:   File \"x.py\", line 1, in f\n"
                 "[rank0]: torch._inductor.exc.InductorError: RuntimeError: a dimension of length 0\n\n"
                 "Epoch 0 train:   0%|          | 0/10 [00:22<?, ?it/s]\n")
    assert report.error_line(traceback) == "torch._inductor.exc.InductorError: RuntimeError: a dimension of length 0"
    assert report.error_line("[rank0]: KeyError: torch.float32\n") == "KeyError: torch.float32"
    assert report.error_line("killed\nover 240 s\n") == "over 240 s"  # no exception named: the last line
    assert report.error_line("[rank1]: ValueError: a ]: b") == "ValueError: a ]: b"
    assert report.error_line(" \n") == "?"


def test_a_measurement_s_error_names_files_relative_to_the_project(monkeypatch):
    import common
    site = f"{ROOT}/.venv/lib/python3.11/site-packages"  # a virtual environment inside the project
    monkeypatch.setattr(sys, "path", [*sys.path, site, "/tmp/site"])
    text = (f'File "{ROOT}/benchmarks/zero3_settings.py", line 91, in child\n'
            f'File "{site}/deepspeed/runtime/engine.py", line 1\nFile "/tmp/site/torch/nn/module.py", line 2')
    assert common.relative_paths(text) == ('File "benchmarks/zero3_settings.py", line 91, in child\n'
                                           'File "deepspeed/runtime/engine.py", line 1\n'
                                           'File "torch/nn/module.py", line 2')


def test_the_readme_is_short_and_its_quickstart_holds_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= README_LIMIT
    quickstart = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    assert len(re.findall(r"```bash\n(.+?)\n```", quickstart, re.S)) == 2


def test_links_between_the_docs_lead_to_files():
    for path in DOCUMENTS:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", path.read_text()):
            if not target.startswith("http"):
                assert (path.parent / target).exists(), f"{path.relative_to(ROOT)} links to missing {target}"


def script_parser(script):
    """(parse(argv), name) for a script of the repository, with the parser the script itself uses."""
    path = ROOT / script
    if script == "src/memory_profile.py":  # it runs benchmarks/memory_profile.py
        path = ROOT / "benchmarks/memory_profile.py"
    if path.name in ("launch_deepspeed.py", "train_deepspeed.py"):
        module = load(path)
        return lambda argv: parse_args(module.get_args_parser, argv)  # flag values checked as in a run
    if path.name in ("train_deepspeed.sh", "train_deepspeed.bat"):
        return script_parser("launch_deepspeed.py")
    return load(path).get_args_parser().parse_args


def load(path):
    spec = importlib.util.spec_from_file_location(f"documented_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def documented_commands():
    """(document, command words) of every command of this repository in the docs' bash blocks."""
    found = []
    for path in DOCUMENTS:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                for command in re.split(r"\s*&&\s*", line):
                    words = shlex.split(command, comments=True)
                    scripts = [i for i, w in enumerate(words) if re.search(r"\.(py|sh|bat)$", w)]
                    if scripts and words[0] in ("python", "python3", "deepspeed", "bash", "train_deepspeed.bat"):
                        found.append((path.relative_to(ROOT), words[scripts[0]], words[scripts[0] + 1:]))
                    elif words[:1] == ["train_deepspeed.bat"]:
                        found.append((path.relative_to(ROOT), words[0], words[1:]))
    return found


def test_the_docs_show_commands():
    scripts = {script for _, script, _ in documented_commands()}
    assert {"launch_deepspeed.py", "src/train_deepspeed.py", "src/prepare_data.py", "src/utils.py",
            "src/export_model.py", "src/evaluate.py", "src/predict.py", "train_deepspeed.sh"} <= scripts


@pytest.mark.parametrize("document, script, argv", documented_commands(),
                         ids=lambda value: value if isinstance(value, str) else None)
def test_every_documented_command_is_accepted_by_its_parser(document, script, argv, capsys):
    try:
        script_parser(script)(argv)
    except SystemExit as stop:
        pytest.fail(f"{document}: {script} {shlex.join(argv)} was refused: {capsys.readouterr().err.strip()} "
                    f"(exit {stop.code})")
