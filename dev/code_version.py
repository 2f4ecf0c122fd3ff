"""Write `.code-version.json` at the repository root: the commit checked out, whether the working tree differs from
it (and which paths), and a digest of the code files, for results measured where the code travels without `.git`.

    python dev/code_version.py    # just before a GPU lease's device call; carry the file: carry=[".whl", ".code-version.json"]

The device tool sends a copy of the working tree without `.git`, so a results file written there cannot ask git
which commit it ran. Every results writer records `benchmark.common.code_version()`: git's answer in a checkout,
else this file's, with `files_match` saying whether the code files it finds are still the ones the file was written
for (a file left from an earlier commit says false). The file is ignored by git (.gitignore).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmark.common import CODE_VERSION_FILE, write_code_version


def main() -> None:
    recorded = write_code_version(ROOT)
    summary = {key: recorded[key] for key in ("commit", "tree_differs", "differing_count", "written_at")}
    print(f"wrote {CODE_VERSION_FILE}: {json.dumps(summary)} ({len(recorded['code_files'])} code files)")


if __name__ == "__main__":
    main()
