"""`python -m specgui stage-picture` is registered and, where its test dependencies are missing, says so in one
line (taking the picture itself needs the model, a browser and minutes: it is a command, not a test)."""

import sys

from specgui.cli import build_parser, main


def test_stage_picture_is_a_subcommand_with_readmes_picture_as_its_default():
    args = build_parser().parse_args(["stage-picture"])
    assert args.command == "stage-picture" and args.out == "assets/stage-race.png" and args.preset is None


def test_without_playwright_it_refuses_in_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "playwright.sync_api", None)  # import fails as if absent
    assert main(["stage-picture", "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: playwright is not installed: pip install -r tests/requirements.txt"
    assert not (tmp_path / "x.png").exists()
