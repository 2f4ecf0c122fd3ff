"""The peer's own virtual environment: `benchmark/.peer-venv` with SheepRL installed by pip.

torch goes in first, at the pin of our requirements.txt, so that pip keeps it when it resolves SheepRL's
`torch>=2.6` instead of pulling another build.
"""

from __future__ import annotations

import json
import subprocess
import sys
import venv
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
VENV_DIR = BENCH_DIR / ".peer-venv"
WORK_DIR = BENCH_DIR / ".work"
# The peer release measured, with the extra that brings ale-py (Atari), and psutil for the USS figures.
SHEEPRL_REQUIREMENT = "sheeprl[atari]==0.8.4"
VERSIONS_OF = ("sheeprl", "torch", "lightning", "gymnasium", "ale-py", "numpy", "hydra-core", "psutil")


def _pin(package: str) -> str:
    """`package==version` as our requirements.txt pins it."""
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        if line.split("==")[0].strip().lower() == package:
            return line.strip()
    raise RuntimeError(f"requirements.txt pins no {package}")


def python() -> Path:
    return VENV_DIR / "bin" / "python"


def versions() -> dict:
    """Versions of the peer's packages, as its environment reports them."""
    code = (
        "import json, importlib.metadata as md\n"
        f"print(json.dumps({{n: md.version(n) for n in {VERSIONS_OF!r}}}))\n"
    )
    out = subprocess.run([str(python()), "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _ready() -> bool:
    if not python().exists():
        return False
    try:
        found = versions()
    except (subprocess.CalledProcessError, json.JSONDecodeError):
        return False
    wanted = SHEEPRL_REQUIREMENT.split("==")[1]
    return (
        found.get("sheeprl") == wanted
        and found.get("torch", "").split("+")[0] == _pin("torch").split("==")[1]
    )


def ensure(log=print) -> dict:
    """Create the environment when it is missing or incomplete; return the versions installed in it."""
    if not _ready():
        WORK_DIR.mkdir(exist_ok=True)
        log_path = WORK_DIR / "peer-install.log"
        log(
            f"creating the peer environment in {VENV_DIR.relative_to(ROOT)} (pip log: {log_path.relative_to(ROOT)})"
        )
        if not python().exists():
            venv.EnvBuilder(with_pip=True, clear=True).create(VENV_DIR)
        pip = [str(python()), "-m", "pip", "install", "--disable-pip-version-check"]
        with open(log_path, "a") as out:
            for packages in ([_pin("torch")], [SHEEPRL_REQUIREMENT, _pin("torch"), _pin("psutil")]):
                done = subprocess.run(pip + packages, stdout=out, stderr=subprocess.STDOUT, check=False)
                if done.returncode != 0:
                    raise RuntimeError(f"pip install {' '.join(packages)} failed; see {log_path}")
    return versions()


if __name__ == "__main__":
    print(json.dumps(ensure(log=lambda m: print(m, file=sys.stderr)), indent=2))
