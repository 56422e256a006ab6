"""The several-machine recipes of examples/ (docs/multi_node.md, #39 item 7) are well formed:
the Slurm batch script passes ``bash -n`` and, run with stand-ins for ``srun`` and
``scontrol``, starts exactly the torchrun it should; the Kubeflow PyTorchJob manifest parses
and has what the training operator needs. No Slurm or Kubernetes needed.

    .venv/bin/python -m pytest tests/unit/test_multi_node_examples.py -q

tests/emu/test_multi_node.py runs both recipes' commands on 4 emulated hosts (root).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "examples" / "slurm" / "multi_node.sbatch"
MANIFEST = ROOT / "examples" / "kubernetes" / "pytorchjob.yaml"
DOCKERFILE = ROOT / "examples" / "kubernetes" / "Dockerfile"

#: What `srun` does on each node, for the tests: drop srun's own options (the script writes
#: them as --name=value), log the command (when SRUN_LOG is set) and run it.
FAKE_SRUN = """#!/bin/sh
while [ "$#" -gt 0 ]; do case "$1" in --*=*) shift ;; *) break ;; esac; done
if [ -n "${SRUN_LOG:-}" ]; then printf '%s\\n' "$@" > "$SRUN_LOG"; fi
exec "$@"
"""
#: `scontrol show hostnames LIST`: one name per line (the tests' lists are comma-separated).
FAKE_SCONTROL = """#!/bin/sh
[ "$1 $2" = "show hostnames" ] || { echo "stand-in scontrol: only 'show hostnames'" >&2; exit 2; }
printf '%s\\n' "$3" | tr ',' '\\n'
"""


def write_slurm_stand_ins(directory: Path) -> Path:
    """Write ``srun`` and ``scontrol`` stand-ins into ``directory``; return it (put it on PATH)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (directory / name).write_text(text)
        (directory / name).chmod(0o755)
    return directory


def _sbatch_options() -> dict[str, str]:
    options = {}
    for line in SBATCH.read_text().splitlines():
        if match := re.match(r"#SBATCH\s+--([\w-]+)=(\S+)", line):
            options[match[1]] = match[2]
    return options


def test_sbatch_script_parses_and_asks_for_one_task_per_node():
    checked = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    options = _sbatch_options()
    assert options["nodes"] == "4" and options["ntasks-per-node"] == "1"  # one torchrun per machine
    assert {"job-name", "time", "cpus-per-task", "output"} <= set(options)
    lines = SBATCH.read_text().splitlines()
    first_command = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    # sbatch reads directives only above the first command.
    assert all(i < first_command for i, line in enumerate(lines) if line.startswith("#SBATCH"))


def _run_sbatch(tmp_path: Path, *args: str, **env: str) -> list[str]:
    log = tmp_path / "srun.log"
    bin_dir = write_slurm_stand_ins(tmp_path / "bin")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    (venv / "bin" / "torchrun").write_text("#!/bin/sh\nexit 0\n")  # what srun starts, here a no-op
    (venv / "bin" / "torchrun").chmod(0o755)
    full_env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SRUN_LOG": str(log), "MLFABRIC_VENV": str(venv),
                "SLURM_JOB_NODELIST": "node7,node8,node9,node10", "SLURM_JOB_NUM_NODES": "4",
                "SLURM_JOB_ID": "4242", **env}
    out = subprocess.run(["bash", str(SBATCH), *args], capture_output=True, text=True, env=full_env, cwd=ROOT,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return log.read_text().splitlines()


def test_sbatch_script_starts_one_torchrun_with_c10d_rendezvous_on_the_first_node(tmp_path):
    argv = _run_sbatch(tmp_path)
    assert argv == [str(tmp_path / "venv" / "bin" / "torchrun"), "--nnodes", "4", "--nproc-per-node", "1",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", "node7:29400", "--rdzv-id", "4242",
                    "--max-restarts", "0", "examples/torch_backend.py", "--backend", "mlfabric"]
    assert (ROOT / argv[-3]).is_file()
    # The script's arguments replace the default job; the ranks per node come from NPROC_PER_NODE.
    argv = _run_sbatch(tmp_path, "examples/ps_train.py", "--consistency", "ssp:2", NPROC_PER_NODE="4")
    assert argv[argv.index("--nproc-per-node") + 1] == "4"
    assert argv[-3:] == ["examples/ps_train.py", "--consistency", "ssp:2"] and (ROOT / argv[-3]).is_file()


def _manifest() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


def test_pytorchjob_manifest_has_what_the_training_operator_needs():
    job = _manifest()
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", job["metadata"]["name"])  # a DNS-1035 label
    spec = job["spec"]
    assert isinstance(spec["nprocPerNode"], str)  # the CRD's type: a string ("1", "auto")
    replicas = spec["pytorchReplicaSpecs"]
    assert set(replicas) == {"Master", "Worker"} and replicas["Master"]["replicas"] == 1
    assert replicas["Worker"]["replicas"] >= 1
    containers = {role: r["template"]["spec"]["containers"] for role, r in replicas.items()}
    for role, listed in containers.items():
        # The operator configures the container named "pytorch" only.
        assert [c["name"] for c in listed] == ["pytorch"], role
        assert replicas[role]["restartPolicy"] in ("Always", "OnFailure", "Never", "ExitCode")
    master, worker = containers["Master"][0], containers["Worker"][0]
    # MASTER_PORT is the master's port named pytorchjob-port.
    assert [p["name"] for p in master["ports"]] == ["pytorchjob-port"]
    assert master["command"] == worker["command"] and master["image"] == worker["image"]


def manifest_command() -> str:
    """The shell command every pod of the manifest runs (the emulator test runs it too)."""
    command = _manifest()["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["sh", "-c"] and len(command) == 3
    return command[2]


def test_pytorchjob_runs_torchrun_with_the_operators_variables():
    words = shlex.split(manifest_command())
    assert words[:2] == ["exec", "torchrun"]
    option = {words[i]: words[i + 1] for i in range(2, len(words) - 1) if words[i].startswith("--")}
    # shlex keeps the variables unexpanded: the pod's shell expands them.
    assert option["--nnodes"] == "$PET_NNODES" and option["--nproc-per-node"] == "$PET_NPROC_PER_NODE"
    assert option["--rdzv-backend"] == "c10d" and option["--rdzv-endpoint"] == "$MASTER_ADDR:$MASTER_PORT"
    script = next(w for w in words if w.endswith(".py"))
    assert (ROOT / script).is_file()


def test_dockerfile_builds_the_image_the_manifest_runs():
    text = DOCKERFILE.read_text()
    tag = re.search(r"docker build -f examples/kubernetes/Dockerfile -t (\S+) \.", text)
    assert tag and tag[1] == _manifest()["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"][
        "containers"][0]["image"]
    assert tag[1] in MANIFEST.read_text().split("docker build")[1]  # the manifest's recipe says the same
    copied = re.findall(r"^COPY (.+) \S+$", text, flags=re.M)
    for sources in copied:
        for source in sources.split():
            assert (ROOT / source).exists(), source  # everything it copies is in the repository
    assert any("examples" in c for c in copied) and any("mlfabric" in c.split() for c in copied)
    assert re.search(r"^WORKDIR /\S+$", text, flags=re.M) and "pip install" in text
