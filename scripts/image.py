"""Build the CPU image and check it the way an operator would run it; print a report.

    python scripts/image.py [--base IMAGE | --assemble-base] [--tag gonka-node:cpu]

Builds ``docker/Dockerfile``; with ``--assemble-base`` first assembles a Debian bookworm base
image locally (debootstrap of python3, its venv module and a C compiler, ``docker import``) for
machines where no image registry is reachable, and with ``--wheelhouse`` installs from wheels
this machine's pip gathers (where the build cannot reach a package index). Then runs the image with its own command and a fresh
volume, and checks: the node starts and the health check turns healthy, it runs as an
unprivileged user, identity, status and checkpoints land on the volume, and ``docker stop``
(SIGTERM) ends it with exit code 0 within the grace period. Everything it starts (container,
volume) is removed at the end. Needs a running docker daemon.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE_TAG = "gonka-base:bookworm"


def sh(*args: str, timeout: float = 600, check: bool = True) -> str:
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise SystemExit(f"{' '.join(args[:4])} ... failed ({result.returncode}):\n{result.stdout[-2000:]}"
                         f"{result.stderr[-2000:]}")
    return result.stdout.strip()


def assemble_base(rootfs: Path) -> str:
    if not (rootfs / "usr" / "bin" / "python3").exists():
        if shutil.which("debootstrap") is None:
            raise SystemExit("--assemble-base: needs debootstrap (apt-get install debootstrap)")
        sh("debootstrap", "--variant=minbase", "--include=python3,python3-venv,python3-pip,ca-certificates,gcc,libc6-dev",
           "bookworm", str(rootfs), "http://deb.debian.org/debian", timeout=1800)
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    subprocess.run(["docker", "import", "-", BASE_TAG], stdin=tar.stdout, check=True, capture_output=True,
                   timeout=600)
    tar.wait(60)
    return BASE_TAG


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", help="base image (default: the Dockerfile's, python:3.11-slim)")
    p.add_argument("--assemble-base", metavar="ROOTFS", help="assemble a bookworm base image in ROOTFS first")
    p.add_argument("--wheelhouse", action="store_true",
                   help="install from wheels this machine's pip gathers into docker/wheels, no index in the build")
    p.add_argument("--tag", default="gonka-node:cpu")
    p.add_argument("--out", default="", help="write the report as JSON here too")
    args = p.parse_args()
    report: dict = {"tag": args.tag}
    base = assemble_base(Path(args.assemble_base)) if args.assemble_base else args.base
    report["base"] = base or "python:3.11-slim"
    started = time.time()
    build = ["docker", "build", "-f", "docker/Dockerfile", "-t", args.tag]
    if base:
        build += ["--build-arg", f"BASE={base}"]
    wheels = ROOT / "docker" / "wheels"
    if args.wheelhouse:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(wheels),
                        "torch==2.13.0", str(ROOT)], check=True, timeout=3600)
        build += ["--build-arg", "PIP_NO_INDEX=1"]
    try:
        subprocess.run([*build, str(ROOT)], check=True, timeout=3600, cwd=ROOT)
    finally:
        for wheel in wheels.glob("*.whl"):
            wheel.unlink()
    report["build_seconds"] = round(time.time() - started, 1)
    report["image_mb"] = round(int(sh("docker", "image", "inspect", "-f", "{{.Size}}", args.tag)) / 1e6)
    name, volume = f"gonka-image-check-{os.getpid()}", f"gonka-image-check-{os.getpid()}"
    try:
        sh("docker", "volume", "create", volume)
        # The image's own command; a tiny model and short rounds through the environment, as an
        # operator would set them, so that a round commits (and checkpoints) within a minute.
        sh("docker", "run", "-d", "--name", name, "-v", f"{volume}:/data", "-e", "GONKA_MODEL_SOURCE=tiny",
           "-e", "GONKA_INNER_STEPS=5", args.tag)
        t0 = time.time()
        health = ""
        while time.time() - t0 < 300:
            state = json.loads(sh("docker", "inspect", name))[0]["State"]
            health = (state.get("Health") or {}).get("Status", "")
            if health == "healthy" or not state["Running"]:
                break
            time.sleep(2)
        report["healthy_after_s"] = round(time.time() - t0, 1) if health == "healthy" else None
        report["uid"] = sh("docker", "exec", name, "id", "-u")
        for _ in range(150):  # the first commit writes a checkpoint
            files = sh("docker", "exec", name, "ls", "/data", "/data/checkpoints", check=False)
            if "identity.key" in files and "status.json" in files and "history.jsonl" in files:
                break
            time.sleep(2)
        report["volume_files"] = sorted(set(files.split()) - {"/data:", "/data/checkpoints:"})
        t1 = time.time()
        sh("docker", "stop", "-t", "60", name, timeout=120)
        report["stop_seconds"] = round(time.time() - t1, 1)
        state = json.loads(sh("docker", "inspect", name))[0]["State"]
        report["exit_code"] = state["ExitCode"]
        logs = subprocess.run(["docker", "logs", name], capture_output=True, text=True, timeout=60)
        text = logs.stdout + logs.stderr
        report["sigterm_seen"] = "SIGTERM received" in text
        report["committed_rounds"] = text.count("committed round=")
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60)
        subprocess.run(["docker", "volume", "rm", "-f", volume], capture_output=True, timeout=60)
    ok = (report["healthy_after_s"] is not None and report["uid"] != "0" and report["exit_code"] == 0
          and report["sigterm_seen"] and {"identity.key", "status.json", "history.jsonl"} <= set(report["volume_files"]))
    report["ok"] = ok
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
