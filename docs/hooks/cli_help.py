"""mkdocs hook: a page's line `<!-- cli-help: run -->` becomes the text of `sbpflow run --help`
(an empty name: `sbpflow --help`), so the command-line reference is argparse's own help."""

import contextlib
import io
import os
import re

MARK = re.compile(r"^<!-- cli-help:\s*([\w-]*)\s*-->$", re.M)


def _help(command: str) -> str:
    from sbpflow.cli import main
    out = io.StringIO()
    os.environ["COLUMNS"] = "100"
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main(([command] if command else []) + ["--help"])
    return out.getvalue().rstrip()


def on_page_markdown(markdown, page, config, files):
    return MARK.sub(lambda m: "```text\n" + _help(m.group(1)) + "\n```", markdown)
