"""The reports' plots: PNG files beside their Markdown, and the same plots inside the Prefect artifact.

A report links its plots by a path relative to its folder, which a Markdown viewer on the machine that
ran it resolves. The Prefect UI serves no run files, so such links are broken images there: `artifact`
puts each linked PNG into the artifact's Markdown as a data URI, reduced to 256 colours (the report
card's five plots: 270 KB as files, ~100 KB in the artifact, 1.33x that as base64).
"""

from __future__ import annotations

import base64
import io
import re
import sys
from pathlib import Path

from infra.errors import SmolflowError

IMAGE = re.compile(r"!\[(?P<alt>[^\]]*)\]\((?P<path>[^)\s:]+\.png)\)")  # a relative link: no scheme, no space
COLOURS = 256  # line and bar plots of a few colours: quantizing shows no change, the PNG shrinks 3x


def save(fig, path: Path) -> Path:
    """Write a matplotlib figure as PNG and close it (a report draws several; an open figure holds its memory)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def data_uri(path: Path) -> str:
    from PIL import Image

    with Image.open(path) as image:
        buffer = io.BytesIO()
        image.convert("RGB").quantize(colors=COLOURS).save(buffer, "PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def inline(markdown: str, folder: Path) -> str:
    """MARKDOWN with every plot it links (relative to FOLDER) inside it; a plot that is not there is an error,
    never an image that silently does not load."""

    def embed(match: re.Match) -> str:
        path = folder / match["path"]
        if not path.is_file():
            raise SmolflowError(f"the report in {folder} links {match['path']}, which is not there")
        return f"![{match['alt']}]({data_uri(path)})"

    return IMAGE.sub(embed, markdown)


def artifact(markdown: str, folder: Path, key: str, description: str) -> None:
    """A report (linking its plots relative to FOLDER) as a Prefect markdown artifact that shows them in the UI:
    the one way a report reaches the UI."""
    if in_run():
        from prefect.artifacts import create_markdown_artifact

        create_markdown_artifact(inline(markdown, folder), key=key, description=description)


def table_artifact(rows: list[dict], key: str, description: str) -> None:
    """Rows as a Prefect table artifact. Prefect is imported here, as in `artifact`: the modules that publish reports
    are imported by every CLI command, most of which run no flow."""
    if in_run():
        from prefect.artifacts import create_table_artifact

        create_table_artifact(rows, key=key, description=description)


def in_run() -> bool:
    """Whether this is a Prefect flow or task run, the only place an artifact belongs. A report rebuilt outside one
    (`smolflow ablate --report`, `swarm --report`) is its file alone: Prefect deprecates a run-less artifact and started
    its temporary server to hold one (docs/developing.md). A run imported Prefect already."""
    if "prefect" not in sys.modules:
        return False
    from prefect.context import FlowRunContext, TaskRunContext

    return FlowRunContext.get() is not None or TaskRunContext.get() is not None
